"""The GEMV kernel built on this machine, and the one-row candidate that reads the weight one row at a time.

At one row ``F.linear(x, W)`` is ``W @ x``: each output is the dot product of a weight row with ``x``. A
``[out, in]`` weight already holds every row contiguously, so the GEMV needs no other layout: read each row once,
multiply in float32, sum. torch's kernels do not do that at the memory's speed on the CPU: ``F.linear`` on
bfloat16 reorders the weight for oneDNN on every call, ``torch.mv`` runs one thread's loop. :func:`gemv` does,
with C++ written with torch's own vector types (``at::vec``, vectorised for the CPU the way Inductor's kernels
are), built once per (dtype, bias or not) and process by Inductor's C++ toolchain
(:func:`fusion_linear_kernels.compat.cpp_kernel`; cached on disk, so a later process loads it), the shape passed
at each call. It takes one to :data:`MAX_INPUTS` input rows and reads ``block`` weight rows side by side
(:data:`BUILT`), each weight row once for every input row; the candidates differ in the rows they take and the
block they read:

- ``row-dot`` (this module): one input row, one weight row at a time (a single stream through the weight). Over
  a pass of copies read from memory, one row, bfloat16, on a 2-core AMD EPYC (avx512_bf16), against a float32 sum
  of the same weights' bytes in the same run: 9728x896 43.0 GB/s (the sum 39.1), 151936x896 27.0 (25.9),
  16384x2048 31.8 (29.4). It replaced Inductor's code for ``(W.float() * x.float()).sum(-1)``, compiled once per
  weight shape, which read 37.5, 25.9 and 29.3 there, cost about 9 us a call around the kernel against 2 (a
  1152x896 projection: 25.6 against 24.6 GB/s) and a compile per shape at a process's first ``generate``.
- ``blocked-rows``, ``few-rows`` and ``few-rows-blocked`` (:mod:`fusion_linear_kernels.blocked_rows`): eight weight
  rows side by side for one wide input row; one or four for two to eight input rows.

**Paired dot products.** On CPUs with AVX512-BF16 (``avx512_bf16``: AMD Zen 4 on, Intel Cooper Lake and Sapphire Rapids
on), a bfloat16 call multiplies with that extension's dot product (``vdpbf16ps``: 32 bfloat16 pairs into 16 float32
sums, one instruction) instead of widening every element to float32 first: at a few rows the kernel is bound by
arithmetic on two cores, not by the memory. Over a pass of copies, bfloat16, GB/s, widening against paired (each with
its faster block) on the 2-core AMD EPYC: four input rows 151936x896 18.6 / 35.3, 8192x2048 19.7 / 24.6, 2048x8192 25.3
/ 29.9; eight rows 151936x896 10.4 / 23.8, 2048x8192 10.0 / 24.4, where ``F.linear`` read 13.1 and 15.7. One input row
read one weight row at a time (row-dot) kept the widening path until 2026-12-07, as it read 3-15% faster from memory
where the memory was slow (151936x896 32.8 against 27.5). But the widening path computes a row at no more than 49-55
GB/s on the two cores (weights in the caches), below what the memory reads at its fast moments (55-60 GB/s), so there it
capped the whole step; paired, row-dot computes at 126-134 GB/s, and from memory it read 0-16% faster than widening at a
fast moment (151936x896 53.3 against 46.0, 2048x8192 33.6 against 26.2) and 2-4% slower at a slow one (151936x896 33.4
against 34.7). Llama-3.2-1B's eager decode, every family on, one process, the two codes alternating over 14 pairs:
1.061x faster paired (every pair 1.04x or more; throwaway probes). The kernel asks the CPU when it is loaded
(``__builtin_cpu_supports``) and compiles that function for the extension whatever flags Inductor's toolchain passes;
other CPUs and compilers, float16 and float32 keep the widening path.
The instruction treats subnormal inputs as zero: within the bound, like every other difference of these candidates.

**Even and odd elements.** On CPUs with AVX2 and FMA and no AVX512-BF16 (AMD Zen 1 to 3; Intel's client cores and
its servers up to Ice Lake), a bfloat16 call reads each 16-element chunk of a weight row as eight 32-bit lanes: a
bfloat16 is the top half of a float32, so a lane shifted left by 16 is the chunk's even element as a float32, and the
lane with its low half cleared is the odd one. That widens sixteen elements in two instructions, where widening them
in order also shuffles across the register's halves, and at these widths the two cores' arithmetic, not the memory,
was what bounded the widening path. The inputs are split the same way once per call (each chunk's eight even
elements, then its eight odd ones, in float32); only the order of the float32 sums changes. Measured on a 2-core AMD
EPYC (AVX2 and FMA only), bfloat16, over a pass of copies, GB/s, in order / even and odd, each with its faster block
(medians of five interleaved passes; a throwaway probe that built both sources side by side): one input row 1152x896
21.0 / 24.8, 9728x896 19.5 / 23.8, 151936x896 21.8 / 24.7, 896x4864 24.0 / 26.4, 8192x2048 20.8 / 26.5; two rows
9728x896 18.5 / 24.5, four 11.4 / 16.5, eight 5.7 / 9.7. An AVX2 sum over the same bytes read 27-33 GB/s there. With
the split, row-dot overtook blocked-rows at 896-wide rows, so the decisions measured on the kernel are stored per
build of it (:data:`CODE_DIGEST`). On a 2-core Xeon with AVX-512 and no AVX512-BF16 (Ice Lake), where the widening
path is AVX-512's, the same split at AVX2's width read as fast at one row and faster at more (the same probe, in order
/ even and odd / the split at AVX-512's width): one row 9728x896 18.2 / 18.0 / 18.8, 8192x2048 22.2 / 22.2 / 22.3;
four rows 151936x896 12.4 / 15.2 / 16.0, 8192x2048 14.0 / 16.7 / 17.1, 896x4864 9.3 / 12.2 / 12.2; eight rows
9728x896 7.6 / 8.8 / 7.8, 896x4864 5.6 / 7.5 / 4.8 (the wider split runs out of registers at eight rows), so the
AVX2 split runs there too. The kernel asks the CPU when it is loaded, like the paired path; CPUs with AVX512-BF16
keep the paired path, and widening in order for one input row read one weight row at a time.

**Reading ahead.** While it reads a block of weight rows, the kernel asks the CPU to fetch the same place of the
next block (``__builtin_prefetch`` where the compiler has it, one request per 64-byte line, a hint that never
faults). The rows of a block lie
back to back, so the requests run one block ahead of the reads, a short linear stream the CPU's own prefetchers do
not start: a block of eight 896-wide rows is eight streams of 28 lines each. The sums are unchanged (the same
bits). Measured on a 2-core Xeon VM (AMX-BF16), over a pass of copies, GB/s, before / after (input rows x block; a
throwaway probe that built both sources side by side, not in the repository):
bfloat16 9728x896 1x8 23.1 / 27.5, 1x1 18.0 / 20.7, 4x4 10.9 / 21.5, 8x4 8.0 / 17.3; 151936x896 1x8 23.9 / 27.8;
896x4864 1x8 27.8 / 29.9, 4x1 15.3 / 13.6 (the one pair slower; the choice measures the others beside it);
float32 9728x896 1x1 25.6 / 29.2. Qwen2-0.5B's eager decode, every family on: 58.97 / 51.41 ms a token
(``benchmarks/bench_decode.py``, each code in a run of its own).

The requests ask for the line for one read (``__builtin_prefetch(p, 0, 0)``: ``prefetchnta`` on x86), so the weight
stream, read once a step and far larger than the caches, does not evict what the rest of the step reuses: the
interpreter's and torch's code and objects between the kernels, the cache's keys and values, the activations. On the
2-core AMD EPYC (AVX512-BF16), Qwen2-0.5B's decode step (every family on, a bare forward a token, fresh processes
alternating, each step set against a 512 MiB read right after it; throwaway probes): 1.24x that read in the median of
12 processes against 1.31x with the ordinary hint, lower in each of the 12 pairs, the time outside the kernels 5.5
against 7.0 ms a step; Llama-3.2-1B, 8 pairs: 1.19x against 1.24x (lower in 5). From memory the kernel read as fast
or faster (one row, GB/s, ordinary / non-temporal, a slow moment of the memory: 151936x896 21.5-23.1 / 24.1-26.0,
16384x2048 25.7-27.1 / 27.2-29.1, 2048x8192 22.7-25.5 / 27.9-28.0); over weights the caches hold between calls it
can read slower (a 1.5 MB weight read again and again: 82-85 against 63-67 GB/s), which a decode step, reading
hundreds of megabytes once, never does.

Only weights of at least :data:`MIN_BYTES` apply (:func:`gemv_weight`): a smaller weight is served from the CPU's
caches, where the kernel buys nothing. Where the kernel cannot be built (no C++ compiler on the machine),
:func:`kernel` returns None, says so once (:class:`RowDotUnavailableWarning`), and the layers keep the other
candidates; a stored decision naming one of these candidates then runs ``F.linear``.

The float32 sum runs in another order than ``F.linear``'s GEMM, so its outputs differ in the last bits: these
are candidates within the bound only (:mod:`fusion_linear_kernels.tolerance`), never in exact mode.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import torch
from torch.nn import functional as F

from fusion_core.plugin import Decisions
from fusion_linear_kernels import compat
from fusion_linear_kernels.built_kernels import BuiltKernels

MIN_BYTES = 2**20
"""The smallest weight the GEMV kernel is tried on."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_INPUTS = 8
"""The most input rows one call of the kernel takes."""
BUILT: tuple[tuple[int, int], ...] = ((1, 1), (1, 8), *((inputs, block) for inputs in range(2, MAX_INPUTS + 1)
                                                         for block in (1, 4)))
