"""The ``fusion`` command (also ``python -m fusion_core``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from fusion_core.plugins import get_registry


def _family_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    registry = get_registry()
    families = [
        {
            "name": family.name,
            "description": family.spec.description,
            "distribution": family.source.distribution,
            "version": family.source.version,
            "plugin": family.source.plugin,
            "options_schema": family.spec.options_model.model_json_schema(),
        }
        for family in registry
    ]
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
    if args.json:
        print(json.dumps({"families": families, "failed_plugins": failures}, indent=2))
        return 0
    if not families:
        print("No fusion family is installed. Install one, e.g.: pip install fusion-patch-embeddings")
    else:
        header = ("FAMILY", "DISTRIBUTION", "VERSION", "OPTIONS", "DESCRIPTION")
        rows = [
            (f["name"], f["distribution"] or "(programmatic)", f["version"] or "-",
             _options_summary(f["options_schema"]), f["description"])
            for f in families
        ]
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
        for row in [header, *rows]:
            print("  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4])
    if failures:
        print("\nPlugins that failed to load:")
        for f in failures:
            family = f" (family {f['family']!r})" if f["family"] else ""
            print(f"  {f['plugin']} from {f['distribution']} {f['version']}{family}: {f['reason']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion", description="Inspect and apply fusion families.")
    sub = parser.add_subparsers(dest="command", required=True)
    list_parser = sub.add_parser("list", help="list installed fusion families and failed plugins")
    list_parser.add_argument("--json", action="store_true", help="machine-readable output")
    list_parser.set_defaults(func=cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
