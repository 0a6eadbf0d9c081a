"""The ``patch_embeddings`` fusion family: Conv3d patch embeddings run as one flattened Linear."""

from fusion_patch_embeddings.family import PatchEmbeddingsFamily, PatchEmbeddingsOptions, PatchLinearMixin

__all__ = ["PatchEmbeddingsFamily", "PatchEmbeddingsOptions", "PatchLinearMixin"]
