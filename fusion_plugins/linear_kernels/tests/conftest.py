"""What the model and packing tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

#: The layers the LoRA tests adapt: merged slices (q/v), packed layers (o/down) and the head.
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]


@pytest.fixture
def lora() -> Callable[[Any], Any]:
    """``lora(model)``: the model with a seeded LoRA adapter on :data:`LORA_TARGETS` (random A and B, so the
    adapter changes the output); skipped where PEFT is not installed."""
    peft = pytest.importorskip("peft")

    def attach(model: Any) -> Any:
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
        return peft.get_peft_model(model, config)

    return attach


def _original_slowest(ways: Any, device: Any) -> list[float]:
    return [1.0] + [0.5] * (len(ways) - 1)  # every timer lists the original way (F.linear, the dense weight) first


def _original_fastest(ways: Any, device: Any) -> list[float]:
    return [0.5] + [1.0] * (len(ways) - 1)


@pytest.fixture
def other_kernels_dense_weights(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every admitted kernel other than ``F.linear`` measures fastest, and packing measures slower (weights stay
    dense), so no clock decides a test; the decisions of other tests are forgotten before and after."""
    from fusion_linear_kernels import choice, packing

    monkeypatch.setattr(choice, "best_times", _original_slowest)
    monkeypatch.setattr(packing, "best_times", _original_fastest)
    choice.clear_decisions()
    packing.clear_pack_decisions()
    yield
    choice.clear_decisions()
    packing.clear_pack_decisions()
