"""bitsandbytes 4-bit (``BitsAndBytesConfig(load_in_4bit=True)``, nf4 or fp4) layers merged exactly at load.

bitsandbytes' ``Linear4bit`` quantizes its weight flattened, in blocks of ``blocksize`` elements
(64), one float scale (``absmax``) per block, and packs two 4-bit codes per byte. A row-major
flattening of q, k and v concatenated by rows is the concatenation of their flattenings, so when
every part's element count is a multiple of the block size, the merged layer's blocks are the
parts' blocks: its packed bytes and scales are the parts' concatenated, and dequantizing it gives,
row for row, what dequantizing the parts gives. A part whose last block is partial, double
quantization (``bnb_4bit_use_double_quant``: the scales are quantized again, in blocks of 256
around an offset that is the mean of the layer's scales, so a merged layer's would span parts),
and parts quantized differently are refused.

The packed bytes do not have the plan's shape, so before the conversion (:func:`take_packed`) they
are taken out of the parts and a shape-only stand-in (a zero-stride view of one byte) goes through
the plan's concatenation; after it (:func:`install`) the container becomes a ``Linear4bit`` over the
merged bytes and scales. A ``state_dict`` hook on it (:func:`present_parts`) writes each part's
bytes, scales and packed quantization state under the part's name, so saving gives the keys and
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
from fusion_core.transforms import ModulePlan
from fusion_quantization.detect import package_of
from fusion_quantization.replaced import PartsLayout, QuantizedParts, leave_stand_ins, replace_container

#: The block size bitsandbytes' ``Params4bit`` quantizes with when none is given (transformers gives none).
BLOCKSIZE = 64


def whole_blocks(shape: tuple[int, ...], blocksize: int) -> bool:
    """Whether a weight of ``shape`` fills whole 4-bit blocks: its flattening then ends where a block ends."""
    return shape[0] * shape[1] % blocksize == 0


def fills_whole_blocks(plan: ModulePlan, blocksize: int) -> bool:
    """Whether every weight ``plan`` concatenates fills whole blocks (checked from the plan, before any weight is
    read)."""
    return all(whole_blocks(spec.shape, blocksize) for bound in plan.transforms for spec in bound.sources
               if spec.name.endswith(".weight") and len(spec.shape) == 2)


def is_4bit_linear(module: nn.Module) -> bool:
    """bitsandbytes' ``Linear4bit`` or a subclass (matched by name: bitsandbytes is imported only where it is used)."""
    return any(cls.__name__ == "Linear4bit" and package_of(cls) == "bitsandbytes" for cls in type(module).__mro__)


@dataclass(frozen=True)
class PackedMerge:
    """One merged container of 4-bit parts: where its parts are, and the merged state."""

    layout: PartsLayout
    in_features: int
    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    blocksize: int
    quant_type: str
    dtype: torch.dtype
    quant_storage: torch.dtype
    compute_dtype: torch.dtype | None


def _same(values: Sequence[object]) -> bool:
    return all(value == values[0] for value in values[1:])


def take_packed(found: Sequence[QuantizedParts]) -> list[PackedMerge]:
    """Before the conversion: take the packed weights out of each weight concatenation whose parts are 4-bit
    layers, leaving a stand-in of the plan's shape in each part."""
    merges = []
    for parts in (p for p in found if p.of(is_4bit_linear)):
        layers = parts.layers
        states: list[Any] = [getattr(layer.weight, "quant_state", None) if is_4bit_linear(layer) else None
                             for layer in layers]
        if any(state is None for state in states):
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} are not all 4-bit-quantized bitsandbytes "
                                  "layers; they cannot share one merged 4-bit weight")
        refusal = _unmergeable(states, [spec.shape for spec in parts.bound.sources], layers)
        if refusal is not None:
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} cannot be merged exactly: {refusal}; load "
                                  "without quantization_config and quantize after, or leave the family out")
        first, layer = states[0], layers[0]
        merges.append(PackedMerge(
            parts.layout, int(parts.bound.sources[0].shape[1]),
            torch.cat([layer.weight.data for layer in layers]), torch.cat([state.absmax for state in states]),
            first.code, int(first.blocksize), str(first.quant_type), first.dtype, layer.weight.quant_storage,
            layer.compute_dtype))
        leave_stand_ins(parts)
    return merges


