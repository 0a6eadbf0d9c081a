"""One training step, plain vs ``linear_cross_entropy``: the step's peak memory, its time, and the same loss and grads.

    python benchmarks/bench_train.py --model qwen2-0.5b --tokens 2048 --setting lora-gc --rounds 3
    python benchmarks/bench_train.py --model llama-3.2-1b --tokens 2048 8192 --setting lora lora-gc full-gc
    python benchmarks/bench_train.py --model qwen2-0.5b --layers 2 --tokens 256 --rounds 1 --with-merged
    python benchmarks/bench_train.py --model tiny --tokens 64 --rounds 1 --dtype fp32   # seconds (CI)

A training step of a causal LM at a 128k-152k vocabulary is dominated in memory by the logits: the
``[tokens, vocab]`` tensor, its float32 copy for the loss and their gradient. ``linear_cross_entropy``
computes the loss chunk by chunk from the hidden states and the LM head, so none of them exists whole.
This measures what that is worth, per setting:

- ``lora``: PEFT LoRA r=8 on q/k/v/o/gate/up/down, everything else frozen;
- ``lora-gc``: the same with gradient checkpointing (non-reentrant);
- ``full``: every parameter trainable (the head too: its weight gradient is vocab-sized);
- ``full-gc``: every parameter trainable, with gradient checkpointing.

Contenders: ``plain`` (transformers), ``linear_cross_entropy`` (and with ``--with-merged``
``linear_cross_entropy+qkv+gate_up``), and ``plain (A/A)``, plain again: its ratios and differences show
the harness's own noise. Every measurement is a fresh process (this script with ``--worker``), the order
of the contenders rotating from round to round. A worker loads the model (random bf16 weights at the
real widths, built once, see :mod:`bench_models`), takes its resident memory as the baseline, resets the
peak mark (``/proc/self/clear_refs``) and runs one step (forward + backward, batch 1, ``labels=ids``):
the first step, with every first-call allocation in it, is the one whose peak counts. A second step is
timed. Loss and gradients (all LoRA tensors; for full fine-tuning the embedding / LM head, the final
norm and layer 0, under their original names) are compared with the plain run of the same round: same
weights, same adapters, same token ids.

The step peak is resident memory, so it includes freed memory glibc's malloc keeps: after the first
free of a large block glibc raises its mmap threshold (up to 32 MiB), the layers' activations then come
from the heap, and what they leave there when freed is not given back. That kept heap grows with depth
for both contenders (Qwen2-0.5B widths, lora-gc, 2048 tokens: about 50-80 MB a layer) while the live
tensors grow by one checkpointed layer input (3.7 MB a layer); the "heap kept" column shows it. The fused
contender gives it back at the layers' boundaries (the family's ``release_freed_memory``, on by default);
``--keep-freed-memory`` turns that off, to compare. ``--mmap-threshold 131072`` runs every worker with that
fixed threshold (``MALLOC_MMAP_THRESHOLD_``: every block above it is its own mapping, unmapped on free), so
the peak is the tensors' own; it makes the step slower (1.7-1.8x at Qwen2-0.5B widths on the 2-core Xeon VM:
fresh pages fault in), so its times are not comparable with a default run's.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_io import RESULT_PREFIX, peak_rss_mb, reset_peak_rss, rotate, rss_mb  # noqa: E402

FUSED = "linear_cross_entropy"
MERGED = "linear_cross_entropy+qkv+gate_up"
CONTROL = "plain (A/A)"
REFERENCE = "plain in float32"
SETTINGS = ("lora", "lora-gc", "full", "full-gc")
MODEL_NAMES = ("qwen2-0.5b", "llama-3.2-1b", "tiny")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Full fine-tuning compares these gradients (original names): the embedding / LM head, the final norm, layer 0.
FULL_GRADS = re.compile(r"(embed_tokens|lm_head)\.weight$|\.layers\.0\.|\.norm\.weight$")
#: Numerical budgets by dtype: loss relative difference, worst gradient relative L2 difference.
NUMERIC_LIMITS = {"bf16": (1e-3, 1e-2), "fp32": (1e-5, 1e-5)}
#: Memory and time budgets of the issue: (setting, tokens or None for any) -> (peak ratio, time ratio or None).
STEP_LIMITS: dict[tuple[str, int | None], tuple[float, float | None]] = {
    ("lora-gc", 2048): (0.25, 1.05),
    ("full-gc", None): (0.6, None),
}
SEED = 0


# --------------------------------------------------------------------------- worker side

def load_model(path: str, families: str | None, dtype_name: str, chunk_tokens: int | None,
               keep_freed_memory: bool = False) -> Any:
    """The model as a user loads it (plain or fused), its parameters copied out of the checkpoint's memory map.

    The copy (:func:`bench_decode.own_memory`) makes the baseline resident memory the weights themselves, for
    every contender alike, rather than file pages the kernel may drop and fault back in during the step.
    """
    import torch
    import transformers
    from bench_decode import own_memory

    import fusion_core

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    if families is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        config: dict[str, Any] = {name: True for name in families.split("+")}
        options: dict[str, Any] = {}
        if chunk_tokens is not None:
            options["chunk_tokens"] = chunk_tokens
        if keep_freed_memory:
            options["release_freed_memory"] = False
        if options and FUSED in config:
            config[FUSED] = options
        model = fusion_core.from_pretrained(transformers.AutoModelForCausalLM, path, fusion_config=config,
                                            dtype=dtype)
    return own_memory(model)


def prepare(model: Any, setting: str) -> Any:
    """Make the model trainable as ``setting`` says; returns the model to train (a PeftModel for LoRA).

    Gradient checkpointing is non-reentrant, so no ``enable_input_require_grads`` is needed: the
    checkpointed blocks reach the LoRA tensors without the input requiring grad.
    """
    if setting.endswith("-gc"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if setting.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))
        seed_adapters(model)
    else:
        model.requires_grad_(True)
    return model.train()


def seed_adapters(model: Any) -> None:
    """Fill every LoRA tensor with N(0, 0.02) from a generator seeded by its name.

    PEFT zeroes ``lora_B``, which would make every ``lora_A`` gradient zero (nothing to compare); and
    seeding by name, not by creation order, gives plain and fused models the same adapters whatever
    order the modules are created in.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.shape, generator=gen).mul_(0.02))