"""The (input rows, weight rows read side by side) the kernel is built for, each a C++ template instance: one weight
row at a time or eight for one input row (row-dot, blocked-rows), one or four for two to eight (few-rows,
few-rows-blocked). A build on a machine without the kernel cached took 11.4 s for bfloat16 without a bias (2-core AMD
EPYC, these sixteen pairs; eight pairs took 9.6 s: the compiler and torch's headers, not the instances, take most
of it), a second dtype or bias 2.5 s more. A later process loads the stored file in about 13 ms (:data:`_LIBRARIES`;
through Inductor's lookup, as it did before, about 2.5 s)."""

PROFILER_LABEL = "fusion::gemv"
"""The name of the kernel's calls in torch's profiler (followed by the weight's shape, ``out``x``in``)."""


class RowDotUnavailableWarning(UserWarning):
    """The GEMV kernel could not be built here; the layers keep the other kernels."""


C_TYPES = {torch.bfloat16: "at::BFloat16", torch.float16: "at::Half", torch.float32: "float"}

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

// A request to fetch the line at p ahead of its read, for one read (non-temporal: the weight stream leaves the caches
// to the rest of the step): a hint that never faults (a no-op where the compiler has none).
#if defined(__GNUC__) || defined(__clang__)
#define FUSION_PREFETCH(p) __builtin_prefetch(p, 0, 0)
#else
#define FUSION_PREFETCH(p) ((void)0)
#endif

