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

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion_core import ModulePlan
from fusion_core.plugin import PackedPart
from fusion_quantization.detect import package_of

#: Packages whose layers replace ``nn.Linear`` at load (bitsandbytes' ``Linear8bitLt`` / ``Linear4bit``, quanto's
#: ``QLinear``, from ``optimum``).
REPLACING_PACKAGES = frozenset({"bitsandbytes", "optimum"})


@dataclass(frozen=True)
class PartsLayout:
    """Where a merged container's parts are: the container's path, the parts' names, row counts and weight shapes,
    in order."""

    container: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

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
    """One merged container of a plan whose parts include a quantizer's layers."""

    layout: PartsLayout
    layers: list[Any]
    where: str

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.parts

    def of(self, is_layer: Callable[[nn.Module], bool]) -> bool:
        """Whether one of the parts is a layer ``is_layer`` recognises."""
        return any(is_layer(layer) for layer in self.layers)


def weight_rows(plan: ModulePlan) -> tuple[PartsLayout, ...]:
    """The merged containers of ``plan`` whose weight is the rows of two or more parts' weights, end to end: what a
    quantizer may replace by its own module, as it replaces the parts on the unfused model.

    Read from the plan's packed parts (:meth:`fusion_core.plugin.ModulePlan.packed_parts`), the one source of which
    original tensors live where in a fused one; only the parts' shapes come from the transforms' sources.
    """
    shapes = {spec.name: tuple(spec.shape) for bound in plan.transforms for spec in bound.sources}
    containers: dict[str, list[PackedPart]] = {}
    for part in plan.packed_parts():
        if part.dim == 0 and part.fused.endswith(".weight") and part.original.endswith(".weight"):
            containers.setdefault(part.fused, []).append(part)
    layouts = []
    for fused, parts in containers.items():
        parts.sort(key=lambda part: part.start)
        ends = list(itertools.accumulate(part.length for part in parts))
        if len(parts) < 2 or [part.start for part in parts] != [0, *ends[:-1]]:
            continue
        layouts.append(PartsLayout(fused.rpartition(".")[0], tuple(p.original.rpartition(".")[0] for p in parts),
                                   tuple(p.length for p in parts), tuple(shapes[p.original] for p in parts)))
    return tuple(layouts)


def quantized_parts(module: nn.Module, plan: ModulePlan) -> list[QuantizedParts]:
    """Each merged container of ``plan`` (:func:`weight_rows`) one of whose parts is a replacing quantizer's layer."""
    found = []
    for layout in weight_rows(plan):
        layers: list[Any] = [module.get_submodule(name) for name in layout.parts]
        if any(package_of(type(layer)) in REPLACING_PACKAGES for layer in layers):
            found.append(QuantizedParts(layout, layers, f"family {plan.family!r}, module {plan.path!r}"))
    return found


def leave_stand_ins(parts: QuantizedParts) -> None:
    """Put a stand-in of the plan's shape (a zero-stride view of one byte) in each part's weight: the conversion
    concatenates it as the plan says, and :func:`replace_container` then drops the result."""
    for layer, shape in zip(parts.layers, parts.layout.shapes, strict=True):
        stand_in = torch.zeros((), dtype=torch.uint8, device=layer.weight.device).expand(shape)
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
