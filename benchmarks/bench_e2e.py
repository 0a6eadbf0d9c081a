"""End to end: what a user of a fused model feels: greedy generate, a prefill, a vision tower forward.

Each workload loads a plain model and its fused variants from one checkpoint (see
:mod:`bench_models`) and runs them in interleaved rounds: every round runs each contender once,
in an order that rotates from round to round, and each fused contender's speed is the per-round
ratio plain time / fused time, reported as median [min-max] over the rounds.

- ``generate``: greedy ``model.generate`` of a Qwen2-0.5B-shaped model. A streamer stamps the
  time of every token, so one call gives the prefill (start to first new token: time to first
  token) and the decode (first to last new token) separately, as tokens per second.
- ``prefill``: one forward over a longer prompt with a fresh KV cache, logits for the last
  position only (what ``generate`` runs before its first token).
- ``tower``: the Qwen2-VL-2B vision tower (depth 32, width 1280) on one image of ``patches``
  patches, called directly (``model.model.visual``).

Modes: ``eager``, and ``compiled``: ``model.forward = torch.compile(model.forward)`` (the
tower's ``forward`` likewise), the one-line change users make. The first calls, which compile,
are reported as "first call s" and excluded from the rounds.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from bench_common import FIXED_LENGTH_GREEDY, Budget, Summary, Table
from bench_models import QWEN2_05B_LAYERS, QWEN2_VL_TOWER_DEPTH, build_checkpoint, text_config, tower_config
from bench_profile import count_ops, enable_kernel_events, per_call_difference
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("eager", "compiled")
TEXT_FAMILIES = ("qkv", "gate_up")
TOWER_FAMILIES = ("patch_embeddings",)
ALL_FAMILIES = ("patch_embeddings", "qkv", "gate_up")
WORKLOADS = ("generate", "prefill", "tower")
#: A fused row is within budget when its median paired speed vs plain is at least this.
BUDGET = 0.98
#: The control contender of every eager group: the plain model loaded a second time, after the fused
#: ones. Its row (plain vs plain, the same operators) shows how far this run's noise, and a later
#: place in memory, move a ratio; it has no budget.
CONTROL = "plain, 2nd load"


@dataclass
class E2EPlan:
    """Sizes, dtypes, modes and rounds of one end-to-end run."""

    quick: bool
    device: str
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    workloads: tuple[str, ...] = WORKLOADS
    compile_each: bool = False
    """Compiled mode runs each family alone too, not only all families together (each compile costs minutes)."""
    compile_backend: str = "inductor"
    text_layers: int = QWEN2_05B_LAYERS
    prompt: int = 16
    new_tokens: int = 32
    prefill_tokens: int = 256
    tower_depth: int = QWEN2_VL_TOWER_DEPTH
    patches: int = 1024
    rounds: int = 5
    deadline: float | None = None
    """``time.perf_counter()`` after which no compiled group starts (it would not finish in time)."""
    compile_reserve_s: float = 150.0
    compile_dtypes: tuple[str, ...] | None = None
    """The dtypes whose compiled rows run (None: all of ``dtypes``)."""
    compile_workloads: tuple[str, ...] | None = None
    """The workloads that get compiled rows (None: all of ``workloads``)."""
    count_ops: bool = True
    """Count with torch.profiler the operators per decoded token and per tower forward ({dtypes[-1]} only)."""
    notes: list[str] = field(default_factory=list)

    def modes_for(self, dtype: str, workload: str) -> tuple[str, ...]:
        compiled = (self.compile_dtypes is None or dtype in self.compile_dtypes) and (
            self.compile_workloads is None or workload in self.compile_workloads)
        return tuple(m for m in self.modes if m == "eager" or compiled)

    def counts_in(self, dtype: str, mode: str, workload: str) -> bool:
        """Operators are counted once per mode and workload: in the last dtype that runs that mode."""
        runs = [dt for dt in self.dtypes if mode in self.modes_for(dt, workload)]
        return self.count_ops and bool(runs) and dtype == runs[-1]

    def may_compile(self, what: str) -> bool:
        """False (with a note) when the time budget leaves too little for another compiled group."""
        if self.deadline is None or self.deadline - time.perf_counter() >= self.compile_reserve_s:
            return True
        self.notes.append(f"{what}: compiled rows skipped, less than {self.compile_reserve_s:.0f} s of the time "
                          "budget left")
        return False


def plan_for(quick: bool, device: str, dtypes: tuple[str, ...], modes: tuple[str, ...], **overrides: Any) -> E2EPlan:
    """The default plan for a device; ``overrides`` (the command line's choices) win.

    On a CPU, compiling a 24-layer model takes ~2.5 minutes per model (three graphs: prefill,
    first decode step, dynamic-shape decode), and the prefill-only row would add a fourth, so the
    full CPU run compiles fp32 generate only (the GPU run covers bf16 compiled, prefill and tower
    included), to stay near 15 minutes.
    """
    modes = tuple(m for m in MODES if m in modes)  # eager first: compiled wraps the same loaded models
    base: dict[str, Any] = {}
    if quick:
        base = dict(text_layers=2, prompt=8, new_tokens=6, prefill_tokens=32, tower_depth=2, patches=64, rounds=2,
                    compile_dtypes=dtypes[-1:])  # one dtype's compiled rows cover the code path
    elif device == "cpu":
        base = dict(compile_dtypes=("fp32",) if "fp32" in dtypes else dtypes[:1],
                    compile_workloads=("generate",))
    base.update({k: v for k, v in overrides.items() if v is not None})
    return E2EPlan(quick, device, dtypes, modes, **base)


# --------------------------------------------------------------------------- timing


def sync(device: str) -> None:
    """Wait for queued device work, so a wall-clock stamp means the work is done."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def paired_rounds(
    contenders: dict[str, Callable[[], dict[str, float]]], rounds: int, warmup: int
) -> tuple[dict[str, list[dict[str, float]]], dict[str, float]]:
    """Interleaved rounds of contenders that each return a dict of measured seconds.

    Returns the samples per contender and the wall time of each contender's first warm-up call
    (for compiled contenders: the compilation).
    """
    names = list(contenders)
    first: dict[str, float] = {}
    for w in range(warmup):
        for name in names:
            start = time.perf_counter()
            contenders[name]()
            if w == 0:
                first[name] = time.perf_counter() - start
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(contenders[name]())
    return samples, first


