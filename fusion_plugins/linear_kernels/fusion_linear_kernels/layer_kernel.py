"""The C++ kernel of a decoder layer's decode step (:mod:`fusion_linear_kernels.decode_layer`): one call computes the
input norm of one to eight rows; another, the rest of the layer after its attention (the residual, the MLP's input
norm, the gate and up GEMVs, the activation's product, the down GEMV, the residual; in the sandwich form the
attention's and the MLP's outputs normed too). The GEMVs are :mod:`fusion_linear_kernels.row_dot`'s templates,
compiled into this kernel once per dtype (stored like the GEMV's own library); the flags below say which form and
which optional parts a call has.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_linear_kernels import row_dot
from fusion_linear_kernels.built_kernels import BuiltKernels
from fusion_linear_kernels.row_dot import RowDotUnavailableWarning

MLP, GATE_UP_BIAS, DOWN_BIAS, GATE_UP_MERGED, SANDWICH_FORM, PLUS_ONE, GELU = 1, 2, 4, 8, 16, 32, 64
"""The flags of a call: the rest of the layer (else the input norm alone); gate and up have biases; down has one; gate
and up are one merged weight (up's rows follow gate's); the sandwich form; Gemma's norms (times 1 + the weight);
GELU's tanh approximation (else SiLU)."""
PROFILER_LABEL = "fusion::decode_layer"
"""The name of the kernel's calls in torch's profiler, followed by ``input norm`` or by ``MLP`` and the MLP's widths
(``hidden``x``intermediate``): the MLP call holds the gate, up and down GEMVs, the norms after the attention and the
residuals."""

_SHARED_SOURCE = r"""
static inline T rounded(float v) { return static_cast<T>(v); }
static inline float wide(T v) { return static_cast<float>(v); }

// transformers' RMSNorms: the mean of the squares in float32, then either the normalised input rounded to T times the
// weight (a product of two T values, rounded to T: Llama's), or the normalised input times 1 + the weight in float32,
// rounded once (Gemma's). In place where out is h.
static void rms_norm(const T* h, const T* weight, T* out, float eps, int64_t n, bool plus_one) {
    double squares = 0.0;
    for (int64_t i = 0; i < n; ++i) { const double v = wide(h[i]); squares += v * v; }
    const float scale = 1.0f / std::sqrt(static_cast<float>(squares / static_cast<double>(n)) + eps);
    if (plus_one) {
        for (int64_t i = 0; i < n; ++i) out[i] = rounded((wide(h[i]) * scale) * (1.0f + wide(weight[i])));
    } else {
        for (int64_t i = 0; i < n; ++i) out[i] = rounded(wide(weight[i]) * wide(rounded(wide(h[i]) * scale)));
    }
}

// out[i, r] = w[r] . x[i] (+ bias[r]) for each of the inputs' rows, block weight rows side by side: the GEMV's
// instances (row_dot.BUILT).
static void rows_gemv(const T* w, const T* x, const T* bias, T* out, int64_t n, int64_t k, int64_t inputs,
                      int64_t block) {
    switch (inputs * 100 + block) {
        @CASES@
    }
}
"""
SHARED_SOURCE = _SHARED_SOURCE.replace("@CASES@", row_dot.gemv_cases("bias"))
"""The C++ a decode step's kernels share (after :func:`row_dot.templates`, which defines ``T`` and the GEMV): rounding
to ``T``, transformers' RMSNorms and the GEMV over one to eight input rows with a block of weight rows. The projection
kernel (:mod:`fusion_linear_kernels.projection_kernel`) norms the queries and keys and runs its GEMV with them."""

