"""Concatenating tensor subclasses (a quantizer's weights) through their inner tensors.

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
must flatten to inner tensors bit-equal to that part's. A scheme that fails any of this raises
:class:`ConcatRefused` naming the subclass and the inner tensor at fault.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ConcatRefused(TypeError):
    """Tensors that cannot be concatenated exactly (mixed schemes, scales that span parts)."""


def is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    """A tensor subclass holding inner tensors (``__tensor_flatten__``), not a plain tensor or parameter."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__")


def row_slice(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``tensor[start:stop]``; a wrapper subclass is sliced outside inference mode (torchao's ``Int8Tensor``
    cannot make its view inside ``torch.inference_mode``, which ``generate`` runs in)."""
    # The class test first: dynamo traces it, but breaks the graph on the inference-mode query.
    if not is_wrapper_subclass(tensor) or not torch.is_inference_mode_enabled():
        return tensor[start:stop]
    with torch.inference_mode(False):
        return tensor[start:stop]


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
        if type(back) is not type(part):
            raise ConcatRefused(f"{name}: a slice of the merged tensor is a {type(back).__name__}, not a "
                                f"{type(part).__name__}: it could not be split back into its parts on save")
        names, _ = part.__tensor_flatten__()  # type: ignore[attr-defined]
        for inner_name in names:
            if not torch.equal(getattr(back, inner_name), getattr(part, inner_name)):
                raise ConcatRefused(f"{name}: part {index}'s {inner_name} does not come back out of the merged tensor")
