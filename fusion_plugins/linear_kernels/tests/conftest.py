"""What the model and packing tests share."""

from __future__ import annotations

from collections.abc import Callable
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
