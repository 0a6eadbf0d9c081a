"""Make this checkout importable, plugins registered, by a python that cannot install it.

``benchmarks/gpu.sh`` runs on a machine that cannot reach PyPI, with a python whose setuptools
may not build wheels. fusion-core and its families need no build: their sources import as they
are. What an install adds is the distribution metadata, whose entry points
register the families. This writes that metadata (``<name>-<version>.dist-info`` with METADATA
and entry_points.txt, read from each pyproject.toml) into a site folder, and prints the
``PYTHONPATH`` that makes both importable: the site folder, then each project's source root.

    python benchmarks/gpu_site.py SITE_DIR    # prints SITE_DIR:ROOT:ROOT/fusion_plugins/...
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def projects(root: Path) -> list[Path]:
    """fusion-core and every family under fusion_plugins/ (each a folder with a pyproject.toml)."""
    plugins = sorted(p for p in (root / "fusion_plugins").iterdir() if (p / "pyproject.toml").is_file())
    return [root, *plugins]


def write_metadata(project: Path, site: Path) -> None:
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    name, version = meta["name"], meta["version"]
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines: list[str] = []
    for group, entries in meta.get("entry-points", {}).items():
        lines += [f"[{group}]", *(f"{key} = {value}" for key, value in entries.items()), ""]
    (dist / "entry_points.txt").write_text("\n".join(lines))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    site = Path(argv[0]).resolve()
    found = projects(ROOT)
    for project in found:
        write_metadata(project, site)
    print(":".join(str(p) for p in [site, *found]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
