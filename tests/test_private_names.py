"""Private names of transformers, PEFT, accelerate, torch and the quantizers are reached only from the compat
modules: ``fusion_core/compat/`` and a plugin's ``compat.py`` (``fusion_quantization/compat.py``: bitsandbytes,
optimum-quanto, torchao).

Walks the AST of the core and of every shipped plugin package. Flagged outside the compat modules:

- an import of a ``_``-prefixed name or module of one of those libraries, or of a quantizer's internal class
  (``QuantState``, ``Params4bit``, ``WeightQBytesTensor``, ...);
- an attribute chain rooted at one of them that reaches a ``_``-prefixed name (``torch._dynamo``);
- a known private attribute of their objects (``model._tp_size``, ``PreTrainedModel._from_config``,
  a module's hook dictionaries, quanto's ``_data`` / ``_scale``, a ``BitsAndBytesConfig``'s
  ``_load_in_4bit``, ...) or a quantizer's internal (bitsandbytes' ``SCB``, ``quant_state``, ...), as an
  attribute or as a string argument of a call (``getattr(weight, "SCB", None)``,
  ``config_field(config, "_load_in_4bit")``).

``nn.Module``'s ``_parameters`` / ``_buffers`` / ``_modules`` dictionaries are allowed: the storage
every module has, which torch's own ``__setattr__``, accelerate and PEFT write (``compat/torch.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = {"transformers", "peft", "accelerate", "torch", "torchao", "bitsandbytes", "optimum", "safetensors"}
MODULE_STORAGE = {"_parameters", "_buffers", "_modules"}
NAMED_TUPLE = {"_fields", "_asdict", "_replace", "_make"}
"""A named tuple's documented API (underscored only to stay clear of field names)."""
KNOWN_PRIVATE = {
    # transformers
    "_tp_size", "_tp_plan", "_device_mesh", "_from_config", "_load_pretrained_model", "_no_split_modules",
    "_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected", "_keys_to_ignore_on_save",
    "_tied_weights_keys", "_checkpoint_conversion_mapping", "_can_record_outputs", "_is_hf_initialized",
    "_BaseAutoModelClass", "_get_parameter_tp_plan", "_get_parameter_plan", "_hf_hook",
    # accelerate
    "_old_forward",
    # torch
    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_forward_hooks",
    "_forward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks", "_non_persistent_buffers_set",
    # PEFT
    "_create_new_module", "_maybe_include_all_linear_layers",
    # transformers' BitsAndBytesConfig, optimum-quanto's tensors, bitsandbytes
    "_load_in_4bit", "_load_in_8bit", "_data", "_scale", "_qtype", "_axis", "_convert_weight_packed_for_cpu",
}
QUANTIZER_INTERNALS = {
    # bitsandbytes: LLM.int8 scales and state, the 4-bit quantization state and its CPU repacking
    "SCB", "MatmulLtState", "has_fp16_weights", "Int8Params", "Params4bit", "QuantState", "quant_state",
    "packing_format_for_cpu",
    # optimum-quanto
    "WeightQBytesTensor", "activation_qtype",
}
"""Internal names of the quantizers without a ``_`` prefix: flagged wherever they appear outside a compat module."""
SOURCES = sorted(
    path
    for package in [ROOT / "fusion_core", *sorted((ROOT / "fusion_plugins").glob("*/fusion_*"))]
    for path in package.rglob("*.py")
    if "compat" not in path.relative_to(ROOT).parts and path.name != "compat.py"
)
FLAGGED = KNOWN_PRIVATE | QUANTIZER_INTERNALS
ALL_OWN_SOURCES = sorted(
    path
    for package in [ROOT / "fusion_core", *sorted((ROOT / "fusion_plugins").glob("*/fusion_*"))]
    for path in package.rglob("*.py")
)


def own_private_names(sources: list[str]) -> set[str]:
    """Every ``_``-prefixed attribute name the project's own code defines: methods and class attributes of its
    classes, attributes it assigns (``self._cache = ...``) and ``__slots__`` entries.

    The allow-list: outside the compat modules, an attribute ``obj._name`` is ours only if ``_name`` is one
    of these (or ``obj`` is one of our modules); anything else is another library's private name
    (``tensor._version``, ``config._experts_implementation``), which belongs in a compat module. Names in
    ``KNOWN_PRIVATE`` stay flagged even where our code assigns them (``model._tp_size`` is transformers').
    """
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(statement.name)
                    targets = (statement.targets if isinstance(statement, ast.Assign) else
                               [statement.target] if isinstance(statement, ast.AnnAssign) else [])
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
                    if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                        names.update(c.value for c in ast.walk(statement) if isinstance(c, ast.Constant)
                                     and isinstance(c.value, str))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.attr)
            elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)  # obj.__dict__["_x"] = ...
                  and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"
                  and isinstance(node.slice, ast.Constant)):
                names.add(str(node.slice.value))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(str(node.args[1].value))
    return {name for name in names if name.startswith("_") and not name.startswith("__")} - FLAGGED


