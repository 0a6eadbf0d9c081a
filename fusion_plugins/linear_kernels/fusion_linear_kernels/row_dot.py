"""A one-row GEMV that reads the dense weight at the memory's bandwidth: Inductor's code for a row-dot reduction.

At one row ``F.linear(x, W)`` is ``W @ x``: each output is the dot product of a weight row with ``x``. A
``[out, in]`` weight already holds every row contiguously, so the GEMV needs no other layout: read each row once,
multiply in float32, sum. torch's kernels do not do that at the memory's speed on the CPU: ``F.linear`` on
bfloat16 reorders the weight for oneDNN on every call, ``torch.mv`` runs one thread's loop. Inductor, given
``(W.float() * x.float()).sum(-1)``, generates a vectorised, multi-threaded reduction that never materialises the
float32 product (a long row in chunks: :func:`chunk_of`). Measured on a 2-core AMD EPYC (avx512_bf16), one row,
bfloat16, over a pass of copies read from memory: Qwen2-0.5B's 151936x896 tied head 9.3 ms (30 GB/s; ``F.linear``
15.7 ms, ``torch.mv`` 25 ms), its merged 9728x896 gate/up 0.52 ms (``F.linear`` 1.28 ms); the cold-buffer reduction
read 33 GB/s there. On some shapes it is not the fastest (a 2048x11008 down projection read faster packed), which
is why it is a candidate the choice measures (:mod:`fusion_linear_kernels.choice`), never a rule.

A kernel is compiled once per process for each (rows of the weight, its width, dtype, bias or not), at the first
call that measures it, through :func:`fusion_linear_kernels.compat.inductor_compile` (Inductor's on-disk cache
makes a later process's compile cheaper). Only weights of at least :data:`MIN_BYTES` apply: a smaller weight is
served from the CPU's caches, where the reduction buys nothing and a compile costs a second. Where Inductor
cannot build it (no C++ compiler on the machine, an unsupported dtype), :func:`kernel` returns None, says so
once (:class:`RowDotUnavailableWarning`), and the layer keeps the other candidates; a stored decision naming this
kernel then runs ``F.linear``.

The float32 sum runs in another order than ``F.linear``'s GEMM, so its outputs differ in the last bits: it is a
candidate only within the bound (:mod:`fusion_linear_kernels.tolerance`), never in exact mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn import functional as F

from fusion_linear_kernels import compat
from fusion_linear_kernels.built_kernels import BuiltKernels

MIN_BYTES = 2**20
"""The smallest weight the row-dot kernel is tried on."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNKED_FROM, MIN_CHUNK, MAX_CHUNK = 2048, 64, 1024
"""Rows wider than ``CHUNKED_FROM`` are summed in chunks of ``MIN_CHUNK`` to ``MAX_CHUNK`` elements
(:func:`chunk_of`)."""


class RowDotUnavailableWarning(UserWarning):
    """A GEMV kernel (row-dot, blocked-rows) could not be built here; the layers keep the other kernels."""


Key = tuple[int, int, torch.dtype, bool]
_KERNELS: BuiltKernels[Key] = BuiltKernels(RowDotUnavailableWarning)


def chunk_of(width: int) -> int:
    """How many elements of a row one inner sum takes: a row wider than :data:`CHUNKED_FROM` is summed in chunks
    (the largest power of two that divides it, at most :data:`MAX_CHUNK`), then the chunks' sums are summed; 0 for a
    row summed whole. Inductor keeps one accumulator per vector lane for a whole row, and a long row's reduction
    then waits on it: over a pass of copies, 2048x8192 bfloat16 read 22.8 GB/s summed whole and 27.2 GB/s in chunks
    of 1024, 896x4864 26.3 against 38.2 in chunks of 256; rows of 896 or 2048 gained nothing (2-core AMD EPYC)."""
    if width <= CHUNKED_FROM:
        return 0
    chunk = min(MAX_CHUNK, width & -width)
    return chunk if chunk >= MIN_CHUNK else 0


def _dots(weight: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Each weight row's dot product with ``row``, in float32 (see :func:`chunk_of`)."""
    rows, width = weight.shape
    chunk = chunk_of(width)
    if not chunk:
        return (weight.float() * row.float()).sum(-1)
    return (weight.float().view(rows, width // chunk, chunk) * row.float().view(width // chunk, chunk)).sum(-1).sum(-1)


def _row_dot(weight: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return _dots(weight, row).to(weight.dtype)


def _row_dot_bias(weight: torch.Tensor, row: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return (_dots(weight, row) + bias.float()).to(weight.dtype)


def fits(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a one-row GEMV over the dense weight may run this call: one row and a :func:`gemv_weight`."""
    return input.numel() == input.shape[-1] and gemv_weight(weight)


def gemv_weight(weight: torch.Tensor) -> bool:
    """Whether the GEMV kernels read ``weight`` (this one and :mod:`fusion_linear_kernels.blocked_rows`): a dense
    contiguous CPU weight of torch's own of at least :data:`MIN_BYTES` in a floating dtype of :data:`DTYPES`."""
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in DTYPES and weight.device.type == "cpu"
            and weight.numel() * weight.element_size() >= MIN_BYTES)


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can run this call: one that :func:`fits`, and a kernel Inductor built for it."""
    return fits(input, weight) and kernel(weight, bias) is not None


def run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for a one-row input, by the row-dot kernel (``F.linear`` where there is
    none)."""
    compiled = kernel(weight, bias)
    if compiled is None:
        return F.linear(input, weight, bias)
    row = input.reshape(-1)
    out = compiled(weight, row) if bias is None else compiled(weight, row, bias)
    return out.view(*input.shape[:-1], weight.shape[0])


def kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[..., torch.Tensor] | None:
    """The compiled kernel for ``weight``'s shape and dtype (with or without a bias), built at the first call; None
    where Inductor cannot build it."""
    rows, width = weight.shape
    return _KERNELS.get((rows, width, weight.dtype, bias is not None), lambda: _build(weight, bias),
                        f"the row-dot GEMV for a {rows}x{width} {weight.dtype} weight")


def _build(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """Inductor's kernel for this weight's shape and dtype. The graph is traced on fake tensors and the layer's own
    weight is the compile's example (its shape and strides; nothing is copied): traced on real tensors, the float32
    product of a whole weight was computed, and building the kernel of Qwen2-0.5B's 260 MB head grew the process's
    peak memory by 1.3 GB."""
    width = weight.shape[1]
    inputs = [weight.detach(), torch.zeros(width, dtype=weight.dtype)] + ([] if bias is None else [bias.detach()])
    with torch.inference_mode(False), torch.no_grad():
        graph = make_fx(_row_dot if bias is None else _row_dot_bias, tracing_mode="fake")(*inputs)
        compiled = compat.inductor_compile(graph, inputs)
        compiled(*inputs)  # the first call loads the generated code: a failure shows here, not at decode
    return compiled


def clear() -> None:
    """Forget the compiled kernels (the next call of each shape builds it again) and whether a failed build was
    reported (``fusion_core.reset_state()``, through the plugin's ``fusion_reset_state`` hook)."""
    _KERNELS.clear()
