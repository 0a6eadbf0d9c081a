"""A one-row GEMV for wide rows: eight weight rows read side by side against one load of the input.

The row-dot GEMV (:mod:`fusion_linear_kernels.row_dot`) reads one weight row at a time and loads the input again
for every row. Where a row is wide (a down projection's 8192 or 11008 elements), that input no longer sits in the
core's first-level cache next to the streaming weight, and the GEMV falls below the memory's bandwidth. This
kernel walks eight rows at once: each slice of the input is loaded and widened to float32 once, then multiplied
into eight accumulators, one per row (eight independent streams, which the CPU's prefetchers follow). Measured on
a 2-core AMD EPYC (avx512_bf16), one row, bfloat16, over a pass of copies read from memory, against a float32 sum
of the weights' own bytes in the same run: 2048x11008 29.5 GB/s (row-dot 21.0, the sum 27.6), 2048x8192 28.5
(24.1; 28.0), 3584x18944 30.4 (22.9; 28.1); on rows of 2048 or fewer it was slower than row-dot (151936x896
17.6 against 37.9), so it is a candidate only for rows wider than :data:`MIN_WIDTH`, and the choice measures it
against the others (:mod:`fusion_linear_kernels.choice`).

It is C++ written with torch's own vector types (``at::vec``, vectorised for the CPU the way Inductor's kernels
are), built once per (dtype, bias or not) and process by Inductor's C++ toolchain
(:func:`fusion_linear_kernels.compat.cpp_kernel`; cached on disk, so a later process loads it), with the
weight's shape passed at each call. Where it cannot be built (no C++ compiler), :func:`kernel` returns None, says
so once (:class:`~fusion_linear_kernels.row_dot.RowDotUnavailableWarning`), and the layer keeps the other
candidates; a stored decision naming it then runs ``F.linear``.

It sums in float32 in another order than ``F.linear``'s GEMM, so it is a candidate within the bound only
(:mod:`fusion_linear_kernels.tolerance`), never in exact mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from fusion_linear_kernels import compat, row_dot
from fusion_linear_kernels.built_kernels import BuiltKernels

ROWS = 8
"""Weight rows one pass over the input reads side by side."""
MIN_WIDTH = row_dot.CHUNKED_FROM
"""The kernel is tried on rows wider than this; narrower rows read faster one at a time (row-dot)."""

PROFILER_LABEL = "fusion::blocked_rows"
"""The name of the kernel's calls in torch's profiler (followed by the weight's shape, ``out``x``in``)."""

_C_TYPES = {torch.bfloat16: "at::BFloat16", torch.float16: "at::Half", torch.float32: "float"}

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
using T = @TYPE@;
using Acc = at::vec::VectorizedN<float, 2>;

static inline Acc widened(const at::BFloat16* p) {
    return at::vec::convert<float, 2, at::BFloat16, 1>(at::vec::Vectorized<at::BFloat16>::loadu(p));
}
static inline Acc widened(const at::Half* p) {
    return at::vec::convert<float, 2, at::Half, 1>(at::vec::Vectorized<at::Half>::loadu(p));
}
static inline Acc widened(const float* p) { return Acc::loadu(p); }

// The dot products of ROWS consecutive weight rows (w, row stride k) with x, in float32.
template <int ROWS>
static inline void dots(const T* w, const T* x, int64_t k, float* sums) {
    constexpr int64_t lanes = Acc::size();
    Acc acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = Acc(0);
    int64_t j = 0;
    for (; j + lanes <= k; j += lanes) {
        const Acc xs = widened(x + j);
        for (int r = 0; r < ROWS; ++r) acc[r] = at::vec::fmadd(widened(w + r * k + j), xs, acc[r]);
    }
    for (int r = 0; r < ROWS; ++r) {
        float sum = at::vec::vec_reduce_all<float, 2>(
            [](at::vec::Vectorized<float>& a, at::vec::Vectorized<float>& b) { return a + b; }, acc[r]);
        for (int64_t t = j; t < k; ++t) sum += static_cast<float>(w[r * k + t]) * static_cast<float>(x[t]);
        sums[r] = sum;
    }
}

extern "C" void kernel(const T* w, const T* x, @BIAS_ARG@T* out, const int64_t n, const int64_t k) {
    const int64_t blocks = (n + @ROWS@ - 1) / @ROWS@;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = b * @ROWS@;
        float sums[@ROWS@];
        if (r0 + @ROWS@ <= n) {
            dots<@ROWS@>(w + r0 * k, x, k, sums);
        } else {
            for (int64_t r = r0; r < n; ++r) dots<1>(w + r * k, x, k, sums + (r - r0));
        }
        for (int64_t r = r0; r < n && r < r0 + @ROWS@; ++r) out[r] = static_cast<T>(sums[r - r0]@BIAS_ADD@);
    }
}
"""

Key = tuple[torch.dtype, bool]
_KERNELS: BuiltKernels[Key] = BuiltKernels(row_dot.RowDotUnavailableWarning)


def source(dtype: torch.dtype, bias: bool) -> str:
    """The C++ of the kernel for weights of ``dtype``, with or without a bias."""
    return (_SOURCE.replace("@TYPE@", _C_TYPES[dtype]).replace("@ROWS@", str(ROWS))
            .replace("@BIAS_ARG@", "const T* bias, " if bias else "")
            .replace("@BIAS_ADD@", " + static_cast<float>(bias[r])" if bias else ""))


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can run this call: one the row-dot GEMV :func:`~fusion_linear_kernels.row_dot.fits`,
    on rows wider than :data:`MIN_WIDTH`, an input and a bias (if any) of the weight's dtype, and a kernel built
    for it."""
    return (row_dot.fits(input, weight) and weight.shape[1] > MIN_WIDTH and input.dtype == weight.dtype
            and (bias is None or bias.dtype == weight.dtype) and kernel(weight.dtype, bias is not None) is not None)


def run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for a one-row input, by the blocked-rows kernel (``F.linear`` where there
    is none)."""
    compiled = kernel(weight.dtype, bias is not None)
    if compiled is None:
        return F.linear(input, weight, bias)
    rows, width = weight.shape
    row = input.reshape(-1).contiguous()
    out = torch.empty(rows, dtype=weight.dtype)
    arguments = (weight, row, out, rows, width) if bias is None else (weight, row, bias.contiguous(), out, rows, width)
    if compat.profiling():  # not an operator of torch's: labelled, or the profiler books it as time outside operators
        with torch.profiler.record_function(f"{PROFILER_LABEL} {rows}x{width}"):
            compiled(*arguments)
    else:
        compiled(*arguments)
    return out.view(*input.shape[:-1], rows)


def kernel(dtype: torch.dtype, bias: bool) -> Callable[..., None] | None:
    """The built kernel for weights of ``dtype`` (with or without a bias), built at the first call; None where it
    cannot be built."""
    return _KERNELS.get((dtype, bias), lambda: _build(dtype, bias), f"the blocked-rows GEMV for {dtype} weights")


def _build(dtype: torch.dtype, bias: bool) -> Callable[..., None]:
    pointer = f"const {_C_TYPES[dtype]}*"
    argtypes = [pointer, pointer] + ([pointer] if bias else []) + [f"{_C_TYPES[dtype]}*", "const int64_t",
                                                                   "const int64_t"]
    return compat.cpp_kernel(argtypes, source(dtype, bias))


def clear() -> None:
    """Forget the built kernels and whether a failed build was reported (``fusion_core.reset_state()``, through the
    plugin's ``fusion_reset_state`` hook)."""
    _KERNELS.clear()
