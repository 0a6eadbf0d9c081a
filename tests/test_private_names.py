"""Private names of transformers, PEFT, accelerate and torch are reached only from ``fusion_core/compat/``.

Walks the AST of the core and of every shipped plugin package. Flagged outside the compat modules:

- an import of a ``_``-prefixed name or module of one of those libraries;
- an attribute chain rooted at one of them that reaches a ``_``-prefixed name (``torch._dynamo``);
- a known private attribute of their objects (``model._tp_size``, ``PreTrainedModel._from_config``,
  a module's hook dictionaries, ...), as an attribute or as a ``getattr``/``hasattr``/``setattr`` string.

``nn.Module``'s ``_parameters`` / ``_buffers`` / ``_modules`` dictionaries are allowed: the storage
every module has, which torch's own ``__setattr__``, accelerate and PEFT write (``compat/torch.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = {"transformers", "peft", "accelerate", "torch", "torchao", "bitsandbytes", "optimum", "safetensors"}
MODULE_STORAGE = {"_parameters", "_buffers", "_modules"}
KNOWN_PRIVATE = {
    # transformers
    "_tp_size", "_tp_plan", "_device_mesh", "_from_config", "_load_pretrained_model", "_no_split_modules",
    "_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected", "_keys_to_ignore_on_save",
    "_tied_weights_keys", "_checkpoint_conversion_mapping", "_can_record_outputs", "_is_hf_initialized",
    "_BaseAutoModelClass", "_get_parameter_tp_plan", "_get_parameter_plan", "_hf_hook",
    # torch
    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_forward_hooks",
    "_forward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks", "_non_persistent_buffers_set",
    # PEFT
    "_create_new_module", "_maybe_include_all_linear_layers",
}
SOURCES = sorted(
    path
    for package in [ROOT / "fusion_core", *sorted((ROOT / "fusion_plugins").glob("*/fusion_*"))]
    for path in package.rglob("*.py")
    if "compat" not in path.relative_to(ROOT).parts
)


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(source: str, path: str = "<string>") -> list[str]:
    """Every private-name use that the rules above flag in ``source``."""
    tree = ast.parse(source)
    aliases = {lib: lib for lib in LIBRARIES}  # local name -> library it refers to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                library = alias.name.split(".")[0]
                if library in LIBRARIES:
                    aliases[alias.asname or library] = library
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            parts = node.module.split(".")
            for alias in node.names:
                if alias.name.startswith("_") or any(part.startswith("_") for part in parts):
                    found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
                aliases[alias.asname or alias.name] = parts[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr in MODULE_STORAGE:
                continue
            if node.attr in KNOWN_PRIVATE or _root_name(node) in aliases:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in {"getattr", "hasattr", "setattr", "delattr"} and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in KNOWN_PRIVATE):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_private_name_outside_the_compat_modules():
    assert SOURCES, "no source found to check"
    found = [v for path in SOURCES for v in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "private names outside fusion_core/compat/:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "from transformers.models.auto import auto_factory\nauto_factory._BaseAutoModelClass",
    "import torch\ntorch._dynamo.reset()",
    "import torch as t\nt._C._log_api_usage_once('x')",
    "from transformers.integrations.tensor_parallel import _get_parameter_tp_plan",
    "from transformers._private import thing",
    "size = model._tp_size",
    "size = getattr(model, '_tp_size', None)",
    "module._state_dict_hooks.clear()",
])
def test_each_rule_flags_what_it_names(source):
    assert violations(source), source


def test_module_storage_and_own_names_pass():
    assert not violations("module._parameters['weight'] = w\nself._cache = None\nowner._modules.get('q_proj')")
