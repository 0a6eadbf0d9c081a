"""fusion_core.merge_policy: the merged GEMM runs where it was measured faster; either way it computes the same."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional as F

import fusion_core
from fusion_core import merge_policy
from fusion_core.merge_policy import merge_decisions, merge_policy_set_to, set_merge_policy


@pytest.fixture
def measure() -> Iterator[None]:
    """The default policy, with no decision measured before the test."""
    merge_policy.clear_merge_decisions()
    with merge_policy_set_to("measure"):
        yield
    merge_policy.clear_merge_decisions()


def _models(layers: int = 2) -> tuple[nn.Module, nn.Module]:
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).eval()
    return plain, fusion_core.fuse(copy.deepcopy(plain), {"qkv": True, "gate_up": True})


def _projections(model: nn.Module) -> list:
    return [m.fused_projection for m in model.modules() if hasattr(type(m), "fused_projection")]


def _ids(tokens: int) -> torch.Tensor:
    return torch.randint(3, 100, (1, tokens), generator=torch.Generator().manual_seed(tokens))


@pytest.mark.parametrize("policy", ["never", "always", "measure"])
def test_every_policy_computes_what_the_plain_model_computes(policy, measure):
    plain, fused = _models()
    with merge_policy_set_to(policy), torch.no_grad():
        for tokens in (1, 7):
            torch.testing.assert_close(fused(_ids(tokens)).logits, plain(_ids(tokens)).logits, rtol=1e-5, atol=1e-5)
    counts = [(p.merged_gemms, p.own_gemms) for p in _projections(fused)]
    if policy == "never":
        assert all(merged == 0 and own > 0 for merged, own in counts), counts
    if policy == "always":
        assert all(merged == 2 and own == 0 for merged, own in counts), counts


def test_a_kind_is_measured_once_and_its_decision_used_by_every_layer(measure, monkeypatch):
    calls: list[tuple[int, ...]] = []

    def slower(input, weight, bias, bounds):
        calls.append(tuple(input.shape))
        return False  # as if one GEMM per part were faster

    monkeypatch.setattr(merge_policy, "_merged_is_faster", slower)
    plain, fused = _models(layers=3)
    with torch.no_grad():
        fused(_ids(5))
    # One measurement per kind (the attention's and the MLP's), in layer 0 only; every layer then runs per part.
    assert len(calls) == 2 and len(merge_decisions()) == 2 and not any(merge_decisions().values())
    assert all(p.merged_gemms == 0 and p.own_gemms > 0 for p in _projections(fused))
    with torch.no_grad():
        fused(_ids(6))  # 5 and 6 rows round up to the same power of two: no new measurement
    assert len(calls) == 2
    with torch.no_grad():
        torch.testing.assert_close(fused(_ids(9)).logits, plain(_ids(9)).logits, rtol=1e-5, atol=1e-5)
    assert len(calls) == 4 and {rows for _, rows, _ in calls} == {5, 9}
    with merge_policy_set_to("always"), torch.no_grad():  # a policy set later overrides what was measured
        fused(_ids(9))
    assert all(p.merged_gemms == 1 for p in _projections(fused))


def test_a_kind_measured_faster_merged_runs_the_merged_gemm(measure, monkeypatch):
    monkeypatch.setattr(merge_policy, "_merged_is_faster", lambda *args: True)
    _, fused = _models()
    with torch.no_grad():
        fused(_ids(4))
    assert all(p.merged_gemms == 1 and p.own_gemms == 0 for p in _projections(fused))


def test_the_measurement_picks_the_faster_way(measure, monkeypatch):
    """A GEMM library on which wide GEMMs are slow: the measurement must see it and stop merging."""
    wide = 20  # rows of the merged q/k/v weight of this toy; each part has fewer
    real_linear = F.linear

    def linear(input, weight, bias=None):
        if weight.shape[0] >= wide:
            time.sleep(0.005)
        return real_linear(input, weight, bias)

    monkeypatch.setattr(merge_policy.F, "linear", linear)
    weight, bias = torch.randn(wide, 8), torch.randn(wide)
    bounds = ((0, 12), (12, 16), (16, 20))
    assert merge_policy._merged_is_faster(torch.randn(3, 8), weight, bias, bounds) is False
    monkeypatch.setattr(merge_policy.F, "linear", real_linear)

    def slow_narrow(input, weight, bias=None):
        if weight.shape[0] < wide:
            time.sleep(0.005)
        return real_linear(input, weight, bias)

    monkeypatch.setattr(merge_policy.F, "linear", slow_narrow)
    assert merge_policy._merged_is_faster(torch.randn(3, 8), weight, bias, bounds) is True


def test_a_real_measurement_is_recorded_by_kind(measure):
    plain, fused = _models()
    with torch.no_grad():
        torch.testing.assert_close(fused(_ids(3)).logits, plain(_ids(3)).logits, rtol=1e-5, atol=1e-5)
    decisions = merge_decisions()
    assert len(decisions) == 2 and all(isinstance(v, bool) for v in decisions.values())
    device, dtype, shape, sizes, _, bucket, weight_class = next(iter(decisions))
    assert (device, dtype, bucket, weight_class) == ("cpu", torch.float32, 2, "torch") and sum(sizes) == shape[0]


def test_meta_tensors_merge_and_decide_nothing(measure):
    merged = _projections(_models()[1])[0]
    weight = merged.weight.to("meta")
    meta_input = torch.empty(2, weight.shape[1], device="meta")
    kind = merge_policy.kind_of(meta_input, weight, merged.sizes, False)
    assert merge_policy.merge_pays(kind, meta_input, weight, None, merged.bounds) is True
    assert merge_decisions() == {}


def test_a_part_written_in_place_under_autograd_gets_the_gradients_of_the_original():
    """With autograd each part is its own view, so a parent may write one in place as with nn.Linear."""

    class ScalesQuery(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q_proj(x)
            q.mul_(0.5)
            return torch.cat([q, self.k_proj(x), self.v_proj(x)], dim=-1)

    from fusion_qkv import QkvFamily

    from fusion_core.testing.kit import fuse_module

    torch.manual_seed(0)
    original = ScalesQuery()
    fused = fuse_module(original, QkvFamily())
    x = torch.randn(3, 8)
    with merge_policy_set_to("always"):
        fused(x).square().sum().backward()
    original(x).square().sum().backward()
    assert fused.fused_projection.merged_gemms == 1
    expected = torch.cat([original.q_proj.weight.grad, original.k_proj.weight.grad, original.v_proj.weight.grad])
    torch.testing.assert_close(fused.qkv_proj.weight.grad, expected, rtol=1e-5, atol=1e-6)


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown merge policy 'sometimes'; expected one of measure, always, never"):
        set_merge_policy("sometimes")  # type: ignore[arg-type]
    env = {**os.environ, "FUSION_CORE_MERGE": "sometimes"}
    proc = subprocess.run([sys.executable, "-c", "import fusion_core.merge_policy"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "environment variable FUSION_CORE_MERGE: unknown merge policy" in proc.stderr


def test_the_environment_sets_the_starting_policy():
    env = {**os.environ, "FUSION_CORE_MERGE": "Never"}
    code = "from fusion_core.merge_policy import merge_policy; print(merge_policy())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "never", proc.stderr
