"""Runtime: what a fused module buys, against the original module and against the machine.

``patch_embeddings``: the original ``nn.Conv3d`` vs the fused module (built exactly as a fused
load builds it, through :func:`fusion_core.testing.kit.fuse_module`) vs a bare
``torch.nn.functional.linear`` on the same input (the floor: the GEMM the fused module must
reduce to), at the real shapes of Qwen2-VL/Qwen2.5-VL, Qwen3-VL and GLM-4V.

``qkv`` / ``gate_up`` (when installed): decoder layer and whole-model forward of a small text
model loaded plain vs fused from the same checkpoint.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from bench_common import Budget, Summary, Table, interleaved, ratios
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class PatchShape:
    name: str
    patch: int
    out: int
    bias: bool
    channels: int = 3
    temporal: int = 2

    @property
    def fan_in(self) -> int:
        return self.channels * self.temporal * self.patch * self.patch


SHAPES = (
    PatchShape("Qwen2-VL/2.5-VL 3x2x14x14->1280", 14, 1280, False),
    PatchShape("Qwen3-VL 3x2x16x16->1152 +b", 16, 1152, True),
    PatchShape("Qwen3-VL 3x2x16x16->1024 +b", 16, 1024, True),
    PatchShape("GLM-4V 3x2x14x14->1536 +b", 14, 1536, True),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class RuntimePlan:
    shapes: tuple[PatchShape, ...]
    patches: tuple[int, ...]
    dtypes: tuple[str, ...]
    compile_shapes: tuple[PatchShape, ...]
    compile_patches: tuple[int, ...]
    seconds_per_config: float
    min_rounds: int
    max_rounds: int
    compile_backend: str = "inductor"
    device: str = "cpu"


def plan_for(quick: bool, compile_enabled: bool, device: str = "cpu",
             dtypes: tuple[str, ...] = ("fp32", "bf16")) -> RuntimePlan:
    if quick:
        return RuntimePlan(SHAPES[:1], (256,), dtypes, SHAPES[:1] if compile_enabled else (), (256,),
                           0.15, 3, 5, device=device)
    return RuntimePlan(SHAPES, (256, 1024, 4096, 16384), dtypes,
                       SHAPES if compile_enabled else (), (1024, 4096), 2.5, 7, 40, device=device)


def device_sync(device: str) -> Callable[[], None] | None:
    """What makes a wall-clock sample include the device work it queued (None on CPU)."""
    return torch.cuda.synchronize if device.startswith("cuda") else None


def _patch_embedding_contenders(shape: PatchShape, n: int, dtype: torch.dtype, compiled: bool, backend: str,
                                device: str = "cpu") -> tuple[dict[str, Callable[[], Any]], float]:
    from fusion_patch_embeddings.family import PatchEmbeddingsFamily

    from fusion_core.testing.kit import fuse_module

    torch.manual_seed(0)
    k = (shape.temporal, shape.patch, shape.patch)
    conv = nn.Conv3d(shape.channels, shape.out, kernel_size=k, stride=k, bias=shape.bias).to(device, dtype).eval()
    fused = fuse_module(conv, PatchEmbeddingsFamily()).eval()
    # The Qwen-VL / GLM-4V towers call their projection on rows of flattened patches viewed as [N, C, T, P, P].
    x = torch.randn(n, shape.fan_in, dtype=dtype, device=device).view(n, shape.channels, *k)
    weight = conv.weight.detach().reshape(shape.out, -1)  # a view: the same storage the fused module uses
    bias = conv.bias.detach() if conv.bias is not None else None

    def floor_fn(inp: torch.Tensor) -> torch.Tensor:
        return F.linear(inp.reshape(inp.shape[0], -1), weight, bias)

    conv_fn: Callable[[torch.Tensor], torch.Tensor] = conv
    fused_fn: Callable[[torch.Tensor], torch.Tensor] = fused
    if compiled:
        torch._dynamo.reset()  # one config, one fresh set of graphs (no recompile limit across configs)
        conv_fn = torch.compile(conv, backend=backend, dynamic=False)
        fused_fn = torch.compile(fused, backend=backend, dynamic=False)
        floor_fn = torch.compile(floor_fn, backend=backend, dynamic=False)
    with torch.inference_mode():
        ref = conv(x).reshape(n, -1).float()
        err = float((fused_fn(x).reshape(n, -1).float() - ref).abs().max())
        err = max(err, float((floor_fn(x).float() - ref).abs().max()))

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.inference_mode():
                return fn(x)

        return call

    return {"conv3d": run(conv_fn), "fused": run(fused_fn), "floor": run(floor_fn)}, err


def _calibrate(contenders: dict[str, Callable[[], Any]], plan: RuntimePlan) -> tuple[int, int]:
    """(rounds, inner): each sample >= ~5 ms, about ``seconds_per_config`` per config in all."""
    times = {}
    wait = device_sync(plan.device) or (lambda: None)
    for name, fn in contenders.items():
        fn()  # warm-up (and, compiled, the compilation itself)
        wait()
        start = time.perf_counter()
        fn()
        wait()
        times[name] = time.perf_counter() - start
    inner = max(1, min(50, int(0.005 / max(min(times.values()), 1e-6))))
    per_round = sum(times.values()) * inner
    rounds = int(max(plan.min_rounds, min(plan.max_rounds, plan.seconds_per_config / max(per_round, 1e-6))))
    return rounds, inner


def run_patch_embeddings(plan: RuntimePlan, log: Callable[[str], None]) -> tuple[Table, list[dict[str, Any]]]:
    table = Table(
        "Runtime: patch_embeddings (seconds per call; median [p10-p90] of interleaved rounds)",
        ["shape", "patches", "dtype", "mode", "conv3d ms", "fused ms", "floor ms", "speedup conv/fused",
         "fused/floor", "floor GFLOP/s", "max abs diff"],
    )
    results: list[dict[str, Any]] = []
    configs: list[tuple[PatchShape, int, str, bool]] = []
    for shape in plan.shapes:
        for n in plan.patches:
            for dt in plan.dtypes:
                configs.append((shape, n, dt, False))
    for shape in plan.compile_shapes:
        for n in plan.compile_patches:
            for dt in plan.dtypes:
                configs.append((shape, n, dt, True))
    for shape, n, dt, compiled in configs:
        mode = f"compile({plan.compile_backend})" if compiled else "eager"
        start = time.perf_counter()
        contenders, err = _patch_embedding_contenders(shape, n, DTYPES[dt], compiled, plan.compile_backend,
                                                      plan.device)
        setup_s = time.perf_counter() - start
        rounds, inner = _calibrate(contenders, plan)
        samples = interleaved(contenders, rounds=rounds, inner=inner, warmup=0, sync=device_sync(plan.device))
        s = {k: Summary.of(v) for k, v in samples.items()}
        speedup = ratios(samples["conv3d"], samples["fused"])
        overhead = ratios(samples["fused"], samples["floor"])
        gflops = 2.0 * n * shape.fan_in * shape.out / s["floor"].median / 1e9
        results.append({
            "shape": shape.name, "patches": n, "dtype": dt, "mode": mode, "rounds": rounds, "inner": inner,
            "setup_s": setup_s, "seconds": {k: v for k, v in s.items()}, "speedup_conv_over_fused": speedup,
            "fused_over_floor": overhead, "floor_gflops": gflops, "max_abs_diff": err,
            "samples": samples,
        })
        table.rows.append([
            shape.name, str(n), dt, mode, s["conv3d"].fmt(1e3), s["fused"].fmt(1e3), s["floor"].fmt(1e3),
            speedup.fmt(unit="x"), overhead.fmt(digits=3), f"{gflops:.0f}", f"{err:.2g}",
        ])
        log(f"  {shape.name} n={n} {dt} {mode}: speedup {speedup.fmt(unit='x')}, "
            f"fused/floor {overhead.fmt(digits=3)} ({rounds}x{inner})")
    if plan.compile_shapes and len(plan.compile_patches) < len(plan.patches):
        table.notes.append(
            f"torch.compile rows cover {', '.join(map(str, plan.compile_patches))} patches only "
            "(the full grid is run eager), to keep the whole benchmark within ~10 minutes on 2 cores"
        )
    table.notes.append("max abs diff is the largest absolute difference of fused and floor outputs from Conv3d's")
    return table, results


def patch_embedding_budgets(results: list[dict[str, Any]]) -> list[Budget]:
    eager = [r for r in results if r["mode"] == "eager"]
    budgets = []
    fp32 = [r for r in eager if r["dtype"] == "fp32" and r["patches"] >= 1024]
    if fp32:
        worst = min(fp32, key=lambda r: r["speedup_conv_over_fused"].median)
        value = worst["speedup_conv_over_fused"].median
        budgets.append(Budget(
            "fused patch embedding vs Conv3d, fp32, >= 1024 patches (eager, worst shape)", ">= 5x",
            f"{value:.2f}x ({worst['shape']}, {worst['patches']})", value >= 5.0,
        ))
    if results:
        worst = max(results, key=lambda r: r["fused_over_floor"].median)
        value = worst["fused_over_floor"].median
        budgets.append(Budget(
            "fused patch embedding vs bare F.linear floor, every shape (worst)", "<= 1.10x",
            f"{value:.3f}x ({worst['shape']}, {worst['patches']}, {worst['dtype']}, {worst['mode']})", value <= 1.10,
        ))
    return budgets


# --------------------------------------------------------------------------- qkv / gate_up

TEXT_FAMILIES = ("qkv", "gate_up")


def _text_config(quick: bool) -> Any:
    from transformers import Qwen2Config

    if quick:
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    # A Qwen2-0.5B-like layer geometry with fewer layers, so a forward fits the time budget on 2 cores.
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096)


def run_text_families(quick: bool, log: Callable[[str], None], device: str = "cpu", dtype: str = "fp32"
                      ) -> tuple[Table | None, list[dict[str, Any]], list[str]]:
    """Decoder layer and whole-model forward, plain vs fused, for each installed text family."""
    import fusion_core

    registry = fusion_core.get_registry()
    available = [name for name in TEXT_FAMILIES if name in registry]
    notes = [f"family {name!r} is not installed: skipped" for name in TEXT_FAMILIES if name not in registry]
    if not available:
        return None, [], notes
    from transformers import AutoModelForCausalLM

    table = Table(
        "Runtime: text families (seconds per forward; median [p10-p90])",
        ["family", "what", "batch x seq", "dtype", "plain ms", "fused ms", "speedup plain/fused"],
    )
    results: list[dict[str, Any]] = []
    sizes = [(1, 32)] if quick else [(1, 128), (4, 256), (1, 1024)]
    config = _text_config(quick)
    with tempfile.TemporaryDirectory(prefix="fusion-bench-text-") as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        plain = AutoModelForCausalLM.from_pretrained(tmp, dtype=DTYPES[dtype]).to(device).eval()
        combos = [*available, "+".join(available)] if len(available) > 1 else available
        for family in combos:
            try:
                fused = fusion_core.from_pretrained(
                    AutoModelForCausalLM, tmp, fusion_config={f: True for f in family.split("+")},
                    dtype=DTYPES[dtype],
                ).to(device).eval()
            except Exception as exc:  # a family that does not cover this architecture: report, go on
                notes.append(f"family {family!r} could not load a Qwen2 model fused: {type(exc).__name__}: {exc}")
                continue
            for b, s in sizes:
                ids = torch.randint(0, config.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
                ids = ids.to(device)
                for what, make in (("decoder layer", _layer_call), ("whole model", _model_call)):
                    try:
                        contenders = {"plain": make(plain, ids), "fused": make(fused, ids)}
                        rounds, inner = (3, 1) if quick else _rounds_for(contenders, device)
                        samples = interleaved(contenders, rounds=rounds, inner=inner, warmup=1,
                                              sync=device_sync(device))
                    except Exception as exc:
                        notes.append(f"{family} {what} {b}x{s}: {type(exc).__name__}: {exc}")
                        continue
                    sp = {k: Summary.of(v) for k, v in samples.items()}
                    speed = ratios(samples["plain"], samples["fused"])
                    results.append({"family": family, "what": what, "batch": b, "seq": s, "dtype": dtype,
                                    "seconds": sp, "speedup_plain_over_fused": speed, "samples": samples})
                    table.rows.append([family, what, f"{b}x{s}", dtype, sp["plain"].fmt(1e3), sp["fused"].fmt(1e3),
                                       speed.fmt(unit="x")])
                    log(f"  {family} {what} {b}x{s}: speedup {speed.fmt(unit='x')}")
    table.notes += notes
    return table, results, notes


def _rounds_for(contenders: dict[str, Callable[[], Any]], device: str) -> tuple[int, int]:
    wait = device_sync(device) or (lambda: None)
    wait()
    start = time.perf_counter()
    for fn in contenders.values():
        fn()
    wait()
    per_round = time.perf_counter() - start
    return int(max(5, min(30, 2.0 / max(per_round, 1e-6)))), 1


def _model_call(model: nn.Module, ids: torch.Tensor) -> Callable[[], Any]:
    def call() -> Any:
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits

    return call


def _layer_call(model: nn.Module, ids: torch.Tensor) -> Callable[[], Any]:
    base = model.model
    layer = base.layers[0]
    with torch.inference_mode():
        hidden = base.embed_tokens(ids)
        position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        position_embeddings = base.rotary_emb(hidden, position_ids)

    def call() -> Any:
        with torch.inference_mode():
            return layer(hidden, attention_mask=None, position_ids=position_ids,
                         position_embeddings=position_embeddings)

    return call
