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
import textwrap

from torch import nn


@functools.cache
def attributes_read(cls: type) -> frozenset[tuple[str, str]]:
    """The pairs ``(n, leaf)`` for which the source of ``cls`` (its MRO's classes, torch's own excluded) reads
    ``<expression>.n.leaf``; each class's source is parsed once."""
    pairs: set[tuple[str, str]] = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] == "torch":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # no readable source (built dynamically)
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                pairs.add((node.value.attr, node.attr))
    return frozenset(pairs)


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
