"""``patch_embeddings``: a non-overlapping ``nn.Conv3d`` runs as one ``nn.Linear`` GEMM.

A Conv3d whose stride equals its kernel, with no padding, dilation 1 and one group, looks at
disjoint patches: each output position is a dot product of one flattened patch with each
filter. That is exactly ``linear(patches, weight.flatten(1), bias)``, which runs at GEMM speed
where a Conv3d often does not: on CPU the fused module runs at the speed of a bare ``F.linear``
on the same data, and how much faster than the Conv3d that is depends on the CPU's Conv3d kernel
and the dtype (measured figures and their method: ``docs/benchmarks.md``).

The family fuses the Conv3d itself, whatever its parent module and attribute are called, so
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V and video models (VideoMAE, ViViT, V-JEPA 2) are all
covered. The fused module is a drop-in Conv3d: it takes the same input and returns the same
output, so the parent's ``forward`` runs unchanged:

- rows of flattened patches, ``[N, C, kt, kh, kw]`` (the Qwen-VL / GLM-4V towers): one GEMM on
  a view of the input;
- video tensors ``[B, C, T, H, W]``: patches are gathered with one reshape/permute, then one GEMM.

Checkpoint layout: ``weight`` ``[out, in, kt, kh, kw]`` <-> ``[out, in*kt*kh*kw]`` (a view both
ways); ``bias`` unchanged. The transforms come from the module's own shapes, never from config
attribute names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fusion_core import FamilyOptions, Flatten, FusedModule, FusionFamily, WeightTransform
from fusion_core.plugin import Replicated


class PatchEmbeddingsOptions(FamilyOptions):
    """Options of ``patch_embeddings``: the common ``target_modules`` / ``exclude_modules`` scoping."""


def is_non_overlapping_conv3d(module: nn.Module) -> bool:
    """True for an ``nn.Conv3d`` (or a subclass keeping its forward) that reads disjoint patches."""
    if not isinstance(module, nn.Conv3d) or type(module).forward is not nn.Conv3d.forward:
        return False
    no_padding = module.padding == "valid" or tuple(module.padding) == (0, 0, 0)
    return (
        no_padding
        and tuple(module.stride) == tuple(module.kernel_size)
        and tuple(module.dilation) == (1, 1, 1)
        and module.groups == 1
        and module.weight.dim() == 5
    )


class PatchLinearMixin(FusedModule):
    """The fused behaviour mixed into a Conv3d subclass: forward as a GEMM on a 2-D weight."""

    kernel_size: tuple[int, int, int]
    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        kernel = tuple(self.kernel_size)
        if input.dim() == 5 and tuple(input.shape[2:]) == kernel:
            # Rows of flattened patches: the reshape is a view for contiguous input.
            rows = input.shape[0]
            return F.linear(input.reshape(rows, -1), weight, self.bias).view(rows, -1, 1, 1, 1)
        batched = input.dim() == 5
        video = input if batched else input.unsqueeze(0)
        b, c, t, h, w = video.shape
        kt, kh, kw = kernel
        nt, nh, nw = t // kt, h // kh, w // kw
        if (nt * kt, nh * kh, nw * kw) != (t, h, w):  # Conv3d drops the remainder; so do we
            video = video[:, :, : nt * kt, : nh * kh, : nw * kw]
        patches = (
            video.reshape(b, c, nt, kt, nh, kh, nw, kw)
            .permute(0, 2, 4, 6, 1, 3, 5, 7)
            .reshape(b * nt * nh * nw, c * kt * kh * kw)
        )
        out = F.linear(patches, weight, self.bias).view(b, nt, nh, nw, -1).permute(0, 4, 1, 2, 3).contiguous()
        return out if batched else out.squeeze(0)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fused=linear"


class PatchEmbeddingsFamily(FusionFamily[PatchEmbeddingsOptions]):
    """Non-overlapping Conv3d patch embeddings run as one flattened nn.Linear (a single GEMM)."""

    name = "patch_embeddings"
    options_model = PatchEmbeddingsOptions
    fused_mixin = PatchLinearMixin
    #: Patch embeddings run unsharded (no tensor-parallel style shards a Conv3d); a plan entry is refused.
    tensor_parallel = Replicated()
    target_modules_patterns = ()

    def is_fusable(self, module: nn.Module, options: PatchEmbeddingsOptions) -> bool:
        return is_non_overlapping_conv3d(module)

    def make_transforms(self, config: Any, options: PatchEmbeddingsOptions) -> list[WeightTransform]:
        return [WeightTransform(("weight",), ("weight",), Flatten(start_dim=1))]

