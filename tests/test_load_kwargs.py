"""Keyword arguments that ``from_pretrained`` routes into the config reach it through fusion-core too.

``num_labels``, ``id2label``, ``output_hidden_states``, a RoPE setting, any config attribute:
plain transformers offers them to the config class and passes on only what the config does not
take. Through :func:`fusion_core.from_pretrained` and the opt-in native route, a fused load must
end with the config, the head and the outputs of the plain load of the same arguments.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import fusion_core
from fusion_core.record import RECORD_KEY

QKV = {"qkv": True, "gate_up": True}
IDS = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
LABELS = {"id2label": {0: "neg", 1: "neutral", 2: "pos"}, "label2id": {"neg": 0, "neutral": 1, "pos": 2}}
# 5.x keeps the RoPE settings in rope_parameters (rope_scaling alone no longer loads plain); 4.57 in rope_scaling.
ROPE = (
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    if hasattr(LlamaConfig(), "rope_parameters") else {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
)
CLASSIFIERS = [AutoModelForSequenceClassification, LlamaForSequenceClassification]
CAUSAL = [AutoModelForCausalLM, LlamaForCausalLM]


@pytest.fixture(autouse=True)
def integration_off():
    fusion_core.integrate_transformers(False)
    yield
    fusion_core.integrate_transformers(False)


def _config(model: torch.nn.Module) -> dict[str, Any]:
    """The config as ``save_pretrained`` writes it, without the record of what fusion-core applied."""
    data = model.config.to_dict()
    data.pop(RECORD_KEY, None)
    return data


def _plain_and_fused(cls: Any, path: Any, load: Any = None, **kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The plain load and the fused one (by ``load``, default fusion_core.from_pretrained), each from seed 0."""
    torch.manual_seed(0)
    plain = cls.from_pretrained(path, **kwargs)
    torch.manual_seed(0)
    fused = (load or fusion_core.from_pretrained)(cls, path, fusion_config=QKV, **kwargs)
    assert fusion_core.get_fusion_plan(fused) is not None
    return plain, fused


def _assert_same_model(plain: torch.nn.Module, fused: torch.nn.Module, head: str, same_path: bool = True) -> None:
    expected, got = _config(plain), _config(fused)
    if not same_path:
        del expected["_name_or_path"], got["_name_or_path"]
    assert got == expected
    assert fused.get_submodule(head).weight.shape == plain.get_submodule(head).weight.shape
    assert fused.get_submodule(head).weight.dtype == plain.get_submodule(head).weight.dtype
    with torch.no_grad():
        expected, got = plain(input_ids=IDS), fused(input_ids=IDS)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    if plain.config.output_hidden_states:
        assert len(got.hidden_states) == len(expected.hidden_states)
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", CLASSIFIERS, ids=["auto", "model-class"])
@pytest.mark.parametrize("overrides", [
    {"num_labels": 3},
    LABELS,
    {"output_hidden_states": True},
    {"num_labels": 3, "dtype": torch.float64},
], ids=["num_labels", "id2label", "output_hidden_states", "num_labels+dtype"])
def test_config_overrides_give_the_plain_config_head_and_logits(cls, overrides, llama):
    plain, fused = _plain_and_fused(cls, llama, **overrides)
    _assert_same_model(plain, fused, "score")
    for key in ("num_labels", "output_hidden_states"):
        if key in overrides:
            assert getattr(fused.config, key) == overrides[key]
    if "id2label" in overrides:
        assert fused.config.id2label == overrides["id2label"] and fused.config.label2id == overrides["label2id"]


@pytest.mark.parametrize("cls", CAUSAL, ids=["auto", "model-class"])
def test_a_rope_override_reaches_the_fused_causal_lm(cls, llama):
    plain, fused = _plain_and_fused(cls, llama, **ROPE)
    name, value = next(iter(ROPE.items()))
    assert getattr(fused.config, name)["factor"] == value["factor"]
    _assert_same_model(plain, fused, "lm_head")


@pytest.mark.parametrize("cls", [*CLASSIFIERS, LlamaForCausalLM], ids=["auto", "model-class", "causal-lm"])
def test_the_native_route_takes_config_overrides(cls, llama):
    overrides = {"num_labels": 3, "output_hidden_states": True} if cls is not LlamaForCausalLM else ROPE

    def routed(model_cls: Any, path: Any, fusion_config: Any, **kwargs: Any) -> torch.nn.Module:
        with fusion_core.integrate_transformers():
            return model_cls.from_pretrained(path, fusion_config=fusion_config, **kwargs)

    plain, fused = _plain_and_fused(cls, llama, load=routed, **overrides)
    _assert_same_model(plain, fused, "lm_head" if cls is LlamaForCausalLM else "score")


