"""The plugin surface: the shipped plugins reach fusion-core only through ``fusion_core`` and ``fusion_core.plugin``.

Third parties get exactly what the shipped families use; a name a shipped plugin needs that is not
on the surface fails here, and is added to :mod:`fusion_core.plugin` (documented), never imported
from a private module. Plugin tests may also use the conformance kit, :mod:`fusion_core.testing`.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import fusion_core
import fusion_core.plugin

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_FILES = sorted(path for path in (ROOT / "fusion_plugins").rglob("*.py") if ".venvs" not in path.parts)
SURFACE = {"fusion_core", "fusion_core.plugin"}


def _allowed(module: str, in_tests: bool) -> bool:
    return module in SURFACE or (in_tests and (module == "fusion_core.testing"
                                               or module.startswith("fusion_core.testing.")))


def core_reaches(path: Path) -> list[str]:
    """Every fusion-core module ``path`` imports from or reaches by attribute, outside the allowed ones."""
    in_tests = "tests" in path.relative_to(ROOT).parts or "benchmarks" in path.relative_to(ROOT).parts
    tree = ast.parse(path.read_text())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fusion_core"):
            module = node.module or ""
            if module == "fusion_core":  # `from fusion_core import x`: x must be a public name, not a submodule
                found += [f"fusion_core.{a.name}" for a in node.names
                          if a.name not in fusion_core.__all__ and a.name not in ("plugin", "testing")]
            elif not _allowed(module, in_tests):
                found.append(module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("fusion_core") and not _allowed(a.name, in_tests)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fusion_core":
            if node.attr not in fusion_core.__all__ and not _allowed(f"fusion_core.{node.attr}", in_tests):
                found.append(f"fusion_core.{node.attr}")
    return found


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=lambda p: str(p.relative_to(ROOT / "fusion_plugins")))
def test_a_shipped_plugin_uses_only_the_public_surface(path: Path) -> None:
    assert core_reaches(path) == []


PLUGIN_TEXTS = sorted(path for path in (ROOT / "fusion_plugins").rglob("*") if path.suffix in (".py", ".md")
                      and ".venvs" not in path.parts)
MENTION = re.compile(r"\bfusion_core\.([A-Za-z_]\w*)")


def private_mentions(text: str) -> list[str]:
    """``fusion_core.<name>`` in prose (docstrings, comments, READMEs) that is neither a public top-level name nor
    the plugin surface or the kit: the docs a plugin author reads must not point at private modules either."""
    public = {*fusion_core.__all__, "plugin", "testing"}
    return sorted({f"fusion_core.{name}" for name in MENTION.findall(text) if name not in public})


@pytest.mark.parametrize("path", PLUGIN_TEXTS, ids=lambda p: str(p.relative_to(ROOT / "fusion_plugins")))
def test_a_shipped_plugin_names_only_the_public_surface_in_its_docs(path: Path) -> None:
    assert private_mentions(path.read_text()) == []


def test_the_docs_check_sees_a_private_module() -> None:
    assert private_mentions("see :mod:`fusion_core.merged` and fusion_core.plugin.concat, fusion_core.fuse") == [
        "fusion_core.merged"]


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    plugin = ROOT / "fusion_plugins" / "_probe.py"
    try:
        plugin.write_text("from fusion_core.layout import fuse_instance\nimport fusion_core\nfusion_core.merged.x\n")
        assert core_reaches(plugin) == ["fusion_core.layout", "fusion_core.merged"]
    finally:
        plugin.unlink()


@pytest.mark.parametrize("name", fusion_core.plugin.__all__)
def test_every_surface_name_resolves_and_is_documented(name: str) -> None:
    value = getattr(fusion_core.plugin, name)
    defining = importlib.import_module(fusion_core.plugin._EXPORTS[name])
    assert value is getattr(defining, name)
    assert f"`{name}`" in (ROOT / "docs" / "api.md").read_text(), f"docs/api.md does not describe {name}"


def test_an_unknown_surface_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="fusion_core.plugin.*no_such_name"):
        fusion_core.plugin.no_such_name  # noqa: B018
