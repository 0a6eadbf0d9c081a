"""The ``moe_experts`` fusion family: sparse MoE blocks' per-expert loops run as grouped GEMMs."""

from fusion_moe_experts.family import (
    ExpertProjection,
    ExpertProjectionError,
    MoeExpertsFamily,
    MoeExpertsOptions,
    StackedExpertsMixin,
)
from fusion_moe_experts.ops import StackExperts, StackPairs

__all__ = [
    "ExpertProjection", "ExpertProjectionError", "MoeExpertsFamily", "MoeExpertsOptions", "StackExperts", "StackPairs",
    "StackedExpertsMixin",
]
