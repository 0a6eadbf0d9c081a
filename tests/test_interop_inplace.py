"""fusion_core.fuse / unfuse: in place, the same plan and outputs as a fused load, and exactly back again."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import fusion_core
from fusion_core import hookimpl
from fusion_core.layout import module_plan
from fusion_core.plugins import PluginSource, get_registry
from fusion_core.spec import FusedModule
from fusion_core.testing.tiny_models import TINY_MODELS
from fusion_core.transforms import attach_plan

ALL_TEXT = {"qkv": True, "gate_up": True}
IDS = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama_and_reference(llama: Path) -> tuple[Path, Any]:
    """The shared tiny Llama checkpoint (conftest) and its plain load."""
    return llama, AutoModelForCausalLM.from_pretrained(llama)


def _logits(model: Any, **inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(**(inputs or {"input_ids": IDS})).logits


def _assert_bit_identical(model: nn.Module, reference: nn.Module) -> None:
    expected, got = reference.state_dict(), model.state_dict()
    assert list(got) == list(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), key


def test_fuse_from_config_gives_the_plan_and_outputs_of_a_fused_load(llama_and_reference, tmp_path):
    directory, reference = llama_and_reference
    built = AutoModelForCausalLM.from_config(reference.config)
    built.load_state_dict(reference.state_dict())
    expected = _logits(built)
    assert fusion_core.fuse(built, ALL_TEXT) is built
    loaded = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=ALL_TEXT)
    assert fusion_core.get_fusion_plan(built) == fusion_core.get_fusion_plan(loaded)
    assert [type(m) for m in built.modules()] == [type(m) for m in loaded.modules()]
    torch.testing.assert_close(_logits(built), expected, rtol=0, atol=1e-5)
    fusion_core.save_pretrained(built, tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()


def test_unfuse_returns_the_unfused_model_bit_for_bit(llama_and_reference, tmp_path):
    directory, reference = llama_and_reference
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=ALL_TEXT)
    assert fusion_core.unfuse(fused) is fused
    assert not any(module_plan(m) is not None or isinstance(m, FusedModule) for m in fused.modules())
    assert [type(m) for m in fused.modules()] == [type(m) for m in reference.modules()]
    assert fusion_core.get_fusion_plan(fused) is None and not hasattr(fused.config, "fusion_core")
    _assert_bit_identical(fused, reference)
    torch.testing.assert_close(_logits(fused), _logits(reference), rtol=0, atol=0)
    # every tensor has storage of its own again, as in the original model: plain transformers saves it
    fused.save_pretrained(tmp_path / "plain")
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()
    # and it fuses again
    fusion_core.fuse(fused, ALL_TEXT)
    torch.testing.assert_close(_logits(fused), _logits(reference), rtol=0, atol=1e-5)


def test_all_families_on_a_vision_language_model_round_trip(tiny_checkpoint):
    directory, reference = tiny_checkpoint("qwen2_vl")
    config = reference.config
    vision = TINY_MODELS["qwen2_vl"].make_vision_input(config, torch.Generator().manual_seed(0))
    tokens = int(vision["grid_thw"].prod()) // config.vision_config.spatial_merge_size ** 2
    ids = [10, 11, config.vision_start_token_id] + [config.image_token_id] * tokens + [config.vision_end_token_id, 12]
    inputs = {"input_ids": torch.tensor([ids]), "pixel_values": vision["hidden_states"],
              "image_grid_thw": vision["grid_thw"]}
    model = AutoModelForImageTextToText.from_pretrained(directory)
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:  # transformers 5.x
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == config.image_token_id).long()
    everything = {"patch_embeddings": True, "qkv": True, "gate_up": True}
    fusion_core.fuse(model, everything)
    loaded = fusion_core.from_pretrained(AutoModelForImageTextToText, directory, fusion_config=everything)
    assert fusion_core.get_fusion_plan(model) == fusion_core.get_fusion_plan(loaded)
    assert set(fusion_core.get_fusion_plan(model).families) == set(everything)
    torch.testing.assert_close(_logits(model, **inputs), _logits(reference, **inputs), rtol=0, atol=1e-5)
    fusion_core.unfuse(model)
    _assert_bit_identical(model, reference)


def test_fuse_refuses_what_it_cannot_do_exactly(llama_and_reference):
    directory, _ = llama_and_reference
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=ALL_TEXT)
    with pytest.raises(fusion_core.FusionError, match="already fused"):
        fusion_core.fuse(fused, ALL_TEXT)

    changed = AutoModelForCausalLM.from_pretrained(directory)
    changed.model.layers[1].self_attn.k_proj = nn.Linear(32, 24, bias=False)
    before = {k: v.clone() for k, v in changed.state_dict().items()}
    with pytest.raises(fusion_core.FusionError, match=r"module 'model\.layers\.1\.self_attn'"):
        fusion_core.fuse(changed, ALL_TEXT)
    # nothing was changed, not even the modules checked before the one at fault
    assert not any(module_plan(m) is not None for m in changed.modules())
    after = changed.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)

    with pytest.raises(fusion_core.FusionError, match="has no config"):
        fusion_core.fuse(nn.Linear(2, 2), ALL_TEXT)
    untouched = AutoModelForCausalLM.from_pretrained(directory)
    assert fusion_core.fuse(untouched, {}) is untouched and fusion_core.get_fusion_plan(untouched) is None


def test_unfuse_refuses_a_fused_class_that_cannot_undo_its_setup(llama_and_reference):
    directory, _ = llama_and_reference
    model = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=ALL_TEXT)
    attention = model.model.layers[0].self_attn

    class NoUndo(type(attention)):
        def fusion_finalize(self) -> None:
            super().fusion_finalize()

        fusion_unfinalize = FusedModule.fusion_unfinalize

    attention.__class__ = NoUndo
    attach_plan(attention, dataclasses.replace(module_plan(attention), fused_class=NoUndo))
    with pytest.raises(fusion_core.FusionError, match="no fusion_unfinalize"):
        fusion_core.unfuse(model)
    # refused before anything changed: the other layer is still fused
    assert module_plan(model.model.layers[1].self_attn) is not None


class FailsOnTheFirstGateUp:
    """Raises inside the conversion of the second module (the second family's first): it is switched, converted and
    finalized, and the module before it (the first family's) is fused, when it fails."""

    @hookimpl
    def fusion_module_fused(self, module: nn.Module, plan: Any) -> None:
        if plan.family == "gate_up" and not any(p.is_meta for p in module.parameters()):
            raise RuntimeError("broken on real data")


class FailsAfterTheConversion:
    """Raises once every module is fused, before fuse() marks the model fused."""

    @hookimpl(wrapper=True)
    def fusion_convert_loaded(self) -> Generator[None, None, None]:
        yield
        raise RuntimeError("broken after the conversion")


@pytest.mark.parametrize(("plugin", "error", "message"), [
    (FailsOnTheFirstGateUp, fusion_core.FusionLoadError,
     r"family 'gate_up' .*module 'model\.layers\.0\.mlp': .*RuntimeError: broken on real data"),
    (FailsAfterTheConversion, RuntimeError, r"^broken after the conversion$"),  # the plugin's own error, as it was
])
def test_a_failure_part_way_gives_the_model_back_as_it_was(llama_and_reference, plugin, error, message):
    directory, reference = llama_and_reference
    model = AutoModelForCausalLM.from_pretrained(directory)
    attention = model.model.layers[0].self_attn
    handle = attention.register_forward_hook(lambda module, args, output: None)
    attention.register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: None)
    before = copy.deepcopy(model)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    hooks = {name: (dict(m._forward_hooks), dict(m._state_dict_hooks), dict(m._load_state_dict_pre_hooks))
             for name, m in model.named_modules()}
    config = dict(vars(model.config))
    get_registry().register_plugin(plugin(), source=PluginSource("failing"))

    with pytest.raises(error) as failure:
        fusion_core.fuse(model, ALL_TEXT)

    assert [(n, type(m)) for n, m in model.named_modules()] == [(n, type(m)) for n, m in before.named_modules()]
    _assert_bit_identical(model, before)
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert list(after) == list(tensors) and all(after[name] is tensor for name, tensor in tensors.items())
    assert {name: (dict(m._forward_hooks), dict(m._state_dict_hooks), dict(m._load_state_dict_pre_hooks))
            for name, m in model.named_modules()} == hooks
    assert vars(model.config) == config and fusion_core.get_fusion_plan(model) is None
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=0)
    handle.remove()  # a handle taken before the call still finds its hook
    assert not attention._forward_hooks
    assert type(failure.value) is error and re.search(message, str(failure.value))
    assert [note for note in getattr(failure.value, "__notes__", []) if "was restored to its state before" in note]


