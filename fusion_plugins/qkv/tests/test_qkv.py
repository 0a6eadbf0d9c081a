"""The qkv family on its own: which attention modules it takes, and that the fused ones are exact."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import transformers
from fusion_qkv import QkvFamily, QkvMixin, QkvOptions
from fusion_qkv.family import CROSS_ATTENTION_PATHS, refusal
from torch import nn

import fusion_core
from fusion_core.plugin import MergedSlice
from fusion_core.testing import kit
from fusion_core.testing.kit import (
    TOLERANCES,
    assert_numerically_equivalent,
    assert_state_dict_round_trip,
    fuse_module,
)
from fusion_core.testing.tiny_models import TEXT_MODELS

FAMILY = QkvFamily()
OPTIONS = FAMILY.options_model()
TEXT = list(TEXT_MODELS)


def _model(name: str, attn: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config = TEXT_MODELS[name].make_config()
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _tensor_output(module: nn.Module) -> nn.Module:
    """The same attention, returning its output tensor only (the kit compares tensors)."""
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {"forward": lambda self, *a, **k: cls.forward(self, *a, **k)[0]})
    return module


def _attention_case(name: str, attn: str = "eager"):
    def module_factory() -> nn.Module:
        return _tensor_output(_model(name, attn).model.layers[0].self_attn)

    def inputs_factory(dtype: torch.dtype):
        model = _model(name, attn)
        hidden = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        cos, sin = model.model.rotary_emb(hidden, torch.arange(5).expand(2, 5))
        return [hidden, (cos.to(dtype), sin.to(dtype)), None]

    return module_factory, inputs_factory


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", TEXT)
def test_attention_matches_the_original(name, attn):
    module_factory, inputs_factory = _attention_case(name, attn)
    errors = assert_numerically_equivalent(module_factory, inputs_factory, FAMILY,
                                           dtypes=(torch.float32, torch.bfloat16, torch.float16))
    assert errors[torch.float32] <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("name", TEXT)
def test_state_dict_round_trip_is_exact(name):
    assert_state_dict_round_trip(_model(name).model.layers[0].self_attn, FAMILY)


def test_one_merged_gemm_per_forward_and_the_cache_is_released():
    module_factory, inputs_factory = _attention_case("qwen2")
    original = module_factory()
    fused = fuse_module(original, FAMILY)
    assert isinstance(fused, QkvMixin) and type(fused).__name__ == type(original).__name__
    assert all(isinstance(getattr(fused, p), MergedSlice) for p in ("q_proj", "k_proj", "v_proj"))
    assert fused.qkv_proj.weight.shape == (32 + 16 + 16, 32) and fused.qkv_proj.bias.shape == (64,)
    merged = fused.fused_projection
    with torch.no_grad():
        for step in range(3):
            assert torch.allclose(fused(*inputs_factory(torch.float32)), original(*inputs_factory(torch.float32)),
                                  atol=1e-6)
            assert (merged.merged_gemms, merged.own_gemms) == (step + 1, 0)
            assert merged._cache is None


def _projections(name: str = "llama_bias"):
    attn = _model(name).model.layers[0].self_attn
    return attn, fuse_module(attn, FAMILY)


def test_each_projection_is_exact_for_any_input_and_order():
    attn, fused = _projections()
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    # k first, then v and q on another input, then q on the first one: every answer is its own Linear's.
    for proj, inp in [("k_proj", x), ("v_proj", y), ("q_proj", y), ("q_proj", x), ("v_proj", x)]:
        assert torch.allclose(getattr(fused, proj)(inp), getattr(attn, proj)(inp), atol=1e-6), proj


def test_partly_used_merged_output_switches_the_module_to_own_gemms():
    attn, fused = _projections()
    merged = fused.fused_projection
    x, memory = torch.randn(2, 4, 32), torch.randn(2, 6, 32)
    for _ in range(2):  # cross-attention style use: q on x, k and v on other states
        assert torch.allclose(fused.q_proj(x), attn.q_proj(x), atol=1e-6)
        assert torch.allclose(fused.k_proj(memory), attn.k_proj(memory), atol=1e-6)
        assert torch.allclose(fused.v_proj(memory), attn.v_proj(memory), atol=1e-6)
    assert merged.merging is False and merged.merged_gemms == 1 and merged._cache is None


def test_input_changed_in_place_is_not_served_from_the_cache():
    attn, fused = _projections()
    x = torch.randn(2, 32)
    fused.q_proj(x)
    x.mul_(3)
    assert torch.allclose(fused.k_proj(x), attn.k_proj(x), atol=1e-6)
    assert torch.allclose(fused.v_proj(x), attn.v_proj(x), atol=1e-6)


def test_grad_mode_and_inference_mode():
    attn, fused = _projections()
    x = torch.randn(2, 32)
    with torch.no_grad():
        fused.q_proj(x)
    k = fused.k_proj(x)  # grad enabled now: must not reuse the no-grad output
    assert k.requires_grad and torch.allclose(k, attn.k_proj(x), atol=1e-6)
    with torch.inference_mode():
        xi = torch.randn(2, 32)
        q, k, v = fused.q_proj(xi), fused.k_proj(xi), fused.v_proj(xi)
        assert torch.allclose(torch.cat([q, k, v], -1), torch.cat([attn.q_proj(xi), attn.k_proj(xi), attn.v_proj(xi)],
                                                                  -1), atol=1e-6)


def test_gradients_match_the_original():
    module_factory, inputs_factory = _attention_case("llama_bias")
    original = module_factory()
    fused = fuse_module(original, FAMILY)
    inputs = inputs_factory(torch.float32)
    original(*inputs).square().sum().backward()
    fused(*inputs).square().sum().backward()
    expected_w = torch.cat([getattr(original, p).weight.grad for p in ("q_proj", "k_proj", "v_proj")])
    expected_b = torch.cat([getattr(original, p).bias.grad for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.allclose(fused.qkv_proj.weight.grad, expected_w, atol=1e-5)
    assert torch.allclose(fused.qkv_proj.bias.grad, expected_b, atol=1e-5)


def test_slices_are_views_and_follow_copies_and_dtype_changes():
    attn, fused = _projections()
    assert fused.k_proj.weight.data_ptr() == fused.qkv_proj.weight[32:].data_ptr()
    assert torch.equal(fused.v_proj.bias, attn.v_proj.bias)
    clone = copy.deepcopy(fused)
    with torch.no_grad():
        clone.qkv_proj.weight.zero_()
    assert not fused.q_proj.weight.eq(0).all() and clone.q_proj.weight.eq(0).all()
    half = copy.deepcopy(fused).to(torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    assert half.q_proj(x).dtype == torch.bfloat16
    assert torch.equal(half.q_proj(x), copy.deepcopy(attn).to(torch.bfloat16).q_proj(x))


class _CustomLinear(nn.Linear):
    def forward(self, input):
        return super().forward(input) * 2


def _refused(mutate) -> nn.Module:
    attn = _model("llama_bias").model.layers[0].self_attn
    mutate(attn)
    return attn


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda a: setattr(a, "is_cross_attention", True), "cross-attention"),
        (lambda a: setattr(a, "k_proj", nn.Linear(24, 16)) or setattr(a, "v_proj", nn.Linear(24, 16)), "width"),
        (lambda a: setattr(a, "q_proj", _CustomLinear(32, 32)), "plain nn.Linear"),
        (lambda a: setattr(a, "v_proj", nn.Conv1d(32, 16, 1)), "plain nn.Linear"),
        (lambda a: a.k_proj.to(torch.bfloat16), "dtype"),
        (lambda a: setattr(a, "v_proj", a.k_proj), "share"),
        (lambda a: setattr(a, "qkv_proj", nn.Linear(32, 64)), "already has"),
        (lambda a: delattr(a, "q_proj"), "no q/k/v projection"),
    ],
    ids=["is_cross_attention", "kv-width", "custom-forward", "conv1d", "dtype", "shared",
         "existing-qkv_proj", "no-q_proj"],
)
def test_refuses_what_it_cannot_compute_exactly_or_usefully(mutate, reason):
    attn = _refused(mutate)
    assert FAMILY.is_fusable(attn, OPTIONS) is False
    assert reason in refusal(attn)


def test_refuses_real_cross_attention_and_single_qkv_classes():
    vl = transformers.Qwen2VLConfig(vision_config=dict(depth=1, embed_dim=32, num_heads=4, hidden_size=32))
    with torch.device("meta"):
        vision = transformers.Qwen2VLForConditionalGeneration(vl).model.visual
    assert not any(FAMILY.is_fusable(m, OPTIONS) for m in vision.modules())
    from transformers.models.mllama import configuration_mllama, modeling_mllama

    mllama = modeling_mllama.MllamaTextCrossAttention
    config = configuration_mllama.MllamaTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    assert FAMILY.is_fusable(mllama(config, layer_idx=0), OPTIONS) is False


@pytest.mark.parametrize(
    ("path", "considered"),
    [
        ("model.layers.0.self_attn", True),
        ("model.decoder.layers.1.self_attn", True),
        ("model.decoder.layers.1.encoder_attn", False),
        ("decoder.block.0.layer.1.EncDecAttention", False),
        ("model.layers.3.cross_attn", False),
        ("text.layers.2.crossattention", False),
        ("model.layers.3.cross_attn_norm_gate_holder.attn", True),
    ],
)
def test_cross_attention_paths_are_not_considered(path, considered):
    assert (re.search(CROSS_ATTENTION_PATHS, path) is None) is considered


def test_cross_attention_paths_stay_excluded_whatever_the_user_excludes():
    assert CROSS_ATTENTION_PATHS in QkvOptions().exclude_modules
    assert QkvOptions(exclude_modules=["vision"]).exclude_modules == ("vision", CROSS_ATTENTION_PATHS)


def test_registered_through_its_entry_point():
    family = fusion_core.get_registry().get("qkv")
    assert family.source.distribution == "fusion-qkv" and family.source.plugin == "qkv"
    assert isinstance(family.spec, QkvFamily)


def test_options_schema_and_transforms_through_the_kit():
    kit.assert_options_schema(FAMILY)
    for name in TEXT:
        attn = _model(name).model.layers[0].self_attn
        bound = kit.assert_transform_round_trip(attn, FAMILY)
        assert [t.targets[0].name for t in bound] == (
            ["qkv_proj.weight", "qkv_proj.bias"] if attn.q_proj.bias is not None else ["qkv_proj.weight"]
        )


@pytest.mark.parametrize("name", TEXT)
def test_discovery_plans_every_self_attention(name):
    config = TEXT_MODELS[name].make_config()
    plan = kit.assert_discovers(FAMILY, (transformers.AutoModelForCausalLM, config),
                                expected_modules=[f"model.layers.{i}.self_attn" for i in range(2)])
    assert all(m.fused_class.__name__ == m.original_class.__name__ for m in plan.modules)


@pytest.mark.parametrize("tiny", ["qwen2_vl", "qwen3_vl"])
def test_fused_load_through_the_kit(tiny, tmp_path):
    comparison = kit.assert_fused_load(FAMILY, tiny, tmp_path)
    assert comparison.modules and all(".visual." not in m.module for m in comparison.modules)


def test_block_sparse_attention_is_declined_so_the_model_loads_runs_short_inputs_and_saves(tmp_path):
    """BigBird rebuilds a block-sparse attention from its q/k/v children when an input is short; fused, its
    tensors would leave the module tree and the save would be refused. Declined, the model stays plain there."""
    config = transformers.BigBirdConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=128, max_position_embeddings=256,
                                        block_size=4, num_random_blocks=2, attention_type="block_sparse")
    transformers.BigBirdForMaskedLM(config).save_pretrained(tmp_path / "source")
    model = fusion_core.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path / "source",
                                        fusion_config={"qkv": {"required": False}})
    plan = fusion_core.get_fusion_plan(model)
    assert plan is not None and not plan.modules
    assert {reason for _, _, reason in plan.refused} == {refusal(model.bert.encoder.layer[0].attention.self)}
    assert "block-sparse" in plan.refused[0][2]
    plain = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "source")
    with torch.no_grad():
        ids = torch.randint(0, 128, (1, 8))  # short: the model switches itself to full attention
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)
    fusion_core.save_pretrained(model, tmp_path / "saved")
    plain.save_pretrained(tmp_path / "plain-saved")  # 5.0 renames LayerNorm tensors on save: plain's save is the bar
    assert kit.compare_checkpoints(tmp_path / "plain-saved", tmp_path / "saved").ok
