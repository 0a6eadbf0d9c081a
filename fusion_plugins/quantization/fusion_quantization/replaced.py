"""What the quantizers that replace ``nn.Linear`` modules at load share (:mod:`~fusion_quantization.bnb_int8`,
:mod:`~fusion_quantization.bnb_4bit`, :mod:`~fusion_quantization.quanto_bytes`).

transformers replaces q, k and v by the quantizer's own layers while the checkpoint is read; each
of those modules finds the plan's weight concatenations over such layers (:func:`quantized_parts`)
before the conversion, takes out what the conversion cannot carry (a shape-only stand-in takes the
weight's place where it must, :func:`leave_stand_ins`), and after the conversion replaces the merged
container by the quantizer's layer over the merged state (:func:`replace_container`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion_core.transforms import BoundTransform, ModulePlan


@dataclass(frozen=True)
class QuantizedParts:
    """One weight concatenation of a plan whose parts include a quantizer's layers."""

    bound: BoundTransform
    names: tuple[str, ...]
    layers: list[Any]
    where: str

    @property
    def container(self) -> str:
        """The merged container's path in the fused module (``qkv_proj``)."""
        return self.bound.targets[0].name.rpartition(".")[0]

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(int(spec.shape[0]) for spec in self.bound.sources)


def quantized_parts(module: nn.Module, plan: ModulePlan, is_layer: Callable[[nn.Module], bool]
                    ) -> Iterator[QuantizedParts]:
    """Each weight concatenation of ``plan`` one of whose parts ``is_layer`` recognises."""
    for bound in plan.transforms:
        leaves = [spec.name for spec in bound.sources]
        if not leaves or not all(leaf.endswith(".weight") for leaf in leaves):
            continue
        names = tuple(leaf.rpartition(".")[0] for leaf in leaves)
        layers: list[Any] = [module.get_submodule(name) for name in names]
        if any(is_layer(layer) for layer in layers):
            yield QuantizedParts(bound, names, layers, f"family {plan.family!r}, module {plan.path!r}")


def leave_stand_ins(parts: QuantizedParts) -> None:
    """Put a stand-in of the plan's shape (a zero-stride view of one byte) in each part's weight: the conversion
    concatenates it as the plan says, and :func:`replace_container` then drops the result."""
    for layer, spec in zip(parts.layers, parts.bound.sources, strict=True):
        stand_in = torch.zeros((), dtype=torch.uint8, device=layer.weight.device).expand(spec.shape)
        layer._parameters["weight"] = nn.Parameter(stand_in, requires_grad=False)


def replace_container(module: nn.Module, container: str, build: Callable[[Any], Any]) -> None:
    """Replace the merged ``container`` of ``module`` by ``build(old container)``, keeping the merged bias."""
    parent_path, _, name = container.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    old: Any = parent._modules[name]
    new = build(old)
    if old.bias is not None:
        new.bias = old.bias
    parent._modules[name] = new
