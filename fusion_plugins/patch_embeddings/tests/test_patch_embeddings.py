"""The patch_embeddings family on its own: which Conv3d it takes, and that the fused one is exact."""

from __future__ import annotations

import pytest
import torch
from fusion_patch_embeddings import PatchEmbeddingsFamily, PatchLinearMixin
from torch import nn

import fusion_core
from fusion_core.testing.kit import (
    assert_numerically_equivalent,
    assert_state_dict_round_trip,
    fuse_module,
)

FAMILY = PatchEmbeddingsFamily()

# (in, out, kernel, bias): Qwen2-VL / Qwen2.5-VL, Qwen3-VL, GLM-4V, VideoMAE / ViViT shapes (widths cut).
SHAPES = [
    (3, 64, (2, 14, 14), False),
    (3, 48, (2, 16, 16), True),
    (3, 40, (2, 14, 14), True),
    (3, 32, (2, 16, 16), True),
]


def _conv(cin: int, cout: int, kernel: tuple[int, int, int], bias: bool) -> nn.Conv3d:
    return nn.Conv3d(cin, cout, kernel_size=kernel, stride=kernel, bias=bias)


@pytest.mark.parametrize(("cin", "cout", "kernel", "bias"), SHAPES)
def test_rows_of_patches_match_conv3d(cin, cout, kernel, bias):
    assert_numerically_equivalent(
        lambda: _conv(cin, cout, kernel, bias),
        lambda dtype: [torch.randn(37, cin, *kernel, generator=torch.Generator().manual_seed(0)).to(dtype)],
        FAMILY,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
    )


@pytest.mark.parametrize(("cin", "cout", "kernel", "bias"), SHAPES)
@pytest.mark.parametrize("frames_hw", [(4, 32, 32), (6, 48, 32), (5, 33, 35)])
def test_video_input_matches_conv3d(cin, cout, kernel, bias, frames_hw):
    t, h, w = frames_hw
    assert_numerically_equivalent(
        lambda: _conv(cin, cout, kernel, bias),
        lambda dtype: [torch.randn(2, cin, t, h, w, generator=torch.Generator().manual_seed(0)).to(dtype)],
        FAMILY,
    )


def test_unbatched_video_input_matches_conv3d():
    conv = _conv(3, 16, (2, 4, 4), True)
    fused = fuse_module(conv, FAMILY)
    x = torch.randn(3, 4, 8, 8)
    assert torch.allclose(fused(x), conv(x), atol=1e-5)
    assert fused(x).is_contiguous() and fused(x).shape == conv(x).shape


def test_gradients_match_conv3d():
    conv = _conv(3, 16, (2, 4, 4), True)
    fused = fuse_module(conv, FAMILY)
    x = torch.randn(5, 3, 2, 4, 4)
    conv(x).square().sum().backward()
    fused(x).square().sum().backward()
    assert torch.allclose(fused.weight.grad.view_as(conv.weight.grad), conv.weight.grad, atol=1e-4)
    assert torch.allclose(fused.bias.grad, conv.bias.grad, atol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip_is_exact(bias):
    assert_state_dict_round_trip(_conv(3, 8, (2, 4, 4), bias), FAMILY)


def test_fused_weight_is_a_view_of_the_original_storage():
    conv = _conv(3, 8, (2, 4, 4), False)
    fused = fuse_module(conv, FAMILY)
    assert fused.weight.shape == (8, 3 * 2 * 4 * 4)
    assert fused.state_dict()["weight"].data_ptr() == fused.weight.data_ptr()
    assert isinstance(fused, PatchLinearMixin) and isinstance(fused, nn.Conv3d)
    assert type(fused).__name__ == "Conv3d" and "fused=linear" in repr(fused)


class _ScaledConv3d(nn.Conv3d):
    def forward(self, input):
        return super().forward(input) * 2


@pytest.mark.parametrize(
    "module",
    [
        nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 4, 4)),  # overlapping in time
        nn.Conv3d(3, 8, kernel_size=2, stride=2, padding=1),
        nn.Conv3d(3, 8, kernel_size=2, stride=2, dilation=2),
        nn.Conv3d(4, 8, kernel_size=2, stride=2, groups=2),
        _ScaledConv3d(3, 8, kernel_size=2, stride=2),  # a forward the fused class would not reproduce
        nn.Conv2d(3, 8, kernel_size=2, stride=2),
        nn.Linear(3, 8),
    ],
    ids=["overlapping", "padding", "dilation", "groups", "custom-forward", "conv2d", "linear"],
)
def test_refuses_what_it_cannot_compute_exactly(module):
    assert FAMILY.is_fusable(module, FAMILY.options_model()) is False


def test_accepts_valid_padding_string_and_subclass_keeping_forward():
    class Plain(nn.Conv3d):
        pass

    assert FAMILY.is_fusable(nn.Conv3d(3, 8, 2, stride=2, padding="valid"), FAMILY.options_model())
    assert FAMILY.is_fusable(Plain(3, 8, 2, stride=2), FAMILY.options_model())


def test_registered_through_its_entry_point():
    registry = fusion_core.get_registry()
    family = registry.get("patch_embeddings")
    assert family.source.distribution == "fusion-patch-embeddings"
    assert family.source.plugin == "patch_embeddings"
    assert isinstance(family.spec, PatchEmbeddingsFamily)


def _rows(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(11, 3, 2, 14, 14, generator=torch.Generator().manual_seed(0)).to(dtype)]


@pytest.mark.parametrize("tiny_model", ["qwen2_vl", "glm4v"])
def test_conformance_kit(fusion_conformance, tiny_model):
    """fusion-core's pytest plugin: options schema, numerics per dtype, round trips, discovery, fused load."""
    fusion_conformance.check_family(
        FAMILY, lambda: _conv(3, 32, (2, 14, 14), True), _rows, tiny_model=tiny_model,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
    )
