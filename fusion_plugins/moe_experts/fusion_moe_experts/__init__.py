"""The ``moe_experts`` fusion family: sparse MoE blocks' per-expert loops run as grouped GEMMs."""

from fusion_moe_experts.family import ExpertProjection, MoeExpertsFamily, MoeExpertsOptions, StackedExpertsMixin
from fusion_moe_experts.ops import StackPairs

__all__ = ["ExpertProjection", "MoeExpertsFamily", "MoeExpertsOptions", "StackPairs", "StackedExpertsMixin"]
