"""The ``linear_cross_entropy`` fusion family: the causal-LM training loss without the full logits."""

from fusion_linear_cross_entropy.deferred import DeferredLogits
from fusion_linear_cross_entropy.family import (
    LinearCrossEntropyFamily,
    LinearCrossEntropyMixin,
    LinearCrossEntropyOptions,
)

__all__ = ["DeferredLogits", "LinearCrossEntropyFamily", "LinearCrossEntropyMixin", "LinearCrossEntropyOptions"]
