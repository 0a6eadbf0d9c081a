"""The C++ kernel of a decode step's queries, keys and values (:mod:`fusion_linear_kernels.decode_attention`): the
merged q/k/v projection's GEMV and its bias, the RMSNorms of the queries and keys where the attention has them, then
the rotary embedding of each query and key head, in one call.

Through the modules, a decode step's attention runs the merged projection's call (the ``qkv`` family's parts, each
taking its columns), a view and a transpose of each part, and the rotation as torch operators (``x * cos``, the
halves of the head swapped and one negated, ``* sin``, the sum: seven operators for the queries and seven for the
keys). On the 2-core AMD EPYC (AVX512-BF16; transformers 5.25.0, bf16, Qwen2-0.5B with every family on; a throwaway
timing of the step's parts) the projection's call and views took 144 us a layer, of which the GEMV about 70, and the
two rotations 62: about 3 ms a token over 24 layers, around GEMVs of 1.7. With this kernel (and ``o_proj`` run by the
GEMV kernel directly), side by side with the step's attention calling its projection modules (``benchmarks/
bench_decode.py``'s ``(projections as modules)`` contender; docs/benchmarks.md, "The step's projections in one C++
call"): 38.17 against 43.57 ms a token, 5 interleaved rounds.

The GEMV is :mod:`fusion_linear_kernels.row_dot`'s templates, compiled into this kernel and run with the block the
merged weight's kind decided, so it gives the module's bits; the rotation rounds as transformers'
``apply_rotary_pos_emb`` does (``x * cos + rotate_half(x) * sin``, each product rounded to the dtype, then the sum),
so the keys the step caches are the module's bit for bit (verified at load, :func:`~fusion_linear_kernels.
decode_attention.verified`). The norms of the queries and keys are the layer kernel's RMSNorms, whose mean of squares
sums in another order than torch's: where an attention has them, its keys may differ from the module's in a last bit,
within the bound (verified so). float32 models keep the modules, as they keep torch's attention
(:data:`~fusion_linear_kernels.attention_kernel.DTYPES`): their products are not rounded between operators, so the
compiler could contract them into other bits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fusion_linear_kernels import attention_kernel, row_dot
from fusion_linear_kernels.built_kernels import BuiltKernels
from fusion_linear_kernels.layer_kernel import SHARED_SOURCE
from fusion_linear_kernels.row_dot import RowDotUnavailableWarning

PROFILER_LABEL = "fusion::decode_projections"
"""The name of the kernel's calls in torch's profiler, followed by the merged weight's shape."""
DTYPES = attention_kernel.DTYPES
"""The dtypes the kernel runs in (see the module docs)."""

BODY = r"""
// One head of width d rotated as apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, where rotate_half(x) is
// (-x[d/2:], x[:d/2]); each product rounded to T, then their sum.
static void rotated(const T* x, const T* cos, const T* sin, T* out, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; ++i) {
        const float turned = i < half ? -wide(x[i + half]) : wide(x[i - half]);
        out[i] = rounded(wide(rounded(wide(x[i]) * wide(cos[i]))) + wide(rounded(turned * wide(sin[i]))));
    }
}

// For each of the rows of x: the merged projection (queries, keys, values: heads, kv_heads and kv_heads heads of
// width) into qkv, its bias added where biased; where q_norm_width is not 0, the queries normed by q_norm in pieces of
// q_norm_width (each head, or all of them) and the keys by k_norm in pieces of k_norm_width (rms_norm); then the query
// heads rotated into query, the key heads into key and the value heads copied into value, each [rows, its heads,
// width]. cos and sin hold a row of width for each row of x, or one for all where cos_rows is 1.
extern "C" void kernel(const T* x, const T* w, const T* bias, const T* cos, const T* sin, const T* q_norm,
                       const T* k_norm, T* qkv, T* query, T* key, T* value, const float eps, const int64_t hidden,
                       const int64_t heads, const int64_t kv_heads, const int64_t width, const int64_t rows,
                       const int64_t cos_rows, const int64_t biased, const int64_t block, const int64_t q_norm_width,
                       const int64_t k_norm_width, const int64_t plus_one) {
    const int64_t n = (heads + 2 * kv_heads) * width;
    rows_gemv(w, x, biased ? bias : nullptr, qkv, n, hidden, rows, block);
    for (int64_t r = 0; r < rows; ++r) {
        T* row = qkv + r * n;
        if (q_norm_width != 0) {
            for (int64_t i = 0; i < heads * width; i += q_norm_width)
                rms_norm(row + i, q_norm, row + i, eps, q_norm_width, plus_one);
            for (int64_t i = heads * width; i < (heads + kv_heads) * width; i += k_norm_width)
                rms_norm(row + i, k_norm, row + i, eps, k_norm_width, plus_one);
        }
        const T* c = cos + (cos_rows == 1 ? 0 : r) * width;
        const T* s = sin + (cos_rows == 1 ? 0 : r) * width;
        for (int64_t h = 0; h < heads; ++h) rotated(row + h * width, c, s, query + (r * heads + h) * width, width);
        for (int64_t h = 0; h < kv_heads; ++h)
            rotated(row + (heads + h) * width, c, s, key + (r * kv_heads + h) * width, width);
        const T* values = row + (heads + kv_heads) * width;
        for (int64_t i = 0; i < kv_heads * width; ++i) value[r * kv_heads * width + i] = values[i];
    }
}
"""
"""The projection kernel's own C++ (after :func:`row_dot.templates` and the shared C++): the rotation and the
entry point ``kernel`` (the step kernel, :mod:`fusion_linear_kernels.step_kernel`, compiles it too)."""


