"""quanto's 8-bit weights (``QuantoConfig(weights="int8")`` or ``"float8"``) merged exactly at load.

transformers replaces each ``nn.Linear`` by quanto's ``QLinear`` and freezes it: the weight becomes
a ``WeightQBytesTensor`` of 8-bit rows (``_data``) and one scale per output row (``_scale``,
``axis=0``). A merged layer whose rows and scales are the parts' concatenated computes, column
for column, what the parts computed. The tensor records its own size in its flatten context, so
the conversion's generic concatenation (:func:`fusion_core.wrapped.concat`) cannot rebuild it;
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

from fusion_core.errors import FusionLoadError
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


def _bytes_weight(layer: Any) -> Any:
    weight = layer._parameters.get("weight")
    return weight if type(weight).__name__ == "WeightQBytesTensor" else None


def take_rows(found: Sequence[QuantizedParts]) -> list[RowsMerge]:
    """Before the conversion: take the quantized rows and scales out of each weight concatenation whose parts are
    frozen quanto layers, leaving a stand-in of the plan's shape in each part."""
    merges = []
    for parts in (p for p in found if p.of(is_quanto_linear)):
        layers = parts.layers
        weights: list[Any] = [_bytes_weight(layer) if is_quanto_linear(layer) else None for layer in layers]
        if any(weight is None for weight in weights):
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} are not all quanto layers with 8-bit per-row "
                                  "weights; they cannot share one merged quantized weight")
        refusal = _unmergeable(weights, layers)
        if refusal is not None:
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} cannot be merged exactly: {refusal}; load "
                                  "without quantization_config and quantize after, or leave the family out")
        merges.append(RowsMerge(parts.layout, torch.cat([w._data for w in weights]),
                                torch.cat([w._scale for w in weights]), weights[0].qtype))
        leave_stand_ins(parts)
    return merges


def _unmergeable(weights: Sequence[Any], layers: Sequence[Any]) -> str | None:
    """Why the parts' quantized weights cannot be concatenated into the merged layer's exactly, or None."""
    if any(w.axis != 0 or w._scale.shape != (w.shape[0], 1) for w in weights):
        return "their scales are not one per output row"
    if len({w.qtype.name for w in weights}) != 1:
        return f"they use different weight types {[w.qtype.name for w in weights]}"
    if any(layer.activation_qtype is not None for layer in layers):
        return "their activations are quantized too, with calibrated per-layer scales"
    return None


def install(module: nn.Module, merges: Sequence[RowsMerge]) -> None:
    """After the conversion: each merged container becomes a frozen ``QLinear`` of the merged rows and scales."""
    if not merges:
        return
    from optimum.quanto.nn import QLinear
    from optimum.quanto.tensor.weights.qbytes import WeightQBytesTensor

    for merge in merges:
        def build(old: Any, merge: RowsMerge = merge) -> Any:
            size = merge.data.shape
            new = QLinear(size[1], size[0], bias=old.bias is not None, device=merge.data.device,
                          dtype=merge.scale.dtype, weights=merge.qtype)
            weight = WeightQBytesTensor(merge.qtype, 0, size, (size[1], 1), merge.data, merge.scale, None)
            new.weight = nn.Parameter(weight, requires_grad=False)
            new.register_state_dict_post_hook(functools.partial(present_parts, merge.layout))
            return new

        replace_container(module, merge.layout.container, build)


def present_parts(layout: PartsLayout, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Mapping[str, Any]) -> None:
    """The merged ``QLinear``'s weight and scale entries written as each part's (a module-level function with its
    layout bound, so a model with the hook still pickles)."""
    data, scale = state_dict.pop(f"{prefix}weight._data"), state_dict.pop(f"{prefix}weight._scale")
    extra = {name: state_dict.pop(f"{prefix}{name}") for name in ("input_scale", "output_scale")
             if f"{prefix}{name}" in state_dict}
    owner = layout.owner_prefix(prefix)
    for part, start, stop in layout.ranges():
        state_dict[f"{owner}{part}.weight._data"] = data[start:stop].clone()
        state_dict[f"{owner}{part}.weight._scale"] = scale[start:stop].clone()
        for name, value in extra.items():
            state_dict[f"{owner}{part}.{name}"] = value.clone()
