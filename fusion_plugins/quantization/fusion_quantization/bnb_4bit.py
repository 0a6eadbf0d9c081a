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

from fusion_core import FusionLoadError, ModulePlan, SaveError
from fusion_quantization.compat import Packed4bit, linear_4bit, part_block_scales, read_4bit, state_4bit_entries
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
    """One merged container of 4-bit parts: where its parts are, and the merged packed bytes and block scales,
    quantized as ``like`` (the first part)."""

    layout: PartsLayout
    in_features: int
    packed: torch.Tensor
    absmax: torch.Tensor
    like: Packed4bit


def _same(values: Sequence[object]) -> bool:
    return all(value == values[0] for value in values[1:])


def take_packed(found: Sequence[QuantizedParts]) -> list[PackedMerge]:
    """Before the conversion: take the packed weights out of each weight concatenation whose parts are 4-bit
    layers, leaving a stand-in of the plan's shape in each part."""
    merges = []
    for parts in (p for p in found if p.of(is_4bit_linear)):
        states = [read_4bit(layer) if is_4bit_linear(layer) else None for layer in parts.layers]
        if any(state is None for state in states):
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} are not all 4-bit-quantized bitsandbytes "
                                  "layers; they cannot share one merged 4-bit weight")
        read = [state for state in states if state is not None]
        refusal = _unmergeable(read, parts.layout.shapes)
        if refusal is not None:
            raise FusionLoadError(f"{parts.where}: {list(parts.names)} cannot be merged exactly: {refusal}; load "
                                  "without quantization_config and quantize after, or leave the family out")
        merges.append(PackedMerge(parts.layout, int(parts.layout.shapes[0][1]),
                                  torch.cat([state.packed for state in read]),
                                  torch.cat([state.absmax for state in read]), read[0]))
        leave_stand_ins(parts)
    return merges


def _unmergeable(states: Sequence[Packed4bit], shapes: Sequence[tuple[int, ...]]) -> str | None:
    """Why the parts' 4-bit states cannot be concatenated into the merged layer's exactly, or None."""
    if any(state.nested for state in states):
        return ("double quantization (bnb_4bit_use_double_quant) quantizes each layer's block scales around their "
                "mean, so a merged layer's nested scales would span parts")
    if any(state.repacked_for_cpu for state in states):
        return "they are repacked for bitsandbytes' CPU kernel already"
    if any(state.absmax.dim() != 1 for state in states):
        return ("their block scales are in the (blocks per row, rows) bfloat16 layout bitsandbytes' avx512-bf16 CPU "
                "kernel leaves them in (a checkpoint saved after that kernel ran)")
    for what, values in (("quant types", [s.quant_type for s in states]),
                         ("block sizes", [s.blocksize for s in states]), ("dtypes", [s.dtype for s in states]),
                         ("compute dtypes", [s.compute_dtype for s in states]),
                         ("storage dtypes", [s.quant_storage for s in states])):
        if not _same(values):
            return f"they use different {what} {values}"
    if not all(torch.equal(state.code, states[0].code) for state in states):
        return "they use different code books"
    partial = [shape for shape in shapes if not whole_blocks(shape, states[0].blocksize)]
    if partial:
        return (f"a part of shape {partial[0]} does not fill whole blocks of {states[0].blocksize} elements, so the "
                "merged layer's blocks would span parts")
    return None


def install(module: nn.Module, merges: Sequence[PackedMerge]) -> None:
    """After the conversion: each merged container becomes a ``Linear4bit`` of the merged packed weight and scales."""
    for merge in merges:
        def build(old: Any, merge: PackedMerge = merge) -> nn.Module:
            shape = (sum(merge.layout.rows), merge.in_features)
            new = linear_4bit(merge.packed, merge.absmax, shape, merge.like, old.bias is not None)
            new.register_state_dict_post_hook(functools.partial(present_parts, merge.layout))  # type: ignore[no-untyped-call]
            return new

        replace_container(module, merge.layout.container, build)


def present_parts(layout: PartsLayout, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Mapping[str, Any]) -> None:
    """The merged ``Linear4bit``'s weight entries written as each part's, as the unfused layers save them (a
    module-level function with its layout bound, so a model with the hook still pickles).

    The packed bytes are what bitsandbytes just wrote, the scales the layer's state: its ``_save_to_state_dict``
    undoes the CPU kernel's repacking of both first.
    """
    key = f"{prefix}weight"
    packed = state_dict.pop(key)
    for entry in [k for k in state_dict if k.startswith(f"{key}.")]:
        state_dict.pop(entry)
    merged = read_4bit(module)
    if merged is None:
        raise SaveError(f"{prefix.rstrip('.')!r} is no longer a quantized bitsandbytes Linear4bit; it cannot be saved "
                        f"as the parts {list(layout.parts)}")
    in_features, total = merged.shape[1], merged.shape[0] * merged.shape[1]
    owner = layout.owner_prefix(prefix)
    for part, start, stop in layout.ranges():
        # Every part fills whole blocks (checked at load), so its elements start and end on a byte and a block.
        first, end = start * in_features * packed.shape[0] // total, stop * in_features * packed.shape[0] // total
        state_dict[f"{owner}{part}.weight"] = packed[first:end].clone()
        entries = state_4bit_entries(part_block_scales(merged, start, stop), (stop - start, in_features), merged)
        for name, value in entries.items():
            state_dict[f"{owner}{part}.weight.{name}"] = value