def _unmergeable(states: Sequence[Any], shapes: Sequence[tuple[int, ...]], layers: Sequence[Any]) -> str | None:
    """Why the parts' 4-bit states cannot be concatenated into the merged layer's exactly, or None."""
    if any(state.nested for state in states):
        return ("double quantization (bnb_4bit_use_double_quant) quantizes each layer's block scales around their "
                "mean, so a merged layer's nested scales would span parts")
    if any(getattr(state, "packing_format_for_cpu", False) for state in states):
        return "they are repacked for bitsandbytes' CPU kernel already"
    for what, values in (("quant types", [s.quant_type for s in states]),
                         ("block sizes", [s.blocksize for s in states]), ("dtypes", [s.dtype for s in states]),
                         ("compute dtypes", [m.compute_dtype for m in layers]),
                         ("storage dtypes", [m.weight.quant_storage for m in layers])):
        if not _same(values):
            return f"they use different {what} {values}"
    if not all(torch.equal(state.code, states[0].code) for state in states):
        return "they use different code books"
    partial = [shape for shape in shapes if not whole_blocks(shape, int(states[0].blocksize))]
    if partial:
        return (f"a part of shape {partial[0]} does not fill whole blocks of {states[0].blocksize} elements, so the "
                "merged layer's blocks would span parts")
    return None


def install(module: nn.Module, merges: Sequence[PackedMerge]) -> None:
    """After the conversion: each merged container becomes a ``Linear4bit`` of the merged packed weight and scales."""
    if not merges:
        return
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Linear4bit, Params4bit

    for merge in merges:
        def build(old: Any, merge: PackedMerge = merge) -> Any:
            out_features = sum(merge.layout.rows)
            new = Linear4bit(merge.in_features, out_features, bias=old.bias is not None,
                             compute_dtype=merge.compute_dtype, compress_statistics=False, quant_type=merge.quant_type,
                             quant_storage=merge.quant_storage, device=merge.packed.device)
            state = QuantState(merge.absmax, shape=torch.Size((out_features, merge.in_features)), code=merge.code,
                               blocksize=merge.blocksize, quant_type=merge.quant_type, dtype=merge.dtype)
            new.weight = Params4bit(merge.packed, requires_grad=False, quant_state=state, blocksize=merge.blocksize,
                                    compress_statistics=False, quant_type=merge.quant_type,
                                    quant_storage=merge.quant_storage, module=new, bnb_quantized=True)
            new.quant_state = state
            new.register_state_dict_post_hook(functools.partial(present_parts, merge.layout))
            return new

        replace_container(module, merge.layout.container, build)


def present_parts(layout: PartsLayout, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Mapping[str, Any]) -> None:
    """The merged ``Linear4bit``'s weight entries written as each part's, as the unfused layers save them (a
    module-level function with its layout bound, so a model with the hook still pickles).

    It reads what bitsandbytes just wrote and the layer's quantization state (its ``_save_to_state_dict``
    undoes the CPU kernel's repacking first).
    """
    from bitsandbytes.functional import QuantState

    key = f"{prefix}weight"
    packed, absmax, code = state_dict.pop(key), state_dict[f"{key}.absmax"], state_dict[f"{key}.quant_map"]
    for entry in [k for k in state_dict if k.startswith(f"{key}.")]:
        state_dict.pop(entry)
    layer: Any = module
    merged = layer.weight.quant_state
    in_features, total = int(merged.shape[1]), int(merged.shape[0]) * int(merged.shape[1])
    owner = layout.owner_prefix(prefix)
    for part, start, stop in layout.ranges():
        # Every part fills whole blocks (checked at load), so its elements start and end on a byte and a block.
        first, end = start * in_features, stop * in_features
        state = QuantState(absmax[first // merged.blocksize:end // merged.blocksize].clone(),
                           shape=torch.Size((stop - start, in_features)), code=code.clone(),
                           blocksize=merged.blocksize, quant_type=merged.quant_type, dtype=merged.dtype)
        state_dict[f"{owner}{part}.weight"] = packed[first * packed.shape[0] // total:end * packed.shape[0] // total
                                                     ].clone()
        for name, value in state.as_dict(packed=True).items():
            state_dict[f"{owner}{part}.weight.{name}"] = value
