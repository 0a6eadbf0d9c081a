"""The ``qkv`` fusion family: attention q/k/v projections run as one merged GEMM."""

from fusion_qkv.family import QkvFamily, QkvMixin, QkvOptions
from fusion_qkv.merged import MergedLinear, MergedSlice

__all__ = ["MergedLinear", "MergedSlice", "QkvFamily", "QkvMixin", "QkvOptions"]