def speed(samples: dict[str, list[dict[str, float]]], name: str, metric: str) -> Summary:
    """Per-round plain seconds / fused seconds of ``metric``: above 1 means the fused model is faster."""
    plain = [s[metric] for s in samples["plain"]]
    fused = [s[metric] for s in samples[name]]
    return Summary.of([p / f for p, f in zip(plain, fused, strict=True)])


def seconds(samples: dict[str, list[dict[str, float]]], name: str, metric: str) -> Summary:
    return Summary.of([s[metric] for s in samples[name]])


# --------------------------------------------------------------------------- models


def available(registry: Any, families: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f for f in families if f in registry)


def combos(families: tuple[str, ...], mode: str, plan: E2EPlan) -> list[str]:
    """Family combinations run in ``mode``: each alone and all together (compiled: all, unless compile_each)."""
    together = "+".join(families)
    if len(families) <= 1:
        return list(families)
    if mode == "compiled" and not plan.compile_each:
        return [together]
    return [*families, together]


def load(auto_class: str, path: Any, families: str | None, dtype: torch.dtype, device: str) -> nn.Module:
    import transformers

    import fusion_core

    cls = getattr(transformers, auto_class)
    if families is None:
        model = cls.from_pretrained(path, dtype=dtype)
    else:
        config = {f: True for f in families.split("+")}
        model = fusion_core.from_pretrained(cls, path, fusion_config=config, dtype=dtype)
    return model.to(device).eval()