def _own_modules(tree: ast.AST) -> set[str]:
    """Local names bound to the project's own modules (``from fusion_core import streaming``)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name.startswith("fusion_"))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fusion_")):
            bound.update(a.asname or a.name for a in node.names)
    return bound


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(source: str, path: str = "<string>", own: set[str] | None = None) -> list[str]:
    """Every private-name use that the rules above flag in ``source``; with ``own`` (the allow-list from
    :func:`own_private_names`), also every ``_``-prefixed attribute read that is not one of our names."""
    tree = ast.parse(source)
    ours = _own_modules(tree)
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
                if (alias.name.startswith("_") or alias.name in QUANTIZER_INTERNALS
                        or any(part.startswith("_") for part in parts)):
                    found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
                aliases[alias.asname or alias.name] = parts[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in QUANTIZER_INTERNALS:
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr in MODULE_STORAGE or node.attr in NAMED_TUPLE:
                continue
            if (node.attr in KNOWN_PRIVATE or _root_name(node) in aliases
                    or (own is not None and node.attr not in own and _root_name(node) not in ours)):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and any(
                isinstance(argument, ast.Constant) and isinstance(argument.value, str) and (
                    argument.value in FLAGGED or (own is not None and argument.value.startswith("_")
                                                  and argument.value not in NAMED_TUPLE
                                                  and not argument.value.startswith("__")
                                                  and argument.value.isidentifier() and argument.value not in own))
                for argument in node.args[1:]):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_private_name_outside_the_compat_modules():
    assert SOURCES, "no source found to check"
    own = own_private_names([path.read_text() for path in ALL_OWN_SOURCES])
    found = [v for path in SOURCES for v in violations(path.read_text(), str(path.relative_to(ROOT)), own)]
    assert not found, "private names outside the compat modules:\n" + "\n".join(found)


def test_the_plugins_compat_modules_are_exempt_and_walked_otherwise():
    compat = ROOT / "fusion_plugins" / "quantization" / "fusion_quantization" / "compat.py"
    assert compat not in SOURCES and compat.parent / "bnb_4bit.py" in SOURCES
    assert violations(compat.read_text()), "the quantizers' compat module no longer reads what the rules flag"


@pytest.mark.parametrize("source", [
    "from transformers.models.auto import auto_factory\nauto_factory._BaseAutoModelClass",
    "import torch\ntorch._dynamo.reset()",
    "import torch as t\nt._C._log_api_usage_once('x')",
    "from transformers.integrations.tensor_parallel import _get_parameter_tp_plan",
    "from transformers._private import thing",
    "size = model._tp_size",
    "size = getattr(model, '_tp_size', None)",
    "module._state_dict_hooks.clear()",
    "scales = getattr(layer.weight, 'SCB', None)",
    "state = layer.weight.quant_state",
    "from bitsandbytes.functional import QuantState",
    "rows, scales = weight._data, weight._scale",
    "config_field(quantization, '_load_in_4bit')",
    "from optimum.quanto.tensor.weights.qbytes import WeightQBytesTensor",
])
def test_each_rule_flags_what_it_names(source):
    assert violations(source), source


def test_module_storage_and_own_names_pass():
    assert not violations("module._parameters['weight'] = w\nself._cache = None\nowner._modules.get('q_proj')")


@pytest.mark.parametrize("source", [
    "version = tensor._version",
    "implementation = config._experts_implementation",
    "gated = experts._apply_gate(x)",
    "getattr(module, '_is_expert_parallel', False)",
])
def test_the_allow_list_flags_a_private_name_our_code_does_not_define(source):
    own = own_private_names(["class A:\n    def _mine(self):\n        self._cache = None\n"])
    assert violations(source, own=own), source
    assert not violations("self._cache = None\nx = a._mine()", own=own)


def _without(class_name: str, **attributes: object) -> object:
    """An instance of a class named like a quantizer's, lacking every attribute but ``attributes``."""
    return type(class_name, (), attributes)()


@pytest.mark.parametrize(("library", "name", "read"), [
    ("bitsandbytes", "Params4bit.quant_state",
     lambda compat: compat.read_4bit(SimpleNamespace(weight=_without("Params4bit")))),
    ("bitsandbytes", "MatmulLtState.threshold",
     lambda compat: compat.int8_settings(SimpleNamespace(state=_without("MatmulLtState")))),
    ("optimum-quanto", "WeightQBytesTensor._data", lambda compat: compat.read_quanto(
        SimpleNamespace(_parameters={"weight": _without("WeightQBytesTensor", qtype=SimpleNamespace(name="qint8"))}))),
])
def test_a_quantizer_release_without_a_name_fusion_quantization_reads_is_named(library, name, read):
    """On a release that lacks an internal name, the error names the library, its release, the name and the
    releases checked, instead of an AttributeError deep in a load or a save."""
    from fusion_quantization import compat

    checked = re.escape(", ".join(compat.CHECKED_RELEASES[library]))
    with pytest.raises(ImportError, match=rf"^{library} {re.escape(compat.release(library))} has no {re.escape(name)},"
                                          rf" .*checked on {library} {checked}: install that release"):
        read(compat)
