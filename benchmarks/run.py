"""fusion-core benchmarks: run time, load, save and start-up, side by side with the alternatives.

    python benchmarks/run.py                 # everything (~10 minutes on 2 CPU cores)
    python benchmarks/run.py --quick         # seconds: every code path on tiny shapes (CI runs this)
    python benchmarks/run.py --json results.json --markdown table.md
    python benchmarks/run.py --sections runtime,startup

Every comparison is a ratio of two contenders measured in the same process (or in fresh
processes started by one parent), interleaved round by round, reported as a median with its
p10-p90 spread. Budgets from issue 5 are printed as PASS/MISS; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTIONS = ("runtime", "load", "save", "startup")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds: seconds, for CI")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile runtime rows")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--json", metavar="PATH", help="write every sample and summary as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown ('-' for stdout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        build_parser().error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

    import torch
    import transformers
    from bench_common import Table, as_jsonable, budget_table, loadavg, machine_info

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick, "machine": machine_info(), "loadavg_start": loadavg(), "sections": {},
    }
    tables: list[Table] = []
    budgets: list[Any] = []

    def section(name: str, fn: Callable[[], tuple[Any, Any, list[Any]]]) -> None:
        if name not in sections:
            return
        _log(f"== {name} (load average {loadavg()})")
        t = time.perf_counter()
        table, data, found = fn()
        report["sections"][name] = {"seconds": time.perf_counter() - t, "loadavg_after": loadavg(), "data": data}
        budgets.extend(found)
        for t in table if isinstance(table, list) else [table]:
            if t is not None:
                tables.append(t)
                print(t.text() + "\n", flush=True)

    def runtime() -> tuple[list[Table | None], Any, list[Any]]:
        import bench_runtime as rt

        plan = rt.plan_for(args.quick, compile_enabled=not args.no_compile)
        plan.compile_backend = args.compile_backend
        table, results = rt.run_patch_embeddings(plan, _log)
        found = rt.patch_embedding_budgets(results)
        if args.quick:
            found = []  # tiny shapes say nothing about the budgets; the full run reports them
        text_table, text_results, notes = rt.run_text_families(args.quick, _log)
        for note in notes:
            print(f"note: {note}", flush=True)
        return [table, text_table], {"patch_embeddings": results, "text_families": text_results, "notes": notes}, found

    def io(kind: str) -> Callable[[], tuple[Table, Any, list[Any]]]:
        def run() -> tuple[Table, Any, list[Any]]:
            import bench_io

            table, data, found = getattr(bench_io, f"run_{kind}")(args.quick, _log)
            return table, data, [] if args.quick and kind != "startup" else found

        return run

    with torch.inference_mode(False):
        section("runtime", runtime)
        section("load", io("load"))
        section("save", io("save"))
        section("startup", io("startup"))

    report["loadavg_end"] = loadavg()
    report["seconds"] = time.perf_counter() - started
    info = report["machine"]
    header = Table(
        "Machine and run",
        ["cpu", "cpus", "torch threads", "python", "torch", "transformers", "load avg start -> end", "total s"],
        [[f"{info['cpu']} ({' '.join(info['cpu_flags'])})", f"{info['cpus_usable']}/{info['logical_cpus']}",
          str(info["torch_threads"]), info["python"], info["torch"], info["transformers"],
          f"{report['loadavg_start']} -> {report['loadavg_end']}", f"{report['seconds']:.0f}"]],
    )
    if args.quick:
        header.notes.append("--quick: tiny shapes and one or few rounds; numbers exercise the code, not the budgets")
    print(header.text() + "\n")
    all_tables = [header, *tables]
    if budgets:
        bt = budget_table(budgets)
        all_tables.append(bt)
        print(bt.text())
    report["budgets"] = budgets
    if args.json:
        Path(args.json).write_text(json.dumps(as_jsonable(report), indent=1, default=str) + "\n")
        _log(f"wrote {args.json}")
    if args.markdown:
        text = "\n\n".join(t.markdown() for t in all_tables) + "\n"
        if args.markdown == "-":
            print(text)
        else:
            Path(args.markdown).write_text(text)
            _log(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