@PAIRED_DOTS@
@EVEN_ODD@
#ifndef FUSION_EVEN_ODD
static inline const float* split_inputs(const T*, int64_t, int) { return nullptr; }  // the other paths
#endif
// The dot products of ROWS consecutive weight rows (w, row stride k) with IN input rows (x, row stride k), in
// float32: sums[i * stride + r] for weight row r and input row i. split: the inputs as even_odd_dots reads them, or
// nullptr (the other paths).
template <int ROWS, int IN>
static inline void dots(const T* w, const T* x, const float* split, int64_t k, float* sums, int64_t stride) {
#ifdef FUSION_PAIRED_DOTS
    if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (paired_dots_run) { paired_dots<ROWS, IN>(w, x, k, sums, stride); return; }
    }
#endif
#ifdef FUSION_EVEN_ODD
    if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (split != nullptr) { even_odd_dots<ROWS, IN>(w, x, split, k, sums, stride); return; }
    }
#endif
    constexpr int64_t lanes = Acc::size();
    Acc acc[ROWS][IN];
    for (int r = 0; r < ROWS; ++r) for (int i = 0; i < IN; ++i) acc[r][i] = Acc(0);
    int64_t j = 0;
    for (; j + lanes <= k; j += lanes) {
        Acc xs[IN];
        for (int i = 0; i < IN; ++i) xs[i] = widened(x + i * k + j);
        for (int r = 0; r < ROWS; ++r) {
            for (int64_t line = 0; line < lanes * int64_t(sizeof(T)); line += 64) {
                FUSION_PREFETCH(reinterpret_cast<const char*>(w + (r + ROWS) * k + j) + line);
            }
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
    const float* split = split_inputs(x, k, IN);
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = b * ROWS;
        float sums[ROWS * IN];
        if (r0 + ROWS <= n) {
            dots<ROWS, IN>(w + r0 * k, x, split, k, sums, ROWS);
        } else {
            for (int64_t r = r0; r < n; ++r) dots<1, IN>(w + r * k, x, split, k, sums + (r - r0), ROWS);
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

ENTRY = 'extern "C" void kernel('
"""How every built kernel's C++ declares its entry point: :func:`built_kernel` loads the function ``kernel``."""

_PAIRED_DOTS = r"""
// Compilers that know AVX512-BF16's intrinsics (GCC 10, Clang 9 on); any other builds the widening path only.
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 9 : (defined(__GNUC__) && __GNUC__ >= 10))
#include <immintrin.h>
#define FUSION_PAIRED_DOTS 1
// dots() for bfloat16 on CPUs with AVX512-BF16: one instruction (vdpbf16ps) multiplies 32 bfloat16 pairs and adds
// them into 16 float32 lanes, where the widening path converts and multiplies in four. Compiled for that ISA
// whatever flags the file gets, and run only where the CPU has it (paired_dots_run).
template <int ROWS, int IN>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void paired_dots(const at::BFloat16* w, const at::BFloat16* x, int64_t k, float* sums, int64_t stride) {
    constexpr int U = ROWS * IN <= 2 ? 2 : 1;  // independent sums per output where there are few
    __m512 acc[U][ROWS][IN];
    for (int u = 0; u < U; ++u) for (int r = 0; r < ROWS; ++r) for (int i = 0; i < IN; ++i) {
        acc[u][r][i] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 32 * U <= k; j += 32 * U) {
        for (int u = 0; u < U; ++u) {
            __m512bh xs[IN];
            for (int i = 0; i < IN; ++i) xs[i] = (__m512bh)_mm512_loadu_si512(x + i * k + j + 32 * u);
            for (int r = 0; r < ROWS; ++r) {
                FUSION_PREFETCH(w + (r + ROWS) * k + j + 32 * u);
                const __m512bh ws = (__m512bh)_mm512_loadu_si512(w + r * k + j + 32 * u);
                for (int i = 0; i < IN; ++i) acc[u][r][i] = _mm512_dpbf16_ps(acc[u][r][i], ws, xs[i]);
            }
        }
    }
    for (; j < k; j += 32) {  // the width's tail, masked (the lanes past it read as zeros)
        const int64_t left = k - j;
        const __mmask32 mask = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
        __m512bh xs[IN];
        for (int i = 0; i < IN; ++i) xs[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k + j);
        for (int r = 0; r < ROWS; ++r) {
            const __m512bh ws = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + j);
            for (int i = 0; i < IN; ++i) acc[0][r][i] = _mm512_dpbf16_ps(acc[0][r][i], ws, xs[i]);
        }
    }
    for (int r = 0; r < ROWS; ++r) for (int i = 0; i < IN; ++i) {
        __m512 total = acc[0][r][i];
        for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[u][r][i]);
        sums[i * stride + r] = _mm512_reduce_add_ps(total);
    }
}
static const bool paired_dots_run = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16"));
#endif
"""

_EVEN_ODD = r"""
// Compilers that know AVX2's and FMA's intrinsics by target attribute (GCC 5, Clang 4 on); any other builds the
// widening path only.
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 4 : (defined(__GNUC__) && __GNUC__ >= 5))
#include <immintrin.h>
#include <vector>
#define FUSION_EVEN_ODD 1
// Where the CPU has AVX2 and FMA and no AVX512-BF16 (even_odd_run), bfloat16 dot products read each 16-element
// chunk of a weight row as eight 32-bit lanes: a bfloat16 is the top half of a float32, so the lane shifted left by
// 16 is the chunk's even element as a float32, and the lane with its low half cleared is the odd one (two
// instructions for sixteen elements, where widening them in order takes a shuffle across the register's halves as
// well; on AVX-512 CPUs without AVX512-BF16 this AVX2 split also beat AVX-512's widening at two to eight rows). The
// inputs are split once per call the same way (split_inputs): each chunk's eight even elements, then its eight odd
// ones, in float32. The width's tail (k % 16) reads x itself.
static const bool even_odd_run = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") &&
                                  __builtin_cpu_supports("fma") && !__builtin_cpu_supports("avx512bf16"));

static const float* split_inputs(const T* x, int64_t k, int inputs) {
    if constexpr (!std::is_same_v<T, at::BFloat16>) {
        return nullptr;
    } else {
        if (!even_odd_run) return nullptr;
        thread_local std::vector<float> split;
        const int64_t chunks = k / 16;
        split.resize(static_cast<size_t>(inputs * chunks * 16));
        for (int i = 0; i < inputs; ++i) for (int64_t c = 0; c < chunks; ++c) for (int t = 0; t < 8; ++t) {
            split[(i * chunks + c) * 16 + t] = static_cast<float>(x[i * k + c * 16 + 2 * t]);
            split[(i * chunks + c) * 16 + 8 + t] = static_cast<float>(x[i * k + c * 16 + 2 * t + 1]);
        }
        return split.data();
    }
}

template <int ROWS, int IN>
__attribute__((target("avx2,fma")))
static void even_odd_dots(const at::BFloat16* w, const at::BFloat16* x, const float* split, int64_t k, float* sums,
                          int64_t stride) {
    constexpr int U = ROWS * IN <= 2 ? 2 : 1;  // independent sums per output where there are few
    const int64_t chunks = k / 16;
    const __m256i high_halves = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    __m256 acc[U][ROWS][IN];
    for (int u = 0; u < U; ++u) for (int r = 0; r < ROWS; ++r) for (int i = 0; i < IN; ++i) {
        acc[u][r][i] = _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t j = c * 16;
        __m256 evens[IN], odds[IN];
        for (int i = 0; i < IN; ++i) {
            evens[i] = _mm256_loadu_ps(split + (i * chunks + c) * 16);
            odds[i] = _mm256_loadu_ps(split + (i * chunks + c) * 16 + 8);
        }
        for (int r = 0; r < ROWS; ++r) {
            FUSION_PREFETCH(w + (r + ROWS) * k + j);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + j));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high_halves));
            for (int i = 0; i < IN; ++i) {
                acc[0][r][i] = _mm256_fmadd_ps(even, evens[i], acc[0][r][i]);
                acc[U - 1][r][i] = _mm256_fmadd_ps(odd, odds[i], acc[U - 1][r][i]);
            }
        }
    }
    for (int r = 0; r < ROWS; ++r) for (int i = 0; i < IN; ++i) {
        __m256 total = acc[0][r][i];
        for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[u][r][i]);
        const __m128 half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
        float lanes[4];
        _mm_storeu_ps(lanes, half);
        float sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
        for (int64_t t = chunks * 16; t < k; ++t) {
            sum += static_cast<float>(w[r * k + t]) * static_cast<float>(x[i * k + t]);
        }
        sums[i * stride + r] = sum;
    }
}
#endif
"""

Key = tuple[torch.dtype, bool]


def source(dtype: torch.dtype, bias: bool, paired: bool = True, even_odd: bool = True) -> str:
    """The C++ of the kernel for weights of ``dtype``, with or without a bias; without the paired dot products where
    not ``paired`` (what a CPU without AVX512-BF16 runs, whatever the CPU at hand), without the even/odd split where
    not ``even_odd`` (what a CPU without AVX2 and FMA, or one with AVX512-BF16, runs)."""
    return (templates(dtype, paired, even_odd) + _SOURCE[_SOURCE.index(ENTRY):].replace("@CASES@", gemv_cases("b"))
            .replace("@BIAS_ARG@", "const T* bias, " if bias else "").replace("@BIAS@", "bias" if bias else "nullptr"))


def templates(dtype: torch.dtype, paired: bool = True, even_odd: bool = True) -> str:
    """The kernel's C++ without its entry point: ``T`` (the C++ type of ``dtype``) and the templates
    ``gemv<ROWS, IN>(w, x, bias, out, n, k)`` and ``dots``, for other kernels built on the same GEMV
    (:mod:`fusion_linear_kernels.decode_layer`)."""
    head = _SOURCE[:_SOURCE.index(ENTRY)]
    return (head.replace("@PAIRED_DOTS@", _PAIRED_DOTS if paired else "")
            .replace("@EVEN_ODD@", _EVEN_ODD if even_odd else "").replace("@TYPE@", C_TYPES[dtype]))


def gemv_cases(bias: str) -> str:
    """The C++ ``case`` lines of a ``switch (inputs * 100 + block)`` that run ``gemv<block, inputs>(w, x, <bias>, out,
    n, k)`` for each pair of :data:`BUILT`."""
    return "\n        ".join(f"case {inputs * 100 + block}: gemv<{block}, {inputs}>(w, x, {bias}, out, n, k); break;"
                               for inputs, block in BUILT)



CODE_DIGEST = hashlib.sha256("".join(source(dtype, bias) for dtype in DTYPES for bias in (False, True))
                             .encode()).hexdigest()[:12]
"""A digest of the C++ every build of the kernel compiles (each dtype, with and without a bias): the ``code`` of every
:class:`~fusion_core.plugin.Decisions` table whose measurements run the kernel (the kernel choice, the decode step's
blocks, packing against the dense kernels, the experts' implementations), so a build whose code changed (a release,
a checkout of another commit) measures its kinds again instead of reusing what another build's timings decided."""


def gemv_weight(weight: torch.Tensor) -> bool:
    """Whether the kernel reads ``weight``: a dense contiguous CPU weight of torch's own of at least
    :data:`MIN_BYTES` in a floating dtype of :data:`DTYPES`."""
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in DTYPES and weight.device.type == "cpu"
            and weight.numel() * weight.element_size() >= MIN_BYTES)


def input_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The input's rows where the kernel can take the call, 0 where it cannot: a :func:`gemv_weight`, 1 to
    :data:`MAX_INPUTS` rows of its width, an input and a bias (if any) of the weight's dtype, and a kernel built
    for it."""
    width = input.shape[-1] if input.dim() else 0
    rows = input.numel() // width if width else 0
    if not (0 < rows <= MAX_INPUTS and width == weight.shape[-1] and gemv_weight(weight)
            and input.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)):
        return 0
    return rows if kernel(weight.dtype, bias is not None) is not None else 0


def gemv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: int) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for an input of 1 to :data:`MAX_INPUTS` rows by the kernel, ``block``
    weight rows side by side (a pair of :data:`BUILT`); ``F.linear`` where there is no kernel, or another pair."""
    rows, width = weight.shape
    inputs = input.numel() // width
    compiled = kernel(weight.dtype, bias is not None)
    if compiled is None or (inputs, block) not in BUILT:
        return F.linear(input, weight, bias)
    x = input.reshape(inputs, width).contiguous()
    out = torch.empty(inputs, rows, dtype=weight.dtype)
    shape = (rows, width, inputs, block)
    arguments = (weight, x, out, *shape) if bias is None else (weight, x, bias.contiguous(), out, *shape)
    labelled_call(f"{PROFILER_LABEL} {rows}x{width}", compiled, *arguments)
    return out.view(*input.shape[:-1], rows)


def stand_in(tensor: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """``tensor``, or ``other`` in its place where there is none: a pointer argument the kernel does not read (a bias
    its flags say is absent, a norm a form does not have)."""
    return other if tensor is None else tensor


def labelled_call(label: str, compiled: Callable[..., None], *arguments: object) -> None:
    """``compiled(*arguments)``, recorded as ``label`` while torch's profiler runs: a built kernel's call is not an
    operator of torch's, so the profiler would book it as time outside operators."""
    if compat.profiling():
        with torch.profiler.record_function(label):
            compiled(*arguments)
    else:
        compiled(*arguments)


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the row-dot candidate can run this call: one input row (see :func:`input_rows`)."""
    return input_rows(input, weight, bias) == 1


def run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for a one-row input, one weight row at a time (``F.linear`` where there is
    no kernel)."""
    return gemv(input, weight, bias, 1)


def kernel(dtype: torch.dtype, bias: bool) -> Callable[..., None] | None:
    """The built kernel for weights of ``dtype`` (with or without a bias), built at the first call; None where it
    cannot be built."""
    return _KERNELS.get((dtype, bias))


def argument_types(dtype: torch.dtype, bias: bool) -> list[str]:
    """The C++ types of the kernel's arguments: weight, input, (bias,) output, then n, k, input rows and block."""
    pointer = f"const {C_TYPES[dtype]}*"
    return [pointer, pointer] + ([pointer] if bias else []) + [f"{C_TYPES[dtype]}*"] + ["const int64_t"] * 4


def _existing(library: object) -> str | None:
    """A stored library file that is still there (None: built again)."""
    return library if isinstance(library, str) and os.path.isfile(library) else None


_LIBRARIES: Decisions[tuple[str, str], str | None] = Decisions("linear_kernels.gemv_library", load=_existing)
"""The file of the kernel each source was built into, per machine and software (a
:class:`~fusion_core.plugin.Decisions` table, stored like every decision): a later process loads it directly
(:func:`~fusion_linear_kernels.compat.load_kernel`, milliseconds) instead of through Inductor's toolchain, whose
import and lookup took about 2.5 s of a fresh process's first ``generate`` on a 2-core AMD EPYC."""


def _build(key: Key) -> Callable[..., None]:
    dtype, bias = key
    return built_kernel(str(dtype), argument_types(dtype, bias), source(dtype, bias))


def built_kernel(label: str, argtypes: list[str], code: str) -> Callable[..., None]:
    """The function ``kernel`` of the C++ ``code`` taking ``argtypes``: loaded from the file stored for this machine
    under ``label`` and the code's hash where one was built before (:data:`_LIBRARIES`), else built by Inductor's
    toolchain and its file stored."""
    built: list[Callable[..., None]] = []

    def build() -> str | None:
        built.append(compat.cpp_kernel(argtypes, code))
        return compat.library_of(built[0])

    library = _LIBRARIES.decide((label, hashlib.sha256(code.encode()).hexdigest()), build)
    if built:
        return built[0]
    try:
        return compat.load_kernel(library) if library is not None else compat.cpp_kernel(argtypes, code)
    except Exception:  # the stored file does not load (replaced, another build's): built (or found) again
        return compat.cpp_kernel(argtypes, code)


_KERNELS: BuiltKernels[Key] = BuiltKernels(RowDotUnavailableWarning, _build,
                                           lambda key: f"the GEMV kernel for {key[0]} weights")


def clear() -> None:
    """Forget the built kernels and whether a failed build was reported (``fusion_core.reset_state()``, through the
    plugin's ``fusion_reset_state`` hook); the stored library files are kept, as every stored decision is."""
    _KERNELS.clear()
    _LIBRARIES.clear()
