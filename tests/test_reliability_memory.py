"""Reliability: a fused load onto the CPU that would not fit in memory is refused before any weight is read.

The merged copies are computed here independently, from the checkpoint's own tensors (the parts
each merged projection concatenates), and the refusal must name them and the bytes available.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

import fusion_core
from fusion_core import memory
from fusion_core.errors import FusionError, FusionLoadError, InsufficientMemoryError
from fusion_core.patching import installed_classes

FUSION = {"qkv": True, "gate_up": True}
MERGED_PARTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")


@pytest.fixture
def calls(monkeypatch):
    """Counts transformers' from_pretrained calls: the only way a fused load reads weights."""
    counted = {"from_pretrained": 0}
    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        counted["from_pretrained"] += 1
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    return counted


def _merged_float32_bytes(directory) -> int:
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) * 4 for key in handle.keys()
                   if key.endswith(MERGED_PARTS))


def _little_memory(monkeypatch) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda: (4096, "a test's reader"))


def test_a_load_that_would_not_fit_is_refused_before_any_weight_is_read(llama, calls, monkeypatch):
    _little_memory(monkeypatch)
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    with pytest.raises(InsufficientMemoryError) as info:
        fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=FUSION, dtype=torch.float32)
    message = str(info.value)
    merged = _merged_float32_bytes(llama)
    assert f"about {merged} bytes ({merged} bytes of merged copies of families ['gate_up', 'qkv']" in message
    assert "only 4096 bytes are available (a test's reader)" in message
    assert memory.SKIP_ENV in message and "device_map" in message
    assert isinstance(info.value, FusionLoadError)
    assert calls["from_pretrained"] == 0
    assert installed_classes() == []


def test_a_cast_counts_the_whole_checkpoint_once(llama, calls, monkeypatch):
    _little_memory(monkeypatch)
    with pytest.raises(InsufficientMemoryError) as info:
        fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=FUSION, dtype=torch.float16)
    with safe_open(llama / "model.safetensors", "pt") as handle:
        stored = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}
    assert set(stored.values()) == {"F32"}  # so every tensor is cast to float16
    # the merged parts are cast once, by the merge (fusion_core.casting): their float16 copies are the merged ones
    merged = _merged_float32_bytes(llama) // 2
    total = sum(t.numel() * 2 for t in _tensors(llama))
    assert f"about {total} bytes ({merged} bytes of merged copies" in str(info.value)
    assert calls["from_pretrained"] == 0


def _tensors(directory) -> list[torch.Tensor]:
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return [handle.get_tensor(key) for key in handle.keys()]


def test_the_environment_variable_skips_the_check(llama, monkeypatch):
    _little_memory(monkeypatch)
    monkeypatch.setenv(memory.SKIP_ENV, "1")
    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=FUSION)
    assert fusion_core.get_fusion_plan(model) is not None


def test_a_load_onto_the_meta_device_is_not_checked(llama, monkeypatch):
    _little_memory(monkeypatch)
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    try:
        fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=FUSION, device_map="meta")
    except InsufficientMemoryError:
        pytest.fail("a load onto the meta device allocates no memory and must not be refused for it")
    except FusionError:  # a fused module refuses meta tensors after loading: not this check's concern
        pass


def test_a_load_that_fits_is_not_refused(llama, monkeypatch):
    monkeypatch.delenv(memory.SKIP_ENV, raising=False)
    available = memory.available_memory()
    assert available is None or available[0] > 0
    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=FUSION)
    assert fusion_core.get_fusion_plan(model) is not None
