"""fusion_core.merged as a building block: a toy family of two merged projections, checked against the original."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from fusion_core import Concat, FusionFamily, WeightTransform
from fusion_core.layout import unfuse_instance
from fusion_core.merged import (
    MergedProjectionsMixin,
    MergedSlice,
    is_plain_linear,
    merge_children,
    merge_refusal,
)
from fusion_core.testing.kit import fuse_module


class TwoHeads(nn.Module):
    """Reads its input twice; a second input goes to b_proj only when given (the cross-attention shape)."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.a_proj = nn.Linear(8, 6, bias=bias)
        self.b_proj = nn.Linear(8, 4, bias=bias)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat([self.a_proj(x), self.b_proj(x if other is None else other)], dim=-1)


class TwoHeadsMixin(MergedProjectionsMixin):
    projections = ("a_proj", "b_proj")
    container = "ab_proj"


class TwoHeadsFamily(FusionFamily):
    """Toy: a_proj and b_proj as one merged projection."""

    name = "two_heads"
    fused_mixin = TwoHeadsMixin

    def is_fusable(self, module: nn.Module, options: Any) -> bool:
        children = [module._modules.get(p) for p in TwoHeadsMixin.projections]
        return all(is_plain_linear(c) for c in children) and merge_refusal(module, children, "ab_proj") is None

    def make_transforms(self, config: Any, options: Any) -> list[WeightTransform]:
        return [
            WeightTransform(("a_proj.weight", "b_proj.weight"), ("ab_proj.weight",), Concat(n=2, dim=0)),
            WeightTransform(("a_proj.bias", "b_proj.bias"), ("ab_proj.bias",), Concat(n=2, dim=0), optional=True),
        ]


def _pair(bias: bool = True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    original = TwoHeads(bias)
    return original, fuse_module(original, TwoHeadsFamily())


@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_module_computes_what_the_original_computed_with_one_gemm(bias):
    original, fused = _pair(bias)
    x = torch.randn(3, 8)
    assert isinstance(fused.a_proj, MergedSlice) and fused.b_proj.out_features == 4
    assert tuple(fused.ab_proj.weight.shape) == (10, 8)
    torch.testing.assert_close(fused(x), original(x), rtol=0, atol=1e-6)
    merged = fused.fused_projection
    assert (merged.merged_gemms, merged.own_gemms, merged._cache) == (1, 0, None)
    # weight and bias of a slice are views of the merged tensors, rows in concatenation order
    assert fused.b_proj.weight.data_ptr() == fused.ab_proj.weight[6:].data_ptr()
    assert torch.equal(fused.b_proj.weight, original.b_proj.weight)


def test_a_second_input_is_answered_from_the_slice_rows_and_merging_stops():
    original, fused = _pair()
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(fused(x, other), original(x, other), rtol=0, atol=1e-6)
    merged = fused.fused_projection
    assert merged.merging is False and merged.own_gemms == 1
    torch.testing.assert_close(fused(x), original(x), rtol=0, atol=1e-6)
    assert merged.merged_gemms == 1 and merged.own_gemms == 3


def test_a_tensor_written_in_place_between_calls_is_not_answered_from_the_cache():
    _, fused = _pair()
    x = torch.randn(3, 8)
    first = fused.a_proj(x)
    x.mul_(2)  # same object, new version: the cached merged output is stale
    torch.testing.assert_close(fused.b_proj(x), nn.functional.linear(x, fused.b_proj.weight, fused.b_proj.bias))
    assert first.shape == (3, 6)


def test_gradients_reach_the_merged_weight_as_they_reached_the_originals():
    original, fused = _pair()
    x = torch.randn(3, 8)
    original(x).square().sum().backward()
    fused(x).square().sum().backward()
    expected = torch.cat([original.a_proj.weight.grad, original.b_proj.weight.grad])
    torch.testing.assert_close(fused.ab_proj.weight.grad, expected, rtol=1e-5, atol=1e-6)


def test_copies_keep_their_slices_on_their_own_tensors_and_carry_no_cache():
    _, fused = _pair()
    x = torch.randn(3, 8)
    fused.a_proj(x)  # leaves a cached merged output
    for copied in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert copied.fused_projection._cache is None
        assert copied.a_proj.merged.owner is copied.ab_proj
        torch.testing.assert_close(copied(x), fused(x), rtol=0, atol=0)


def test_unfuse_puts_the_original_projections_back():
    original, fused = _pair()
    unfuse_instance(fused)
    assert type(fused) is TwoHeads and type(fused.a_proj) is nn.Linear and "ab_proj" not in fused._modules
    expected, got = original.state_dict(), fused.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_merge_children_names_the_module_whose_container_is_wrong():
    module = TwoHeads()
    with pytest.raises(RuntimeError, match=r"TwoHeads: no merged ab_proj.weight"):
        merge_children(module, ("a_proj", "b_proj"), "ab_proj")
    module.ab_proj = nn.Module()
    module.ab_proj.weight = nn.Parameter(torch.zeros(9, 8))
    with pytest.raises(RuntimeError, match=r"has shape \(9, 8\), expected \(10, 8\)"):
        merge_children(module, ("a_proj", "b_proj"), "ab_proj")


def test_refusals_shared_by_merging_families():
    module = TwoHeads()
    assert merge_refusal(module, [module.a_proj, module.b_proj], "ab_proj") is None
    module.b_proj.to(torch.float64)
    assert "dtype" in merge_refusal(module, [module.a_proj, module.b_proj], "ab_proj")
    module = TwoHeads()
    module.ab_proj = nn.Linear(1, 1)
    assert "already has a 'ab_proj'" in merge_refusal(module, [module.a_proj, module.b_proj], "ab_proj")

    class OwnForward(nn.Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input) * 2

    assert is_plain_linear(nn.Linear(2, 2)) and not is_plain_linear(OwnForward(2, 2))
    assert not is_plain_linear(nn.Conv1d(2, 2, 1))
