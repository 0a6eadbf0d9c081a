"""Copies of fused models: torch.save/torch.load (in a fresh process too), pickle, deepcopy, dtype casts, training."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.layout import module_plan

ALL_TEXT = {"qkv": True, "gate_up": True}
IDS = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _fused(directory: Path) -> Any:
    return fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=ALL_TEXT)


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _assert_equal_fused(copied: Any, original: Any) -> None:
    assert [type(m) for m in copied.modules()] == [type(m) for m in original.modules()]
    assert fusion_core.get_fusion_plan(copied) == fusion_core.get_fusion_plan(original)
    expected, got = original.state_dict(), copied.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    torch.testing.assert_close(_logits(copied), _logits(original), rtol=0, atol=0)
    # the copy's merged projections read the copy's own tensors
    attention = copied.model.layers[0].self_attn
    assert attention.q_proj.merged.owner is attention.qkv_proj
    assert attention.qkv_proj.weight.data_ptr() != original.model.layers[0].self_attn.qkv_proj.weight.data_ptr()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_are_equal_fused_models(llama, how, tmp_path):
    fused = _fused(llama)
    _logits(fused)  # leaves nothing cached that a copy would carry
    if how == "deepcopy":
        copied = copy.deepcopy(fused)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(fused))
    else:
        torch.save(fused, tmp_path / "model.pt")
        copied = torch.load(tmp_path / "model.pt", weights_only=False)
    _assert_equal_fused(copied, fused)
    # saving the copy writes the original checkpoint layout
    fusion_core.save_pretrained(copied, tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (llama / "model.safetensors").read_bytes()


def test_torch_load_in_a_fresh_process(llama, tmp_path):
    fused = _fused(llama)
    torch.save(fused, tmp_path / "model.pt")
    torch.save(_logits(fused), tmp_path / "logits.pt")
    torch.save(IDS, tmp_path / "ids.pt")
    script = f"""
import torch
model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)
attention = model.model.layers[0].self_attn
assert (type(attention).__name__, type(attention).__module__) == ("LlamaAttention", "fusion_core.spec")
with torch.no_grad():
    logits = model(input_ids=torch.load({str(tmp_path / 'ids.pt')!r})).logits
assert torch.equal(logits, torch.load({str(tmp_path / 'logits.pt')!r}))
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_fused_class_reference_names_its_parts():
    from fusion_qkv import QkvMixin
    from transformers.models.llama.modeling_llama import LlamaAttention

    from fusion_core import spec

    fused = spec.fused_subclass(QkvMixin, LlamaAttention)
    assert fused.__name__ == "LlamaAttention" and issubclass(fused, (QkvMixin, LlamaAttention))
    assert getattr(spec, fused.__qualname__) is fused
    assert pickle.loads(pickle.dumps(fused)) is fused
    with pytest.raises(AttributeError, match="cannot rebuild fused class"):
        getattr(spec, "fused_class[no/such/module:Mixin,transformers:Nothing]")


def test_cast_to_bfloat16_keeps_the_fused_model_working(llama):
    plain = AutoModelForCausalLM.from_pretrained(llama).to(torch.bfloat16)
    fused = _fused(llama).to(torch.bfloat16)
    assert fused.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(_logits(fused).float(), _logits(plain).float(), rtol=0, atol=3e-2)


def test_gradient_checkpointing_training_gives_the_unfused_gradients(llama):
    plain, fused = AutoModelForCausalLM.from_pretrained(llama), _fused(llama)
    for model in (plain, fused):
        model.gradient_checkpointing_enable()
        model.train()
        model(input_ids=IDS, labels=IDS).loss.backward()
    attention = fused.model.layers[0].self_attn
    grad = attention.qkv_proj.weight.grad
    plain_attention = plain.model.layers[0].self_attn
    expected = torch.cat([plain_attention.q_proj.weight.grad, plain_attention.k_proj.weight.grad,
                          plain_attention.v_proj.weight.grad])
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    assert module_plan(attention) is not None
