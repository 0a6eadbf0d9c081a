"""Where an end-to-end gain can and cannot come from, in figures a reader can check.

- Vision tower: the patch embedding's share of the tower's FLOPs (``torch.utils.flop_counter``
  per module, on a real-width tower, extrapolated to the full depth by blocks; the analytic
  count is printed beside it), and the time the fused patch embedding saves at this size
  (Conv3d vs fused, interleaved), hence the tower speed-up fusion can deliver at most.
- Decode: the bytes one decoded token reads (every weight once, the tied ``lm_head`` included,
  plus the KV cache) against this machine's memory bandwidth, measured by a large tensor copy:
  the bandwidth bound on decode tokens/s. A merged GEMM reads the same bytes as three.
- Operators: a hardware-independent count from ``torch.profiler`` of the aten operators run per
  decoded token and per tower forward, plain vs fused; compiled, the graphs and kernels run. That
  count is what fusion removes whatever the hardware. The ``e2e`` section counts them on the
  models it has loaded (and, compiled, already compiled): this section tabulates them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bench_common import Summary, Table, interleaved
from bench_e2e import CONTROL, DTYPES, sync, tower_input
from bench_models import QWEN2_05B_LAYERS, QWEN2_VL_TOWER_DEPTH, text_config, tower_config
from torch import nn

from fusion_core import merge_policy

# --------------------------------------------------------------------------- memory bandwidth


def memory_bandwidth(device: str, quick: bool) -> dict[str, Any]:
    """GB/s of a large tensor copy (bytes read + bytes written), median [min-max] of interleaved rounds."""
    n_bytes = (16 << 20) if quick else ((2 << 30) if device.startswith("cuda") else (512 << 20))
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        sync(device)

    samples = interleaved({"copy": copy}, rounds=3 if quick else 15, inner=1, warmup=2)["copy"]
    rates = Summary.of([2 * n_bytes / s / 1e9 for s in samples])
    return {"bytes": n_bytes, "gb_per_s": rates}


# --------------------------------------------------------------------------- decode bytes per token


def decode_bytes(config: Any, dtype: torch.dtype, context: int) -> dict[str, int]:
    """Bytes one decode step reads: each parameter once (tied lm_head counted once) and the KV cache."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * size  # parameters() yields a tied tensor once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * context * size
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


# --------------------------------------------------------------------------- FLOPs of the tower


def tower_flops(quick: bool, patches: int, depth: int, device: str) -> dict[str, Any]:
    """FLOPs of one tower forward by module, counted on a 2-block tower and extrapolated to ``depth`` blocks."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = tower_config(quick, 2)
    tower = Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config).float().to(device).eval()
    pixels, grid = tower_input(config, patches, torch.float32, device)
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        tower(pixels, grid_thw=grid)
    counts = counter.get_flop_counts()
    by_module = {name: sum(ops.values()) for name, ops in counts.items()}

    def find(suffix: str) -> int:
        return next((v for k, v in by_module.items() if k.endswith(suffix)), 0)

    vision = config.vision_config
    patch, block, merger = find(".patch_embed"), find(".blocks.0"), find(".merger")
    # Q K^T and A V of one image: 4 * N^2 * width. flop_counter sees sdpa only through kernels it knows
    # (not the CPU ones): add the attention analytically when it counted none.
    attention = 4 * patches * patches * vision.embed_dim
    counted_attention = any("scaled_dot_product" in str(op) for ops in counts.values() for op in ops)
    if not counted_attention:
        block += attention
    total = patch + depth * block + merger
    fan_in = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "patches": patches, "depth": depth, "patch_embed": patch, "block": block, "merger": merger, "total": total,
        "attention_per_block": attention, "attention_added": not counted_attention,
        "share": patch / total if total else 0.0, "analytic_patch_embed": 2 * patches * fan_in * vision.embed_dim,
    }


def patch_embedding_saving(quick: bool, patches: int, dtype: torch.dtype, device: str) -> dict[str, Any]:
    """Seconds of the tower's own Conv3d and of its fused replacement on ``patches`` patches (interleaved)."""
    from fusion_patch_embeddings.family import PatchEmbeddingsFamily

    from fusion_core.testing.kit import fuse_module

    vision = tower_config(quick, 2).vision_config
    k = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
    conv = nn.Conv3d(vision.in_channels, vision.embed_dim, kernel_size=k, stride=k, bias=False).to(device, dtype)
    fused = fuse_module(conv, PatchEmbeddingsFamily()).eval()
    x = torch.randn(patches, vision.in_channels, *k, device=device, dtype=dtype)

    def call(module: nn.Module) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode():
                module(x)
            sync(device)

        return run

    samples = interleaved({"conv3d": call(conv), "fused": call(fused)}, rounds=3 if quick else 15, warmup=1)
    return {"conv3d_s": Summary.of(samples["conv3d"]), "fused_s": Summary.of(samples["fused"])}


