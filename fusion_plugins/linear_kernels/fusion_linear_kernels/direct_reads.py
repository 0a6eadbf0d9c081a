"""Linear layers whose weight the model's own code reads directly: they keep a dense weight.

A packed weight (:mod:`fusion_linear_kernels.packing`) is only usable by the layer's own forward.
Some architectures read a child layer's weight in the parent's code instead of calling the layer:
Mamba's mixer computes ``self.dt_proj.weight @ time_step``, RWKV rescales
``block.attention.output.weight`` in place when it switches to inference, Mamba's causal-LM class
reads ``self.lm_head.weight``. Packed, those reads get oneDNN's opaque tensor and fail (found by the
model-zoo census: ``NotImplementedError: Could not run 'aten::mm.out' with arguments from the
'MkldnnCPU' backend``).

So before a layer is packed, the source of every module class on its path from the model's root
(each class along its MRO, torch's own excluded) is read for an attribute chain ``<...>.<name>.weight``
naming the layer's attribute name; a layer so named is left dense (it still gets the kernel choice,
which reads the dense weight as the model does). The reading is conservative: any class on the path
that spells the name counts, whichever instance it means.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import sys

from torch import nn


@functools.cache
def attributes_read(cls: type) -> frozenset[tuple[str, str]]:
    """The pairs ``(n, leaf)`` for which the source of ``cls`` (its MRO's classes, torch's own excluded) reads
    ``<expression>.n.leaf``."""
    pairs: set[tuple[str, str]] = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] == "torch":
            continue
        try:
            filename = inspect.getsourcefile(klass)
        except TypeError:  # a built-in class
            continue
        if filename is not None:  # None: no readable source (built dynamically)
            pairs |= _pairs_by_class(filename, klass.__module__).get(klass.__qualname__, frozenset())
    return frozenset(pairs)


@functools.cache
def _pairs_by_class(filename: str, module: str) -> dict[str, frozenset[tuple[str, str]]]:
    """For each class a source file defines, by qualified name, the ``(n, leaf)`` of every ``<expression>.n.leaf``
    in its body. Each file is parsed once: ``inspect.getsource`` parses a class's whole file again for every class
    it finds, and a Qwen2 model's MROs span ``modeling_utils.py`` and ``generation/utils.py`` (under cProfile a fused
    Qwen2-0.5B load with ``linear_kernels`` spent 1.6 of its 2.9 s there; parsing each file once, the load took
    1.9 s). A class defined twice under one name (in two branches) gets the union."""
    try:
        # the module's globals let linecache read a source its loader holds (a zip import), as inspect does
        loaded = sys.modules.get(module)
        tree = ast.parse("".join(linecache.getlines(filename, vars(loaded) if loaded is not None else None)))
    except (SyntaxError, ValueError):
        return {}
    found: dict[str, set[tuple[str, str]]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                found.setdefault(name, set()).update(
                    (sub.value.attr, sub.attr) for sub in ast.walk(child)
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute))
                visit(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return {name: frozenset(pairs) for name, pairs in found.items()}


def read_directly(model: nn.Module, path: str, leaves: tuple[str, ...] = ("weight",)) -> str | None:
    """The class on the path to ``path`` whose code reads ``<...>.<name>.<leaf>`` for the module's name and one of
    its ``leaves`` (a 5.x experts module's ``gate_up_proj`` / ``down_proj``), or None."""
    *parents, name = path.split(".")
    module: nn.Module | None = model
    for index in range(len(parents) + 1):
        if module is None:
            return None
        if any((name, leaf) in attributes_read(type(module)) for leaf in leaves):
            return type(module).__qualname__
        if index < len(parents):
            module = module._modules.get(parents[index])
    return None
