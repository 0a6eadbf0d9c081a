"""The C++ kernel of a whole decoder layer's one-token step: the input norm, the merged q/k/v projection with its norms
and rotation, the new keys and values written into the cache's buffer, the attention over it, the output projection,
and the rest of the layer, in one call.

A layer's decode step called five kernels (the layer kernel's input norm, :mod:`~fusion_linear_kernels.
projection_kernel`, :mod:`~fusion_linear_kernels.attention_kernel`, the output projection's GEMV, the layer kernel's
MLP), and between them ran the attention's checks, the cache's bookkeeping and about twenty torch operators (views,
copies, allocations). Each weight stream of the step evicts the interpreter's and torch's code and objects from the
CPU's caches, so that Python ran from memory: on the 2-core AMD EPYC (AVX512-BF16), Llama-3.2-1B's step spent about
690 us a layer between its kernels (docs/benchmarks.md, "The time between the kernels"). Here the same C++ functions
run back to back in one call, compiled from the same sources (:data:`~fusion_linear_kernels.layer_kernel.BODY`,
:data:`~fusion_linear_kernels.projection_kernel.BODY`, :data:`~fusion_linear_kernels.attention_kernel.BODY`), so they
give the same bits; :func:`fusion_linear_kernels.decode_layer.switch_layers` verifies that once per form on the loaded
weights before a layer takes this call.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_linear_kernels import attention_kernel, layer_kernel, projection_kernel, row_dot
from fusion_linear_kernels.built_kernels import BuiltKernels
from fusion_linear_kernels.row_dot import RowDotUnavailableWarning

PROFILER_LABEL = "fusion::decode_layer_step"
"""The name of the kernel's calls in torch's profiler, followed by the layer's widths (``hidden``x``intermediate``)."""

_STEP = r"""
// One token a sequence (rows of them) through a whole layer. scratch holds, in order: the normed input (rows *
// hidden), the merged projection (rows * qkv), the rotated queries (rows * heads * width), the new keys and values
// (rows * kv_heads * width each), the attention (rows * heads * width), its projection (rows * hidden), the MLP's
// normed input (rows * hidden) and its gate and up (2 * rows * intermediate). The new keys and values are written at
// token `length` of the buffers ([rows, kv_heads, capacity, width], strides kv_batch_stride and kv_head_stride), and
// the attention reads the length + 1 tokens there.
extern "C" void kernel(const T* h, const T* norm, const T* mlp_norm, const T* attention_norm, const T* out_norm,
                       const T* qkv_weight, const T* qkv_bias, const T* cos, const T* sin, const T* q_norm,
                       const T* k_norm, T* key_buffer, T* value_buffer, const float* mask, const T* o_weight,
                       const T* o_bias, const T* gate, const T* up, const T* down, const T* gate_bias,
                       const T* up_bias, const T* down_bias, T* scratch, T* out, const float eps, const float qk_eps,
                       const float scale, const float cap, const int64_t hidden, const int64_t intermediate,
                       const int64_t rows, const int64_t flags, const int64_t gate_up_block, const int64_t down_block,
                       const int64_t heads, const int64_t kv_heads, const int64_t width, const int64_t cos_rows,
                       const int64_t qkv_biased, const int64_t qkv_block, const int64_t q_norm_width,
                       const int64_t k_norm_width, const int64_t qk_plus_one, const int64_t length,
                       const int64_t kv_batch_stride, const int64_t kv_head_stride, const int64_t masked,
                       const int64_t mask_batch_stride, const int64_t o_biased, const int64_t o_block) {
    const int64_t qkv_rows = (heads + 2 * kv_heads) * width;
    T* normed = scratch;
    T* qkv = normed + rows * hidden;
    T* query = qkv + rows * qkv_rows;
    T* key = query + rows * heads * width;
    T* value = key + rows * kv_heads * width;
    T* attended = value + rows * kv_heads * width;
    T* attention = attended + rows * heads * width;
    T* x = attention + rows * hidden;
    T* g = x + rows * hidden;
    layer_kernel(h, h, norm, norm, norm, gate, up, down, gate, up, down, normed, normed, normed, eps, hidden,
                 intermediate, rows, flags & ~@MLP@, gate_up_block, down_block);
    projection_kernel(normed, qkv_weight, qkv_bias, cos, sin, q_norm, k_norm, qkv, query, key, value, qk_eps, hidden,
                      heads, kv_heads, width, rows, cos_rows, qkv_biased, qkv_block, q_norm_width, k_norm_width,
                      qk_plus_one);
    for (int64_t b = 0; b < rows; ++b) {
        for (int64_t j = 0; j < kv_heads; ++j) {
            const int64_t at = b * kv_batch_stride + j * kv_head_stride + length * width;
            const int64_t from = (b * kv_heads + j) * width;
            for (int64_t d = 0; d < width; ++d) {
                key_buffer[at + d] = key[from + d];
                value_buffer[at + d] = value[from + d];
            }
        }
    }
    attention_kernel(query, key_buffer, value_buffer, attended, scale, cap, mask, rows, heads, kv_heads, length + 1,
                     width, kv_batch_stride, kv_head_stride, masked, mask_batch_stride);
    rows_gemv(o_weight, attended, o_biased ? o_bias : nullptr, attention, hidden, heads * width, rows, o_block);
    layer_kernel(h, attention, mlp_norm, attention_norm, out_norm, gate, up, down, gate_bias, up_bias, down_bias, x,
                 g, out, eps, hidden, intermediate, rows, flags | @MLP@, gate_up_block, down_block);
}
"""


