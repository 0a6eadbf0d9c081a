"""quanto's 8-bit weights (``QuantoConfig(weights="int8")`` or ``"float8"``) merged exactly at load.

transformers replaces each ``nn.Linear`` by quanto's ``QLinear`` and freezes it: the weight becomes
a ``WeightQBytesTensor`` of 8-bit rows and one scale per output row (``axis=0``; read through
:mod:`fusion_quantization.compat`). A merged layer whose rows and scales are the parts' concatenated computes, column
for column, what the parts computed. The tensor records its own size in its flatten context, so
the conversion's generic concatenation (:func:`fusion_core.plugin.concat`) cannot rebuild it;
instead the rows and scales are taken out of the parts before the conversion
(:func:`take_rows`, leaving a shape-only stand-in for the plan's concatenation) and the container
becomes a frozen ``QLinear`` over them after it (:func:`install`). A ``state_dict`` hook on it
(:func:`present_parts`) gives each part's entries under the part's name, as the unfused layers
give them (transformers does not save quanto models; the state dict is still what tools read).
Other schemes (int4 / int2 group-wise packed weights, quantized activations with calibrated
scales) are refused before any weight is read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion_core import FusionLoadError
from fusion_quantization.compat import (
    QUANTO_SAVED,
    QUANTO_SAVED_SCALES,
    QuantoBytes,
    quanto_linear,
    quanto_part_entries,
    read_quanto,
)
from fusion_quantization.detect import package_of
from fusion_quantization.replaced import PartsLayout, QuantizedParts, leave_stand_ins, replace_container

#: The ``QuantoConfig.weights`` values whose weights are per-row scaled bytes, merged exactly.
MERGED_WEIGHTS = frozenset({"int8", "float8"})


def is_quanto_linear(module: nn.Module) -> bool:
    """quanto's ``QLinear`` (matched by name: quanto is imported only where it is used)."""
    return type(module).__name__ == "QLinear" and package_of(type(module)) == "optimum"


@dataclass(frozen=True)
class RowsMerge:
    """One merged container of quanto parts: where its parts are, and the merged rows and scales."""

    layout: PartsLayout
    data: torch.Tensor
    scale: torch.Tensor
    qtype: Any


def take_rows(found: Sequence[QuantizedParts]) -> list[RowsMerge]:
    """Before the conversion: take the quantized rows and scales out of each weight concatenation whose parts are
    frozen quanto layers, leaving a stand-in of the plan's shape in each part."""
    merges = []
    for parts in (p for p in found if p.of(is_quanto_linear)):
        weights = [read_quanto(layer) if is_quanto_linear(layer) else None for layer in parts.layers]
        if any(weight is None for weight in weights):
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} are not all quanto layers with 8-bit per-row "
                                  "weights; they cannot share one merged quantized weight")
        read = [weight for weight in weights if weight is not None]
        refusal = _unmergeable(read)
        if refusal is not None:
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} cannot be merged exactly: {refusal}; load "
                                  "without quantization_config and quantize after, or leave the family out")
        merges.append(RowsMerge(parts.layout, torch.cat([w.data for w in read]), torch.cat([w.scale for w in read]),
                                read[0].qtype))
        leave_stand_ins(parts)
    return merges


def _unmergeable(weights: Sequence[QuantoBytes]) -> str | None:
    """Why the parts' quantized weights cannot be concatenated into the merged layer's exactly, or None."""
    if any(w.axis != 0 or w.scale.shape != (w.data.shape[0], 1) for w in weights):
        return "their scales are not one per output row"
    if len({w.qtype_name for w in weights}) != 1:
        return f"they use different weight types {[w.qtype_name for w in weights]}"
    if any(w.activation_type is not None for w in weights):
        return "their activations are quantized too, with calibrated per-layer scales"
    return None


def install(module: nn.Module, merges: Sequence[RowsMerge]) -> None:
    """After the conversion: each merged container becomes a frozen ``QLinear`` of the merged rows and scales."""
    for merge in merges:
        def build(old: Any, merge: RowsMerge = merge) -> nn.Module:
            new = quanto_linear(merge.data, merge.scale, merge.qtype, old.bias is not None)
            new.register_state_dict_post_hook(functools.partial(present_parts, merge.layout))  # type: ignore[no-untyped-call]
            return new

        replace_container(module, merge.layout.container, build)


def present_parts(layout: PartsLayout, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Mapping[str, Any]) -> None:
    """The merged ``QLinear``'s weight and scale entries written as each part's (a module-level function with its
    layout bound, so a model with the hook still pickles)."""
    data, scale = (state_dict.pop(f"{prefix}{name}") for name in QUANTO_SAVED)
    extra = {name: state_dict.pop(f"{prefix}{name}") for name in QUANTO_SAVED_SCALES if f"{prefix}{name}" in state_dict}
    owner = layout.owner_prefix(prefix)
    for part, start, stop in layout.ranges():
        for name, value in quanto_part_entries(data[start:stop].clone(), scale[start:stop].clone()).items():
            state_dict[f"{owner}{part}.{name}"] = value
        for name, value in extra.items():
            state_dict[f"{owner}{part}.{name}"] = value.clone()
