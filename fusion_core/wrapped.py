"""Tensor subclasses (a quantizer's weights): telling them from torch's own, slicing, comparing, concatenating.

A quantizer that keeps ``nn.Linear`` and swaps its weight for a tensor subclass (torchao's
``Int8Tensor``: ``qdata`` int8 ``[out, in]`` and a per-row ``scale``) rarely implements
``torch.cat`` for it. For a scheme whose data and scales are per output row (per-channel, per
row-group), the quantized weight of concatenated rows *is* the concatenation of the parts'
quantized data and scales: what vLLM loads into packed q/k/v layers. :func:`concat` builds that
merged tensor from the subclass's own ``__tensor_flatten__`` / ``__tensor_unflatten__`` (the
protocol every traceable wrapper subclass implements), without knowing the quantizer:

- an inner tensor as long as its part along ``dim`` is per-row: the parts' inner tensors are
  concatenated along ``dim``;
- any other inner tensor (a per-tensor scale, a block-wise scale whose blocks could span parts)
  must be bit-equal in every part, and is kept once; otherwise the merge is refused.

The result is then checked, not trusted: each part's rows, narrowed out of the merged tensor,
must flatten to inner tensors bit-equal to that part's (:func:`same_bits`, which compares every
tensor, plain or subclass, by its bytes). A scheme that fails any of this raises
:class:`ConcatRefused` naming the subclass and the inner tensor at fault.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


class ConcatRefused(TypeError):
    """Tensors that cannot be concatenated exactly (mixed schemes, scales that span parts)."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_torch_tensor(tensor: torch.Tensor) -> bool:
    """A tensor of torch's own classes (``Parameter``, ``DTensor``, ...), not a quantizer's tensor subclass."""
    return type(tensor) in _PLAIN or _torch_class(type(tensor))


@functools.cache
def _torch_class(cls: type) -> bool:  # cached per class: asked on every eager merged-projection call
    return cls.__module__ == "torch" or cls.__module__.startswith("torch.")


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """A quantizer's tensor subclass holding inner tensors (``__tensor_flatten__``); torch's own wrapper
    subclasses (``DTensor``, fake and functional tensors) are not: they concatenate and slice as tensors."""
    return not is_torch_tensor(tensor) and hasattr(tensor, "__tensor_flatten__")


def row_slice(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``tensor[start:stop]``; a wrapper subclass is sliced outside inference mode (torchao's ``Int8Tensor``
    cannot make its view inside ``torch.inference_mode``, which ``generate`` runs in)."""
    # The class tests first: dynamo traces them, but breaks the graph on the inference-mode query.
    if type(tensor) in _PLAIN or not is_wrapper_subclass(tensor) or not torch.is_inference_mode_enabled():
        return tensor[start:stop]
    with torch.inference_mode(False):
        return tensor[start:stop]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads and -0.0 included), unlike ``torch.equal``.

    A wrapper subclass is compared through its inner tensors and flatten context: the same class,
    context and inner bytes.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if (type(a) in _PLAIN and type(b) in _PLAIN and a.device == b.device and a.device.type != "meta"
            and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()):
        return True  # the same elements of the same memory (a merged tensor that is a view of its parts)
    if is_wrapper_subclass(a) or is_wrapper_subclass(b):
        if type(a) is not type(b):
            return False
        (names, context), (other_names, other_context) = a.__tensor_flatten__(), b.__tensor_flatten__()  # type: ignore[attr-defined]
        return (list(names) == list(other_names) and context == other_context
                and all(same_bits(getattr(a, name), getattr(b, name)) for name in names))
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    if flat.numel() > 1:
        return flat.contiguous().view(torch.uint8)  # a copy only when the tensor is not contiguous
    # ``contiguous()`` keeps the stride of a tensor with 0 or 1 elements (a row unbound from a
    # stacked tensor has stride 2), and a byte view of that raises: copy it into a fresh one.
    fresh = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device)
    return fresh.copy_(flat).view(torch.uint8)


def concat(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(tensors, dim)``; for wrapper subclasses, through their inner tensors (see the module docs)."""
    if not any(is_wrapper_subclass(t) for t in tensors):
        return torch.cat(list(tensors), dim=dim)
    cls = type(tensors[0])
    name = f"{cls.__module__}.{cls.__qualname__}"
    if any(type(t) is not cls for t in tensors):
        classes = sorted({type(t).__name__ for t in tensors})
        raise ConcatRefused(f"cannot concatenate tensors of different classes: {classes}")
    flattened = [t.__tensor_flatten__() for t in tensors]  # type: ignore[attr-defined]
    names, context = flattened[0]
    for other_names, other_context in flattened[1:]:
        if list(other_names) != list(names) or other_context != context:
            raise ConcatRefused(f"{name}: the parts are quantized differently ({context!r} vs {other_context!r})")
    inner: dict[str, torch.Tensor] = {}
    for inner_name in names:
        parts = [getattr(t, inner_name) for t in tensors]
        if all(p.dim() > dim and p.shape[dim] == t.shape[dim] for p, t in zip(parts, tensors, strict=True)):
            inner[inner_name] = torch.cat(parts, dim=dim)
        elif all(p.shape == parts[0].shape and torch.equal(p, parts[0]) for p in parts[1:]):
            inner[inner_name] = parts[0]
        else:
            raise ConcatRefused(
                f"{name}.{inner_name} (shape {tuple(parts[0].shape)} for a part of shape {tuple(tensors[0].shape)}) is "
                f"neither per row along dim {dim} nor equal in every part: its blocks would span parts"
            )
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    merged: torch.Tensor = cls.__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, context, torch.Size(shape), torch.empty(shape, device="meta").stride())
    _check_parts(merged, tensors, dim, name)
    return merged


def _check_parts(merged: torch.Tensor, tensors: Sequence[torch.Tensor], dim: int, name: str) -> None:
    """Each part narrowed out of ``merged`` flattens to the part's own inner tensors, bit for bit."""
    start = 0
    for index, part in enumerate(tensors):
        try:
            back = merged.narrow(dim, start, part.shape[dim])
        except Exception as exc:  # the subclass cannot slice: it could not be split back on save either
            raise ConcatRefused(f"{name} cannot be narrowed back into its parts: {type(exc).__name__}: {exc}") from exc
        start += part.shape[dim]
        if not same_bits(back, part):
            raise ConcatRefused(f"{name}: part {index} does not come back out of the merged tensor bit for bit (its "
                                f"slice is a {type(back).__name__}); it could not be split back into its parts on save")
