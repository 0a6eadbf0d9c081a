"""A GEMV for one to four input rows: several weight rows read side by side, each read once for every input row.

The row-dot GEMV (:mod:`fusion_linear_kernels.row_dot`) reads one weight row at a time and loads the input again
for every row. Where a row is wide (a down projection's 8192 or 11008 elements), that input no longer sits in the
core's first-level cache next to the streaming weight, and the GEMV falls below the memory's bandwidth. This
kernel walks eight rows at once: each slice of the input is loaded and widened to float32 once, then multiplied
into eight accumulators, one per row (eight independent streams, which the CPU's prefetchers follow). Measured on
a 2-core AMD EPYC (avx512_bf16), one row, bfloat16, over a pass of copies read from memory, against a float32 sum
of the weights' own bytes in the same run: 2048x11008 29.5 GB/s (row-dot 21.0, the sum 27.6), 2048x8192 28.5
(24.1; 28.0), 3584x18944 30.4 (22.9; 28.1); on rows of 2048 or fewer it was slower than row-dot (151936x896
17.6 against 37.9), so for one row it is a candidate only for rows wider than :data:`MIN_WIDTH`
(``blocked-rows``), and the choice measures it against the others (:mod:`fusion_linear_kernels.choice`).

**Two to four input rows** (a batch of two to four sequences, beams, a few tokens at once: the candidate
``few-rows``). ``F.linear`` there runs a GEMM that reads the weight at half the memory's speed or less, and
row-dot takes one row. This kernel reads each weight row once and multiplies it into every input row's
accumulator, so a step of a few rows reads the weights once, as a one-row step does: four weight rows side by
side on rows of 2048 or more, one at a time on narrower rows (:func:`block_of`). Same machine, two input rows:
151936x896 24-25 GB/s against ``F.linear``'s 13; 9728x896 25-28 against 11-12; 2048x8192 21-28 against 16-17;
four input rows 15-19 against 11-16. Qwen2-0.5B decode at a batch of two came from 1.00x plain (every one of its
layers ran ``F.linear``) to 1.70x (docs/benchmarks.md).

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
"""Weight rows one pass over a single input row reads side by side."""
MIN_WIDTH = row_dot.CHUNKED_FROM
"""The kernel is tried on one input row where rows are wider than this; narrower rows read faster one at a time
(row-dot)."""
MAX_INPUTS = 4
"""The most input rows one call takes (each weight row is read once for all of them)."""
FEW_ROWS_WIDE_FROM = 2048
"""From this width on, two to four input rows read four weight rows side by side (:func:`block_of`)."""

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

// The dot products of ROWS consecutive weight rows (w, row stride k) with IN input rows (x, row stride k), in
// float32: sums[i * stride + r] for weight row r and input row i.
template <int ROWS, int IN>
static inline void dots(const T* w, const T* x, int64_t k, float* sums, int64_t stride) {
    constexpr int64_t lanes = Acc::size();
    Acc acc[ROWS][IN];
    for (int r = 0; r < ROWS; ++r) for (int i = 0; i < IN; ++i) acc[r][i] = Acc(0);
    int64_t j = 0;
    for (; j + lanes <= k; j += lanes) {
        Acc xs[IN];
        for (int i = 0; i < IN; ++i) xs[i] = widened(x + i * k + j);
        for (int r = 0; r < ROWS; ++r) {
            const Acc ws = widened(w + r * k + j);
            for (int i = 0; i < IN; ++i) acc[r][i] = at::vec::fmadd(ws, xs[i], acc[r][i]);
        }
    }
    for (int r = 0; r < ROWS; ++r) for (int i = 0; i < IN; ++i) {
        float sum = at::vec::vec_reduce_all<float, 2>(
            [](at::vec::Vectorized<float>& a, at::vec::Vectorized<float>& b) { return a + b; }, acc[r][i]);
        for (int64_t t = j; t < k; ++t) sum += static_cast<float>(w[r * k + t]) * static_cast<float>(x[i * k + t]);
        sums[i * stride + r] = sum;
    }
}

// out[i, r] for every weight row r (n of them) and input row i, ROWS weight rows read side by side.
template <int ROWS, int IN>
static void gemv(const T* w, const T* x, const T* bias, T* out, int64_t n, int64_t k) {
    const int64_t blocks = (n + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = b * ROWS;
        float sums[ROWS * IN];
        if (r0 + ROWS <= n) {
            dots<ROWS, IN>(w + r0 * k, x, k, sums, ROWS);
        } else {
            for (int64_t r = r0; r < n; ++r) dots<1, IN>(w + r * k, x, k, sums + (r - r0), ROWS);
        }
        for (int i = 0; i < IN; ++i) {
            for (int64_t r = r0; r < n && r < r0 + ROWS; ++r) {
                float value = sums[i * ROWS + (r - r0)];
                if (bias != nullptr) value += static_cast<float>(bias[r]);
                out[i * n + r] = static_cast<T>(value);
            }
        }
    }
}

extern "C" void kernel(const T* w, const T* x, @BIAS_ARG@T* out, const int64_t n, const int64_t k,
                       const int64_t inputs, const int64_t block) {
    const T* b = @BIAS@;
    switch (inputs * 100 + block) {
        @CASES@
    }
}
"""