# --------------------------------------------------------------------------- one merged GEMM vs separate ones


def merged_gemm_speeds(config: Any, dtypes: tuple[str, ...], rows: tuple[int, ...], device: str, quick: bool
                       ) -> list[dict[str, Any]]:
    """Bare ``F.linear``: q, k, v (gate, up) as separate GEMMs vs one merged GEMM, per token count.

    This is the most a merged projection can gain or lose at that size on this machine, with no
    module code around it: the GEMM library's speed at the merged width against its speed at the
    separate widths.
    """
    from torch.nn import functional as F

    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    groups = {"qkv": (hidden, kv * head_dim, kv * head_dim), "gate_up": (config.intermediate_size,) * 2}
    gen = torch.Generator().manual_seed(0)
    out = []
    for dt in dtypes:
        for m in rows:
            x = torch.randn(1, m, hidden, generator=gen).to(device, DTYPES[dt])
            for family, sizes in groups.items():
                weights = [torch.randn(n, hidden, generator=gen).mul_(0.02).to(device, DTYPES[dt]) for n in sizes]
                biases = [torch.zeros(n, device=device, dtype=DTYPES[dt]) if family == "qkv" else None for n in sizes]
                merged_w = torch.cat(weights)
                merged_b = torch.cat(biases) if family == "qkv" else None

                def separate(ws: list[torch.Tensor] = weights, bs: list[Any] = biases, inp: torch.Tensor = x) -> None:
                    with torch.inference_mode():
                        for w, b in zip(ws, bs, strict=True):
                            F.linear(inp, w, b)
                    sync(device)

                def merged(w: torch.Tensor = merged_w, b: Any = merged_b, inp: torch.Tensor = x) -> None:
                    with torch.inference_mode():
                        F.linear(inp, w, b)
                    sync(device)

                samples = interleaved({"separate": separate, "merged": merged}, rounds=3 if quick else 25,
                                      inner=1 if quick else max(1, 64 // m), warmup=2)
                kind = merge_policy.kind_of(x, merged_w, tuple(sizes), merged_b is not None)
                out.append({"dtype": dt, "tokens": m, "family": family, "sizes": sizes, "e2e_ran": _e2e_choice(kind),
                            "separate_s": Summary.of(samples["separate"]), "merged_s": Summary.of(samples["merged"]),
                            "speed": Summary.of([a / b for a, b in zip(samples["separate"], samples["merged"],
                                                                       strict=True)])})
    return out


def _e2e_choice(kind: merge_policy.Kind) -> str:
    """What the merged projections of this process's e2e models ran for calls of ``kind``."""
    policy = merge_policy.merge_policy()
    if policy != "measure":
        return "merged" if policy == "always" else "per part"
    decision = merge_policy.merge_decisions().get(kind)
    return "-" if decision is None else ("merged" if decision else "per part")


# --------------------------------------------------------------------------- the section


def run(quick: bool, device: str, dtypes: tuple[str, ...], e2e: dict[str, Any], log: Callable[[str], None], *,
        text_layers: int | None = None, tower_depth: int | None = None, patches: int | None = None,
        compile_backend: str = "inductor") -> tuple[list[Table], dict[str, Any]]:
    import fusion_core

    e2e_plan = e2e.get("plan", {})
    layers = text_layers or e2e_plan.get("text_layers") or (2 if quick else QWEN2_05B_LAYERS)
    depth = tower_depth or e2e_plan.get("tower_depth") or (2 if quick else QWEN2_VL_TOWER_DEPTH)
    n_patches = patches or e2e_plan.get("patches") or (64 if quick else 1024)
    prompt, new = e2e_plan.get("prompt", 8 if quick else 16), e2e_plan.get("new_tokens", 6 if quick else 32)
    prefill = e2e_plan.get("prefill_tokens", 32 if quick else 256)
    rows = e2e.get("rows", [])
    registry = fusion_core.get_registry()
    data: dict[str, Any] = {}
    tables: list[Table] = []

    # -- decode: bytes per token against the memory bandwidth
    bandwidth = memory_bandwidth(device, quick)
    data["bandwidth"] = bandwidth
    config = text_config(quick, layers)
    context = prompt + new // 2  # the mean KV length over the decode
    t = Table(f"Decode: bytes read per token vs this machine's memory bandwidth ({device})",
              ["dtype", "weights MB", f"KV cache MB (mean context {context})", "bytes/token MB",
               "copy bandwidth GB/s", "bound tok/s", "measured decode tok/s plain (eager)", "of the bound"])
    for dt in dtypes:
        b = decode_bytes(config, DTYPES[dt], context)
        bound = bandwidth["gb_per_s"].median * 1e9 / b["total"]
        measured = [r for r in rows if r["workload"] == "generate" and r["dtype"] == dt and r["mode"] == "eager"]
        rate = (new - 1) / measured[0]["plain_decode_s"].median if measured else None
        data.setdefault("decode_bytes", {})[dt] = {**b, "bound_tok_s": bound, "measured_tok_s": rate}
        t.rows.append([dt, f"{b['weights'] / 1e6:.0f}", f"{b['kv_cache'] / 1e6:.2f}", f"{b['total'] / 1e6:.0f}",
                       bandwidth["gb_per_s"].fmt_range(digits=1), f"{bound:.1f}",
                       "-" if rate is None else f"{rate:.1f}", "-" if rate is None else f"{rate / bound:.0%}"])
    t.notes.append(f"bandwidth: copy of a {bandwidth['bytes'] >> 20} MiB tensor, bytes read + written per second; "
                   "a merged q/k/v or gate/up GEMM reads the same weight bytes as the separate ones, so where decode "
                   "runs near this bound fusion can only save per-operator overhead")
    tables.append(t)

    # -- one merged GEMM vs the separate ones, at the token counts the e2e rows run
    gemms = merged_gemm_speeds(config, dtypes, tuple(sorted({1, prompt, prefill})), device, quick)
    data["merged_gemms"] = gemms
    t = Table(f"One merged GEMM vs the separate ones (bare F.linear, {device}; median [min-max] of per-round ratios)",
              ["dtype", "tokens", "family", "separate widths", "separate ms", "merged ms", "merged speed",
               f"the e2e models ran (merge policy {merge_policy.merge_policy()})"])
    for g in gemms:
        t.rows.append([g["dtype"], str(g["tokens"]), g["family"], " + ".join(map(str, g["sizes"])),
                       g["separate_s"].fmt_range(1e3, 3), g["merged_s"].fmt_range(1e3, 3),
                       g["speed"].fmt_range(unit="x"), g["e2e_ran"]])
    t.notes.append("the most a merged projection can gain or lose at that size with no module code around it: "
                   f"1 token = a decode step, {prompt} = the generate rows' prompt, {prefill} = the prefill row")
    t.notes.append("the e2e models ran: what fusion_core.merge_policy chose for that kind of call in this process's "
                   "e2e rows ('measure': timed once per kind on its first call, the faster way kept; '-': that kind "
                   "did not occur, e.g. the e2e section did not run)")
    tables.append(t)

    # -- the tower: the patch embedding's share of FLOPs and of time
    if "patch_embeddings" in registry:
        flops = tower_flops(quick, n_patches, depth, device)
        data["tower_flops"] = flops
        width = tower_config(quick, depth).vision_config.embed_dim
        t = Table(f"Vision tower: where the patch embedding fusion can gain (depth {depth}, width {width}, "
                  f"{n_patches} patches)",
                  ["what", "value"])
        t.rows += [
            ["patch embedding GFLOP (counted / analytic 2 * patches * fan-in * width)",
             f"{flops['patch_embed'] / 1e9:.4g} / {flops['analytic_patch_embed'] / 1e9:.4g}"],
            ["one block GFLOP" + (" (attention's 4*N^2*width added: the counter does not see this sdpa)"
                                  if flops["attention_added"] else ""), f"{flops['block'] / 1e9:.4g}"],
            ["merger GFLOP", f"{flops['merger'] / 1e9:.4g}"],
            [f"tower GFLOP (patch embedding + {depth} blocks + merger)", f"{flops['total'] / 1e9:.4g}"],
            ["patch embedding share of the tower's FLOPs", f"{flops['share']:.3%}"],
        ]
        for dt in dtypes:
            saving = patch_embedding_saving(quick, n_patches, DTYPES[dt], device)
            data.setdefault("patch_saving", {})[dt] = saving
            saved = saving["conv3d_s"].median - saving["fused_s"].median
            tower_rows = [r for r in rows if r["workload"] == "tower" and r["dtype"] == dt and r["mode"] == "eager"
                          and r["families"] != CONTROL]
            t.rows.append([f"{dt}: Conv3d -> fused patch embedding ms (this size)",
                           f"{saving['conv3d_s'].median * 1e3:.2f} -> {saving['fused_s'].median * 1e3:.2f} "
                           f"(saves {saved * 1e3:.2f} ms)"])
            if tower_rows:
                plain_s = tower_rows[0]["plain_s"].median
                expected = plain_s / max(plain_s - saved, 1e-12)
                t.rows.append([f"{dt}: expected tower speed = plain / (plain - saved), plain {plain_s:.3f} s",
                               f"{expected:.4f}x (measured {tower_rows[0]['speed'].fmt_range(unit='x')})"])
        t.notes.append("FLOPs from torch.utils.flop_counter per module on a 2-block tower of this width (blocks are "
                       "identical); expected speed: the time the fused patch embedding saves, measured here, against "
                       "the plain tower's time from the e2e rows")
        tables.append(t)

    counts = e2e.get("op_counts", {})
    if counts:
        tables.append(_counts_table(counts, layers, depth, device, compile_backend))
    else:
        data["op_counts_note"] = "operator counts come from the e2e section: run it in the same command"
    return tables, data


def _counts_table(counts: dict[str, Any], layers: int, depth: int, device: str, backend: str) -> Table:
    cuda = device.startswith("cuda")
    header = ["what", "model", "aten ops (from Python)", "aten ops (all)", "GEMMs + convs", "compiled graphs run",
              "inductor kernels", *(["GPU kernels"] if cuda else [])]
    t = Table(f"Operators run per decoded token ({layers} layers) and per tower forward (depth {depth}), "
              f"torch.profiler, {device}", header)
    for key, per in counts.items():
        for model, c in per.items():
            t.rows.append([key, model, *(_count(c[k]) for k in ("aten_top", "aten_all", "gemm", "graphs",
                                                               "inductor_kernels")),
                           *([_count(c.get("kernels", 0))] if cuda else [])])
    t.notes += [
        "per decoded token: the profile of a 6-token greedy generate minus that of a 2-token one, over the 4 extra "
        "decode steps (generate's own per-token work included); per tower forward: one forward of the timed input",
        "aten ops (from Python): aten operators not nested in another aten operator, i.e. dispatched by the model's "
        "Python code; GEMMs + convs: aten::mm/addmm/bmm/baddbmm/convolution calls",
        f"compiled (backend {backend!r}): graphs run = compiled regions entered per call (more than one: graph "
        "breaks); inductor kernels: C++/Triton kernels run (inductor's kernel profiling on)"
        + ("; GPU kernels: every kernel launched, compiled or not" if cuda else ""),
    ]
    return t


def _count(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"