def token_ids(vocab: int, tokens: int) -> Any:
    """The same random ids for every contender of a run (batch 1)."""
    import torch

    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(SEED))


def release_freed_memory() -> None:
    """Collect garbage and return glibc's free heap to the system before the baseline is read.

    Memory the load freed but the allocator kept would be counted in the baseline and then reused by the
    step without raising the resident size: the step's peak above the baseline would read too low.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def heap_kept_mb() -> float:
    """Resident memory that :func:`release_freed_memory` gives back now: freed memory the allocator was keeping.

    Read after the timed step (it would change the timed step's starting heap if taken before), it shows how
    much of a resident-memory peak can be the allocator's rather than live tensors'.
    """
    before = rss_mb()
    release_freed_memory()
    return before - rss_mb()


def step(model: Any, ids: Any) -> float:
    """Forward + backward with ``labels=ids``; the loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach())


def first_step_peak(model: Any, ids: Any) -> dict[str, Any]:
    """Run the first step and measure its peak resident memory above the loaded model.

    The peak mark (VmHWM) is reset to the current RSS first. Where the kernel does not allow that,
    ``ru_maxrss`` before and after is what remains: it can only see how far the step rose above the
    load's own peak, a lower bound, and ``peak_method`` says so.
    """
    release_freed_memory()
    baseline = rss_mb()
    reset = reset_peak_rss()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    loss = step(model, ids)
    elapsed = time.perf_counter() - start
    if reset:
        peak, method = peak_rss_mb() - baseline, "VmHWM reset"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
        method = "ru_maxrss delta (lower bound)"
    return {"loaded_rss_mb": baseline, "step_peak_mb": peak, "peak_method": method, "first_step_s": elapsed,
            "first_loss": loss}


