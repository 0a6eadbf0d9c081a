"""Generate ``docs/api.md``, the API reference, from the live objects' signatures and docstrings.

Repository tooling. The page is plain markdown so it reads the same on GitHub and in the built
site: every public name of ``fusion_core`` and of the plugin surface ``fusion_core.plugin`` (their lazy
exports), the members of each protocol and class, the plugin hooks, the comparison engine, and the whole
test kit (functions, fixtures, the fixture's methods, tiny models). ``tests/test_docs.py`` fails when the
page differs from what this script renders now::

    python scripts/gen_api.py          # rewrite docs/api.md
    python scripts/gen_api.py --check  # exit 1 when docs/api.md is stale
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"

#: Modules documented after the two facades, with what they are for: the hooks a plugin implements,
#: the comparison engine behind ``fusion check``, and the conformance kit.
EXTRA_MODULES = (
    "fusion_core.hookspecs",
    "fusion_core.compare",
    "fusion_core.testing.kit",
    "fusion_core.testing.decisions",
    "fusion_core.testing.pytest_plugin",
    "fusion_core.testing.tiny_models",
)

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`~?([^`]+)`")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _markdown(doc: str | None) -> str:
    """A docstring as markdown: roles and ``literals`` as code, ``::`` blocks fenced."""
    if not doc:
        return ""
    text = inspect.cleandoc(doc)
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = text.replace("``", "`")
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            # Indentation outside code means nothing in markdown but an unwanted code block.
            out.append(line.lstrip() if not line.lstrip().startswith("- ") else line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        out.append(line.rstrip()[:-1].rstrip().lstrip())
        i += 1
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            i -= 1
            block.pop()
        out += ["", "```python", *textwrap.dedent("\n".join(block)).strip("\n").splitlines(), "```", ""]
    return "\n".join(out).strip()


class _Raw(str):
    """An annotation string printed without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _signature(obj: Any, name: str) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name

    def raw(annotation: Any) -> Any:
        return _Raw(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=raw(p.annotation)) for p in sig.parameters.values()]
    sig = sig.replace(parameters=params, return_annotation=raw(sig.return_annotation))
    return _ADDRESS.sub("", f"{name}{sig}")


def _own_members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties a class defines itself (not inherited from bases outside the project)."""
    pydantic = hasattr(cls, "model_fields")
    for name, value in cls.__dict__.items():
        if (name.startswith("_") and name != "__call__") or (pydantic and name.startswith("model_")):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            yield name, value


def _fields(cls: type) -> list[str]:
    """Documented class attributes: dataclass fields, pydantic fields, annotated protocol attributes."""
    fields = getattr(cls, "model_fields", None)
    if isinstance(fields, dict) and fields:
        return [f"`{n}`: {f.description or ''}".rstrip(": ") for n, f in fields.items()]
    annotations = inspect.get_annotations(cls)
    return [f"`{n}: {t}`" for n, t in annotations.items() if not n.startswith("_") and "ClassVar" not in str(t)]


def _class(name: str, cls: type, level: str) -> list[str]:
    kind = "protocol" if getattr(cls, "_is_protocol", False) else "class"
    bases = [b.__name__ for b in cls.__bases__ if b is not object and b.__name__ not in ("Protocol", "Generic")]
    head = f"{kind} {name}" + (f"({', '.join(bases)})" if bases else "")
    out = [f"{level} `{name}`", "", "```python", head, "```", "", _markdown(cls.__doc__)]
    fields = _fields(cls)
    if fields:
        out += ["", "Fields: " + "; ".join(fields) + "."]
    for member, value in _own_members(cls):
        if isinstance(value, property):
            out += ["", f"- `{name}.{member}` (property): {_markdown(value.__doc__) or ''}".rstrip(": ")]
        else:
            doc = _markdown(value.__doc__)
            out += ["", f"- `{_signature(value, f'{name}.{member}')}`" + (f"  \n  {_indent(doc)}" if doc else "")]
    return out


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")


def _constant(obj: Any) -> str:
    if isinstance(obj, dict):
        shown = repr(obj)
        if len(shown) <= 200 and " at 0x" not in shown:
            return f"`{shown}`"
        return f"a `dict` of {len(obj)}: " + ", ".join(f"`{key}`" for key in obj)
    return f"`{obj!r}`"


def _entry(name: str, obj: Any, level: str = "###") -> list[str]:
    if isinstance(obj, types.UnionType) or getattr(obj, "__origin__", None) is not None:
        return [f"{level} `{name}`", "", f"Type alias: `{_ADDRESS.sub('', repr(obj)).replace('typing.', '')}`", ""]
    if inspect.isclass(obj):
        return _class(name, obj, level)
    if callable(obj) and hasattr(obj, "__wrapped__") and "fixture" in type(obj).__name__.lower():
        return [f"{level} fixture `{name}`", "", _markdown(obj.__doc__)]
    if callable(obj):
        return [f"{level} `{name}`", "", "```python", _signature(obj, name), "```", "", _markdown(obj.__doc__)]
    return [f"{level} `{name}`", "", f"Constant: {_constant(obj)}.", ""]


def _public(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__ and (inspect.isclass(v) or callable(v))]
    return list(names)


def _by_module(exports: dict[str, str]) -> dict[str, list[str]]:
    by_module: dict[str, list[str]] = {}
    for name, module in exports.items():
        by_module.setdefault(module, []).append(name)
    return by_module


def _facade(exports: dict[str, str]) -> list[str]:
    """A facade's names (``fusion_core``, ``fusion_core.plugin``), grouped by the module that defines them."""
    out: list[str] = []
    for module_name, names in _by_module(exports).items():
        module = importlib.import_module(module_name)
        title = (module.__doc__ or module_name).strip().splitlines()[0]
        out += ["", f"### From `{module_name}`", "", _markdown(title), ""]
        for name in names:
            out += [*_entry(name, getattr(module, name), "####"), ""]
    return out


def render() -> str:
    """The reference as markdown, from the objects importable now."""
    import fusion_core
    import fusion_core.plugin

    out = [
        "# API reference",
        "",
        "Generated by `python scripts/gen_api.py` from the signatures and docstrings of the installed code",
        "(`tests/test_docs.py` fails when this page is stale). Everything here is public: the names",
        "`import fusion_core` exports, the plugin surface `fusion_core.plugin` (with the top-level package, all",
        "a family or integration may import), the plugin hooks, the comparison engine behind `fusion check`, and",
        "the conformance kit for family authors (`fusion_core.testing`).",
        "",
        "## `fusion_core`",
        "",
        "Import these from the package: `fusion_core.from_pretrained`, `fusion_core.Stack`, ... (loaded on first use).",
        *_facade(fusion_core._EXPORTS),
        "",
        "## `fusion_core.plugin`",
        "",
        _markdown(fusion_core.plugin.__doc__),
        *_facade(fusion_core.plugin._EXPORTS),
    ]
    for module_name in EXTRA_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        out += ["", f"## `{module_name}`", "", _markdown(module.__doc__), ""]
        for name in _public(module):
            out += [*_entry(name, getattr(module, name)), ""]
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip() + "\n"


def main(argv: list[str] | None = None, write: Callable[[str], Any] = API.write_text) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not API.is_file() or API.read_text() != text
        if stale:
            print(f"{API} is stale: regenerate with {sys.executable} scripts/gen_api.py", file=sys.stderr)
        return int(stale)
    write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
