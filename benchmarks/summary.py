"""The one-page summary that opens docs/benchmarks.md: its table and its charts, from ``benchmarks/summary.json``.

``summary.json`` records the headline figure of each family (and of loading), each with the command that
measured it, the machine, the transformers release and the date: the benchmark scripts print these figures,
and whoever reruns one updates its row here. This script renders them, so the page and its charts never
disagree with the record:

    python benchmarks/summary.py            # rewrite the summary block of docs/benchmarks.md and its charts
    python benchmarks/summary.py --check    # exit 1 if the page's summary block differs from summary.json

The charts (matplotlib, the ``benchmarks`` extra: ``pip install fusion-core[benchmarks]``) are
``docs/images/summary-<chart>.png``: one horizontal bar per row of a chart, the bar at the median, the whisker
over the measured range, and a line at 1 (plain, or the floor).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECORD = HERE / "summary.json"
PAGE = ROOT / "docs" / "benchmarks.md"
IMAGES = ROOT / "docs" / "images"
START, END = "<!-- summary:start (benchmarks/summary.py writes this block) -->", "<!-- summary:end -->"

#: Each chart: its title and what its reference line at 1 means.
CHARTS = {
    "speed": ("Speed vs plain transformers (higher is better)", "plain"),
    "cost": ("Time and memory costs vs plain transformers (lower is better)", "plain"),
    "floor": ("Decode time per token vs the memory-bandwidth floor (lower is better)", "floor"),
}


@dataclass(frozen=True)
class Row:
    """One headline figure: ``value`` (a ratio) with its measured range, and where it comes from."""

    family: str
    workload: str
    chart: str
    value: float
    low: float
    high: float
    budget: str
    machine: str
    transformers: str
    date: str
    command: str

    @classmethod
    def of(cls, data: dict[str, Any]) -> Row:
        row = cls(**data)
        where = f"{row.family} / {row.workload}"
        if row.chart not in CHARTS:
            raise ValueError(f"{where}: chart must be one of {sorted(CHARTS)}, got {row.chart!r}")
        if not row.low <= row.value <= row.high:
            raise ValueError(f"{where}: value {row.value} outside its range [{row.low}, {row.high}]")
        return row


def rows(record: Path = RECORD) -> list[Row]:
    return [Row.of(item) for item in json.loads(record.read_text())["rows"]]


def markdown(found: list[Row]) -> str:
    """The summary block: one table per chart, each after its chart's image."""
    lines = [START, ""]
    for chart, (title, _) in CHARTS.items():
        mine = [row for row in found if row.chart == chart]
        if not mine:
            continue
        lines += [f"#### {title}", "", f"![{title}](images/summary-{chart}.png)", "",
                  "| family | workload | median [range] | budget | machine, transformers, date | command |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.family} | {r.workload} | {r.value:.2f}x [{r.low:.2f}-{r.high:.2f}] | {r.budget} | "
                  f"{r.machine}, {r.transformers}, {r.date} | `{r.command}` |" for r in mine]
        lines.append("")
    return "\n".join([*lines, END])


def draw(found: list[Row], directory: Path) -> list[Path]:
    """One PNG per chart under ``directory``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    directory.mkdir(parents=True, exist_ok=True)
    for chart, (title, reference) in CHARTS.items():
        mine = [row for row in found if row.chart == chart]
        if not mine:
            continue
        figure, axes = plt.subplots(figsize=(10, 0.62 * len(mine) + 1.2))
        labels = [r.family + "\n" + "\n".join(textwrap.wrap(r.workload, 50)) for r in mine]
        values = [r.value for r in mine]
        errors = [[r.value - r.low for r in mine], [r.high - r.value for r in mine]]
        axes.barh(range(len(mine)), values, xerr=errors, color="#4c72b0", ecolor="#333333", capsize=3)
        axes.axvline(1.0, color="#c44e52", linestyle="--", linewidth=1, label=reference)
        axes.set_yticks(range(len(mine)), labels, fontsize=7)
        axes.invert_yaxis()
        axes.set_xlabel("x " + reference)
        axes.set_title(title, fontsize=9)
        axes.legend(fontsize=7, loc="lower right")
        figure.tight_layout()
        path = directory / f"summary-{chart}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def page_with(block: str, page: str) -> str:
    """``page`` with its summary block replaced by ``block`` (the page must hold the two markers)."""
    head, found_start, rest = page.partition(START)
    _, found_end, tail = rest.partition(END)
    if not (found_start and found_end):
        raise ValueError(f"{PAGE} lacks the summary markers {START!r} ... {END!r}")
    return head + block + tail


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page's summary block is not current")
    parser.add_argument("--images", type=Path, default=IMAGES, help="where the charts go (default docs/images)")
    args = parser.parse_args(argv)
    found = rows()
    page = PAGE.read_text()
    current = page_with(markdown(found), page)
    if args.check:
        if current != page:
            print(f"{PAGE} is stale: regenerate with python benchmarks/summary.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(current)
    for path in draw(found, args.images):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