def _renamed(body: str, name: str) -> str:
    """``body`` with its entry point made a function of this translation unit named ``name``."""
    assert body.count(row_dot.ENTRY) == 1
    return body.replace(row_dot.ENTRY, f"static void {name}(")


def source(dtype: torch.dtype) -> str:
    """The C++ of the step kernel for a model of ``dtype``: the GEMV's templates, the decode step's shared C++, the
    layer, projection and attention kernels' own code (each entry point renamed), then this entry point."""
    return (row_dot.templates(dtype) + layer_kernel.SHARED_SOURCE
            + _renamed(layer_kernel.BODY, "layer_kernel") + _renamed(projection_kernel.BODY, "projection_kernel")
            + _renamed(attention_kernel.BODY, "attention_kernel") + _STEP.replace("@MLP@", str(layer_kernel.MLP)))


def scratch_size(rows: int, hidden: int, intermediate: int, heads: int, kv_heads: int, width: int) -> int:
    """The elements of the scratch a call of ``rows`` rows needs (see :data:`_STEP`)."""
    return rows * (3 * hidden + (heads + 2 * kv_heads) * width + 2 * heads * width + 2 * kv_heads * width
                   + 2 * intermediate)


def _build(dtype: torch.dtype) -> Any:
    pointer, out = f"const {row_dot.C_TYPES[dtype]}*", f"{row_dot.C_TYPES[dtype]}*"
    argtypes = ([pointer] * 11 + [out] * 2 + ["const float*"] + [pointer] * 8 + [out] * 2 + ["const float"] * 4
                + ["const int64_t"] * 22)
    return row_dot.built_kernel(f"decode layer step {dtype}", argtypes, source(dtype))


_KERNELS: BuiltKernels[torch.dtype] = BuiltKernels(RowDotUnavailableWarning, _build,
                                                   lambda dtype: f"the decode layer step kernel for {dtype} models")


def kernel(dtype: torch.dtype) -> Any:
    """The built step kernel for ``dtype``, None where it cannot be built (nor the kernels it is built from)."""
    if projection_kernel.kernel(dtype) is None or layer_kernel.kernel(dtype) is None:
        return None
    return _KERNELS.get(dtype)


def clear() -> None:
    """Forget the built kernels (``fusion_core.reset_state()``: the plugin's ``fusion_reset_state`` hook)."""
    _KERNELS.clear()
