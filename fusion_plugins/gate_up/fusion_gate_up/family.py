"""``gate_up``: gated MLPs run their ``gate_proj``/``up_proj`` as one merged GEMM.

A gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))`` (SwiGLU, GeGLU: Llama, Mistral,
Qwen, Gemma and most decoder LLMs) reads ``x`` twice; the fused module computes
``x @ [Wgate; Wup]^T`` once. The family does not copy any MLP ``forward``: the fused class keeps
the original one, and its ``fusion_finalize`` replaces ``gate_proj`` and ``up_proj`` by slices
of one merged projection (see :mod:`fusion_core.merged`). The two calls on the same input
share one GEMM; any other call is answered from that projection's own rows, so the activation,
the product and ``down_proj`` run exactly as before. ``down_proj`` is untouched.

Why slices rather than a new ``forward`` (``down(act(gu[:, :n]) * gu[:, n:])``): a rewritten
forward is only right for MLPs whose forward is exactly that expression, which cannot be
checked on a module instance (some scale, clamp, drop out or route between the calls). The
slices are exact for any forward; the cost is a Python-level cache check per projection call.

Checkpoint layout: ``gate_proj.weight`` and ``up_proj.weight`` are concatenated along dim 0
into ``gate_up_proj.weight`` on load and split back on save; the biases likewise when both
have one.

Refused (``is_fusable`` is False):

- activations the family does not know as elementwise (anything but the activations of
  ``transformers.activations``, the elementwise ``torch.nn`` activations and the matching
  ``torch.nn.functional`` functions; see :func:`is_elementwise_activation`), or no activation
  attribute at all (``act_fn``, ``act``, ``activation_fn``, ``activation``): the module is not
  a recognised gated MLP;
- shapes that are not a gated MLP (gate and up of different widths or inputs, ``down_proj``
  not reading their width);
- projections that are not plain ``nn.Linear``, or are shared; tensors of different dtypes; a
  bias on one of gate/up but not the other;
- modules that already have a ``gate_up_proj`` (Phi-3 style MLPs are not matched at all: they
  have no ``gate_proj``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fusion_core import Concat, FamilyOptions, FusionFamily, WeightTransform
from fusion_core.merged import MergedProjectionsMixin, is_plain_linear, merge_refusal
from fusion_core.parallel.rules import PackedColwise

PROJECTIONS = ("gate_proj", "up_proj")
MERGED = "gate_up_proj"
ACTIVATION_ATTRIBUTES = ("act_fn", "act", "activation_fn", "activation")

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



def activation(module: nn.Module) -> Any:
    for name in ACTIVATION_ATTRIBUTES:
        act = getattr(module, name, None)
        if act is not None:
            return act
    return None


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` cannot run a merged gate/up projection exactly and usefully; None when it can."""
    gate, up, down = (module._modules.get(name) for name in ("gate_proj", "up_proj", "down_proj"))
    if gate is None or up is None or down is None:
        return "no gate_proj/up_proj/down_proj children"
    if not all(is_plain_linear(m) for m in (gate, up, down)):
        return "a projection is not a plain nn.Linear"
    act = activation(module)
    if act is None:
        return f"no activation attribute ({', '.join(ACTIVATION_ATTRIBUTES)})"
    if not is_elementwise_activation(act):
        return f"unknown activation {type(act).__qualname__}: not a recognised gated MLP"
    if gate is up or gate.weight is up.weight:
        return "gate and up share a module or a weight"
    if gate.in_features != up.in_features or gate.out_features != up.out_features:
        return "gate and up differ in shape (not a gated MLP)"
    if down.in_features != gate.out_features:
        return "down_proj does not read the gate/up width"
    if (gate.bias is None) != (up.bias is None):
        return "a bias on one of gate/up but not the other"
    return merge_refusal(module, (gate, up), MERGED)


class GateUpMixin(MergedProjectionsMixin):
    """The fused behaviour mixed into an MLP subclass: gate and up share one merged GEMM."""

    projections = PROJECTIONS
    container = MERGED


class GateUpFamily(FusionFamily[GateUpOptions]):
    """Gated MLP gate_proj/up_proj run as one merged projection (one GEMM instead of two)."""

    name = "gate_up"
    options_model = GateUpOptions
    fused_mixin = GateUpMixin
    #: Under a tensor-parallel plan with gate_proj/up_proj colwise, each rank merges its own rows.
    tensor_parallel = PackedColwise(PROJECTIONS, MERGED)
    target_modules_patterns = ()

    def is_fusable(self, module: nn.Module, options: GateUpOptions) -> bool:
        return refusal(module) is None

    def refusal(self, module: nn.Module, options: GateUpOptions) -> str | None:
        """The reason for a module with the projections this family merges; None for the rest."""
        return refusal(module) if all(name in module._modules for name in (*PROJECTIONS, "down_proj")) else None

    def make_transforms(self, config: Any, options: GateUpOptions) -> list[WeightTransform]:
        return [
            WeightTransform(tuple(f"{p}.weight" for p in PROJECTIONS), (f"{MERGED}.weight",), Concat(n=2, dim=0)),
            WeightTransform(
                tuple(f"{p}.bias" for p in PROJECTIONS), (f"{MERGED}.bias",), Concat(n=2, dim=0), optional=True
            ),
        ]