def test_fused_parameters_carry_the_marks_transformers_set_on_the_parts(llama):
    """transformers 5.x marks each loaded parameter ``_is_hf_initialized`` and its ``_init_weights`` leaves a marked
    one alone, so ``model.apply(model._init_weights)`` changes nothing on a loaded plain model. The merged q/k/v and
    gate/up parameters lacked the mark, and the same call initialised them anew on the fused model without a word.
    Unfusing gives the mark back to the parts."""
    plain = AutoModelForCausalLM.from_pretrained(llama)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"qkv": True, "gate_up": True})
    marks = {name: getattr(p, "_is_hf_initialized", None) for name, p in plain.named_parameters()}
    merged = fused.model.layers[0].self_attn.qkv_proj.weight
    assert getattr(merged, "_is_hf_initialized", None) == marks["model.layers.0.self_attn.q_proj.weight"]
    before = {key: value.clone() for key, value in plain.state_dict().items()}
    for model in (plain, fused):
        torch.manual_seed(0)
        model.apply(model._init_weights)
    left = [key for key, value in plain.state_dict().items() if torch.equal(value, before[key])]
    if not left:
        pytest.skip("this transformers initialises every loaded weight again, plain included")
    got = fused.state_dict()
    assert [key for key in left if not torch.equal(got[key], before[key])] == []
    fusion_core.unfuse(fused)
    assert {name: getattr(p, "_is_hf_initialized", None) for name, p in fused.named_parameters()} == marks