def original_named_gradients(model: Any, keep: Callable[[str], bool]) -> dict[str, Any]:
    """The trainable gradients under the unfused model's names (``q_proj.weight``, not ``qkv_proj.weight``).

    ``fusion_core.original_named_parameters`` yields each part of a merged parameter as a view of its rows;
    with every parameter's data swapped for its gradient for the duration of the call, those views are the
    parts' gradients. A plain model's names pass through unchanged.
    """
    import torch

    import fusion_core

    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad
        return {name: t.detach().clone() for name, t in fusion_core.original_named_parameters(model)
                if t.requires_grad and keep(name)}
    finally:
        with torch.no_grad():
            for p, data in zip(params, saved, strict=True):
                p.data = data


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: load, first step (peak), second step (time), loss and gradients to ``args['grads']``."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.manual_seed(SEED)
    start = time.perf_counter()
    model = prepare(load_model(args["path"], args["families"], args["dtype"], args.get("chunk_tokens"),
                               args.get("keep_freed_memory", False)),
                    args["setting"])
    out: dict[str, Any] = {"load_s": time.perf_counter() - start}
    ids = token_ids(model.config.vocab_size, args["tokens"])
    out.update(first_step_peak(model, ids))
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out["loss"] = step(model, ids)
    out["step_s"] = time.perf_counter() - start
    out["heap_kept_mb"] = heap_kept_mb()
    lora = args["setting"].startswith("lora")
    grads = original_named_gradients(model, (lambda name: True) if lora else FULL_GRADS.search)
    torch.save({"loss": out["loss"], "grads": grads}, args["grads"])
    out["compared_tensors"] = len(grads)
    # A zero gradient would compare equal to anything: the norm shows there was something to compare.
    out["grad_norm"] = float(sum(g.double().norm() ** 2 for g in grads.values()) ** 0.5)
    out["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return out


# --------------------------------------------------------------------------- parent side

def run_worker(args: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    """Run one measurement in a fresh process (this script with ``--worker``); its parsed result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(args)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    if args.get("mmap_threshold") is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args["mmap_threshold"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"worker {args} printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def require_families(families: list[str]) -> None:
    """Fail now, with the registry's reason, if a family is not installed (rather than in every worker)."""
    import fusion_core

    registry = fusion_core.get_registry()
    for name in families:
        if name not in registry:
            sys.exit(f"bench_train: {registry.unknown_family_message(name)}\n(linear_cross_entropy installs with "
                     "pip install -e fusion_plugins/linear_cross_entropy)")


def depth(model: str, layers: int | None) -> int:
    """Decoder layers of the run: ``--layers``, else the released model's (2 for the toy model)."""
    from bench_decode import MODELS

    return layers or (2 if model == "tiny" else MODELS[model][2])


def checkpoint_for(model: str, layers: int | None, log: Callable[[str], None]) -> Path:
    """The random-weight checkpoint of ``model`` (``layers`` deep); bench_decode's, when it built it already."""
    from bench_decode import config_of
    from bench_models import build_checkpoint, text_config

    if model == "tiny":
        return build_checkpoint(text_config(True, depth(model, layers)), "AutoModelForCausalLM",
                                f"train-tiny-{depth(model, layers)}", log)
    # The same config and tag as bench_decode: one cached checkpoint per shape serves both benchmarks.
    return build_checkpoint(config_of(model, layers), "AutoModelForCausalLM", f"decode-{model}-{layers or 'all'}", log)


def compare(contender: Path, plain: Path) -> dict[str, Any]:
    """Loss relative difference and the worst gradient relative L2 difference of a contender vs plain."""
    import torch
    from bench_e2e import relative_error

    mine, ref = torch.load(contender), torch.load(plain)
    loss = relative_error(torch.tensor(mine["loss"]), torch.tensor(ref["loss"]))
    missing = sorted(set(ref["grads"]) ^ set(mine["grads"]))
    worst, where = 0.0, ""
    for name, reference in ref["grads"].items():
        if name in mine["grads"]:
            err = relative_error(mine["grads"][name], reference)
            if err > worst:
                worst, where = err, name
    return {"loss_rel": loss, "grad_rel": worst, "grad_worst": where, "unmatched": missing}


def measure(args: argparse.Namespace, setting: str, tokens: int, path: Path, contenders: dict[str, str | None],
            log: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    """``args.rounds`` rounds of a fresh process per contender, order rotating; each compared with its round's plain."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    scratch = Path(tempfile.mkdtemp(prefix="fusion-bench-train-"))
    try:
        for r in range(args.rounds):
            start = time.perf_counter()
            files: dict[str, Path] = {}
            for name in rotate(list(contenders), r):
                files[name] = scratch / f"{len(files)}.pt"
                job = {"path": str(path), "families": contenders[name], "setting": setting, "tokens": tokens,
                       "dtype": args.dtype, "chunk_tokens": args.chunk_tokens,
                       "keep_freed_memory": args.keep_freed_memory, "grads": str(files[name]),
                       "mmap_threshold": args.mmap_threshold}
                samples[name].append(run_worker(job))
            if args.fp32_reference:  # plain in float32, after the round: the exact gradients each contender is off by
                files[REFERENCE] = scratch / "reference.pt"
                run_worker({"path": str(path), "families": None, "setting": setting, "tokens": tokens,
                            "dtype": "fp32", "chunk_tokens": None, "grads": str(files[REFERENCE]),
                            "mmap_threshold": args.mmap_threshold})
            for name in contenders:
                samples[name][-1].update(compare(files[name], files["plain"]))
                if args.fp32_reference:
                    against = compare(files[name], files[REFERENCE])
                    samples[name][-1].update(loss_rel_fp32=against["loss_rel"], grad_rel_fp32=against["grad_rel"])
            for file in files.values():
                file.unlink()
            log(f"  {setting}, {tokens} tokens: round {r + 1}/{args.rounds} in {time.perf_counter() - start:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return samples


def step_table(args: argparse.Namespace, setting: str, tokens: int, samples: dict[str, list[dict[str, Any]]]) -> Any:
    """Per contender: peak above the loaded model, step time, each vs plain (per-round ratios), and the differences."""
    from bench_common import Summary, Table, ratios

    plain = samples["plain"]
    shape = f"{args.model} ({depth(args.model, args.layers)} layers)"
    table = Table(f"Training step, {shape}, {setting}, {args.dtype}, batch 1 x {tokens} tokens: median [min-max] of "
                  f"{args.rounds} fresh processes",
                  ["contender", "loaded GB", "step peak GB", "peak vs plain", "step s", "time vs plain",
                   "loss rel diff", "worst grad rel L2", "heap kept GB"]
                  + (["worst grad rel L2 vs fp32"] if args.fp32_reference else []))
    for name, runs in samples.items():
        def col(key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [run[key] for run in runs]

        row = [name, Summary.of(col("loaded_rss_mb")).fmt_range(1e-3, 2), Summary.of(col("step_peak_mb")).fmt_range(
            1e-3, 2)]
        if name == "plain":
            row += ["1", Summary.of(col("step_s")).fmt_range(digits=3), "1", "-", "-"]
        else:
            row += [ratios(col("step_peak_mb"), [p["step_peak_mb"] for p in plain]).fmt_range(digits=3, unit="x"),
                    Summary.of(col("step_s")).fmt_range(digits=3),
                    ratios(col("step_s"), [p["step_s"] for p in plain]).fmt_range(digits=3, unit="x"),
                    f"{max(col('loss_rel')):.1e}", f"{max(col('grad_rel')):.1e}"]
        row.append(Summary.of(col("heap_kept_mb")).fmt_range(1e-3, 2))
        if args.fp32_reference:
            row.append(f"{max(col('grad_rel_fp32')):.1e}")
        table.rows.append(row)
        for run in runs:
            if run["unmatched"]:
                table.notes.append(f"{name}: gradients not in both runs: {run['unmatched'][:4]}")
    first = plain[0]
    table.notes += [
        f"step peak: resident memory above the loaded model during the first step ({first['peak_method']}); "
        f"step s: the second step; {first['trainable_params'] / 1e6:.2f}M trainable parameters, "
        f"{first['compared_tensors']} gradient tensors compared (plain's L2 norm over them {first['grad_norm']:.3g})",
        "differences: the worst over the rounds, each vs the plain run of the same round (same weights and ids)",
        "heap kept: after the second step, the resident memory gc + malloc_trim(0) gives back (freed memory the "
        "allocator kept; the step peak includes what it kept then); malloc: " + malloc_settings(args),
    ]
    return table


def malloc_settings(args: argparse.Namespace) -> str:
    """The glibc malloc tunables the workers ran with (``--mmap-threshold``, or inherited ``MALLOC_*`` variables), and
    whether the fused contender gave its freed heap back."""
    settings = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if args.mmap_threshold is not None:
        settings["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    allocator = ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "glibc's defaults"
    return allocator + (f"; {FUSED} keeps the freed heap (--keep-freed-memory)" if args.keep_freed_memory
                        else f"; {FUSED} gives the freed heap back at layer boundaries (release_freed_memory)")


def budgets_for(args: argparse.Namespace, setting: str, tokens: int, samples: dict[str, list[dict[str, Any]]]
                ) -> list[Any]:
    """The issue's budgets for each fused contender of this setting (the A/A row has none)."""
    from bench_common import Budget, ratios

    plain = samples["plain"]
    loss_limit, grad_limit = NUMERIC_LIMITS[args.dtype]
    limits = STEP_LIMITS.get((setting, tokens)) or STEP_LIMITS.get((setting, None))
    budgets = []
    for name, runs in samples.items():
        if name in ("plain", CONTROL):
            continue
        where = f"{name}, {setting}, {tokens} tokens"
        if limits is not None:
            peak = ratios([r["step_peak_mb"] for r in runs], [p["step_peak_mb"] for p in plain])
            budgets.append(Budget(f"step peak vs plain, {where}", f"<= {limits[0]}x", peak.fmt_range(digits=3,
                                                                                                      unit="x"),
                                  peak.median <= limits[0]))
            if limits[1] is not None:
                speed = ratios([r["step_s"] for r in runs], [p["step_s"] for p in plain])
                budgets.append(Budget(f"step time vs plain, {where}", f"<= {limits[1]}x",
                                      speed.fmt_range(digits=3, unit="x"), speed.median <= limits[1]))
        loss = max(r["loss_rel"] for r in runs)
        grad = max(r["grad_rel"] for r in runs)
        worst = max(runs, key=lambda r: r["grad_rel"])["grad_worst"]
        budgets += [Budget(f"loss rel diff, {where}", f"<= {loss_limit:g} ({args.dtype})", f"{loss:.1e}",
                           loss <= loss_limit),
                    Budget(f"grad rel L2 diff, {where}", f"<= {grad_limit:g} ({args.dtype})", f"{grad:.1e}",
                           grad <= grad_limit, note=worst.removeprefix("base_model.model."))]
    return budgets


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODEL_NAMES, default="qwen2-0.5b",
                        help="real widths and vocabulary, random weights (tiny: a toy Qwen2, for CI)")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the released model")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048], help="sequence length(s), batch 1")
    parser.add_argument("--setting", choices=SETTINGS, nargs="+", default=["lora-gc"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(NUMERIC_LIMITS), default="bf16")
    parser.add_argument("--with-merged", action="store_true", help=f"also the contender {MERGED}")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help=f"{FUSED}'s chunk_tokens option (default: the family's)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help=f"{FUSED} with release_freed_memory off: glibc keeps the heap it freed, as before")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also run plain in float32 each round and show every contender's distance from its "
                        "gradients (bf16 runs differ from each other by about as much as each differs from exact)")
    parser.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="run every worker with MALLOC_MMAP_THRESHOLD_=BYTES (e.g. 131072): the step peak is then "
                        "the live tensors' rather than also the freed heap glibc keeps; steps are slower")
    parser.add_argument("--json", type=Path, default=None, help="write every sample and summary as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    from bench_common import as_jsonable, budget_table, loadavg, machine_info

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    require_families(MERGED.split("+") if args.with_merged else [FUSED])
    info = machine_info()
    print(f"{info['cpu']} {info['cpu_flags']}, {info['cpus_usable']} CPUs, {info['torch_threads']} threads, "
          f"torch {info['torch']}, transformers {info['transformers']}, load {loadavg()}", flush=True)
    path = checkpoint_for(args.model, args.layers, log)
    contenders: dict[str, str | None] = {"plain": None, FUSED: FUSED}
    if args.with_merged:
        contenders[MERGED] = MERGED
    contenders[CONTROL] = None
    report: dict[str, Any] = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "worker"},
                              "checkpoint": str(path), "runs": []}
    budgets = []
    for setting in args.setting:
        for tokens in args.tokens:
            samples = measure(args, setting, tokens, path, contenders, log)
            table = step_table(args, setting, tokens, samples)
            budgets += budgets_for(args, setting, tokens, samples)
            print(table.text(), flush=True)
            report["runs"].append({"setting": setting, "tokens": tokens, "samples": samples, "table": table})
    summary = budget_table(budgets)
    print(summary.text(), flush=True)
    report["budgets"] = budgets
    if args.json is not None:
        args.json.write_text(json.dumps(as_jsonable(report), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