FEW_ROWS_BLOCKS = (1, 4)
"""The weight rows read side by side for two to :data:`MAX_INPUTS` input rows: one on narrow rows, four on wide."""


def block_of(inputs: int, width: int) -> int:
    """How many weight rows the kernel reads side by side for ``inputs`` input rows on rows of ``width``: eight for
    one input row; for two to four, four on rows of :data:`FEW_ROWS_WIDE_FROM` or more and one on narrower rows,
    which then read as one stream. Measured on a 2-core AMD EPYC, bfloat16, over a pass of copies, two input rows:
    151936x896 23.4 GB/s one at a time (``F.linear`` 15.0); 9728x896 26.0 one at a time, 13.6 two at a time;
    8192x2048 21.5 four at a time, 13.1 one at a time, 17.3 eight at a time (``F.linear`` 17.6); 2048x8192 23.9 four
    at a time (``F.linear`` 16.8)."""
    if inputs == 1:
        return ROWS
    narrow, wide = FEW_ROWS_BLOCKS
    return wide if width >= FEW_ROWS_WIDE_FROM else narrow


def _built_for() -> list[tuple[int, int]]:
    """Every (input rows, weight rows side by side) the kernel is built for: what :func:`block_of` can give."""
    return [(1, ROWS)] + [(inputs, block) for inputs in range(2, MAX_INPUTS + 1) for block in FEW_ROWS_BLOCKS]


Key = tuple[torch.dtype, bool]
_KERNELS: BuiltKernels[Key] = BuiltKernels(row_dot.RowDotUnavailableWarning)


def source(dtype: torch.dtype, bias: bool) -> str:
    """The C++ of the kernel for weights of ``dtype``, with or without a bias."""
    cases = "\n        ".join(f"case {inputs * 100 + block}: gemv<{block}, {inputs}>(w, x, b, out, n, k); break;"
                                for inputs, block in _built_for())
    return (_SOURCE.replace("@TYPE@", _C_TYPES[dtype]).replace("@CASES@", cases)
            .replace("@BIAS_ARG@", "const T* bias, " if bias else "").replace("@BIAS@", "bias" if bias else "nullptr"))


def _input_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The input's rows where the kernel can take the call (0 where it cannot): a weight the GEMVs read
    (:func:`~fusion_linear_kernels.row_dot.gemv_weight`), 1 to :data:`MAX_INPUTS` rows, an input and a bias (if any)
    of the weight's dtype, and a kernel built for it."""
    width = input.shape[-1] if input.dim() else 0
    rows = input.numel() // width if width else 0
    if not (0 < rows <= MAX_INPUTS and width == weight.shape[-1] and row_dot.gemv_weight(weight)
            and input.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)):
        return 0
    return rows if kernel(weight.dtype, bias is not None) is not None else 0


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can run this one-row call (the candidate ``blocked-rows``): rows wider than
    :data:`MIN_WIDTH` (see :func:`_input_rows` for the rest)."""
    return input.numel() == input.shape[-1] > MIN_WIDTH and _input_rows(input, weight, bias) == 1


def applies_to_few_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can run this call of two to :data:`MAX_INPUTS` input rows (the candidate ``few-rows``:
    small batches, beams, a few tokens at once), on rows of any width."""
    return _input_rows(input, weight, bias) > 1


def run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for an input of 1 to :data:`MAX_INPUTS` rows, by the blocked-rows kernel
    (``F.linear`` where there is none, or for more rows)."""
    rows, width = weight.shape
    inputs = input.numel() // width
    compiled = kernel(weight.dtype, bias is not None)
    if compiled is None or not 0 < inputs <= MAX_INPUTS:
        return F.linear(input, weight, bias)
    x = input.reshape(inputs, width).contiguous()
    out = torch.empty(inputs, rows, dtype=weight.dtype)
    shape = (rows, width, inputs, block_of(inputs, width))
    arguments = (weight, x, out, *shape) if bias is None else (weight, x, bias.contiguous(), out, *shape)
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
    argtypes = [pointer, pointer] + ([pointer] if bias else []) + [f"{_C_TYPES[dtype]}*"] + ["const int64_t"] * 4
    return compat.cpp_kernel(argtypes, source(dtype, bias))


def clear() -> None:
    """Forget the built kernels and whether a failed build was reported (``fusion_core.reset_state()``, through the
    plugin's ``fusion_reset_state`` hook)."""
    _KERNELS.clear()
