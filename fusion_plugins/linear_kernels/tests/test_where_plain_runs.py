"""Where plain transformers loads and runs, a load with linear_kernels does too (transformers' own model tests,
run as a new user would, found two refusals).

- A layer the checkpoint does not hold (a new classification head on a causal-LM checkpoint, or one
  re-initialised with ``ignore_mismatched_sizes=True``): transformers initialises it and reports it as it
  does for the plain model, and the layer is packed (or left dense) after that.
- A dtype this CPU's oneDNN cannot pack (float16 without avx512_fp16/avx_ne_convert: the repack raises):
  the weight stays dense, and the decision says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fusion_linear_kernels import LinearKernelsMixin, packing
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import fusion_core
from fusion_core.testing.decisions import original_slowest
from fusion_core.testing.tiny_models import TEXT_MODELS

pytestmark = pytest.mark.usefixtures("other_kernels_dense_weights")
IDS = torch.tensor([[5, 17, 42, 9]])


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("causal-lm")
    config = TEXT_MODELS["llama"].make_config()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _both(load: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The plain and the fused model, each built from the same seed (the new head draws the same numbers)."""
    torch.manual_seed(1)
    plain = load(None)  # type: ignore[operator]
    torch.manual_seed(1)
    fused = load({"linear_kernels": True})  # type: ignore[operator]
    return plain.eval(), fused.eval()


def test_a_new_head_on_a_causal_lm_checkpoint_loads_and_runs_as_plain(causal_lm: Path) -> None:
    def load(fusion_config: dict[str, bool] | None) -> torch.nn.Module:
        if fusion_config is None:
            return AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=3)
        return fusion_core.from_pretrained(AutoModelForSequenceClassification, causal_lm, num_labels=3,
                                           fusion_config=fusion_config)

    plain, fused = _both(load)
    assert isinstance(fused.score, LinearKernelsMixin)
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits)


def test_a_head_reinitialised_for_other_sizes_loads_and_runs_as_plain(causal_lm: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=2).save_pretrained(tmp_path / "two")

    def load(fusion_config: dict[str, bool] | None) -> torch.nn.Module:
        kwargs = {"num_labels": 5, "ignore_mismatched_sizes": True}
        if fusion_config is None:
            return AutoModelForSequenceClassification.from_pretrained(tmp_path / "two", **kwargs)
        return fusion_core.from_pretrained(AutoModelForSequenceClassification, tmp_path / "two",
                                           fusion_config=fusion_config, **kwargs)

    plain, fused = _both(load)
    assert fused.score.weight.shape[0] == 5
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits)


def test_a_dtype_onednn_cannot_pack_here_stays_dense(monkeypatch: pytest.MonkeyPatch, fake_times: Any) -> None:
    def refuse(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: float16 is not supported on this CPU")

    monkeypatch.setattr(packing.compat, "pack", refuse)
    fake_times(packing, original_slowest)  # packing wins
    config = TEXT_MODELS["llama"].make_config()
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config).half().eval()
    model = AutoModelForCausalLM.from_config(config).half().eval()
    model.load_state_dict(plain.state_dict())
    fusion_core.fuse(model, {"linear_kernels": True})
    assert not any(packing.is_packed(p) for p in model.parameters())
    assert any("oneDNN refused to pack it" in why for _, why in packing.pack_decisions().values())
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, plain(IDS).logits)
