"""fusion-core benchmarks: run time, load, save and start-up, side by side with the alternatives.

    python benchmarks/run.py                 # everything (~10 minutes on 2 CPU cores)
    python benchmarks/run.py --quick         # seconds: every code path on tiny shapes (CI runs this)
    python benchmarks/run.py --json results.json --markdown table.md
    python benchmarks/run.py --sections runtime,startup
    python benchmarks/run.py --sections e2e,explain  # generate / prefill / vision tower, and why (~15 min)
    python benchmarks/run.py --gpu           # CUDA, bf16: module and end-to-end tables (benchmarks/gpu.sh)

Every comparison is a ratio of two contenders measured in the same process (or in fresh
processes started by one parent), interleaved round by round, reported as a median with its
p10-p90 spread. Budgets from issue 5 are printed as PASS/MISS; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTIONS = ("runtime", "e2e", "explain", "load", "save", "startup")
#: ``--gpu``: what a CUDA machine adds to the CPU tables (load/save/start-up do not run on the device).
GPU_SECTIONS = ("runtime", "e2e", "explain")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds: seconds, for CI")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip every torch.compile row")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--device", default=None,
                        help="device for runtime, e2e and explain: cpu or cuda[:N] (default cpu; --gpu: cuda)")
    parser.add_argument("--dtypes", default=None, help="runtime/e2e dtypes, comma-separated: fp32,bf16 (default both)")
    parser.add_argument("--gpu", action="store_true",
                        help="the prepared GPU run: --device cuda --dtypes bf16 --sections runtime,e2e,explain")
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="skip compiled end-to-end groups that would start with less than ~150 s left of S")
    e2e = parser.add_argument_group("end to end (e2e, explain)")
    e2e.add_argument("--rounds", type=int, default=None, help="interleaved rounds per e2e row (default 5; quick 2)")
    e2e.add_argument("--text-layers", type=int, default=None, help="Qwen2-0.5B-shaped model depth (default 24)")
    e2e.add_argument("--tower-depth", type=int, default=None, help="Qwen2-VL-2B tower depth (default 32)")
    e2e.add_argument("--patches", type=int, default=None, help="patches in the tower's image (default 1024)")
    e2e.add_argument("--workloads", default=None, help="comma-separated subset of generate,prefill,tower")
    e2e.add_argument("--compile-dtypes", default=None,
                     help="dtypes with compiled e2e rows (default: all; on CPU fp32 only, compiling takes minutes)")
    e2e.add_argument("--compile-workloads", default=None,
                     help="workloads with compiled e2e rows (default: all; on CPU generate only)")
    e2e.add_argument("--modes", default="eager,compiled",
                     help="e2e modes: eager and/or compiled (--no-compile: eager only)")
    e2e.add_argument("--compile-each", action="store_true",
                     help="compiled mode also runs each family alone (default: all families together only)")
    parser.add_argument("--json", metavar="PATH", help="write every sample and summary as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown ('-' for stdout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    if args.gpu:
        args.dtypes = args.dtypes or "bf16"
        if args.sections == ",".join(SECTIONS):
            args.sections = ",".join(GPU_SECTIONS)
    dtypes = tuple(d.strip() for d in (args.dtypes or "fp32,bf16").split(",") if d.strip())
    if not dtypes or set(dtypes) - {"fp32", "bf16"}:
        build_parser().error(f"--dtypes takes fp32 and/or bf16, not {args.dtypes!r}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        build_parser().error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

    import torch
    import transformers
    from bench_common import Table, as_jsonable, budget_table, loadavg, machine_info

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        _log(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; nothing measured")
        return 2

    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick, "machine": machine_info(), "loadavg_start": loadavg(), "sections": {},
    }
    tables: list[Table] = []
    partial: list[Table] = []  # the tables of the section running now, as far as it got
    budgets: list[Any] = []
    failed: list[str] = []

    def section(name: str, fn: Callable[[], tuple[Any, Any, list[Any]]]) -> None:
        if name not in sections:
            return
        _log(f"== {name} (load average {loadavg()})")
        t = time.perf_counter()
        try:
            table, data, found = fn()
        except Exception:  # one broken section must not cost the others' results (a GPU run has one try)
            failed.append(name)
            so_far = report["sections"].get(name, {}).get("data")  # what a section reported before it broke
            report["sections"][name] = {"seconds": time.perf_counter() - t, "error": traceback.format_exc(),
                                        "data": so_far}
            tables.extend(partial)
            partial.clear()
            _log(f"section {name} FAILED:\n{traceback.format_exc()}")
            write(final=False)
            return
        report["sections"][name] = {"seconds": time.perf_counter() - t, "loadavg_after": loadavg(), "data": data}
        partial.clear()
        budgets.extend(found)
        for t in table if isinstance(table, list) else [table]:
            if t is not None:
                tables.append(t)
                print(t.text() + "\n", flush=True)
        write(final=False)

    def write(final: bool) -> None:
        """Write the JSON and Markdown so far (after every section: a run cut short keeps what it measured)."""
        report["loadavg_end"] = loadavg()
        report["seconds"] = time.perf_counter() - started
        report["failed_sections"] = failed
        info = report["machine"]
        header = Table(
            "Machine and run",
            ["cpu", "cpus", "torch threads", "device", "python", "torch", "transformers", "load avg start -> end",
             "total s"],
            [[f"{info['cpu']} ({' '.join(info['cpu_flags'])})", f"{info['cpus_usable']}/{info['logical_cpus']}",
              str(info["torch_threads"]), info.get("gpu") if args.device.startswith("cuda") else "cpu",
              info["python"], info["torch"], info["transformers"],
              f"{report['loadavg_start']} -> {report['loadavg_end']}", f"{report['seconds']:.0f}"]],
        )
        if args.quick:
            header.notes.append("--quick: tiny shapes, one or few rounds; numbers exercise the code, not the budgets")
        if failed:
            header.notes.append(f"FAILED sections (tracebacks in the JSON): {', '.join(failed)}")
        closing = [header, *([budget_table(budgets)] if budgets else [])]
        all_tables = [header, *tables, *partial, *closing[1:]]
        report["budgets"] = budgets
        if final:
            print("\n\n".join(t.text() for t in closing) + "\n", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(as_jsonable(report), indent=1, default=str) + "\n")
        if args.markdown:
            text = "\n\n".join(t.markdown() for t in all_tables) + "\n"
            if args.markdown == "-":
                if final:
                    print(text)
            else:
                Path(args.markdown).write_text(text)

    def runtime() -> tuple[list[Table | None], Any, list[Any]]:
        import bench_runtime as rt

        plan = rt.plan_for(args.quick, compile_enabled=not args.no_compile, device=args.device, dtypes=dtypes)
        if args.gpu and not args.quick:  # compiled patch-embedding rows: one shape, to keep the GPU run short
            plan.compile_shapes = plan.compile_shapes[:1]
        plan.compile_backend = args.compile_backend
        table, results = rt.run_patch_embeddings(plan, _log)
        found = rt.patch_embedding_budgets(results)
        if args.quick:
            found = []  # tiny shapes say nothing about the budgets; the full run reports them
        text_dtype = "fp32" if "fp32" in dtypes and args.device == "cpu" else dtypes[-1]
        text_table, text_results, notes = rt.run_text_families(args.quick, _log, args.device, text_dtype)
        for note in notes:
            print(f"note: {note}", flush=True)
        return [table, text_table], {"patch_embeddings": results, "text_families": text_results, "notes": notes}, found

    e2e_data: dict[str, Any] = {}

    def e2e() -> tuple[list[Table], Any, list[Any]]:
        import bench_e2e

        overrides = {k: v for k, v in (("rounds", args.rounds), ("text_layers", args.text_layers),
                                       ("tower_depth", args.tower_depth), ("patches", args.patches)) if v is not None}
        for name in ("workloads", "compile_dtypes", "compile_workloads"):
            if getattr(args, name):
                overrides[name] = tuple(w.strip() for w in getattr(args, name).split(",") if w.strip())
        modes = ("eager",) if args.no_compile else tuple(m.strip() for m in args.modes.split(",") if m.strip())
        if not modes or set(modes) - set(bench_e2e.MODES):
            raise ValueError(f"--modes takes {' and/or '.join(bench_e2e.MODES)}, not {args.modes!r}")
        if args.time_budget is not None:
            overrides["deadline"] = started + args.time_budget
        plan = bench_e2e.plan_for(args.quick, args.device, dtypes, modes, compile_each=args.compile_each,
                                  compile_backend="eager" if args.quick else args.compile_backend, **overrides)
        if args.quick:
            plan.notes.append("--quick: compiled rows use torch.compile(backend='eager') (dynamo only), "
                              "to exercise the code path in seconds")
        def progress(so_far: list[Table], data: dict[str, Any]) -> None:
            partial[:] = so_far
            report["sections"]["e2e"] = {"partial": True, "data": data}
            write(final=False)

        tables, data, found = bench_e2e.run(plan, _log, progress)
        e2e_data.update(data)
        return tables, data, [] if args.quick else found

    def explain() -> tuple[list[Table], Any, list[Any]]:
        import bench_explain

        tables, data = bench_explain.run(args.quick, args.device, dtypes, e2e_data, _log,
                                         text_layers=args.text_layers, tower_depth=args.tower_depth,
                                         patches=args.patches,
                                         compile_backend="eager" if args.quick else args.compile_backend)
        return tables, data, []

    def io(kind: str) -> Callable[[], tuple[Table, Any, list[Any]]]:
        def run() -> tuple[Table, Any, list[Any]]:
            import bench_io

            table, data, found = getattr(bench_io, f"run_{kind}")(args.quick, _log)
            return table, data, [] if args.quick and kind != "startup" else found

        return run

    with torch.inference_mode(False):
        section("runtime", runtime)
        section("e2e", e2e)
        section("explain", explain)
        section("load", io("load"))
        section("save", io("save"))
        section("startup", io("startup"))

    write(final=True)
    for path in (args.json, args.markdown):
        if path and path != "-":
            _log(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
