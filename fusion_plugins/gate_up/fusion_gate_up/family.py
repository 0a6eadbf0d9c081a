"""``gate_up``: gated MLPs run their gate and up projections as one merged GEMM.

A gated MLP ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU: Llama, Mistral, Qwen, Gemma, Mixtral's
experts, T5 v1.1 / MT5 / UMT5 and most decoder LLMs) reads ``x`` twice; the fused module computes
``x @ [Wgate; Wup]^T`` once. The projections are found by structure, not by name
(:mod:`fusion_gate_up.recognition`): two children that the class's ``forward`` combines as
``act(gate(x)) * up(x)`` (``gate_proj``/``up_proj``, ``w1``/``w3``, ``wi_0``/``wi_1``, ...). The
family does not copy any MLP ``forward``: the fused class keeps the original one, and its
``fusion_finalize`` replaces the gate and up children by slices of one merged projection (see
:class:`fusion_core.plugin.MergedProjectionsMixin`), under their original names (PEFT targets them as before). The two
calls on the same input share one GEMM; any other call is answered from that projection's own
rows, so the activation, the product and the down projection run exactly as before.

Why slices rather than a new ``forward`` (``down(act(gu[:, :n]) * gu[:, n:])``): a rewritten
forward is only right for MLPs whose forward is exactly that expression, which cannot be
checked on a module instance (some scale, clamp, drop out or route between the calls). The
slices are exact for any forward; the cost is a Python-level cache check per projection call.

Checkpoint layout: the gate and up ``.weight`` s are concatenated along dim 0 into
``gate_up_proj.weight`` on load and split back on save; the biases likewise when both have one.

Refused (``is_fusable`` is False):

- activations the family does not know as elementwise (anything but the activations of
  ``transformers.activations``, the elementwise ``torch.nn`` activations and the matching
  ``torch.nn.functional`` functions; see :func:`is_elementwise_activation`), or an activation
  attribute the instance does not have: the module is not a recognised gated MLP;
- a ``forward`` without exactly one gated product of two children, or whose source cannot be
  read; gate and up applied to different inputs;
- shapes that are not a gated MLP (gate and up of different widths or inputs, no other
  ``nn.Linear`` child reading their width);
- projections that are not plain ``nn.Linear``, or are shared; tensors of different dtypes; a
  bias on one of gate/up but not the other;
- modules that already have a ``gate_up_proj`` (Phi-3 style MLPs, which split one projection
  with ``chunk``, are not matched at all).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from fusion_core import FamilyOptions
from fusion_core.plugin import MergedProjectionsMixin, MergingFamily, PackedColwise, is_plain_linear, merge_refusal
from fusion_gate_up.recognition import gated_products, resolve_activation

PROJECTIONS = ("gate_proj", "up_proj")
MERGED = "gate_up_proj"

#: Elementwise ``torch.nn`` activations (``GLU``, ``Softmax`` and friends are not elementwise).
TORCH_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.SiLU, nn.GELU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Identity,
)
TORCH_FUNCTIONS: tuple[Any, ...] = (
    F.silu, F.gelu, F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.mish, F.hardswish, F.hardsigmoid,
    F.softplus, torch.tanh, torch.sigmoid, torch.relu, F.tanh, F.sigmoid,
)


class GateUpOptions(FamilyOptions):
    """Options of ``gate_up``: the common ``target_modules`` / ``exclude_modules`` scoping."""


def is_elementwise_activation(act: Any) -> bool:
    """A known elementwise activation: from ``transformers.activations``, ``torch.nn`` or ``F``."""
    if isinstance(act, nn.Module):
        if type(act).__module__ == "transformers.activations":
            return True
        return type(act) in TORCH_ACTIVATIONS
    return any(act is fn for fn in TORCH_FUNCTIONS)


def gate_up(module: nn.Module) -> tuple[str, str] | None:
    """The names of ``module``'s gate and up children, when its ``forward`` has exactly one gated product."""
    products = gated_products(module)
    return (products[0].gate, products[0].up) if len(products) == 1 else None


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` cannot run a merged gate/up projection exactly and usefully; None when it can."""
    products = gated_products(module)
    if not products:
        return "no gated product act(gate(x)) * up(x) of two children in forward: not a gated MLP"
    if len(products) > 1:
        return f"several gated products in forward: {[(p.gate, p.up) for p in products]}"
    product = products[0]
    gate, up = (cast(nn.Linear, module._modules[name]) for name in (product.gate, product.up))
    if not (is_plain_linear(gate) and is_plain_linear(up)):
        return f"a projection ({product.gate}/{product.up}) is not a plain nn.Linear"
    act = resolve_activation(module, product)
    if act is None:
        return f"no activation {'.'.join(product.activation)}"
    if not is_elementwise_activation(act):
        return f"unknown activation {type(act).__qualname__}: not a recognised gated MLP"
    if not product.same_input:
        return f"{product.owner.__qualname__}.forward applies {product.gate} and {product.up} to different inputs"
    if gate is up or gate.weight is up.weight:
        return "gate and up share a module or a weight"
    if gate.in_features != up.in_features or gate.out_features != up.out_features:
        return "gate and up differ in shape (not a gated MLP)"
    others = [child for name, child in module._modules.items() if name not in (product.gate, product.up)]
    if not any(is_plain_linear(child) and cast(nn.Linear, child).in_features == gate.out_features for child in others):
        return "no down projection reads the gate/up width (not a gated MLP)"
    if (gate.bias is None) != (up.bias is None):
        return "a bias on one of gate/up but not the other"
    return merge_refusal(module, (gate, up), MERGED)


class GateUpMixin(MergedProjectionsMixin):
    """The fused behaviour mixed into an MLP subclass: gate and up share one merged GEMM."""

    container = MERGED

    def merged_parts(self) -> tuple[str, ...] | None:
        """The instance's own gate and up children, whatever their names."""
        return gate_up(self)


class GateUpFamily(MergingFamily[GateUpOptions]):
    """Gated MLP gate_proj/up_proj run as one merged projection (one GEMM instead of two)."""

    name = "gate_up"
    options_model = GateUpOptions
    fused_mixin = GateUpMixin
    projections = PROJECTIONS
    container = MERGED
    #: Under a tensor-parallel plan with gate_proj/up_proj colwise, each rank merges its own rows.
    tensor_parallel = PackedColwise(PROJECTIONS, MERGED)
    target_modules_patterns = ()

    def parts(self, module: nn.Module) -> tuple[str, ...] | None:
        return gate_up(module)

    def candidate(self, module: nn.Module) -> bool:
        """A module whose ``forward`` has a gated product of its children."""
        return bool(gated_products(module))

    def module_refusal(self, module: nn.Module) -> str | None:
        return refusal(module)
