"""Shared pieces of the benchmarks: interleaved timing, robust statistics, tables, budgets.

Every comparison is a ratio of two things measured in the same process (or, for loads, in
fresh processes started by the same parent), *interleaved*: each round runs every contender
once, in an order that rotates from round to round, so a burst of load from a neighbour
slows all of them alike. A ratio is computed per round and summarised by its median and its
p10-p90 spread, never by dividing two medians.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

FIXED_LENGTH_GREEDY: dict[str, Any] = {"eos_token_id": None, "do_sample": False, "pad_token_id": 0}
"""``generate`` keyword arguments (with ``max_new_tokens=n``) for a greedy call that makes exactly ``n`` tokens: the
end-of-sequence token turned off, not ``min_new_tokens``, which adds logits processors a plain ``generate`` does
not run (an ``arange`` over the vocabulary, ``isin``, two ``where``: about 2 ms a token at a 150k vocabulary on a
2-core CPU), paid by every contender and not by the floor."""


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (0 <= q <= 1) of a non-empty sequence."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = q * (len(data) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Median, p10/p90 and min/max of a list of samples."""

    median: float
    p10: float
    p90: float
    n: int
    min: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(statistics.median(values), quantile(values, 0.1), quantile(values, 0.9), len(values),
                   min(values), max(values))

    def fmt(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        """``median [p10-p90]``."""
        m, lo, hi = (v * scale for v in (self.median, self.p10, self.p90))
        return f"{m:.{digits}f}{unit} [{lo:.{digits}f}-{hi:.{digits}f}]"

    def fmt_range(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        """``median [min-max]``: with the few rounds an end-to-end row affords, the whole range."""
        m, lo, hi = (v * scale for v in (self.median, self.min, self.max))
        return f"{m:.{digits}f}{unit} [{lo:.{digits}f}-{hi:.{digits}f}]"


def interleaved(
    contenders: Mapping[str, Callable[[], Any]],
    rounds: int,
    inner: int = 1,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each contender, ``rounds`` samples each, interleaved and rotated.

    Each sample is the mean of ``inner`` back-to-back calls (to lift very short calls above the
    timer's resolution). ``warmup`` untimed rounds run first. ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs before each sample starts and before it stops, so queued
    device work is counted in the sample that queued it.
    """
    wait = sync or (lambda: None)
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            fn = contenders[name]
            wait()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            wait()
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def ratios(numerator: Sequence[float], denominator: Sequence[float]) -> Summary:
    """Per-round ratio of two interleaved sample lists."""
    return Summary.of([a / b for a, b in zip(numerator, denominator, strict=True)])


@dataclass
class Budget:
    """One budget of the issue: what is compared, the limit, the measured value, pass/fail."""

    name: str
    limit: str
    measured: str
    passed: bool
    note: str = ""


@dataclass
class Table:
    """A titled table; rendered as aligned text for the terminal and as Markdown for the docs."""

    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        widths = [max(len(str(r[i])) for r in [self.header, *self.rows]) for i in range(len(self.header))]
        lines = [f"== {self.title}", "  ".join(h.ljust(w) for h, w in zip(self.header, widths, strict=True))]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in self.rows]
        lines += [f"   note: {n}" for n in self.notes]
        return "\n".join(lines)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.header) + " |"]
        lines.append("|" + "|".join("---" for _ in self.header) + "|")
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines)


def budget_table(budgets: Sequence[Budget]) -> Table:
    table = Table("Budgets", ["budget", "limit", "measured", "result"])
    for b in budgets:
        verdict = "PASS" if b.passed else "MISS"
        table.rows.append([b.name, b.limit, b.measured, verdict + (f" ({b.note})" if b.note else "")])
    return table


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The SIMD features that decide GEMM speed (avx2/avx512/amx), as /proc/cpuinfo lists them."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
                    return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def as_jsonable(obj: Any) -> Any:
    if isinstance(obj, (Summary, Budget, Table)):
        return asdict(obj)
    if isinstance(obj, dict):
        return {str(k): as_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_jsonable(v) for v in obj]
    return obj
