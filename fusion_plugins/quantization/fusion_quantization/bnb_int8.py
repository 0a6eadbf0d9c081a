"""bitsandbytes LLM.int8 (``BitsAndBytesConfig(load_in_8bit=True)``) layers merged exactly at load.

transformers replaces each ``nn.Linear`` by bitsandbytes' ``Linear8bitLt`` before the checkpoint
is read; its weight holds int8 rows (``CB``) and one float scale per row (``SCB``). The matmul
scales every output column by its own row's scale (outlier input columns, above ``threshold``,
run in float on the dequantized rows), so a merged layer whose rows and scales are the parts'
concatenated computes, column for column, what the parts computed.

fusion-core's conversion concatenates the int8 rows into the merged container (a plain
``Concat``); the scales live outside the weight tensor, so they are read from the parts before
the conversion (:func:`collect`) and the container is then replaced by a ``Linear8bitLt`` holding
both (:func:`install`). A ``state_dict`` hook (:func:`present_part_scales`) writes the scales back
under each part's name (``q_proj.SCB``, ``q_proj.weight_format``), so saving gives the keys and
bytes the unfused model saves.
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
from fusion_quantization.replaced import PartsLayout, QuantizedParts, replace_container


def is_int8_linear(module: nn.Module) -> bool:
    """bitsandbytes' ``Linear8bitLt`` (matched by name: bitsandbytes is imported only where it is used)."""
    return type(module).__name__ == "Linear8bitLt" and package_of(type(module)) == "bitsandbytes"


@dataclass(frozen=True)
class Int8Merge:
    """One merged container of LLM.int8 parts: where its parts are, their scales concatenated, the threshold."""

    layout: PartsLayout
    scales: torch.Tensor
    threshold: float


def _scale(layer: nn.Module) -> torch.Tensor | None:
    weight_scale = getattr(layer.weight, "SCB", None)
    return weight_scale if weight_scale is not None else getattr(layer.state, "SCB", None)


def collect(found: Sequence[QuantizedParts]) -> list[Int8Merge]:
    """Before the conversion: the scales of each weight concatenation whose parts are LLM.int8 layers."""
    merges = []
    for parts in (p for p in found if p.of(is_int8_linear)):
        layers = parts.layers
        scales = [_scale(layer) if is_int8_linear(layer) else None for layer in layers]
        if any(scale is None for scale in scales) or any(layer.state.has_fp16_weights for layer in layers):
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} are not all int8-quantized bitsandbytes "
                                  "layers; they cannot share one merged int8 weight")
        thresholds = {float(layer.state.threshold) for layer in layers}
        if len(thresholds) != 1:
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} use different outlier thresholds "
                                  f"{sorted(thresholds)}")
        merges.append(Int8Merge(parts.layout, torch.cat([s.detach().clone() for s in scales if s is not None]),
                                thresholds.pop()))
    return merges


def install(module: nn.Module, merges: Sequence[Int8Merge]) -> None:
    """After the conversion: each merged container becomes a ``Linear8bitLt`` of the merged rows and scales."""
    if not merges:
        return
    from bitsandbytes.nn import Int8Params, Linear8bitLt

    for merge in merges:
        def build(old: Any, merge: Int8Merge = merge) -> Any:
            rows = old.weight.data
            new = Linear8bitLt(rows.shape[1], rows.shape[0], bias=old.bias is not None, has_fp16_weights=False,
                               threshold=merge.threshold, device=rows.device)
            new.weight = Int8Params(rows, requires_grad=False, has_fp16_weights=False, CB=rows,
                                    SCB=merge.scales.to(rows.device))
            return new

        replace_container(module, merge.layout.container, build)
    module.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
        functools.partial(present_part_scales, tuple(merge.layout for merge in merges)))


def present_part_scales(layouts: tuple[PartsLayout, ...], module: nn.Module, state_dict: dict[str, Any],
                        prefix: str, local_metadata: Mapping[str, Any]) -> None:
    """The merged container's ``SCB`` / ``weight_format`` entries written as each part's, as the unfused layers
    save them (a module-level function with its layout bound, so a model with the hook still pickles)."""
    for layout in layouts:
        key = f"{prefix}{layout.container}"
        state_dict.pop(f"{key}.SCB", None)
        state_dict.pop(f"{key}.weight_format", None)
        scales = _scale(module.get_submodule(layout.container))
        if scales is None:
            continue
        for part, start, stop in layout.ranges():
            state_dict[f"{prefix}{part}.SCB"] = scales[start:stop].clone()
            state_dict[f"{prefix}{part}.weight_format"] = torch.tensor(0, dtype=torch.uint8)
