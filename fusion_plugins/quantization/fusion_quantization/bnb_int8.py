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

from fusion_core import FusionLoadError
from fusion_quantization.compat import INT8_SAVED, int8_linear, int8_part_entries, int8_scales, int8_settings
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


def collect(found: Sequence[QuantizedParts]) -> list[Int8Merge]:
    """Before the conversion: the scales of each weight concatenation whose parts are LLM.int8 layers."""
    merges = []
    for parts in (p for p in found if p.of(is_int8_linear)):
        layers = parts.layers
        scales = [int8_scales(layer) if is_int8_linear(layer) else None for layer in layers]
        if any(scale is None for scale in scales) or any(int8_settings(layer)[1] for layer in layers):
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} are not all int8-quantized bitsandbytes "
                                  "layers; they cannot share one merged int8 weight")
        thresholds = {int8_settings(layer)[0] for layer in layers}
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
    for merge in merges:
        def build(old: Any, merge: Int8Merge = merge) -> nn.Module:
            return int8_linear(old.weight.data, merge.scales, merge.threshold, old.bias is not None)

        replace_container(module, merge.layout.container, build)
    module.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
        functools.partial(present_part_scales, tuple(merge.layout for merge in merges)))


def present_part_scales(layouts: tuple[PartsLayout, ...], module: nn.Module, state_dict: dict[str, Any],
                        prefix: str, local_metadata: Mapping[str, Any]) -> None:
    """The merged container's ``SCB`` / ``weight_format`` entries written as each part's, as the unfused layers
    save them (a module-level function with its layout bound, so a model with the hook still pickles)."""
    for layout in layouts:
        for name in INT8_SAVED:
            state_dict.pop(f"{prefix}{layout.container}.{name}", None)
        scales = int8_scales(module.get_submodule(layout.container))
        if scales is None:
            continue
        for part, start, stop in layout.ranges():
            for name, value in int8_part_entries(scales[start:stop].clone()).items():
                state_dict[f"{prefix}{part}.{name}"] = value
