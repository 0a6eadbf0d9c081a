"""The ``fusion`` command (also ``python -m fusion_core``).

::

    fusion list                                   installed families and integrations, where each comes from
    fusion plan MODEL_DIR -f FAMILY[,FAMILY]      what a fused load would do (no weight is read)
    fusion check MODEL_DIR -f ...                 fused vs plain on random inputs, round trip, time
    fusion convert SRC DST -f ... --to fused      rewrite a checkpoint in the other layout
    fusion new-family NAME [--dir DIR]            scaffold a plugin distribution
    fusion tune [--every-machine]                 forget the stored decisions: the next load measures again

Every command takes ``--json`` (machine-readable output on stdout). Exit status: 0 success,
1 a failed check or an error naming its cause, 2 a usage error. When the reader of stdout goes away
(``fusion list --json | head -1``) the command stops quietly with status 1, as Python's own tools do.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import Any, cast

from fusion_core.plugins import get_registry


# -- output helpers ----------------------------------------------------------------------------
def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    cells = [[str(c) for c in header], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in cells]
    return "\n".join(lines)


def _shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "[" + ", ".join(str(s) for s in shape) + "]"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _status(enabled: bool | None) -> Callable[[str], None]:
    """A one-line progress indicator on stderr (only on a terminal unless forced)."""
    show = sys.stderr.isatty() if enabled is None else enabled
    if not show:
        return lambda _: None

    def step(what: str) -> None:
        sys.stderr.write(f"\r\033[K... {what}")
        sys.stderr.flush()

    return step


def _clear_status(enabled: bool | None) -> None:
    if (sys.stderr.isatty() if enabled is None else enabled):
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


# -- list --------------------------------------------------------------------------------------
def _integration_rows() -> list[dict[str, Any]]:
    return [
        {
            "name": entry.name,
            "description": entry.integration.description,
            "distribution": entry.source.distribution,
            "version": entry.source.version,
            "plugin": entry.source.plugin,
        }
        for entry in get_registry().integrations()
    ]


def _family_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    registry = get_registry()
    families = []
    for family in registry:
        spec_cls = type(family.spec)
        module = sys.modules.get(spec_cls.__module__)
        try:
            location = inspect.getsourcefile(module) if module is not None else None
        except TypeError:
            location = None
        families.append(
            {
                "name": family.name,
                "description": family.spec.description,
                "distribution": family.source.distribution,
                "version": family.source.version,
                "plugin": family.source.plugin,
                "module": spec_cls.__module__,
                "spec_class": spec_cls.__qualname__,
                "location": location,
                "options_schema": family.spec.options_model.model_json_schema(),
            }
        )
    failures = [
        {
            "plugin": failure.source.plugin,
            "distribution": failure.source.distribution,
            "version": failure.source.version,
            "family": failure.family,
            "reason": failure.reason,
        }
        for failure in registry.failures
    ]
    return families, failures


def _options_summary(schema: dict[str, Any]) -> str:
    props = schema.get("properties", {})
    return ", ".join(sorted(props)) or "-"


def cmd_list(args: argparse.Namespace) -> int:
    families, failures = _family_rows()
    integrations = _integration_rows()
    if args.json:
        print(json.dumps({"families": families, "integrations": integrations, "failed_plugins": failures}, indent=2))
        return 0
    if not families:
        print("No fusion family is installed. Install one, e.g.: pip install fusion-patch-embeddings")
    else:
        print(table(
            ("FAMILY", "DISTRIBUTION", "VERSION", "OPTIONS", "DESCRIPTION"),
            [(f["name"], f["distribution"] or "(programmatic)", f["version"] or "-",
              _options_summary(f["options_schema"]), f["description"]) for f in families],
        ))
        print()
        print(table(("FAMILY", "MODULE", "LOCATION"),
                    [(f["name"], f"{f['module']}.{f['spec_class']}", f["location"] or "-") for f in families]))
    if integrations:
        print()
        print(table(("INTEGRATION", "DISTRIBUTION", "VERSION", "DESCRIPTION"),
                    [(i["name"], i["distribution"] or "(programmatic)", i["version"] or "-", i["description"])
                     for i in integrations]))
    if failures:
        print("\nPlugins that failed to load:")
        for f in failures:
            family = f" (family {f['family']!r})" if f["family"] else ""
            print(f"  {f['plugin']} from {f['distribution']} {f['version']}{family}: {f['reason']}")
    return 0


# -- plan --------------------------------------------------------------------------------------
def _print_some(title: str, rows: list[dict[str, Any]], detail: Callable[[dict[str, Any]], str]) -> None:
    """A titled list of plan rows, ``module (family): detail``, the first eight and a count of the rest."""
    if not rows:
        return
    print(f"\n{title} ({len(rows)}):")
    for row in rows[:8]:
        print(f"  {row['module']} ({row['family']}): {detail(row)}")
    if len(rows) > 8:
        print(f"  ... and {len(rows) - 8} more")


def cmd_plan(args: argparse.Namespace) -> int:
    from fusion_core.commands.plan import run_plan

    result = run_plan(args.model_dir, args.families, args.options, args.config, args.model_class)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if result["ok"] else 1
    print(f"{result['model_dir']}: {result['model_class']}, {result['layout']} layout; "
          f"fusion_config {json.dumps(result['fusion_config'])}")
    _print_some("Left to the family fusing the module around them", result.get("nested", []),
                lambda row: f"inside {row['inside']}, fused by {row['left_to']}")
    _print_some("Declined by the family, with its reason", result.get("refused", []), lambda row: row["reason"])
    if result["skipped"]:
        print(f"\nSkipped, nothing to fuse (required=False): {', '.join(result['skipped'])}")
    if not result["modules"]:
        print(f"\nNothing to fuse: {result['error'] or 'every family was skipped'}")
        return 0 if result["ok"] else 1
    print(f"\n{len(result['modules'])} module(s) of {result['scanned_modules']} would be replaced:\n")
    print(table(("MODULE", "FAMILY", "ORIGINAL CLASS", "FUSED CLASS"),
                [(m["module"], m["family"], m["original_class"], m["fused_class"]) for m in result["modules"]]))
    rows = []
    for row in result["transforms"]:
        keys = row.get("checkpoint_keys", {})
        sources, targets = list(row["original"].items()), list(row["fused"].items())
        for i, (src, dst) in enumerate(zip_longest(sources, targets)):
            rows.append((
                keys.get(src[0]) or src[0] if src else "",
                _shape(src[1]) if src else "",
                "->" if i == 0 else "",
                keys.get(dst[0]) or dst[0] if dst else "",
                _shape(dst[1]) if dst else "",
                (row.get("dtype") or "-") if i == 0 else "",
                row["op"] if i == 0 else "",
            ))
    if rows:
        print(f"\n{len(result['transforms'])} checkpoint tensor group(s) would be transformed:\n")
        print(table(("ORIGINAL KEY", "SHAPE", "", "FUSED KEY", "SHAPE", "DTYPE", "OP"), rows))
    else:
        print("\nNo checkpoint tensor changes: the fused modules run on the original weights.")
    checkpoint = result["checkpoint"]
    if checkpoint["error"]:
        print(f"\nCheckpoint does not match the plan: {checkpoint['error']}")
        return 1
    print("\nCheckpoint headers match the plan." if checkpoint["checked"] else "")
    return 0


# -- check -------------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    from fusion_core.commands.check import run_check

    try:
        result = run_check(args.model_dir, args.families, args.options, args.config, args.model_class,
                           dtype=args.dtype, seed=args.seed, repeats=args.repeats, on_step=_status(args.progress))
    finally:
        _clear_status(args.progress)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if result["ok"] else 1
    print(f"{result['model_dir']}: {result['model_class']} in {result['dtype']}; "
          f"fusion_config {json.dumps(result['fusion_config'])}\n")
    print(table(
        ("MODULE", "FAMILY", "MAX ABS", "MAX REL", "TOLERANCE", "INPUTS", "RESULT"),
        [(m["module"], m["family"], _num(m["max_abs_error"]), _num(m["max_rel_error"]), _num(m["tolerance"]),
          m["input_sets"], ("ok" if m["ok"] else "FAIL") + (f" ({m['note']})" if m["note"] else ""))
         for m in result["modules"]],
    ))
    whole = result["whole_model"]
    if whole["ran"]:
        inputs = ", ".join(f"{k}{_shape(v)}" for k, v in whole["inputs"].items())
        print(f"\nWhole model ({inputs}): max abs {_num(whole['max_abs_error'])}, max rel "
              f"{_num(whole['max_rel_error'])} (tolerance {_num(whole['tolerance'])}): "
              f"{'ok' if whole['ok'] else 'FAIL'}")
    else:
        print(f"\nWhole model: {whole['note']}")
    for path, tower in whole.get("towers", {}).items():
        if tower.get("ok") is None:
            print(f"{path}: {tower['note']}")
        else:
            inputs = ", ".join(f"{k}{_shape(v)}" for k, v in tower["inputs"].items())
            print(f"{path} ({inputs}): max abs {_num(tower['max_abs_error'])}, max rel "
                  f"{_num(tower['max_rel_error'])}: {'ok' if tower['ok'] else 'FAIL'}"
                  + (f" ({tower['note']})" if tower.get("note") else ""))
    trip = result["round_trip"]
    if trip["ok"]:
        print(f"Round trip: ok ({trip['tensors']} tensors identical to the source)")
    else:
        print(f"Round trip: FAIL ({len(trip['problems'])} problem(s))")
        for problem in trip["problems"][:20]:
            print(f"  {problem}")
    training = result.get("training")
    if training is not None:
        said = training["note"] or (f"loss rel {_num(training['loss'])}, worst gradient rel L2 "
                                    f"{_num(training['gradients'])}")
        print(f"Training step with labels ({', '.join(training['families'])}: loss and gradients, not logits): "
              f"{said}: {'ok' if training['ok'] else 'FAIL'}")
    ratio = result["forward_time_ratio"]
    if ratio is not None:
        print(f"Forward time, fused / plain ({result['timed']}): {ratio:.2f}x")
    print("\nPASS" if result["ok"] else "\nFAIL")
    return 0 if result["ok"] else 1


# -- convert -----------------------------------------------------------------------------------
def cmd_convert(args: argparse.Namespace) -> int:
    from fusion_core.commands.convert import run_convert, verify_conversion

    result = run_convert(args.src, args.dst, args.to, args.families, args.options, args.config, args.model_class,
                         overwrite=args.overwrite, show_progress=args.progress)
    if args.verify:
        result["verify"] = verify_conversion(result, args.model_class)
    ok = result.get("verify", {}).get("ok", True)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if ok else 1
    print(f"Wrote {result['destination']} in the {result['to']} layout: {result['tensors']} tensors in "
          f"{result['shards']} shard(s), {result['transformed_groups']} tensor group(s) transformed, "
          f"{result['total_size']} bytes")
    if "verify" in result:
        verify = result["verify"]
        print(f"Verify: {'ok' if verify['ok'] else 'FAIL'} ({verify['tensors']} tensors compared)")
        for problem in verify["problems"][:20]:
            print(f"  {problem}")
    return 0 if ok else 1


# -- new-family --------------------------------------------------------------------------------
def cmd_new_family(args: argparse.Namespace) -> int:
    from fusion_core.commands.scaffold import new_family

    result = new_family(args.name, args.dir)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"Created {result['distribution']} in {result['directory']}:")
    for name in cast("list[str]", result["files"]):
        print(f"  {name}")
    print(f"\nNext: pip install -e {result['directory']} && pytest {result['directory']}")
    return 0


# -- tune --------------------------------------------------------------------------------------
def cmd_tune(args: argparse.Namespace) -> int:
    from fusion_core.commands.tune import run_tune

    result = run_tune(args.every_machine)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    whose = "every machine's" if args.every_machine else "this machine's"
    print(f"Forgot {result['forgotten']} of {whose} stored decisions in {result['store']}: the next load of each "
          "kind measures again.")
    return 0


# -- parser ------------------------------------------------------------------------------------
def _add_fusion_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--families", metavar="FAMILY[,FAMILY]",
                        help="families to enable (default: the fusion_config stored in the checkpoint)")
    parser.add_argument("--options", metavar="JSON",
                        help='family options as JSON, e.g. \'{"patch_embeddings": {"exclude_modules": ["video"]}}\'')
    parser.add_argument("--config", metavar="FILE", help="a JSON file holding a whole fusion_config mapping")
    parser.add_argument("--model-class", metavar="NAME",
                        help="transformers class to load with (default: config.json's architectures[0])")


def _add_common(parser: argparse.ArgumentParser, progress: bool = False) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    if progress:
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--progress", dest="progress", action="store_true", default=None,
                           help="always show progress on stderr (default: only on a terminal)")
        group.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion", description="Inspect, check and apply fusion families.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="list installed families and integrations, where they come from, failed plugins")
    _add_common(p)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("plan", help="show what a fused load would replace and transform (reads no weight)")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a local checkpoint directory")
    _add_fusion_args(p)
    _add_common(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("check", help="compare a fused load with a plain one; round trip; forward-time ratio")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a local checkpoint directory (original layout)")
    _add_fusion_args(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="load both models in this dtype (default: the checkpoint's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--repeats", type=int, default=5, help="timed forward passes per model (default 5)")
    _add_common(p, progress=True)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("convert", help="write a checkpoint in the other layout, shard by shard, atomically")
    p.add_argument("src", metavar="SRC", help="the checkpoint directory to read")
    p.add_argument("dst", metavar="DST", help="the directory to write (appears only when complete)")
    p.add_argument("--to", choices=["fused", "original"], default="fused",
                   help="the layout to write (default: fused)")
    _add_fusion_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--verify", action="store_true",
                   help="afterwards, load the fused side with fusion_core.from_pretrained and compare it with the "
                        "original side tensor by tensor (loads the whole model)")
    _add_common(p, progress=True)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("new-family", help="scaffold a plugin distribution for a new family")
    p.add_argument("name", metavar="NAME", help="the family name (a lowercase identifier)")
    p.add_argument("--dir", default=".", help="where to create NAME/ (default: the current directory)")
    _add_common(p)
    p.set_defaults(func=cmd_new_family)

    p = sub.add_parser("tune", help="forget this machine's stored decisions (which way is faster): measured again")
    p.add_argument("--every-machine", action="store_true",
                   help="forget the decisions stored for every machine and software, not only this one's")
    _add_common(p)
    p.set_defaults(func=cmd_tune)
    return parser


#: Subcommands that load transformers models (and so import transformers anyway).
MODEL_COMMANDS = frozenset({"plan", "check", "convert"})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pydantic import ValidationError

    from fusion_core.commands._common import UsageError
    from fusion_core.errors import FusionError

    quiet = not (sys.stderr.isatty() if getattr(args, "progress", None) is None else args.progress)
    if quiet and args.command in MODEL_COMMANDS:  # `fusion list` must not pay for importing transformers
        import transformers

        transformers.logging.disable_progress_bar()
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, so that a closed pipe is met inside this try, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader closed stdout: nothing more can be said. Point stdout at /dev/null so the
        # interpreter's final flush of what is still buffered does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (FusionError, ValidationError, OSError) as exc:
        status = 2 if isinstance(exc, UsageError) else 1
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "error": str(exc), "error_type": type(exc).__name__}, indent=2))
        else:
            print(f"fusion {args.command}: error: {exc}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