def compile_forward(module: nn.Module, backend: str) -> None:
    """``module.forward = torch.compile(module.forward)``: what a user writes."""
    module.forward = torch.compile(module.forward, backend=backend)


def allow_recompiles() -> None:
    """Plain and fused models share one ``forward`` code object; let each keep its graphs."""
    config = torch._dynamo.config
    for name, value in (("cache_size_limit", 256), ("recompile_limit", 256), ("accumulated_cache_size_limit", 4096),
                        ("accumulated_recompile_limit", 4096)):
        if hasattr(config, name):
            setattr(config, name, value)


@contextmanager
def held(models: dict[str, nn.Module]) -> Iterator[dict[str, nn.Module]]:
    """Models of one group; freed (and compiled graphs dropped) when the group ends."""
    try:
        yield models
    finally:
        models.clear()
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def tower_of(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", model)
    tower = getattr(inner, "visual", None) or getattr(model, "visual", None)
    if tower is None:
        raise AttributeError(f"{type(model).__name__} has no vision tower at .model.visual or .visual")
    return tower


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| in float64."""
    ref = reference.double()
    return float((value.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- workloads


class _TokenClock:
    """A ``generate`` streamer that stamps each ``put``: the prompt, then every new token. With ``between``, it runs
    ``between()`` after each of the first ``tokens - 1`` new tokens, so once between every two decode steps it times,
    and keeps that time off its stamps (``between_s``: their sum)."""

    def __init__(self, between: Callable[[], None] | None = None, tokens: int = 0) -> None:
        self.stamps: list[float] = []
        self.between, self.tokens, self.between_s = between, tokens, 0.0

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter() - self.between_s)
        if self.between is not None and 1 <= len(self.stamps) - 1 < self.tokens:
            start = time.perf_counter()
            self.between()
            self.between_s += time.perf_counter() - start

    def end(self) -> None:
        pass


def generate_call(model: nn.Module, ids: torch.Tensor, new_tokens: int, device: str,
                  mask: torch.Tensor | None = None, between: Callable[[], None] | None = None,
                  ) -> tuple[Callable[[], dict[str, float]], list[Any]]:
    """A timed greedy ``generate`` of exactly ``new_tokens`` (:data:`bench_common.FIXED_LENGTH_GREEDY`), every
    position of ``ids`` attended unless ``mask`` (its attention mask) says otherwise; the second value collects the
    new tokens of each call. With ``between``, that runs between every two decode steps, untimed
    (:class:`_TokenClock`; ``between``: the time it took in all)."""
    outputs: list[Any] = []
    mask = torch.ones_like(ids) if mask is None else mask

    def call() -> dict[str, float]:
        clock = _TokenClock(between, new_tokens)
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, streamer=clock,
                                 **FIXED_LENGTH_GREEDY)
        sync(device)
        end = time.perf_counter() - clock.between_s
        outputs[:] = [out[0, ids.shape[1]:].tolist()]
        # stamps: [prompt, token 1, ..., token N]; each put follows a .cpu() copy, so the device is done.
        first, last = clock.stamps[1], clock.stamps[-1]
        return {"total": end - start, "prefill": first - start, "decode": last - first, "between": clock.between_s}

    return call, outputs


def _forward_call(forward: Callable[[], Any], device: str
                  ) -> tuple[Callable[[], dict[str, float]], list[torch.Tensor]]:
    """A timed inference-mode ``forward()``; the second value keeps its last output (float, on the CPU)."""
    outputs: list[torch.Tensor] = []

    def call() -> dict[str, float]:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = forward()
        sync(device)
        end = time.perf_counter()
        if not isinstance(out, torch.Tensor):  # a tower on 5.x may return a ModelOutput
            out = out[0]
        outputs[:] = [out.detach().float().cpu()]
        return {"total": end - start}

    return call, outputs


def prefill_call(model: nn.Module, ids: torch.Tensor, device: str
                 ) -> tuple[Callable[[], dict[str, float]], list[torch.Tensor]]:
    return _forward_call(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1).logits, device)


def tower_call(tower: nn.Module, pixels: torch.Tensor, grid: torch.Tensor, device: str
               ) -> tuple[Callable[[], dict[str, float]], list[torch.Tensor]]:
    return _forward_call(lambda: tower(pixels, grid_thw=grid), device)


def tower_input(config: Any, patches: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One image of ``patches`` patches (a square grid), as the Qwen2-VL processor flattens it."""
    vision = config.vision_config
    side = math.isqrt(patches)
    if side * side != patches or side % vision.spatial_merge_size:
        raise ValueError(f"patches={patches}: need a square grid whose side is a multiple of "
                         f"{vision.spatial_merge_size}")
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(patches, width, generator=torch.Generator().manual_seed(0))
    return pixels.to(device=device, dtype=dtype), torch.tensor([[1, side, side]], device=device)


# --------------------------------------------------------------------------- the section


@dataclass
class E2EResults:
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """{"decode eager bf16": {contender: counts per decoded token}, "tower compiled bf16": {...}, ...}"""
    listener: Callable[[], None] | None = None

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.listener is not None:
            self.listener()


def run(plan: E2EPlan, log: Callable[[str], None],
        progress: Callable[[list[Table], dict[str, Any]], None] | None = None
        ) -> tuple[list[Table], dict[str, Any], list[Budget]]:
    """Every workload of ``plan``; ``progress`` gets the tables and data so far after each row."""
    import fusion_core

    allow_recompiles()
    registry = fusion_core.get_registry()
    results = E2EResults(notes=plan.notes)
    if progress is not None:
        results.listener = lambda: progress(tables_for(plan, results), _data(plan, results))
    if {"generate", "prefill"} & set(plan.workloads):
        text = available(registry, TEXT_FAMILIES)
        if text:
            _run_text(plan, text, results, log)
        else:
            results.notes.append("no text family (qkv, gate_up) is installed: generate and prefill skipped")
    if "tower" in plan.workloads:
        if available(registry, TOWER_FAMILIES):
            _run_tower(plan, available(registry, ALL_FAMILIES), results, log)
        else:
            results.notes.append("patch_embeddings is not installed: the tower rows are skipped")
    return tables_for(plan, results), _data(plan, results), budgets_for(results)


def _data(plan: E2EPlan, results: E2EResults) -> dict[str, Any]:
    plan_data = {k: v for k, v in plan.__dict__.items() if k != "deadline"}
    return {"plan": plan_data, "rows": results.rows, "notes": results.notes, "op_counts": results.counts}


def _run_text(plan: E2EPlan, families: tuple[str, ...], results: E2EResults, log: Callable[[str], None]) -> None:
    config = text_config(plan.quick, plan.text_layers)
    path = build_checkpoint(config, "AutoModelForCausalLM", f"qwen2-{'tiny' if plan.quick else '05b'}", log)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (1, plan.prompt), generator=gen).to(plan.device)
    long_prompt = torch.randint(3, config.vocab_size, (1, plan.prefill_tokens), generator=gen).to(plan.device)
    for dt in plan.dtypes:
        _text_group(plan, dt, families, path, (prompt, long_prompt), results, log)
        gc.collect()  # the group's models are unreachable once it returns: free them before the next loads


