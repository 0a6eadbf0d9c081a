"""Load, save and start-up, each measurement in a fresh process, interleaved across contenders.

The parent starts one worker process per measurement (``python bench_io.py worker '<json>'``),
rotating the order of the contenders from round to round. A worker imports what it needs,
resets its peak-RSS mark (``/proc/self/clear_refs``), does the one thing it measures, and
prints a ``RESULT {...}`` line: wall times, the peak RSS of the measured step, and for fused
loads the discovery (meta-device instantiation) time of the first load and of a second load
in the same process (the cache hit).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULT_PREFIX = "RESULT "
CHECKPOINT_ROOT = Path(os.environ.get("FUSION_BENCH_CHECKPOINTS", Path(tempfile.gettempdir()) / "fusion-bench"))


# --------------------------------------------------------------------------- process memory

def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    hwm = _status_kb("VmHWM")
    if hwm is None:  # no /proc: the process-wide peak (kilobytes on Linux)
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return hwm / 1024.0


def rss_mb() -> float:
    rss = _status_kb("VmRSS")
    return (rss or 0) / 1024.0


# --------------------------------------------------------------------------- checkpoints

def qwen2_vl_config(quick: bool) -> Any:
    """Qwen2-VL with its real vision tower (depth 32, width 1280) and a small text model."""
    from transformers import Qwen2VLConfig

    if quick:
        from fusion_core.testing.tiny_models import TINY_MODELS

        return TINY_MODELS["qwen2_vl"].make_config()
    text = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    vision = dict(depth=32, embed_dim=1280, hidden_size=512, num_heads=16, mlp_ratio=4, in_channels=3,
                  patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, vision_start_token_id=3, vision_end_token_id=4,
                         image_token_id=5, video_token_id=6)


def build_checkpoints(quick: bool, log: Callable[[str], None]) -> dict[str, Path]:
    """{"single": dir, "sharded": dir}, bf16, cached under /tmp by config and transformers version."""
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText

    config = qwen2_vl_config(quick)
    key = hashlib.sha256((config.to_json_string() + transformers.__version__).encode()).hexdigest()[:12]
    root = CHECKPOINT_ROOT / f"qwen2vl-{'tiny' if quick else 'real'}-tf{transformers.__version__}-{key}"
    dirs = {"single": root / "single", "sharded": root / "sharded"}
    if all((d / "config.json").is_file() for d in dirs.values()):
        return dirs
    log(f"  building checkpoints under {root} (once)")
    start = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).mul_(0.02))
        for _name, buf in model.named_buffers():
            if buf.is_floating_point():
                buf.zero_()
    # Non-persistent buffers (rotary inv_freq) are not saved; a load recomputes them from the config.
    model.eval()
    shard = "64MB" if quick else "300MB"
    for name, size in (("single", "20GB"), ("sharded", shard)):
        tmp = Path(str(dirs[name]) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, max_shard_size=size)
        shutil.rmtree(dirs[name], ignore_errors=True)
        tmp.rename(dirs[name])
    log(f"  built in {time.perf_counter() - start:.1f} s: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
        f"{checkpoint_bytes(dirs['single']) / 1e9:.2f} GB")
    return dirs


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


# --------------------------------------------------------------------------- worker side

def _worker(args: dict[str, Any]) -> dict[str, Any]:
    kind = args["kind"]
    if kind == "import":
        return _worker_import(args)
    start = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import fusion_core
    from fusion_core import discovery, hf

    path = args["path"]
    # Import the model's modeling module up front (transformers imports it lazily on first use), so
    # that no contender's first load pays for it and the fused one's discovery does not absorb it.
    architectures = json.loads((Path(path) / "config.json").read_text()).get("architectures")
    if architectures:
        getattr(transformers, architectures[0])
    else:  # 4.57 leaves "architectures" out of a composite config: ask the Auto class's mapping
        AutoModelForImageTextToText._model_mapping[type(transformers.AutoConfig.from_pretrained(path))]
    out: dict[str, Any] = {"import_s": time.perf_counter() - start, "rss_after_import_mb": rss_mb()}
    dtype = torch.bfloat16
    fusion = {"patch_embeddings": True}
    timings: dict[str, list[float]] = {"discover": [], "meta_init": []}
    real_discover, real_build = hf.discover, discovery.build_meta_model

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[name].append(time.perf_counter() - t)

        return wrapper

    hf.discover = timed("discover", real_discover)
    discovery.build_meta_model = timed("meta_init", real_build)

    def load() -> Any:
        if kind in ("plain", "save_plain"):
            return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
        if kind in ("fusion", "save_fused"):
            return fusion_core.from_pretrained(AutoModelForImageTextToText, path, fusion_config=fusion, dtype=dtype)
        if kind == "tf_fusion":
            model, info = AutoModelForImageTextToText.from_pretrained(
                path, dtype=dtype, fusion_config=fusion, output_loading_info=True
            )
            out["tf_missing"] = [k for k in info.get("missing_keys", ()) if "patch_embed" in str(k)]
            out["tf_unexpected"] = [k for k in info.get("unexpected_keys", ()) if "patch_embed" in str(k)]
            return model
        raise ValueError(kind)

    measured_peak = reset_peak_rss()
    rss0 = rss_mb()
    t = time.perf_counter()
    model = load()
    out["first_s"] = time.perf_counter() - t
    out["first_peak_mb"] = peak_rss_mb()
    out["first_peak_delta_mb"] = out["first_peak_mb"] - rss0
    out["peak_is_per_step"] = measured_peak
    if kind.startswith("save_"):
        target = Path(args["out"])
        shutil.rmtree(target, ignore_errors=True)
        reset_peak_rss()
        rss0 = rss_mb()
        t = time.perf_counter()
        if kind == "save_fused":
            fusion_core.save_pretrained(model, target)
        else:
            model.save_pretrained(target)
        out["save_s"] = time.perf_counter() - t
        out["save_peak_mb"] = peak_rss_mb()
        out["save_peak_delta_mb"] = out["save_peak_mb"] - rss0
        out["saved_bytes"] = checkpoint_bytes(target)
        shutil.rmtree(target, ignore_errors=True)
        return out
    del model
    t = time.perf_counter()
    model = load()
    out["second_s"] = time.perf_counter() - t
    out["discover_s"] = timings["discover"]
    out["meta_init_s"] = timings["meta_init"]
    if kind == "tf_fusion":
        # The reference fuses into nn.Linear; whether its weight is the checkpoint's is what this row checks.
        out["tf_fused_modules"] = sorted({type(m).__name__ for m in model.modules() if "atch" in type(m).__name__})
    return out


def _worker_import(args: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    if args.get("transformers"):
        import transformers  # noqa: F401
    t2 = time.perf_counter()
    if args.get("fusion_core"):
        import fusion_core  # noqa: F401
    t3 = time.perf_counter()
    return {"torch_s": t1 - t0, "transformers_s": t2 - t1, "fusion_core_s": t3 - t2}


def run_worker(args: dict[str, Any], python: str | None = None, timeout: float = 600) -> dict[str, Any]:
    """Run one measurement in a fresh process; its wall time (start to exit) is added as ``process_s``."""
    cmd = [python or sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(args)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_worker_env())
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            result["process_s"] = elapsed
            return result
    raise RuntimeError(f"worker {args} printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    return env


def run_command(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_worker_env())
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed


def rotate(items: list[Any], r: int) -> list[Any]:
    k = r % len(items)
    return items[k:] + items[:k]


# --------------------------------------------------------------------------- parent side

LOADERS = {
    "plain": "plain transformers from_pretrained",
    "fusion": "fusion_core.from_pretrained (patch_embeddings)",
    "tf_fusion": "transformers fusion_config (reference, 5.x)",
}


def run_load(quick: bool, log: Callable[[str], None]) -> tuple[Any, dict[str, Any], list[Any]]:
    import transformers
    from bench_common import Budget, Summary, Table, ratios

    dirs = build_checkpoints(quick, log)
    layouts = ["single"] if quick else ["single", "sharded"]
    kinds = ["plain", "fusion"]
    notes = []
    if "fusion_config" in inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters:
        kinds.append("tf_fusion")
    else:  # 4.57, and 5.x before transformers' own experimental fusion
        notes.append(f"transformers {transformers.__version__} has no fusion_config of its own: reference not run")
    rounds = 1 if quick else 5
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {(lay, k): [] for lay in layouts for k in kinds}
    jobs = [(lay, k) for lay in layouts for k in kinds]
    if not quick:  # one untimed pass: page cache and .pyc files warm for every contender alike
        for lay, k in jobs:
            run_worker({"kind": k, "path": str(dirs[lay])})
    for r in range(rounds):
        for lay, k in rotate(jobs, r):
            samples[(lay, k)].append(run_worker({"kind": k, "path": str(dirs[lay])}))
        log(f"  load round {r + 1}/{rounds} done")
    table = Table(
        "Load: Qwen2-VL-style checkpoint, bf16, fresh process per load (median [p10-p90])",
        ["layout", "loader", "1st load s", "2nd load s", "peak RSS MB", "1st vs plain", "1st - plain ms",
         "2nd vs plain", "peak RSS vs plain", "discovery ms (meta-init ms)", "discovery cache hit ms"],
    )
    budgets: list[Budget] = []
    results: dict[str, Any] = {"checkpoint": {lay: {"path": str(dirs[lay]), "bytes": checkpoint_bytes(dirs[lay]),
                                                    "files": len(list(dirs[lay].glob("*.safetensors")))}
                                              for lay in layouts},
                               "rounds": rounds, "samples": {f"{lay}/{k}": v for (lay, k), v in samples.items()}}
    for lay in layouts:
        plain = samples[(lay, "plain")]
        for k in kinds:
            runs = samples[(lay, k)]
            first = [x["first_s"] for x in runs]
            second = [x["second_s"] for x in runs]
            peak = [x["first_peak_mb"] for x in runs]
            row = [f"{lay} ({results['checkpoint'][lay]['files']} files)", LOADERS[k],
                   Summary.of(first).fmt(digits=3), Summary.of(second).fmt(digits=3), Summary.of(peak).fmt(digits=0)]
            if k == "plain":
                row += ["1", "0", "1", "1", "-", "-"]
            else:
                r1 = ratios(first, [x["first_s"] for x in plain])
                d1 = Summary.of([a - x["first_s"] for a, x in zip(first, plain, strict=True)])
                r2 = ratios(second, [x["second_s"] for x in plain])
                rm = ratios(peak, [x["first_peak_mb"] for x in plain])
                disc = meta = hit = "-"
                if k == "fusion":
                    d_first = Summary.of([x["discover_s"][0] for x in runs])
                    m_first = Summary.of([x["meta_init_s"][0] for x in runs])
                    d_hit = Summary.of([x["discover_s"][1] for x in runs])
                    disc, meta, hit = d_first.fmt(1e3, 1), m_first.fmt(1e3, 1), d_hit.fmt(1e3, 3)
                    budgets += [
                        Budget(f"fused 1st load - plain 1st load, {lay}", "<= one meta-init",
                               f"{d1.median * 1e3:+.0f} ms (meta-init {m_first.median * 1e3:.0f} ms)",
                               d1.median <= m_first.median),
                        Budget(f"fused 2nd load / plain 2nd load, {lay}", "<= 1.05x", r2.fmt(digits=3, unit="x"),
                               r2.median <= 1.05),
                        Budget(f"fused / plain peak RSS (1st load), {lay}", "<= 1.05x", rm.fmt(digits=3, unit="x"),
                               rm.median <= 1.05),
                    ]
                if k == "tf_fusion":
                    missing = runs[0].get("tf_missing") or []
                    unexpected = runs[0].get("tf_unexpected") or []
                    if missing or unexpected:
                        notes.append(f"reference ({lay}): transformers reported MISSING {missing} and UNEXPECTED "
                                     f"{unexpected}: the fused Linear stays randomly initialised")
                row += [r1.fmt(digits=3, unit="x"), d1.fmt(1e3, 0), r2.fmt(digits=3, unit="x"),
                        rm.fmt(digits=3, unit="x"), f"{disc} ({meta})" if disc != "-" else "-", hit]
            table.rows.append(row)
    table.notes += notes
    table.notes.append("peak RSS: the process's high-water mark while the first load runs (VmHWM reset after "
                       "imports), file-backed pages of the memory-mapped checkpoint included")
    table.notes.append("2nd load: a second load of the same checkpoint in the same process (for fusion: the "
                       "discovery cache hit)")
    return table, results, budgets


def run_save(quick: bool, log: Callable[[str], None]) -> tuple[Any, dict[str, Any], list[Any]]:
    from bench_common import Budget, Summary, Table, ratios

    dirs = build_checkpoints(quick, log)
    rounds = 1 if quick else 5
    kinds = ["save_plain", "save_fused"]
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    out = Path(tempfile.mkdtemp(prefix="fusion-bench-save-"))
    try:
        if not quick:
            for k in kinds:
                run_worker({"kind": k, "path": str(dirs["single"]), "out": str(out / k)})
        for r in range(rounds):
            for k in rotate(kinds, r):
                samples[k].append(run_worker({"kind": k, "path": str(dirs["single"]), "out": str(out / k)}))
            log(f"  save round {r + 1}/{rounds} done")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    table = Table(
        "Save: original-format save of a fused model vs plain save of the unfused one (median [p10-p90])",
        ["saver", "save s", "peak RSS MB", "peak RSS growth MB", "bytes written", "time vs plain",
         "peak RSS vs plain"],
    )
    plain = samples["save_plain"]
    budgets = []
    for k, label in (("save_plain", "plain model.save_pretrained (unfused)"),
                     ("save_fused", "fusion_core.save_pretrained (fused, original format)")):
        runs = samples[k]
        t = [x["save_s"] for x in runs]
        peak = [x["save_peak_mb"] for x in runs]
        growth = [x["save_peak_delta_mb"] for x in runs]
        rt = ratios(t, [x["save_s"] for x in plain])
        rm = ratios(peak, [x["save_peak_mb"] for x in plain])
        table.rows.append([label, Summary.of(t).fmt(digits=3), Summary.of(peak).fmt(digits=0),
                           Summary.of(growth).fmt(digits=0), str(runs[0]["saved_bytes"]), rt.fmt(digits=3, unit="x"),
                           rm.fmt(digits=3, unit="x")])
        if k == "save_fused":
            budgets += [
                Budget("original-format save / plain save, time", "<= 1.05x", rt.fmt(digits=3, unit="x"),
                       rt.median <= 1.05),
                Budget("original-format save / plain save, peak RSS", "<= 1.05x", rm.fmt(digits=3, unit="x"),
                       rm.median <= 1.05),
            ]
    table.notes.append("each save runs in a fresh process right after a load of the single-file checkpoint; the "
                       "peak RSS is the high-water mark of the save alone (reset after the load)")
    return table, {"rounds": rounds, "samples": samples}, budgets


def _fusion_command() -> list[str]:
    script = Path(sys.executable).with_name("fusion")
    return [str(script), "list"] if script.exists() else [sys.executable, "-m", "fusion_core", "list"]


def run_startup(quick: bool, log: Callable[[str], None]) -> tuple[Any, dict[str, Any], list[Any]]:
    from bench_common import Budget, Summary, Table, ratios

    rounds = 1 if quick else 7
    variants = {
        "torch": {"kind": "import"},
        "torch + fusion_core": {"kind": "import", "fusion_core": True},
        "torch + transformers + fusion_core": {"kind": "import", "transformers": True, "fusion_core": True},
    }
    commands = {"python -c 'import torch'": [sys.executable, "-c", "import torch"], "fusion list": _fusion_command()}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    walls: dict[str, list[float]] = {k: [] for k in commands}
    if not quick:
        run_worker(variants["torch + fusion_core"])  # .pyc files written, page cache warm
    for r in range(rounds):
        for name in rotate(list(variants), r):
            runs[name].append(run_worker(variants[name]))
        for name in rotate(list(commands), r):
            walls[name].append(run_command(commands[name]))
    table = Table("Start-up (fresh processes, median [p10-p90])", ["what", "ms", "process wall ms", "note"])
    base = [x["process_s"] for x in runs["torch"]]
    table.rows.append(["import torch", Summary.of([x["torch_s"] for x in runs["torch"]]).fmt(1e3, 0),
                       Summary.of(base).fmt(1e3, 0), "baseline"])
    added = Summary.of([x["fusion_core_s"] for x in runs["torch + fusion_core"]])
    wall = [x["process_s"] for x in runs["torch + fusion_core"]]
    table.rows.append(["import fusion_core after import torch", added.fmt(1e3, 0), Summary.of(wall).fmt(1e3, 0),
                       f"process wall vs torch only: {ratios(wall, base).fmt(digits=3, unit='x')}"])
    added_tf = Summary.of([x["fusion_core_s"] for x in runs["torch + transformers + fusion_core"]])
    tf = Summary.of([x["transformers_s"] for x in runs["torch + transformers + fusion_core"]])
    table.rows.append(["import fusion_core after torch + transformers", added_tf.fmt(1e3, 0), "-",
                       f"import transformers itself: {tf.fmt(1e3, 0)} ms"])
    lst = Summary.of(walls["fusion list"])
    py_torch = Summary.of(walls["python -c 'import torch'"])
    table.rows.append(["fusion list", "-", lst.fmt(1e3, 0),
                       f"python -c 'import torch' alone: {py_torch.fmt(1e3, 0)} ms"])
    budgets = [
        Budget("import fusion_core on top of import torch", "< 50 ms", f"{added.median * 1e3:.0f} ms",
               added.median < 0.050),
        Budget("fusion list", "< 1 s", f"{lst.median:.2f} s (import torch alone {py_torch.median:.2f} s)",
               lst.median < 1.0),
    ]
    return table, {"rounds": rounds, "imports": runs, "commands": walls}, budgets


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.path.insert(0, str(HERE))
        print(RESULT_PREFIX + json.dumps(_worker(json.loads(sys.argv[2]))), flush=True)
    else:
        sys.exit("usage: bench_io.py worker '<json>' (the benchmarks are run by benchmarks/run.py)")
