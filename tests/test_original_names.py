"""A fused model's parameters under their original names: one source (ModulePlan.packed_parts), one user API.

``named_parameters()`` of a fused model lists what it holds (``qkv_proj.weight``); scripts that address
parameters by name (freezing, initialising, inspecting) get the original names from
``fusion_core.original_named_parameters`` / ``original_parameter``: views of the merged rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.testing.tiny_models import TEXT_MODELS, save_tiny_model

FAMILIES = {"qkv": True, "gate_up": True}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_model(TEXT_MODELS[request.param], directory)
    return directory


def test_original_names_and_values_are_the_unfused_models(checkpoint: Path) -> None:
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config=FAMILIES)
    assert any("qkv_proj" in name for name, _ in fused.named_parameters())
    originals = list(fusion_core.original_named_parameters(fused))
    assert [name for name, _ in originals] == [name for name, _ in plain.named_parameters()]
    assert all(torch.equal(tensor, plain.get_parameter(name)) for name, tensor in originals)
    assert [name for name, _ in fusion_core.original_named_parameters(plain)] == [
        name for name, _ in plain.named_parameters()]


def test_a_part_writes_through_to_the_merged_parameter(checkpoint: Path) -> None:
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config=FAMILIES)
    name = "model.layers.0.self_attn.k_proj.weight"
    with torch.no_grad():
        fusion_core.original_parameter(fused, name).zero_()
        plain.get_parameter(name).zero_()
        ids = torch.arange(1, 9).unsqueeze(0)
        assert torch.allclose(fused(ids).logits, plain(ids).logits, atol=1e-5)


def test_a_part_cannot_be_frozen_alone_and_says_so(checkpoint: Path) -> None:
    """Freezing by original name used to freeze nothing silently (the name was not there); a part is a view now."""
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config=FAMILIES)
    with pytest.raises(RuntimeError, match="leaf"):
        fusion_core.original_parameter(fused, "model.layers.0.self_attn.q_proj.weight").requires_grad_(False)


def test_packed_parts_are_the_one_description_of_the_slices(checkpoint: Path) -> None:
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config=FAMILIES)
    plan = fusion_core.get_fusion_plan(fused)
    attention = next(m for m in plan.modules if m.family == "qkv")
    parts = {part.original: part for part in attention.packed_parts()}
    q, k, v = (parts[f"{p}_proj.weight"] for p in "qkv")
    assert (q.fused, q.start, k.start, v.start) == ("qkv_proj.weight", 0, q.length, q.length + k.length)
    merged = fused.get_submodule(attention.path).qkv_proj.weight
    assert v.start + v.length == merged.shape[0]


def test_an_unknown_original_name_is_an_attribute_error(checkpoint: Path) -> None:
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config=FAMILIES)
    with pytest.raises(AttributeError, match="no_such.weight"):
        fusion_core.original_parameter(fused, "model.no_such.weight")