def _text_group(plan: E2EPlan, dt: str, families: tuple[str, ...], path: Any, prompts: tuple[torch.Tensor, ...],
                results: E2EResults, log: Callable[[str], None]) -> None:
    """Load plain and fused models in ``dt`` once; measure eager, then compile the same models and measure."""
    prompt, long_prompt = prompts
    text_modes = tuple(dict.fromkeys(m for w in ("generate", "prefill") for m in plan.modes_for(dt, w)))
    wanted = {c for mode in text_modes for c in combos(families, mode, plan)}
    with held({"plain": load("AutoModelForCausalLM", path, None, DTYPES[dt], plan.device)}) as models:
        for combo in sorted(wanted, key=lambda c: (c.count("+"), c)):
            models[combo] = load("AutoModelForCausalLM", path, combo, DTYPES[dt], plan.device)
        if "eager" in text_modes:  # loaded last: it also shows what loading later does to a model's speed
            models[CONTROL] = load("AutoModelForCausalLM", path, None, DTYPES[dt], plan.device)
        for mode in text_modes:
            if mode == "compiled" and not plan.may_compile(f"text {dt}"):
                continue
            names = ["plain", *([CONTROL] if mode == "eager" else []), *combos(families, mode, plan)]
            if mode == "compiled":
                enable_kernel_events()
                for name in names:
                    compile_forward(models[name], plan.compile_backend)
            active = {n: models[n] for n in names}
            if "generate" in plan.workloads and mode in plan.modes_for(dt, "generate"):
                _measure_generate(plan, dt, mode, active, prompt, results, log)
                if plan.counts_in(dt, mode, "generate"):
                    results.counts[f"decode {mode} {dt}"] = {n: _count_decode(m, prompt, plan.device)
                                                             for n, m in active.items() if n != CONTROL}
            if "prefill" in plan.workloads and mode in plan.modes_for(dt, "prefill"):
                _measure_prefill(plan, dt, mode, active, long_prompt, results, log)
            del active


