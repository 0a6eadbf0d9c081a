"""Tensors over another tensor's memory that are nonetheless their own storage: splitting back without a copy.

A merged projection's parts are slices of one tensor. Presented as views, they would share one
storage, and every checkpoint writer treats tensors that share a storage as tied weights:
transformers' ``save_pretrained`` clones the disjoint ones (4.57: all of them, at once) or drops
all but one, and ``safetensors`` refuses them. Presented as clones, a save holds a second copy of
every merged weight. :func:`alias` gives each part a storage of its own (``torch.frombuffer`` over
the part's bytes) that keeps the merged tensor alive and copies nothing: a save writes the parts
straight from the merged tensor's memory, shard by shard, as plain transformers writes the unfused
model's parameters. Like the parameters in a plain model's ``state_dict()``, the parts alias the
model's weights.

Only plain, contiguous CPU tensors can be aliased this way, and only outside a torch.distributed
process group; :func:`split_views` returns None for anything else (an accelerator, a DTensor, a
quantizer's tensor subclass, a rank of a group) and the op's own inverse (copies) runs instead.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from fusion_core.transforms import Shape, TransformOp

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def alias(address: int, dtype: torch.dtype, shape: Sequence[int], owner: object) -> torch.Tensor:
    """A tensor of its own storage over ``shape`` elements of ``dtype`` at ``address`` (CPU memory that ``owner``
    keeps alive; the new tensor keeps ``owner`` alive in turn)."""
    length = math.prod(shape) * dtype.itemsize
    span = (ctypes.c_char * length).from_address(address)
    span.owner = owner  # type: ignore[attr-defined]
    return torch.frombuffer(span, dtype=dtype).view(tuple(shape))


def in_process_group() -> bool:
    """Whether a torch.distributed process group is up. There, a save presents copies and a load merges with the
    op's own ``forward`` (:mod:`fusion_core.streaming` stands aside), as before: two-rank torchrun runs abort at
    teardown now and then ("terminate called without an active exception"), measured 2 of 8 runs with aliased
    saves, 1 of 8 with streamed merges under CPU load, and 1 of 24 with neither, so the abort is torch's and its
    cause unknown; the gating keeps the rate where it was."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def split_views(op: TransformOp, targets: Sequence[torch.Tensor], source_shapes: Sequence[Shape]) -> tuple[
    torch.Tensor, ...
] | None:
    """``op.inverse(targets, source_shapes)`` without a copy: each source an :func:`alias` of its bytes in the target.

    None when the op does not place its sources whole in one target (``flat_offsets``), or the target is not a
    plain, contiguous CPU tensor.
    """
    if len(targets) != 1 or any(math.prod(shape) == 0 for shape in source_shapes) or in_process_group():
        return None
    (target,) = targets
    offsets = op.flat_offsets(source_shapes)
    if (offsets is None or type(target) not in _PLAIN or target.device.type != "cpu" or not target.is_contiguous()
            or target.requires_grad):
        return None
    size = target.element_size()
    return tuple(
        alias(target.data_ptr() + offset * size, target.dtype, shape, target)
        for offset, shape in zip(offsets, source_shapes, strict=True)
    )
