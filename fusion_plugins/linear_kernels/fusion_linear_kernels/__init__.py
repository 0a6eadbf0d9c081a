"""The ``linear_kernels`` fusion family: each linear layer holds its weight prepacked, or runs the fastest kernel,
where that measured faster here."""

from fusion_linear_kernels.choice import MAX_ROWS, clear_decisions, decisions, linear
from fusion_linear_kernels.family import (
    ExactLinearKernelsMixin,
    LinearKernelsFamily,
    LinearKernelsMixin,
    LinearKernelsOptions,
)
from fusion_linear_kernels.packing import PrepackLinearWeight, clear_pack_decisions, pack_decisions
from fusion_linear_kernels.tolerance import admission_bound

__all__ = [
    "MAX_ROWS", "ExactLinearKernelsMixin", "LinearKernelsFamily", "LinearKernelsMixin", "LinearKernelsOptions",
    "PrepackLinearWeight", "admission_bound", "clear_decisions", "clear_pack_decisions", "decisions", "linear",
    "pack_decisions",
]