def _measure_generate(plan: E2EPlan, dt: str, mode: str, models: dict[str, nn.Module], prompt: torch.Tensor,
                      results: E2EResults, log: Callable[[str], None]) -> None:
    calls = {name: generate_call(m, prompt, plan.new_tokens, plan.device) for name, m in models.items()}
    warmup = 2 if mode == "compiled" else 1  # compiled: prefill, first decode step, then the dynamic-shape graph
    samples, first = paired_rounds({n: c for n, (c, _) in calls.items()}, plan.rounds, warmup)
    plain_tokens = calls["plain"][1][0]
    for name in models:
        if name == "plain":
            continue
        row = {
            "workload": "generate", "dtype": dt, "mode": mode, "families": name, "rounds": plan.rounds,
            "prompt": plan.prompt, "new_tokens": plan.new_tokens,
            "plain_s": seconds(samples, "plain", "total"), "fused_s": seconds(samples, name, "total"),
            "speed": speed(samples, name, "total"),
            "plain_prefill_s": seconds(samples, "plain", "prefill"),
            "fused_prefill_s": seconds(samples, name, "prefill"), "prefill_speed": speed(samples, name, "prefill"),
            "plain_decode_s": seconds(samples, "plain", "decode"),
            "fused_decode_s": seconds(samples, name, "decode"), "decode_speed": speed(samples, name, "decode"),
            "first_call_s": {"plain": first["plain"], "fused": first[name]},
            "same_tokens": calls[name][1][0] == plain_tokens,
            "samples": {"plain": samples["plain"], "fused": samples[name]},
        }
        results.add(row)
        log(f"  generate {dt} {mode} {name}: {row['speed'].fmt_range(unit='x')} "
            f"(prefill {row['prefill_speed'].fmt_range(unit='x')}, decode {row['decode_speed'].fmt_range(unit='x')})")


def _count_decode(model: nn.Module, prompt: torch.Tensor, device: str) -> dict[str, float]:
    """Operators per decoded token: a 6-token generate minus a 2-token one, over the 4 extra decode steps."""
    mask = torch.ones_like(prompt)

    def generate(n: int) -> Callable[[], Any]:
        return lambda: model.generate(prompt, attention_mask=mask, max_new_tokens=n, **FIXED_LENGTH_GREEDY)

    return per_call_difference(count_ops(generate(2), device), count_ops(generate(6), device), 4)


