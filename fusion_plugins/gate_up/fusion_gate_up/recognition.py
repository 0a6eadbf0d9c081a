"""Which children of a module are the gate and up projections of a gated MLP, read from its ``forward``.

Architectures name them differently (``gate_proj``/``up_proj`` in Llama and most decoders,
``w1``/``w3`` in Mixtral's experts and LFM2, ``wi_0``/``wi_1`` in T5 v1.1, MT5, UMT5, LongT5 and
Pix2Struct), so no list of names is kept. A gated MLP is a class whose ``forward`` multiplies
``act(self.<gate>(x))`` by ``self.<up>(x)``, where ``<gate>`` and ``<up>`` are two of its own
children and ``act`` is a call of ``self.<attribute>`` or of a module-level function
(``F.silu``); the factors may first be stored in local names (T5's ``hidden_gelu`` and
``hidden_linear``). The class's source decides the candidate pair (:func:`gated_products`,
cached per class); the instance decides the rest (:mod:`fusion_gate_up.family`): both children
plain ``nn.Linear`` s of one shape, an activation known to be elementwise, one input.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fusion_core.plugin import Aliases, aliases, alternatives, forwards, self_call, value_of


@dataclass(frozen=True)
class GatedProduct:
    """``act(self.<gate>(x)) * self.<up>(y)`` in a ``forward``, and what ``x`` and ``y`` may be."""

    gate: str
    up: str
    #: ``("self", attribute)`` for ``self.<attribute>(...)``, ``("global", dotted)`` for ``F.silu(...)``.
    activation: tuple[str, str]
    same_input: bool
    #: The class whose ``forward`` holds the product, and that function's globals (to resolve ``activation``).
    owner: type[Any]
    namespace: Any = field(compare=False, repr=False)


def gated_products(module: nn.Module) -> tuple[GatedProduct, ...]:
    """The distinct gated products of ``module``'s class's first ``forward`` that calls its children."""
    children = tuple(name for name, child in module._modules.items() if child is not None)
    cls: Any = type(module)
    return _gated_products(cls, children)


@functools.lru_cache(maxsize=256)
def _gated_products(cls: Any, children: tuple[str, ...]) -> tuple[GatedProduct, ...]:
    for klass, function, tree in forwards(cls):
        if not any(self_call(node, children) for node in ast.walk(tree)):
            continue
        assigned = aliases(tree)
        found: dict[tuple[str, str], GatedProduct] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                for gated, linear in ((node.left, node.right), (node.right, node.left)):
                    product = _product(gated, linear, children, assigned, klass, function)
                    if product is not None:
                        found.setdefault((product.gate, product.up), product)
        return tuple(found.values())
    return ()


def _product(gated: ast.expr, linear: ast.expr, children: tuple[str, ...], assigned: Aliases,
             klass: type[Any], function: Any) -> GatedProduct | None:
    gated, linear = value_of(gated, assigned), value_of(linear, assigned)
    up = self_call(linear, children)
    if up is None or not isinstance(gated, ast.Call) or len(gated.args) != 1 or gated.keywords:
        return None
    gate = self_call(value_of(gated.args[0], assigned), children)
    activation = _callee(gated.func)
    if gate is None or activation is None or gate[0] == up[0] or activation == ("self", gate[0]):
        return None
    same = bool(alternatives(gate[1], assigned) & alternatives(up[1], assigned))
    return GatedProduct(gate[0], up[0], activation, same, klass, getattr(function, "__globals__", {}))


def _callee(func: ast.expr) -> tuple[str, str] | None:
    """``self.<attribute>`` or a dotted module-level name (``F.silu``, ``torch.sigmoid``); None otherwise."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return ("self", func.attr)
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name) and func.id != "self":
        return ("global", ".".join([func.id, *reversed(parts)]))
    return None


def resolve_activation(module: nn.Module, product: GatedProduct) -> Any:
    """The object ``product``'s activation calls on ``module``; None when it is not there."""
    kind, name = product.activation
    if kind == "self":
        return getattr(module, name, None)
    first, *rest = name.split(".")
    value = product.namespace.get(first)
    for part in rest:
        value = getattr(value, part, None)
    return value
