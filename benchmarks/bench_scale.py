"""Fused loads at the sizes people load: time to first token, peak memory and save, plain vs fused.

    python benchmarks/bench_scale.py                       # Qwen2.5-1.5B shapes, qkv + gate_up, 3 rounds
    python benchmarks/bench_scale.py --shape 7b --rounds 1 # Qwen2.5-7B shapes (~15 GB of bf16 on disk)
    python benchmarks/bench_scale.py --shape olmoe         # OLMoE-1B-7B widths, moe_experts (4.57)
    python benchmarks/bench_scale.py --shape qwen2vl       # a Qwen2-VL-2B-sized checkpoint, patch_embeddings
    python benchmarks/bench_scale.py --no-save --steps     # also: the fused load's fixed costs, step by step

Random bf16 weights at the real shapes and vocabulary, saved by transformers itself in shards of
1 GB (built once, cached under ``$FUSION_BENCH_CHECKPOINTS`` or /tmp/fusion-bench). Every
measurement is a fresh process (``bench_io.run_worker``): imports and the model's modeling module
first, then the peak-RSS mark is reset (``/proc/self/clear_refs``) and the process loads
(``from_pretrained`` with ``dtype=torch.bfloat16``, or ``--dtype``), runs one 16-token forward, and for the save rows
saves to a fresh directory. "first token" counts from the load call; "from process start" from
before torch, transformers and (fused) fusion_core are imported, as the user of a script waits.
Contenders alternate order from round to round; ``plain (A/A)`` is a second plain contender: its
ratio to plain is the harness's own noise. Peak RSS is VmHWM (file pages of the mapped checkpoint
included, as the kernel counts them).

``--steps`` adds fused processes of their own, left out of the ratios (their clocks change what they time):
each times importing pydantic before anything of fusion-core, then the steps of the load
(:func:`step_timers`). The floor it prints is plain's first token plus the three costs a fused load has
and plain's has not: pydantic (fusion_config is a pydantic model), the meta model discovery plans on,
and the merges.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_io import CHECKPOINT_ROOT, checkpoint_bytes, peak_rss_mb, reset_peak_rss, rotate, rss_mb  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "1.5b": {"auto": "AutoModelForCausalLM", "config": "Qwen2Config", "fusion": {"qkv": True, "gate_up": True},
             "kwargs": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                            max_position_embeddings=32768)},
    "7b": {"auto": "AutoModelForCausalLM", "config": "Qwen2Config", "fusion": {"qkv": True, "gate_up": True},
           "kwargs": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                          num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                          max_position_embeddings=32768)},
    "olmoe": {"auto": "AutoModelForCausalLM", "config": "OlmoeConfig", "fusion": {"moe_experts": True},
              "kwargs": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                             num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304)},
    "qwen2vl": {"auto": "AutoModelForImageTextToText", "config": "Qwen2VLConfig", "fusion": {"patch_embeddings": True},
                "kwargs": dict(
                    text_config=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                     tie_word_embeddings=True, rope_scaling={"type": "mrope",
                                                                             "mrope_section": [16, 24, 24]}),
                    vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4,
                                       in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2),
                    vision_start_token_id=151652, vision_end_token_id=151653, image_token_id=151655,
                    video_token_id=151656, tie_word_embeddings=True)},
}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_checkpoint(shape: str) -> Path:
    """Random bf16 weights at ``shape``, saved by transformers in 1 GB shards; cached by shape.

    One checkpoint serves both transformers lines (a 7B one is 15 GB): every release saves the original
    per-module layout (5.x converts its stacked experts back when it saves)."""
    import torch
    import transformers

    spec = SHAPES[shape]
    directory = CHECKPOINT_ROOT / f"scale-{shape}"
    if (directory / "config.json").is_file():
        return directory
    _log(f"building {directory} (once)")
    start = time.perf_counter()
    config = getattr(transformers, spec["config"])(**spec["kwargs"])
    with torch.device("meta"):
        model = getattr(transformers, spec["auto"]).from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.zero_()
    staging = Path(f"{directory}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, max_shard_size="1GB")
    staging.rename(directory)
    _log(f"  built in {time.perf_counter() - start:.0f} s: {checkpoint_bytes(directory) / 1e9:.2f} GB")
    return directory


# --------------------------------------------------------------------------- worker side

def worker(args: dict[str, Any]) -> dict[str, Any]:
    process_start = time.perf_counter()  # before torch, transformers and (fused) fusion_core are imported
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    fusion_core = importlib.import_module("fusion_core") if args["kind"] == "fused" else None

    steps: dict[str, float] = {}
    if args.get("steps"):
        start = time.perf_counter()
        pydantic = importlib.import_module("pydantic")
        pydantic.BaseModel, pydantic.RootModel  # noqa: B018 (pydantic imports its machinery on first access)
        steps["pydantic import"] = time.perf_counter() - start
        step_timers(steps)
    spec = SHAPES[args["shape"]]
    auto = getattr(transformers, spec["auto"])
    config = transformers.AutoConfig.from_pretrained(args["path"])
    auto._model_mapping[type(config)]  # the modeling module, imported before the clock starts
    tokens = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    dtype = getattr(torch, args.get("dtype", "bfloat16"))
    out: dict[str, Any] = {}
    reset_peak_rss()
    start = time.perf_counter()
    if fusion_core is not None:
        model = fusion_core.from_pretrained(auto, args["path"], fusion_config=spec["fusion"], dtype=dtype)
    else:
        model = auto.from_pretrained(args["path"], dtype=dtype)
    out["load_s"] = time.perf_counter() - start
    with torch.no_grad():
        model(input_ids=tokens)
    out["first_token_s"] = time.perf_counter() - start
    out["process_first_token_s"] = time.perf_counter() - process_start
    out["peak_mb"] = peak_rss_mb()
    out["rss_mb"] = rss_mb()
    if steps:
        out["steps"] = steps
    if args.get("save"):
        target = Path(args["save"])
        shutil.rmtree(target, ignore_errors=True)
        start = time.perf_counter()
        if fusion_core is not None:
            fusion_core.save_pretrained(model, target)
        else:
            model.save_pretrained(target)
        out["save_s"] = time.perf_counter() - start
        out["save_peak_mb"] = peak_rss_mb()
        out["saved"] = sorted(p.name for p in target.iterdir() if "safetensors" in p.name)
        shutil.rmtree(target, ignore_errors=True)
    return out


#: step of a fused load -> (module, function) whose calls it sums
STEPS = {
    "fusion-core's loader import": None,
    "plugin registry": ("fusion_core.hf", "get_registry"),
    "discovery": ("fusion_core.hf", "discover"),
    "  of which the meta model": ("fusion_core.discovery", "build_meta_model"),
    "conversion": ("fusion_core.hf", "_convert_built"),
    "  of which the merges": ("fusion_core.streaming", "merge"),
}


def step_timers(steps: dict[str, float]) -> None:
    """Import fusion-core's loader (timed) and wrap each function of :data:`STEPS` to add its calls' time to
    ``steps`` (the functions are looked up by module attribute where their callers look them up)."""
    start = time.perf_counter()
    importlib.import_module("fusion_core.hf")
    steps["fusion-core's loader import"] = time.perf_counter() - start
    for step, target in STEPS.items():
        if target is None:
            continue
        module = importlib.import_module(target[0])
        function = getattr(module, target[1])

        def timed(*args: Any, _function: Any = function, _step: str = step, **kwargs: Any) -> Any:
            begun = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                steps[_step] = steps.get(_step, 0.0) + time.perf_counter() - begun

        setattr(module, target[1], timed)


def _compile_sources() -> None:
    """Bytecode for fusion-core and its plugins, as pip writes it when it installs a wheel.

    transformers and torch come from wheels with their bytecode; an editable checkout under
    ``PYTHONDONTWRITEBYTECODE=1`` (as on this project's machines) would otherwise compile fusion-core's
    modules again in every fused process, a cost no installed user pays."""
    import compileall

    root = HERE.parent
    for directory in (root / "fusion_core", root / "fusion_plugins"):
        if directory.is_dir():
            compileall.compile_dir(str(directory), quiet=1)


def run_worker(args: dict[str, Any], python: str = sys.executable) -> dict[str, Any]:
    import subprocess

    cmd = [python, str(Path(__file__).resolve()), "worker", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# --------------------------------------------------------------------------- parent side

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-save", action="store_true", help="load and first token only")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                        help="the dtype loads ask for (the checkpoint is bf16: another dtype casts every tensor)")
    parser.add_argument("--anchor", metavar="PYTHON", default=None,
                        help="the python of another transformers environment: its plain load is one more contender "
                             "(transformers 5.x's own stacked experts beside a fused 4.57 load)")
    parser.add_argument("--steps", action="store_true",
                        help="also time the fused load step by step, in processes of its own (see the module docs)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import subprocess

    import transformers
    from bench_common import Summary, Table, machine_info, ratios

    path = build_checkpoint(args.shape)
    _compile_sources()
    # name -> (what the worker does, the python that runs it)
    contenders = {"plain": ("plain", sys.executable), "fused": ("fused", sys.executable),
                  "plain (A/A)": ("plain", sys.executable)}
    if args.anchor:
        version = subprocess.run([args.anchor, "-c", "import transformers; print(transformers.__version__)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        contenders[f"plain, transformers {version}"] = ("plain", args.anchor)
    save_root = Path(tempfile.mkdtemp(prefix="fusion-bench-scale-", dir=path.parent))
    if args.steps:
        contenders["fused, timed by step"] = ("fused", sys.executable)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    try:
        run_worker({"kind": "plain", "path": str(path), "shape": args.shape})  # page cache warm for all alike
        for r in range(args.rounds):
            for name in rotate(list(contenders), r):
                kind, python = contenders[name]
                save = None if args.no_save else str(save_root / "out")
                samples[name].append(run_worker({"kind": kind, "path": str(path), "shape": args.shape,
                                                 "save": save, "dtype": args.dtype,
                                                 "steps": name == "fused, timed by step"}, python))
            _log(f"  round {r + 1}/{args.rounds} done")
    finally:
        shutil.rmtree(save_root, ignore_errors=True)
    fusion = SHAPES[args.shape]["fusion"]
    table = Table(
        f"{args.shape} shapes, {checkpoint_bytes(path) / 1e9:.1f} GB bf16 in "
        f"{len(list(path.glob('*.safetensors')))} shards loaded as {args.dtype}, {fusion}, "
        f"transformers {transformers.__version__}: "
        f"median [p10-p90] of {args.rounds} fresh processes each",
        ["loader", "load s", "first token s", "from process start s", "peak RSS GB", "save s", "save peak RSS GB",
         "first token vs plain", "from process start vs plain", "peak RSS vs plain", "save vs plain",
         "save peak vs plain"],
    )
    plain = samples["plain"]
    for name in contenders:
        runs = samples[name]
        if runs and "steps" in runs[0]:
            continue

        def col(key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [x[key] for x in runs]

        saving = not args.no_save
        row = [name, Summary.of(col("load_s")).fmt(digits=2), Summary.of(col("first_token_s")).fmt(digits=2),
               Summary.of(col("process_first_token_s")).fmt(digits=2), Summary.of(col("peak_mb")).fmt(1e-3, 2),
               Summary.of(col("save_s")).fmt(digits=2) if saving else "-",
               Summary.of(col("save_peak_mb")).fmt(1e-3, 2) if saving else "-"]
        row += [ratios(col(k), [x[k] for x in plain]).fmt(digits=3, unit="x") if saving or "save" not in k else "-"
                for k in ("first_token_s", "process_first_token_s", "peak_mb", "save_s", "save_peak_mb")]
        table.rows.append(row)
        if saving and runs[0]["saved"] != plain[0]["saved"]:
            table.notes.append(f"{name} wrote other files than plain: {runs[0]['saved']} vs {plain[0]['saved']}")
    print(table.text())
    print()
    print(table.markdown())
    if args.steps:
        print()
        print(_steps_table(samples["fused, timed by step"], plain, args).markdown())
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine_info(), "samples": samples}, indent=1, default=str))
    return 0


def _steps_table(runs: list[dict[str, Any]], plain: list[dict[str, Any]], args: argparse.Namespace) -> Any:
    """Median [p10-p90] seconds of each step, and the floor the costs plain's load has not put under the ratio."""
    from bench_common import Summary, Table

    table = Table(f"{args.shape} fused load by step ({args.dtype}): median [p10-p90] of {args.rounds} fresh processes",
                  ["step", "seconds"])
    names = ["pydantic import", *STEPS]
    for name in names:
        table.rows.append([name, Summary.of([run["steps"].get(name, 0.0) for run in runs]).fmt(digits=3)])
    table.rows.append(["load (this process, pydantic imported before it)",
                       Summary.of([run["load_s"] for run in runs]).fmt(digits=3)])
    first_token = Summary.of([run["first_token_s"] for run in plain]).median
    floor = sum(Summary.of([run["steps"].get(name, 0.0) for run in runs]).median
                for name in ("pydantic import", "  of which the meta model", "  of which the merges"))
    table.notes.append(f"plain's first token {first_token:.3f} s; with pydantic, the meta model and the merges "
                       f"added ({floor:.3f} s) a fused first token could be no less than "
                       f"{(first_token + floor) / first_token:.3f}x plain's")
    return table


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        print("RESULT " + json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
    else:
        sys.exit(main())