def _measure_prefill(plan: E2EPlan, dt: str, mode: str, models: dict[str, nn.Module], ids: torch.Tensor,
                     results: E2EResults, log: Callable[[str], None]) -> None:
    calls = {name: prefill_call(m, ids, plan.device) for name, m in models.items()}
    samples, first = paired_rounds({n: c for n, (c, _) in calls.items()}, plan.rounds,
                                   2 if mode == "compiled" else 1)
    reference = calls["plain"][1][0]
    for name in models:
        if name == "plain":
            continue
        row = {
            "workload": "prefill", "dtype": dt, "mode": mode, "families": name, "rounds": plan.rounds,
            "tokens": plan.prefill_tokens,
            "plain_s": seconds(samples, "plain", "total"), "fused_s": seconds(samples, name, "total"),
            "speed": speed(samples, name, "total"),
            "first_call_s": {"plain": first["plain"], "fused": first[name]},
            "rel_diff": relative_error(calls[name][1][0], reference),
            "samples": {"plain": samples["plain"], "fused": samples[name]},
        }
        results.add(row)
        log(f"  prefill {dt} {mode} {name}: {row['speed'].fmt_range(unit='x')}")


def _run_tower(plan: E2EPlan, families: tuple[str, ...], results: E2EResults, log: Callable[[str], None]) -> None:
    config = tower_config(plan.quick, plan.tower_depth)
    tag = f"qwen2vl-tower{plan.tower_depth}-{'tiny' if plan.quick else 'real'}"
    path = build_checkpoint(config, "AutoModelForImageTextToText", tag, log)
    reference: list[torch.Tensor] = []  # the fp32 plain eager output, once measured
    for dt in plan.dtypes:
        _tower_group(plan, dt, config, path, families, reference, results, log)
        gc.collect()  # the group's models are unreachable once it returns: free them before the next loads
    towers = [r for r in results.rows if r["workload"] == "tower"]
    fused_counts = towers[-1]["fused_in_tower"] if towers else {}
    results.notes.append(
        "tower: loaded with " + ", ".join(families) + "; modules of the tower each family fused: "
        + ", ".join(f"{f} {n}" for f, n in fused_counts.items())
        + " (the tower's attention has one `qkv` Linear and its MLP is fc1/fc2, so only the patch embedding"
        " is fused: this row is patch_embeddings alone and all families together at once)"
    )


def _tower_group(plan: E2EPlan, dt: str, config: Any, path: Any, families: tuple[str, ...],
                 reference: list[torch.Tensor], results: E2EResults, log: Callable[[str], None]) -> None:
    """Plain vs fused tower in ``dt``: eager, then the same towers compiled."""
    import fusion_core

    combo = "+".join(families)
    pixels, grid = tower_input(config, plan.patches, DTYPES[dt], plan.device)
    plain = load("AutoModelForImageTextToText", path, None, DTYPES[dt], plan.device)
    fused = load("AutoModelForImageTextToText", path, combo, DTYPES[dt], plan.device)
    tower_path = next(n for n, m in fused.named_modules() if m is tower_of(fused))
    per_family = {f: sum(1 for m in fusion_core.get_fusion_plan(fused).modules
                         if m.family == f and m.path.startswith(tower_path + ".")) for f in families}
    modes = plan.modes_for(dt, "tower")
    with held({"plain": plain, combo: fused}) as models:
        del plain, fused
        if "eager" in modes:
            models[CONTROL] = load("AutoModelForImageTextToText", path, None, DTYPES[dt], plan.device)
        for mode in modes:
            if mode == "compiled" and not plan.may_compile(f"tower {dt}"):
                continue
            if mode == "compiled":
                models.pop(CONTROL, None)
            towers = {n: tower_of(m) for n, m in models.items()}
            if mode == "compiled":
                enable_kernel_events()
                for tower in towers.values():
                    compile_forward(tower, plan.compile_backend)
            calls = {n: tower_call(t, pixels, grid, plan.device) for n, t in towers.items()}
            samples, first = paired_rounds({n: c for n, (c, _) in calls.items()}, plan.rounds,
                                           2 if mode == "compiled" else 1)
            plain_out = calls["plain"][1][0]
            if not reference and dt == "fp32" and mode == "eager":
                reference.append(plain_out)
            ref = reference[0] if reference else None
            for name in towers:
                if name == "plain":
                    continue
                fused_out = calls[name][1][0]
                row = {
                    "workload": "tower", "dtype": dt, "mode": mode, "families": name, "rounds": plan.rounds,
                    "depth": plan.tower_depth, "patches": plan.patches, "fused_in_tower": per_family,
                    "plain_s": seconds(samples, "plain", "total"), "fused_s": seconds(samples, name, "total"),
                    "speed": speed(samples, name, "total"),
                    "first_call_s": {"plain": first["plain"], "fused": first[name]},
                    "rel_diff": relative_error(fused_out, plain_out),
                    "plain_rel_err_vs_fp32": relative_error(plain_out, ref) if ref is not None else None,
                    "fused_rel_err_vs_fp32": relative_error(fused_out, ref) if ref is not None else None,
                    "samples": {"plain": samples["plain"], "fused": samples[name]},
                }
                results.add(row)
                log(f"  tower {dt} {mode} {name}: {row['speed'].fmt_range(unit='x')}")
            if plan.counts_in(dt, mode, "tower"):
                results.counts[f"tower {mode} {dt}"] = {
                    n: count_ops(c, plan.device) for n, (c, _) in calls.items() if n != CONTROL
                }
            del towers, calls


