"""The core's import graph: no cycles, no integration imported, imports following the data flow.

Read from the AST of every module of ``fusion_core`` (imports inside functions included: a lazy
import is still a dependency; imports under ``if TYPE_CHECKING:`` are not, they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "fusion_core"

#: Modules every stage may import: the protocol and its building blocks, errors, the compat layer.
FOUNDATIONS = {
    "errors", "patterns", "hookspecs", "integration", "spec", "transforms", "decisions", "merge_policy", "merged",
    "wrapped", "forward_source", "parallel", "parallel.rules", "compat", "compat.transformers", "compat.peft",
    "compat.torch", "compat.accelerate", "mapped_files", "streaming", "aliases", "lazy", "random_state",
}
#: The pipeline's stages in data-flow order; a module imports only foundations and earlier stages.
STAGES: list[set[str]] = [
    {"config"},
    {"plugins"},
    {"discovery"},
    {"patching"},
    {"layout"},
    {"checkpoint", "record", "parallel.saving"},
    {"memory", "casting"},
    {"hf", "inplace", "routing", "integration_needs", "state"},
]
#: Imports that run against the flow, each with why it must (the three places the flow loops back).
AGAINST_THE_FLOW = {
    ("config", "plugins"): "a family name in fusion_config is resolved against the registry once, while parsing",
    ("discovery", "patching"): "the meta model is built with class routing suspended (no_routing, LOAD_LOCK)",
    ("discovery", "layout"): "discovery rehearses every planned fuse on the meta model (fuse_instance)",
}
#: Distributions the core must never import: integrations are reached through hooks only.
NEVER_IMPORTED = {"fusion_peft", "fusion_tensor_parallel", "fusion_quantization", "fusion_qkv", "fusion_gate_up",
                  "fusion_patch_embeddings", "fusion_moe_experts", "peft", "torchao", "bitsandbytes", "optimum"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in CORE.rglob("*.py")}


def _runtime_imports(path: Path) -> set[str]:
    """Every module name imported by ``path`` when it runs (``fusion_core.x`` and third-party alike)."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(block.test) for stmt in block.body for node in ast.walk(stmt)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}".removeprefix("fusion_core.")
                      in MODULES else node.module for alias in node.names}
    return found


def core_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = {t.removeprefix("fusion_core.") for t in _runtime_imports(path) if t.startswith("fusion_core.")}
        edges[name] = {t for t in targets if t in MODULES and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_core_has_no_import_cycle() -> None:
    assert cycles(core_edges()) == []


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_never_imports_an_integration_or_a_family() -> None:
    offenders = {name: sorted(t for t in _runtime_imports(path) if t.split(".")[0] in NEVER_IMPORTED)
                 for name, path in MODULES.items()}
    assert {name: found for name, found in offenders.items() if found} == {}


@pytest.mark.parametrize("stage", range(len(STAGES)))
def test_each_stage_imports_only_foundations_and_earlier_stages(stage: int) -> None:
    earlier = set().union(*STAGES[: stage + 1])
    edges = core_edges()
    against = {(module, target) for module in STAGES[stage] for target in edges[module]
               if target not in FOUNDATIONS and target not in earlier}
    assert against - set(AGAINST_THE_FLOW) == set()


def test_every_pipeline_module_has_a_place_and_every_exception_is_real() -> None:
    placed = FOUNDATIONS | set().union(*STAGES)
    pipeline = {m for m in MODULES if not m.startswith(("commands", "testing")) and m not in
                {"", "__main__", "cli", "compare", "plugin"}}
    assert pipeline - placed == set()
    edges = core_edges()
    assert {pair for pair in AGAINST_THE_FLOW if pair[1] not in edges[pair[0]]} == set()


def test_foundations_import_no_stage() -> None:
    stages = set().union(*STAGES)
    edges = core_edges()
    assert {(m, t) for m in FOUNDATIONS for t in edges[m] if t in stages} == set()
