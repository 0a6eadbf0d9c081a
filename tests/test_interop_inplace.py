"""fusion_core.fuse / unfuse: in place, the same plan and outputs as a fused load, and exactly back again."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import fusion_core
from fusion_core import inplace
from fusion_core.layout import module_plan
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


def test_a_failure_on_real_data_unfuses_what_was_already_fused(llama_and_reference, monkeypatch):
    directory, reference = llama_and_reference
    model = AutoModelForCausalLM.from_pretrained(directory)
    real = inplace.fuse_instance
    calls = []

    def fails_on_the_third(module: nn.Module, plan: Any, verified: Any = None) -> None:
        calls.append(plan.path)
        if len(calls) == 3:
            raise RuntimeError("broken op")
        real(module, plan, verified)

    monkeypatch.setattr(inplace, "fuse_instance", fails_on_the_third)
    with pytest.raises(fusion_core.FusionLoadError, match=r"broken op .*fused before it were unfused again"):
        fusion_core.fuse(model, ALL_TEXT)
    assert not any(module_plan(m) is not None for m in model.modules())
    _assert_bit_identical(model, reference)
