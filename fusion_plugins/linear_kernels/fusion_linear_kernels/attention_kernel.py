"""The C++ kernel of a decode step's attention over the cache (:mod:`fusion_linear_kernels.decode_attention`): one
query token a head, read against every cached key and value of its group's head once.

torch's ``scaled_dot_product_attention`` runs its CPU flash-attention kernel for a decode step's single query row as
for a prompt: blocks, buffers and GEMM calls sized for many rows. On the 2-core AMD EPYC (AVX2; torch 2.13.0, bf16,
Qwen2-0.5B's 14 query and 2 key/value heads of 64; a throwaway timing) it took 23 us at 16 cached tokens, 89 at 64,
230 at 256 and 989 at 1024 a layer, where reading that layer's 1024 keys and values (0.5 MB) takes about 20 us at the
machine's read bandwidth: at 1024 tokens, about 24 ms a token over Qwen2-0.5B's 24 layers.

Here each key/value head's group of query heads is one task (OpenMP over batch rows and key/value heads): the queries
widened to float32 once, each cached key widened once and dotted with every query of the group, the scores scaled (and
soft-capped, ``cap * tanh(score / cap)``, where the attention caps them: Gemma 2's), a softmax over them (their maximum
subtracted, torch's vectorised ``exp``), then each cached value widened once and accumulated into every query's output
with its weight, the sums divided by the softmax's and rounded to the dtype once. The sums run in another order than
torch's flash kernel (which also rounds once): within the bound (:mod:`fusion_linear_kernels.tolerance`), and the decode
step verifies the whole attention against the module's forward at load. """

from __future__ import annotations

from typing import Any

import torch

from fusion_linear_kernels import row_dot
from fusion_linear_kernels.built_kernels import BuiltKernels
from fusion_linear_kernels.row_dot import RowDotUnavailableWarning

PROFILER_LABEL = "fusion::decode_attention"
"""The name of the kernel's calls in torch's profiler."""
DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes the kernel attends in. A float32 model's step keeps torch's kernel, which runs float32 on GEMMs of its
own: on a 2-core Xeon with AVX-512 (Ice Lake; 14/2 heads of 64, a throwaway timing) it took 120 us at 1024 cached
tokens to this kernel's 107, and this kernel's float32 sums, added a cached token at a time, came out further from the
exact attention than torch's (4.7e-6 against 3.3e-6 at most over 37 tokens; summed in float64 instead, 1.9e-6, but
584 us). In bfloat16 torch's kernel took 771 us there, this one 115."""

BODY = r"""
#include <cmath>
#include <vector>
using V = at::vec::Vectorized<float>;

// A row of T widened to float32 into out, Acc::size() at a time.
static inline void widen(const T* row, float* out, int64_t n) {
    constexpr int64_t lanes = Acc::size();
    int64_t d = 0;
    for (; d + lanes <= n; d += lanes) widened(row + d).store(out + d);
    for (; d < n; ++d) out[d] = static_cast<float>(row[d]);
}
// scale * (q . k) for a query and a key row, both widened to float32; soft-capped (cap * tanh(s / cap), Gemma 2's)
// where cap is positive.
static inline float score(const float* q, const float* k, int64_t n, float scale, float cap) {
    constexpr int64_t lanes = Acc::size();
    Acc sums(0.0f);
    int64_t d = 0;
    for (; d + lanes <= n; d += lanes) sums = at::vec::fmadd(Acc::loadu(k + d), Acc::loadu(q + d), sums);
    float sum = at::vec::vec_reduce_all<float, 2>([](V& a, V& b) { return a + b; }, sums);
    for (; d < n; ++d) sum += q[d] * k[d];
    return cap > 0.0f ? cap * std::tanh(sum * scale / cap) : sum * scale;
}
// Subtracts the maximum of s[0..n) from each, takes exp in place and returns their sum.
static inline float softmax_numerators(float* s, int64_t n) {
    float top = s[0];
    for (int64_t j = 1; j < n; ++j) top = s[j] > top ? s[j] : top;
    const V shift(top);
    V sums(0.0f);
    int64_t j = 0;
    for (; j + V::size() <= n; j += V::size()) {
        const V e = (V::loadu(s + j) - shift).exp();
        e.store(s + j);
        sums = sums + e;
    }
    float sum = at::vec::vec_reduce_all<float>([](V& a, V& b) { return a + b; }, sums);
    for (; j < n; ++j) { s[j] = std::exp(s[j] - top); sum += s[j]; }
    return sum;
}

// q: [batch, heads, width]; k, v: [batch, kv_heads, length, width], rows of a head back to back, heads kv_head_stride
// and batch rows kv_batch_stride elements apart (a cache's view of a longer buffer); out: [batch, heads, width]. Query
// head h reads key/value head h / (heads / kv_heads); one task a batch row and key/value head. cap: the scores' soft
// cap, 0 for none. bias, where biased: length floats a batch row (bias_batch_stride apart, 0 for one row for all)
// added to the scores after the cap (an attention mask's); a key whose bias is -inf is hidden: neither read nor
// weighted.
extern "C" void kernel(const T* q, const T* k, const T* v, T* out, const float scale, const float cap,
                       const float* bias, const int64_t batch, const int64_t heads, const int64_t kv_heads,
                       const int64_t length, const int64_t width, const int64_t kv_batch_stride,
                       const int64_t kv_head_stride, const int64_t biased, const int64_t bias_batch_stride) {
    const int64_t group = heads / kv_heads;
    constexpr int64_t lanes = Acc::size();
    const int64_t whole = width - width % lanes;
    #pragma omp parallel for collapse(2)
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t g = 0; g < kv_heads; ++g) {
            std::vector<float> queries(group * width), scores(group * length), sums(group * width, 0.0f);
            std::vector<float> totals(group), row(width);
            const int64_t first = b * heads + g * group;
            const T* keys = k + b * kv_batch_stride + g * kv_head_stride;
            const T* values = v + b * kv_batch_stride + g * kv_head_stride;
            const float* added = biased ? bias + b * bias_batch_stride : nullptr;
            widen(q + first * width, queries.data(), group * width);
            for (int64_t j = 0; j < length; ++j) {
                if (added != nullptr && added[j] == -INFINITY) {
                    for (int64_t i = 0; i < group; ++i) scores[i * length + j] = -INFINITY;
                    continue;
                }
                widen(keys + j * width, row.data(), width);
                for (int64_t i = 0; i < group; ++i) {
                    const float s = score(queries.data() + i * width, row.data(), width, scale, cap);
                    scores[i * length + j] = added == nullptr ? s : s + added[j];
                }
            }
            for (int64_t i = 0; i < group; ++i) totals[i] = softmax_numerators(scores.data() + i * length, length);
            for (int64_t j = 0; j < length; ++j) {
                if (added != nullptr && added[j] == -INFINITY) continue;
                const T* value = values + j * width;
                for (int64_t d = 0; d < whole; d += lanes) {
                    const Acc widened_value = widened(value + d);
                    for (int64_t i = 0; i < group; ++i) {
                        float* sum = sums.data() + i * width + d;
                        at::vec::fmadd(Acc(scores[i * length + j]), widened_value, Acc::loadu(sum)).store(sum);
                    }
                }
                for (int64_t d = whole; d < width; ++d)
                    for (int64_t i = 0; i < group; ++i)
                        sums[i * width + d] += scores[i * length + j] * static_cast<float>(value[d]);
            }
            for (int64_t i = 0; i < group; ++i)
                for (int64_t d = 0; d < width; ++d)
                    out[(first + i) * width + d] = static_cast<T>(sums[i * width + d] / totals[i]);
        }
    }
}
"""
"""The attention kernel's own C++ (after :func:`row_dot.templates`): its helpers and the entry point ``kernel`` (the
step kernel, :mod:`fusion_linear_kernels.step_kernel`, compiles it too)."""