def test_a_config_object_takes_no_override_as_in_transformers(llama):
    """With ``config=`` given, transformers hands the other arguments to the model's ``__init__``; so does fusion."""
    config = AutoConfig.from_pretrained(llama)
    with pytest.raises(TypeError, match="num_labels") as plain:
        LlamaForSequenceClassification.from_pretrained(llama, config=config, num_labels=3)
    with pytest.raises(TypeError, match="num_labels") as fused:
        fusion_core.from_pretrained(LlamaForSequenceClassification, llama, fusion_config=QKV, config=config,
                                    num_labels=3)
    assert str(fused.value) == str(plain.value)


def test_an_override_the_config_does_not_take_reaches_the_model_as_in_transformers(llama):
    with pytest.raises(TypeError, match="not_a_config_attribute") as plain:
        LlamaForCausalLM.from_pretrained(llama, not_a_config_attribute=1)
    with pytest.raises(TypeError, match="not_a_config_attribute") as fused:
        fusion_core.from_pretrained(LlamaForCausalLM, llama, fusion_config=QKV, not_a_config_attribute=1)
    assert str(fused.value) == str(plain.value)


def test_a_fused_layout_checkpoint_takes_config_overrides(llama, tmp_path):
    torch.manual_seed(0)
    plain = LlamaForSequenceClassification.from_pretrained(llama, **LABELS)
    fusion_core.save_pretrained(fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=QKV),
                                tmp_path, save_original_format=False)
    for cls in CLASSIFIERS:
        torch.manual_seed(0)
        fused = fusion_core.from_pretrained(cls, tmp_path, **LABELS)
        assert fused.config.id2label == plain.config.id2label and fused.score.weight.shape == (3, 32)
        _assert_same_model(plain, fused, "score", same_path=False)


# -- any config attribute (hypothesis) ---------------------------------------------------------
def _parameter_shapes(cls: Any, config: Any, **overrides: Any) -> dict[str, tuple[int, ...]] | None:
    """Parameter shapes of ``cls`` for ``config`` with ``overrides`` (meta device); None if it cannot be built."""
    try:
        changed = config.__class__.from_dict(config.to_dict(), **overrides)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a drawn size of 0 warns of zero-element tensors
            model = cls(changed)
    except Exception:
        return None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@st.composite
def attribute_overrides(draw: st.DrawFn, config: Any, cls: Any) -> dict[str, Any]:
    """One top-level config attribute holding a bool or an int, with a new value that keeps every parameter's shape.

    A change of shape is left out: plain transformers then initialises the weight at random,
    where a fused load refuses (no silent weights), which is not what this property is about.
    """
    scalars = sorted(k for k, v in config.to_dict().items()
                     if not k.startswith("_") and isinstance(v, (bool, int)) and hasattr(config, k))
    name = draw(st.sampled_from(scalars))
    old = getattr(config, name)
    value = (not old) if isinstance(old, bool) else draw(st.integers(0, 8).filter(lambda v: v != old))
    shapes = _parameter_shapes(cls, config, **{name: value})
    assume(shapes is not None and shapes == _parameter_shapes(cls, config))
    return {name: value}


@pytest.fixture(scope="module")
def llama_config(llama):
    return AutoConfig.from_pretrained(llama)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.filter_too_much])
@given(data=st.data())
def test_any_config_attribute_gives_the_plain_config(data, llama, llama_config):
    cls = data.draw(st.sampled_from(CAUSAL), label="class")
    overrides = data.draw(attribute_overrides(llama_config, LlamaForCausalLM), label="overrides")
    try:
        plain = cls.from_pretrained(llama, **overrides)
    except Exception as exc:  # a value the plain load refuses: the fused load refuses it alike
        with pytest.raises(type(exc)):
            fusion_core.from_pretrained(cls, llama, fusion_config=QKV, **overrides)
        return
    fused = fusion_core.from_pretrained(cls, llama, fusion_config=QKV, **overrides)
    assert _config(fused) == _config(plain)
    name = next(iter(overrides))
    assert getattr(fused.config, name) == getattr(plain.config, name)
