"""What the quantizers that replace ``nn.Linear`` modules at load share (:mod:`~fusion_quantization.bnb_int8`,
:mod:`~fusion_quantization.bnb_4bit`, :mod:`~fusion_quantization.quanto_bytes`).

transformers replaces q, k and v by the quantizer's own layers while the checkpoint is read; each
of those modules finds the plan's weight concatenations over such layers (:func:`quantized_parts`)
once, before the conversion; each of those modules takes out what the conversion cannot carry from
its own (a shape-only stand-in takes the weight's place where it must, :func:`leave_stand_ins`), and
after the conversion replaces the merged container by the quantizer's layer over the merged state
(:func:`replace_container`). The save hooks that write each part's entries back bind only the
tensor-free :class:`PartsLayout` and read the tensors from the module they run on, so a model moved to
another device does not keep its load-time tensors alive through them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion_core import Concat, ModulePlan
from fusion_core.plugin import BoundTransform
from fusion_quantization.detect import package_of

#: Packages whose layers replace ``nn.Linear`` at load (bitsandbytes' ``Linear8bitLt`` / ``Linear4bit``, quanto's
#: ``QLinear``, from ``optimum``).
REPLACING_PACKAGES = frozenset({"bitsandbytes", "optimum"})


@dataclass(frozen=True)
class PartsLayout:
    """Where a merged container's parts are: the container's path, the parts' names and row counts, in order."""

    container: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]

    def ranges(self) -> Iterator[tuple[str, int, int]]:
        """``(part, first row, end row)`` of each part in the merged container."""
        start = 0
        for part, rows in zip(self.parts, self.rows, strict=True):
            yield part, start, start + rows
            start += rows

    def owner_prefix(self, container_prefix: str) -> str:
        """The fused module's ``state_dict`` prefix, from the container's (``...self_attn.qkv_proj.``)."""
        return container_prefix[: len(container_prefix) - len(self.container) - 1]


@dataclass(frozen=True)
class QuantizedParts:
    """One weight concatenation of a plan whose parts include a quantizer's layers."""

    bound: BoundTransform
    names: tuple[str, ...]
    layers: list[Any]
    where: str

    @property
    def layout(self) -> PartsLayout:
        return layout_of(self.bound)

    def of(self, is_layer: Callable[[nn.Module], bool]) -> bool:
        """Whether one of the parts is a layer ``is_layer`` recognises."""
        return any(is_layer(layer) for layer in self.layers)


def layout_of(bound: BoundTransform) -> PartsLayout:
    """Where the parts of one weight concatenation (``q_proj.weight``, ... -> ``qkv_proj.weight``) are."""
    return PartsLayout(bound.targets[0].name.rpartition(".")[0],
                       tuple(spec.name.rpartition(".")[0] for spec in bound.sources),
                       tuple(int(spec.shape[0]) for spec in bound.sources))


def weight_rows(plan: ModulePlan) -> tuple[PartsLayout, ...]:
    """The layouts of ``plan``'s concatenations of weight rows (``Concat`` along dim 0 of ``.weight`` tensors): the
    merged containers a quantizer may replace by its own module, as it replaces the parts on the unfused model."""
    return tuple(layout_of(bound) for bound in plan.transforms
                 if isinstance(bound.op, Concat) and bound.op.dim == 0 and bound.sources
                 and all(spec.name.endswith(".weight") for spec in (*bound.sources, *bound.targets)))


def quantized_parts(module: nn.Module, plan: ModulePlan) -> list[QuantizedParts]:
    """Each weight concatenation of ``plan`` one of whose parts is a replacing quantizer's layer."""
    found = []
    for bound in plan.transforms:
        leaves = [spec.name for spec in bound.sources]
        if not leaves or not all(leaf.endswith(".weight") for leaf in leaves):
            continue
        names = tuple(leaf.rpartition(".")[0] for leaf in leaves)
        layers: list[Any] = [module.get_submodule(name) for name in names]
        if any(package_of(type(layer)) in REPLACING_PACKAGES for layer in layers):
            found.append(QuantizedParts(bound, names, layers, f"family {plan.family!r}, module {plan.path!r}"))
    return found


def leave_stand_ins(parts: QuantizedParts) -> None:
    """Put a stand-in of the plan's shape (a zero-stride view of one byte) in each part's weight: the conversion
    concatenates it as the plan says, and :func:`replace_container` then drops the result."""
    for layer, spec in zip(parts.layers, parts.bound.sources, strict=True):
        stand_in = torch.zeros((), dtype=torch.uint8, device=layer.weight.device).expand(spec.shape)
        layer._parameters["weight"] = nn.Parameter(stand_in, requires_grad=False)


def replace_container(module: nn.Module, container: str, build: Callable[[Any], Any]) -> None:
    """Replace the merged ``container`` of ``module`` by ``build(old container)``, keeping the merged bias.

    The new container takes the training mode of the module holding it (the model's: the container the
    conversion built is left in a new module's training mode): the quantizers' kernels differ by mode
    (bitsandbytes' 4-bit avx512-bf16 CPU kernel runs in eval mode only), so it runs as the unfused layers do.
    """
    parent_path, _, name = container.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    old: Any = parent._modules[name]
    new = build(old)
    if old.bias is not None:
        new.bias = old.bias
    new.train(parent.training)
    parent._modules[name] = new