def source(dtype: torch.dtype) -> str:
    """The C++ of the projection kernel for a model of ``dtype``: the GEMV's templates (:func:`row_dot.templates`),
    the decode step's shared C++ (:data:`~fusion_linear_kernels.layer_kernel.SHARED_SOURCE`: the RMSNorms and the GEMV
    over a block of rows), then the rotation and the entry point."""
    return row_dot.templates(dtype) + SHARED_SOURCE + BODY


def _build(dtype: torch.dtype) -> Any:
    pointer, out = f"const {row_dot.C_TYPES[dtype]}*", f"{row_dot.C_TYPES[dtype]}*"
    argtypes = [pointer] * 7 + [out] * 4 + ["const float"] + ["const int64_t"] * 11
    return row_dot.built_kernel(f"decode projections {dtype}", argtypes, source(dtype))


_KERNELS: BuiltKernels[torch.dtype] = BuiltKernels(RowDotUnavailableWarning, _build,
                                                   lambda dtype: f"the decode projection kernel for {dtype} models")


def kernel(dtype: torch.dtype) -> Any:
    """The built projection kernel for ``dtype``, None where it cannot be built (nor the GEMV kernel it is built on)
    or ``dtype`` is not one of :data:`DTYPES`."""
    if dtype not in DTYPES or row_dot.kernel(dtype, False) is None:
        return None
    return _KERNELS.get(dtype)


class Norms(NamedTuple):
    """The RMSNorms of the queries and the keys (Qwen3's, Gemma 3's over each head; OLMo 2's over all of them): their
    weights (a head's width, or all the queries' and all the keys'), their epsilon, and whether they multiply by
    1 + the weight (Gemma's) or by the weight (Llama's)."""

    query: torch.Tensor
    key: torch.Tensor
    eps: float
    plus_one: bool


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            heads: int, kv_heads: int, width: int, block: int,
            norms: Norms | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotated queries and keys and the values of ``x`` (``[rows, hidden]``, contiguous) by the merged ``weight``
    (queries, keys, values) and ``bias``, the queries and keys normed by ``norms`` first where given, each ``[rows,
    its heads, 1, width]`` and contiguous, as a decode step's attention reads them; ``cos`` and ``sin`` hold ``width``
    elements for each row or one row for all. The caller checked :func:`kernel` builds for the dtype, ``block`` is of
    ``row_dot.BUILT`` at these rows, and the norms' weights are contiguous and of a head's width or all the heads'."""
    rows, hidden = x.shape
    compiled = kernel(x.dtype)
    qkv = x.new_empty(rows, weight.shape[0])
    query, key, value = (x.new_empty(rows, count, 1, width) for count in (heads, kv_heads, kv_heads))
    q_norm, k_norm = (weight, weight) if norms is None else (norms.query, norms.key)
    widths = (0, 0) if norms is None else (norms.query.numel(), norms.key.numel())
    row_dot.labelled_call(f"{PROFILER_LABEL} {weight.shape[0]}x{hidden}", compiled, x, weight,
                          row_dot.stand_in(bias, weight), cos, sin, q_norm, k_norm, qkv, query, key, value,
                          0.0 if norms is None else norms.eps, hidden, heads, kv_heads, width, rows,
                          cos.numel() // width, bias is not None, block, *widths,
                          norms is not None and norms.plus_one)
    return query, key, value


def clear() -> None:
    """Forget the built kernels (``fusion_core.reset_state()``: the plugin's ``fusion_reset_state`` hook)."""
    _KERNELS.clear()
