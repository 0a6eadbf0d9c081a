"""The private torch names fusion-linear-kernels uses: oneDNN's prepacked linear weight, and nothing else.

torch ships oneDNN's prepacked linear for its own compiler (Inductor's CPU weight freezing) under
``torch.ops.mkldnn``, without a public name:

- ``torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)`` returns the ``[out, in]`` weight
  reordered into the blocked layout oneDNN's GEMM reads: a ``torch.Tensor`` with layout
  ``torch._mkldnn`` (``tensor.is_mkldnn``), the same shape, dtype and device, no storage that Python
  can see (no ``data_ptr``, no pickling), ``to_dense()`` giving the original bytes back;
- ``torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")`` computes
  ``F.linear(input, weight, bias)`` from it, without reordering the weight on every call (what
  ``F.linear`` does for bfloat16 on CPU, and what makes it slower at few rows).

Checked on torch 2.13.0+cpu (the one build this project installs). Where the operators are missing
(a build without oneDNN) :func:`available` is False and nothing is packed: every layer keeps its
dense weight and ``F.linear``.

One private method of ``nn.Module`` is overridden, not called from here: the fused class's
``_apply`` (what ``.to()``, ``.half()``, ``.cuda()`` call on every module; unchanged since torch 1.0)
unpacks the weight before ``nn.Module._apply`` runs and packs it again only where it still may be
(:class:`fusion_linear_kernels.family.LinearKernelsMixin`).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (and oneDNN is enabled)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018  (resolving the name loads the op or raises)
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``, dense, on the CPU) in oneDNN's blocked layout for few-row GEMMs."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
    return packed


def packed_linear(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for ``packed = pack(weight)``; no autograd (see :mod:`.packing`)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(input.contiguous(), packed, bias, "none", [], "")
    return out