def source(dtype: torch.dtype) -> str:
    """The C++ of the attention kernel for a model of ``dtype``: the GEMV's head (``T``, its widening loads), then the
    attention."""
    return row_dot.templates(dtype) + BODY


def _build(dtype: torch.dtype) -> Any:
    pointer = f"const {row_dot.C_TYPES[dtype]}*"
    argtypes = ([pointer] * 3 + [f"{row_dot.C_TYPES[dtype]}*", "const float", "const float", "const float*"]
                + ["const int64_t"] * 9)
    return row_dot.built_kernel(f"decode attention {dtype}", argtypes, source(dtype))


_KERNELS: BuiltKernels[torch.dtype] = BuiltKernels(RowDotUnavailableWarning, _build,
                                                   lambda dtype: f"the decode attention kernel for {dtype} models")


def kernel(dtype: torch.dtype) -> Any:
    """The built attention kernel for ``dtype``, None where it cannot be built or ``dtype`` is not one of
    :data:`DTYPES`."""
    return _KERNELS.get(dtype) if dtype in DTYPES else None


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
           softcap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The attention of ``query`` (``[batch, heads, 1, width]``, contiguous) over ``keys`` and ``values`` (``[batch,
    kv_heads, length, width]``, of the query's dtype, alike in strides, each head's rows back to back: contiguous, or
    a cache's view of a longer buffer, :mod:`fusion_linear_kernels.cache_growth`) as ``[batch, 1, heads * width]``, its
    scaled scores soft-capped (``softcap * tanh(score / softcap)``, Gemma 2's) where ``softcap`` is given, then
    ``bias`` added where given (float32 ``[batch or 1, length]``, contiguous: an attention mask's, ``-inf`` hiding a
    key; each row must leave a key visible); None where the kernel cannot take them (the caller runs torch's)."""
    if query.dim() != 4 or keys.dim() != 4:
        return None
    batch, heads, tokens, width = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    compiled = kernel(query.dtype)
    if (compiled is None or tokens != 1 or length == 0 or kv_heads == 0 or heads % kv_heads
            or keys.shape != values.shape
            or keys.shape[0] != batch or keys.shape[3] != width or not (keys.dtype is values.dtype is query.dtype)
            or not query.is_contiguous() or keys.stride() != values.stride() or keys.stride()[2:] != (width, 1)
            or (softcap is not None and not softcap > 0.0)
            or (bias is not None and not (bias.dtype is torch.float32 and bias.dim() == 2 and bias.is_contiguous()
                                          and bias.shape[0] in (1, batch) and bias.shape[1] == length))):
        return None
    out = query.new_empty(batch, 1, heads * width)
    row_dot.labelled_call(PROFILER_LABEL, compiled, query, keys, values, out, scale, softcap or 0.0,
                          row_dot.stand_in(bias, query), batch, heads, kv_heads, length, width, keys.stride(0),
                          keys.stride(1), bias is not None, 0 if bias is None or bias.shape[0] == 1 else length)
    return out


def clear() -> None:
    """Forget the built kernels (``fusion_core.reset_state()``: the plugin's ``fusion_reset_state`` hook)."""
    _KERNELS.clear()
