"""The gate_up family on its own: which MLPs it takes, and that the fused ones are exact."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from fusion_gate_up import GateUpFamily, GateUpMixin
from fusion_gate_up.family import refusal
from torch import nn

import fusion_core
from fusion_core.plugin import MergedSlice
from fusion_core.testing import kit
from fusion_core.testing.kit import (
    TOLERANCES,
    assert_numerically_equivalent,
    assert_state_dict_round_trip,
    compare_checkpoints,
    fuse_module,
)
from fusion_core.testing.tiny_models import TEXT_MODELS

FAMILY = GateUpFamily()
OPTIONS = FAMILY.options_model()
TEXT = list(TEXT_MODELS)


def _mlp(name: str) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(TEXT_MODELS[name].make_config()).model.layers[0].mlp.eval()


def _inputs(dtype: torch.dtype):
    return [torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)).to(dtype)]


@pytest.mark.parametrize("name", TEXT)
def test_mlp_matches_the_original(name):
    errors = assert_numerically_equivalent(lambda: _mlp(name), _inputs, FAMILY,
                                           dtypes=(torch.float32, torch.bfloat16, torch.float16))
    assert errors[torch.float32] <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("name", TEXT)
def test_state_dict_round_trip_is_exact(name):
    assert_state_dict_round_trip(_mlp(name), FAMILY)


def test_one_merged_gemm_per_forward_and_the_original_forward_runs():
    original = _mlp("llama_bias")
    fused = fuse_module(original, FAMILY)
    assert isinstance(fused, GateUpMixin) and type(fused).__name__ == type(original).__name__
    assert type(fused).forward is type(original).forward  # the MLP's own forward, not a copy
    assert isinstance(fused.gate_proj, MergedSlice) and isinstance(fused.up_proj, MergedSlice)
    assert type(fused.down_proj) is nn.Linear
    assert fused.gate_up_proj.weight.shape == (128, 32) and fused.gate_up_proj.bias.shape == (128,)
    merged = fused.fused_projection
    with torch.no_grad():
        for step in range(3):
            x = _inputs(torch.float32)[0]
            assert torch.allclose(fused(x), original(x), atol=1e-6)
            assert (merged.merged_gemms, merged.own_gemms, merged._cache) == (step + 1, 0, None)


class _UpFirstMLP(nn.Module):
    """A gated MLP whose forward calls up before gate and scales between them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        up = self.up_proj(x)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * up * 0.5)


class _TwoInputMLP(_UpFirstMLP):
    """Reads one input per the source (``other`` may be ``x``), but may be given two at run time."""

    def forward(self, x, other=None):
        other = x if other is None else other
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(other))


class _CrossInputMLP(_UpFirstMLP):
    def forward(self, x, other):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(other))


@pytest.mark.parametrize("cls", [_UpFirstMLP, _TwoInputMLP])
def test_any_forward_is_computed_exactly(cls):
    errors = assert_numerically_equivalent(cls, lambda dtype: [torch.randn(3, 16).to(dtype)], FAMILY)
    assert errors[torch.float32] <= TOLERANCES[torch.float32]


def test_two_input_forward_stops_merging():
    original = _TwoInputMLP()
    fused = fuse_module(original, FAMILY)
    for _ in range(3):
        x = torch.randn(3, 16)
        assert torch.allclose(fused(x, x.flip(0)), original(x, x.flip(0)), atol=1e-6)
    assert fused.fused_projection.merging is False and fused.fused_projection.merged_gemms == 1


def test_gradients_and_copies():
    original = _mlp("llama_bias")
    fused = fuse_module(original, FAMILY)
    x = torch.randn(4, 32)
    original(x).square().sum().backward()
    fused(x).square().sum().backward()
    assert torch.allclose(fused.gate_up_proj.weight.grad,
                          torch.cat([original.gate_proj.weight.grad, original.up_proj.weight.grad]), atol=1e-5)
    assert torch.allclose(fused.down_proj.weight.grad, original.down_proj.weight.grad, atol=1e-5)
    clone = copy.deepcopy(fused)
    with torch.no_grad():
        clone.gate_up_proj.weight.zero_()
    assert clone.up_proj.weight.eq(0).all() and not fused.up_proj.weight.eq(0).all()


class _Custom(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x) * 1.5


class _CustomLinear(nn.Linear):
    def forward(self, input):
        return super().forward(input) + 1


def _set_act(mlp: nn.Module, act) -> None:
    del mlp.act_fn  # a child module cannot be overwritten by a plain function
    mlp.act_fn = act


