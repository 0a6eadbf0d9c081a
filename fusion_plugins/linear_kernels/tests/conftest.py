"""What the model and packing tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from fusion_core.testing.decisions import Times, fake_clock, original_fastest, original_slowest

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


@pytest.fixture
def fake_times(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Any, Times], None]]:
    """``fake_times(module, times)``: the decisions of ``module`` (``choice``, ``packing``, ``experts``,
    ``decode_layer``) are timed by ``times(number of ways)`` instead of a clock
    (:func:`fusion_core.testing.decisions.fake_clock`); the others keep the clock. Every ``linear_kernels`` decision is
    forgotten before and after."""
    from fusion_linear_kernels import choice, experts, packed_experts, packing, step_blocks

    from fusion_core.plugin import Decisions

    by_topic: dict[str, Times] = {}
    monkeypatch.setattr(Decisions, "times", fake_clock(by_topic))
    forget = (choice.clear_decisions, packing.clear_pack_decisions, experts.clear_decisions,
              packed_experts.clear_decisions, step_blocks.clear_decisions)
    for clear in forget:
        clear()
    yield lambda module, fake: by_topic.update({module._DECISIONS.topic: fake})
    for clear in forget:
        clear()


@pytest.fixture
def other_kernels_dense_weights(fake_times: Callable[[Any, Times], None]) -> None:
    """Every admitted kernel other than ``F.linear`` measures fastest, and packing measures slower (weights stay
    dense), so no clock decides a test; the decisions of other tests are forgotten before and after."""
    from fusion_linear_kernels import choice, packing

    fake_times(choice, original_slowest)
    fake_times(packing, original_fastest)


@pytest.fixture
def torch_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step's own attention attends with torch's ``scaled_dot_product_attention``, as the attention modules
    do (``fusion_linear_kernels.attention_kernel`` not built), so that a step gives its modules' bits."""
    from fusion_linear_kernels import attention_kernel

    monkeypatch.setattr(attention_kernel, "kernel", lambda dtype: None)


@pytest.fixture
def attended(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The attention modules each step's own attention ran for, one kernel at a time, in order."""
    from fusion_linear_kernels.decode_attention import AttentionForm
    from one_row_gemv import recorded_calls

    return recorded_calls(monkeypatch, AttentionForm, "_attend")
