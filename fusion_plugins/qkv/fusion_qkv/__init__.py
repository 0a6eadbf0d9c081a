"""The ``qkv`` fusion family: attention q/k/v projections run as one merged GEMM."""

from fusion_qkv.family import QkvFamily, QkvMixin, QkvOptions

__all__ = ["QkvFamily", "QkvMixin", "QkvOptions"]