# --------------------------------------------------------------------------- tables and budgets


def _fmt_rate(count: int, s: Summary) -> str:
    return f"{count / s.median:.1f}"


def tables_for(plan: E2EPlan, results: E2EResults) -> list[Table]:
    where = f"{plan.device}, {plan.rounds} rounds"
    rows = results.rows
    tables: list[Table] = []
    gen = [r for r in rows if r["workload"] == "generate"]
    if gen:
        t = Table(
            f"End to end: greedy generate, {plan.prompt}-token prompt + {plan.new_tokens} new, "
            f"{_text_name(plan)} ({where}; median [min-max])",
            ["dtype", "mode", "families", "plain s", "fused s", "speed vs plain", "prefill tok/s plain -> fused",
             "prefill speed", "decode tok/s plain -> fused", "decode speed", "first call s plain / fused",
             "same tokens"],
        )
        for r in gen:
            n_dec = r["new_tokens"] - 1
            t.rows.append([
                r["dtype"], r["mode"], r["families"], r["plain_s"].fmt_range(), r["fused_s"].fmt_range(),
                r["speed"].fmt_range(unit="x"),
                f"{_fmt_rate(r['prompt'], r['plain_prefill_s'])} -> {_fmt_rate(r['prompt'], r['fused_prefill_s'])}",
                r["prefill_speed"].fmt_range(unit="x"),
                f"{_fmt_rate(n_dec, r['plain_decode_s'])} -> {_fmt_rate(n_dec, r['fused_decode_s'])}",
                r["decode_speed"].fmt_range(unit="x"),
                f"{r['first_call_s']['plain']:.1f} / {r['first_call_s']['fused']:.1f}",
                "yes" if r["same_tokens"] else "no",
            ])
        t.notes += [
            "prefill: start of generate() to its first new token (time to first token); decode: first to last new"
            f" token ({plan.new_tokens - 1} tokens); speed: per-round plain time / fused time",
            "first call: the untimed warm-up (compiled: includes the compilation of the prefill and decode graphs)",
        ]
        tables.append(t)
    pre = [r for r in rows if r["workload"] == "prefill"]
    if pre:
        t = Table(f"End to end: prefill forward, 1 x {plan.prefill_tokens} tokens, KV cache built, last logits only, "
                  f"{_text_name(plan)} ({where}; median [min-max])",
                  ["dtype", "mode", "families", "plain ms", "fused ms", "speed vs plain", "tokens/s plain -> fused",
                   "first call s plain / fused", "logits rel diff"])
        for r in pre:
            t.rows.append([r["dtype"], r["mode"], r["families"], r["plain_s"].fmt_range(1e3, 1),
                           r["fused_s"].fmt_range(1e3, 1), r["speed"].fmt_range(unit="x"),
                           f"{_fmt_rate(r['tokens'], r['plain_s'])} -> {_fmt_rate(r['tokens'], r['fused_s'])}",
                           f"{r['first_call_s']['plain']:.1f} / {r['first_call_s']['fused']:.1f}",
                           f"{r['rel_diff']:.1e}"])
        tables.append(t)
    tow = [r for r in rows if r["workload"] == "tower"]
    if tow:
        width = tower_config(plan.quick, plan.tower_depth).vision_config.embed_dim
        name = "tiny Qwen2-VL tower" if plan.quick else "Qwen2-VL-2B vision tower"
        t = Table(f"End to end: {name} (depth {plan.tower_depth}, width {width}), one image of "
                  f"{plan.patches} patches ({where}; median [min-max])",
                  ["dtype", "mode", "families", "plain s", "fused s", "speed vs plain", "first call s plain / fused",
                   "fused vs plain rel diff", "rel err vs fp32 plain / fused"])
        for r in tow:
            err = ("-" if r["plain_rel_err_vs_fp32"] is None or r["dtype"] == "fp32"
                   else f"{r['plain_rel_err_vs_fp32']:.2%} / {r['fused_rel_err_vs_fp32']:.2%}")
            t.rows.append([r["dtype"], r["mode"], r["families"], r["plain_s"].fmt_range(digits=3),
                           r["fused_s"].fmt_range(digits=3), r["speed"].fmt_range(unit="x"),
                           f"{r['first_call_s']['plain']:.1f} / {r['first_call_s']['fused']:.1f}",
                           f"{r['rel_diff']:.1e}", err])
        t.notes.append("rel diff / rel err: ||a - b|| / ||b|| of the tower outputs (float64)")
        tables.append(t)
    if rows:
        t = Table("End to end: fused speed vs plain, side by side (per-round ratio plain/fused, median [min-max])",
                  ["workload", "dtype", "mode", "families", "speed vs plain", f"budget >= {BUDGET}"])
        for r in rows:
            verdict = ("(noise: plain vs plain)" if r["families"] == CONTROL
                       else "PASS" if r["speed"].median >= BUDGET else "MISS")
            t.rows.append([r["workload"], r["dtype"], r["mode"], r["families"], r["speed"].fmt_range(unit="x"),
                           verdict])
            if r["workload"] == "generate":
                for part in ("prefill", "decode"):
                    t.rows.append([f"generate: {part}", r["dtype"], r["mode"], r["families"],
                                   r[f"{part}_speed"].fmt_range(unit="x"), ""])
        t.notes.append(f"{CONTROL!r}: the plain model loaded a second time and timed as a contender like the fused "
                       "ones; its ratio to plain is what noise alone does to a ratio in this run")
        t.notes += results.notes
        tables.append(t)
    return tables


def _text_name(plan: E2EPlan) -> str:
    if plan.quick:
        return f"tiny Qwen2 ({plan.text_layers} layers)"
    return f"Qwen2-0.5B shape ({plan.text_layers} layers, hidden 896, GQA 14/2)"


def budgets_for(results: E2EResults) -> list[Budget]:
    """Issue 14: no fused end-to-end row slower than its plain row (median paired speed >= 0.98)."""
    budgets = []
    for r in results.rows:
        if r["families"] == CONTROL:
            continue
        value = r["speed"].median
        budgets.append(Budget(
            f"end to end {r['workload']}, {r['dtype']}, {r['mode']}, {r['families']}: fused speed vs plain",
            f">= {BUDGET}x", r["speed"].fmt_range(unit="x"), value >= BUDGET,
        ))
    return budgets