_BODY = r"""
static void rms_norms(const T* h, const T* weight, T* out, float eps, int64_t n, int64_t rows, bool plus_one) {
    for (int64_t r = 0; r < rows; ++r) rms_norm(h + r * n, weight, out + r * n, eps, n, plus_one);
}

// act(gate) rounded to T, times up (n elements further), rounded to T, as torch computes the activation in float32
// vectors: SiLU x / (1 + exp(-x)), or GELU's tanh approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
static void gated_product(T* g, int64_t n, bool gelu) {
    using V = at::vec::Vectorized<float>;
    constexpr int64_t lanes = V::size();
    const V one(1.0f), half(0.5f), beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715f);
    float z[lanes];
    for (int64_t i = 0; i < n; i += lanes) {
        const int64_t count = n - i < lanes ? n - i : lanes;
        for (int64_t t = 0; t < count; ++t) z[t] = wide(g[i + t]);
        const V v = V::loadu(z, count);
        if (gelu) {
            const V inner = beta * (v + kappa * (v * v * v));
            (half * v * (one + inner.tanh())).store(z, count);
        } else {
            (v / (one + v.neg().exp())).store(z, count);
        }
        for (int64_t t = 0; t < count; ++t) g[i + t] = rounded(wide(rounded(z[t])) * wide(g[n + i + t]));
    }
}

// Without @MLP@ in flags: out = the input norm of h. With it, the rest of the layer after its attention: the residual
// (the attention's output normed first where @SANDWICH@), the MLP's input norm, gate and up, the activation's product,
// down (normed where @SANDWICH@), the residual.
extern "C" void kernel(const T* h, const T* attention, const T* norm, const T* attention_norm, const T* out_norm,
                       const T* gate, const T* up, const T* down, const T* gate_bias, const T* up_bias,
                       const T* down_bias, T* x, T* g, T* out, const float eps, const int64_t hidden,
                       const int64_t intermediate, const int64_t rows, const int64_t flags,
                       const int64_t gate_up_block, const int64_t down_block) {
    const bool plus_one = flags & @PLUS_ONE@, sandwich = flags & @SANDWICH@;
    const int64_t n = rows * hidden;
    if (!(flags & @MLP@)) { rms_norms(h, norm, out, eps, hidden, rows, plus_one); return; }
    if (sandwich) {
        rms_norms(attention, attention_norm, x, eps, hidden, rows, plus_one);
        for (int64_t i = 0; i < n; ++i) out[i] = rounded(wide(h[i]) + wide(x[i]));
    } else {
        for (int64_t i = 0; i < n; ++i) out[i] = rounded(wide(h[i]) + wide(attention[i]));
    }
    rms_norms(out, norm, x, eps, hidden, rows, plus_one);
    if (flags & @GATE_UP_MERGED@) { up = gate + intermediate * hidden; up_bias = gate_bias + intermediate; }
    const bool biased = flags & @GATE_UP_BIAS@;
    rows_gemv(gate, x, biased ? gate_bias : nullptr, g, intermediate, hidden, rows, gate_up_block);
    rows_gemv(up, x, biased ? up_bias : nullptr, g + rows * intermediate, intermediate, hidden, rows, gate_up_block);
    gated_product(g, rows * intermediate, flags & @GELU@);
    rows_gemv(down, g, flags & @DOWN_BIAS@ ? down_bias : nullptr, x, hidden, intermediate, rows, down_block);
    if (sandwich) rms_norms(x, out_norm, x, eps, hidden, rows, plus_one);
    for (int64_t i = 0; i < n; ++i) out[i] = rounded(wide(out[i]) + wide(x[i]));
}
"""


def _with_flags(code: str) -> str:
    flags = {"@MLP@": MLP, "@GATE_UP_BIAS@": GATE_UP_BIAS, "@DOWN_BIAS@": DOWN_BIAS,
             "@GATE_UP_MERGED@": GATE_UP_MERGED, "@SANDWICH@": SANDWICH_FORM, "@PLUS_ONE@": PLUS_ONE, "@GELU@": GELU}
    for name, value in flags.items():
        code = code.replace(name, str(value))
    return code


BODY = _with_flags(_BODY)
"""The layer kernel's own C++ (after :func:`row_dot.templates` and :data:`SHARED_SOURCE`): the norms of its rows, the
activation's product and the entry point ``kernel``, with the flags' values in place (the step kernel,
:mod:`fusion_linear_kernels.step_kernel`, compiles it too)."""


def source(dtype: torch.dtype) -> str:
    """The C++ of the layer kernel for a model of ``dtype``: the GEMV's templates (:func:`row_dot.templates`), the
    decode step's shared C++, then the norms, the activation and the entry point."""
    return row_dot.templates(dtype) + SHARED_SOURCE + BODY


def _build(dtype: torch.dtype) -> Any:
    pointer = f"const {row_dot.C_TYPES[dtype]}*"
    out = f"{row_dot.C_TYPES[dtype]}*"
    argtypes = [pointer] * 11 + [out] * 3 + ["const float"] + ["const int64_t"] * 6
    return row_dot.built_kernel(f"decode layer {dtype}", argtypes, source(dtype))


_KERNELS: BuiltKernels[torch.dtype] = BuiltKernels(RowDotUnavailableWarning, _build,
                                                   lambda dtype: f"the decode layer kernel for {dtype} models")


def kernel(dtype: torch.dtype) -> Any:
    """The built layer kernel for ``dtype``, None where it cannot be built (nor the GEMV kernel it is built on)."""
    if dtype not in row_dot.DTYPES or row_dot.kernel(dtype, False) is None:
        return None
    return _KERNELS.get(dtype)


def clear() -> None:
    """Forget the built kernels (``fusion_core.reset_state()``: the plugin's ``fusion_reset_state`` hook)."""
    _KERNELS.clear()