def _mutated(mutate) -> nn.Module:
    mlp = _mlp("llama_bias")
    mutate(mlp)
    return mlp


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda m: setattr(m, "act_fn", _Custom()), "unknown activation"),
        (lambda m: setattr(m, "act_fn", nn.GLU()), "unknown activation"),
        (lambda m: setattr(m, "act_fn", nn.Softmax(-1)), "unknown activation"),
        (lambda m: _set_act(m, lambda x: x * 2), "unknown activation"),
        (lambda m: delattr(m, "act_fn"), "no activation self.act_fn"),
        (lambda m: setattr(m, "up_proj", _CustomLinear(32, 64)), "plain nn.Linear"),
        (lambda m: setattr(m, "up_proj", nn.Linear(32, 48)), "differ in shape"),
        (lambda m: setattr(m, "down_proj", nn.Linear(32, 32)), "no down projection"),
        (lambda m: m.up_proj.to(torch.float16), "dtype"),
        (lambda m: m.up_proj.register_parameter("bias", None), "bias on one"),
        (lambda m: setattr(m, "up_proj", m.gate_proj), "share"),
        (lambda m: setattr(m, "gate_up_proj", nn.Linear(32, 128)), "already has"),
        (lambda m: delattr(m, "down_proj"), "no down projection"),
    ],
    ids=["custom-activation", "glu", "softmax", "lambda", "no-activation", "custom-linear", "gate-up-shapes",
         "down-width", "dtype", "partial-bias", "shared", "existing-gate_up_proj", "no-down_proj"],
)
def test_refuses_what_it_does_not_recognise(mutate, reason):
    mlp = _mutated(mutate)
    assert FAMILY.is_fusable(mlp, OPTIONS) is False
    assert reason in refusal(mlp)


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(approximate="tanh"), nn.ReLU(), torch.nn.functional.silu])
def test_accepts_known_elementwise_activations(act):
    mlp = _mlp("llama")
    _set_act(mlp, act)
    assert FAMILY.is_fusable(mlp, OPTIONS) is True


def test_refuses_mlps_that_are_not_gated():
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)
    phi3 = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   vocab_size=64, pad_token_id=0)
    with torch.device("meta"):
        models = [transformers.GPT2LMHeadModel(gpt2), transformers.Phi3ForCausalLM(phi3)]
    for model in models:
        assert not any(FAMILY.is_fusable(m, OPTIONS) for m in model.modules()), type(model).__name__


def test_registered_through_its_entry_point():
    family = fusion_core.get_registry().get("gate_up")
    assert family.source.distribution == "fusion-gate-up" and family.source.plugin == "gate_up"
    assert isinstance(family.spec, GateUpFamily)


def test_options_schema_and_transforms_through_the_kit():
    kit.assert_options_schema(FAMILY)
    for name in TEXT:
        mlp = _mlp(name)
        bound = kit.assert_transform_round_trip(mlp, FAMILY)
        assert [t.targets[0].name for t in bound] == (
            ["gate_up_proj.weight", "gate_up_proj.bias"] if mlp.gate_proj.bias is not None else ["gate_up_proj.weight"]
        )


@pytest.mark.parametrize("name", TEXT)
def test_discovery_plans_every_mlp(name):
    config = TEXT_MODELS[name].make_config()
    kit.assert_discovers(FAMILY, (transformers.AutoModelForCausalLM, config),
                         expected_modules=[f"model.layers.{i}.mlp" for i in range(2)])


@pytest.mark.parametrize("tiny", ["qwen2_vl", "qwen3_vl"])
def test_fused_load_through_the_kit(tiny, tmp_path):
    comparison = kit.assert_fused_load(FAMILY, tiny, tmp_path)
    assert comparison.modules and all("language_model" in m.module for m in comparison.modules)


def test_refuses_gate_and_up_of_different_inputs():
    mlp = _CrossInputMLP()
    assert FAMILY.is_fusable(mlp, OPTIONS) is False
    assert "applies gate_proj and up_proj to different inputs" in refusal(mlp)


def _t5_gated() -> tuple[type, transformers.PretrainedConfig]:
    return transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_decoder_layers=1, num_heads=4,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0)


def _lfm2() -> tuple[type, transformers.PretrainedConfig]:
    return transformers.Lfm2ForCausalLM, transformers.Lfm2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)


@pytest.mark.parametrize(
    ("make", "mlps", "names"),
    [(_t5_gated, ["encoder.block.0.layer.1.DenseReluDense", "decoder.block.0.layer.2.DenseReluDense"],
      ("wi_0", "wi_1")),
     (_lfm2, ["model.layers.0.feed_forward", "model.layers.1.feed_forward"], ("w1", "w3"))],
    ids=["t5-gated-gelu", "lfm2"],
)
def test_other_namings_load_fused_exactly_and_save_back(make, mlps, names, tmp_path):
    model_cls, config = make()
    torch.manual_seed(0)
    model_cls(config).save_pretrained(tmp_path / "source")
    plain = model_cls.from_pretrained(tmp_path / "source").eval()
    with kit.registered(FAMILY):
        fused = fusion_core.from_pretrained(model_cls, tmp_path / "source", fusion_config={"gate_up": True}).eval()
    assert sorted(m.path for m in fusion_core.get_fusion_plan(fused).modules) == sorted(mlps)
    for path in mlps:  # fused under the original child names, which PEFT targets
        mlp = fused.get_submodule(path)
        assert isinstance(mlp, GateUpMixin) and all(isinstance(getattr(mlp, n), MergedSlice) for n in names)
    fusion_core.save_pretrained(fused, tmp_path / "saved")
    assert compare_checkpoints(tmp_path / "source", tmp_path / "saved").ok  # byte for byte
    reloaded = model_cls.from_pretrained(tmp_path / "saved").eval()
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    extra = {"decoder_input_ids": ids[:, :3]} if config.is_encoder_decoder else {}
    with torch.no_grad():
        expected = plain(input_ids=ids, **extra).logits
        # the merged GEMM may round differently from two GEMMs (LFM2: 4e-8), within float32 noise
        torch.testing.assert_close(fused(input_ids=ids, **extra).logits, expected, atol=1e-6, rtol=0)
        assert torch.equal(reloaded(input_ids=ids, **extra).logits, expected)
