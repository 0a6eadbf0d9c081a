"""Families at the model's root: a family may fuse the ``*ForCausalLM`` class itself, composing with the others.

A root module carries its :class:`~fusion_core.ModulePlan` beside the model's
:class:`~fusion_core.FusionPlan`; both survive a load, a save in the original layout and ``unfuse``.
A family that declares ``preserves = "training_loss"`` is held by the conformance kit to exactly
that: the loss and every gradient in training mode with labels, and the original outputs elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fusion_core
from fusion_core.testing import kit


class _Root(fusion_core.FusedModule):
    """A root fusion that only changes the class (what a loss fusion starts from)."""


class _LossScaled(fusion_core.FusedModule):
    """A broken training fusion: its loss is off by 1%."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().forward(*args, **kwargs)
        if outputs.loss is not None:
            outputs.loss = outputs.loss * 1.01
        return outputs


class _LogitsShifted(fusion_core.FusedModule):
    """A broken training fusion: without labels its logits are not the original's."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().forward(*args, **kwargs)
        if kwargs.get("labels") is None:
            outputs.logits = outputs.logits + 1e-3
        return outputs


def _root_family(mixin: type, preserves: str = "outputs") -> fusion_core.FusionFamily[Any]:
    class RootFamily(fusion_core.FusionFamily[fusion_core.FamilyOptions]):
        """Fuses the causal LM's own class."""

        name = "root_test"
        target_modules_patterns = ("^$",)
        fused_mixin = mixin

        def is_fusable(self, module: nn.Module, options: fusion_core.FamilyOptions) -> bool:
            return type(module).__name__.endswith("ForCausalLM")

    family = RootFamily()
    family.preserves = preserves  # type: ignore[misc]
    return family


def test_a_root_family_composes_saves_the_original_layout_and_unfuses(llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    fusion_core.register_family(_root_family(_Root))
    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama,
                                        fusion_config={"root_test": True, "qkv": True, "gate_up": True})
    plan = fusion_core.get_fusion_plan(model)
    assert plan is not None and set(plan.families) == {"root_test", "qkv", "gate_up"}
    assert isinstance(model, _Root) and plan.by_path()[""].family == "root_test"
    plain = AutoModelForCausalLM.from_pretrained(llama)
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        assert kit.relative_error(plain(ids).logits, model(ids).logits) <= kit.TOLERANCES[torch.float32]
    fusion_core.save_pretrained(model, tmp_path / "saved")
    assert kit.compare_checkpoints(llama, tmp_path / "saved").ok  # names, dtypes, shapes, bytes
    fusion_core.unfuse(model)
    assert type(model) is type(plain) and fusion_core.get_fusion_plan(model) is None


def test_the_kit_accepts_a_root_family_that_preserves_the_training_loss(tmp_path: Path) -> None:
    kit.assert_fused_load(_root_family(_Root, "training_loss"), "llama", tmp_path)


@pytest.mark.parametrize(("mixin", "message"), [(_LossScaled, "training loss"), (_LogitsShifted, "without labels")])
def test_the_kit_catches_a_family_that_breaks_its_training_declaration(mixin: type, message: str,
                                                                       tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=message):
        kit.assert_fused_load(_root_family(mixin, "training_loss"), "llama", tmp_path)


def test_a_fused_root_keeps_the_key_renames_of_its_class(tmp_path: Path) -> None:
    """transformers 5.x renames Qwen2-VL's legacy keys by the model class; a fused root class must get the same
    renames (it is not "custom code"), or the load would leave the language model unloaded."""
    from fusion_core.testing.tiny_models import TINY_MODELS, auto_class, save_tiny_model

    tiny = TINY_MODELS["qwen2_vl"]
    if tiny.make_config() is None:
        pytest.skip("this transformers has no Qwen2-VL")
    save_tiny_model(tiny, tmp_path / "source")

    class VlRoot(fusion_core.FusionFamily[fusion_core.FamilyOptions]):
        """Fuses the conditional-generation class itself."""

        name = "vl_root"
        target_modules_patterns = ("^$",)
        fused_mixin = _Root

        def is_fusable(self, module: nn.Module, options: fusion_core.FamilyOptions) -> bool:
            return True

    fusion_core.register_family(VlRoot())
    plain = auto_class(tiny).from_pretrained(tmp_path / "source")
    fused = fusion_core.from_pretrained(auto_class(tiny), tmp_path / "source", fusion_config={"vl_root": True})
    assert isinstance(fused, _Root)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fused.state_dict().values(), strict=True))
    fusion_core.save_pretrained(fused, tmp_path / "saved")
    assert kit.compare_checkpoints(tmp_path / "source", tmp_path / "saved").ok


def test_a_root_fused_by_class_only_is_held_to_every_key_below_it(llama: Path, tmp_path: Path) -> None:
    """A missing key is tolerated for a layer fused by class only (a new head, initialised as plain does), never
    for a module with children: a key missing below a fused root fails the load, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(llama, tmp_path / "partial")
    shard = next((tmp_path / "partial").glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    fusion_core.register_family(_root_family(_Root))
    from transformers import AutoModelForCausalLM

    with pytest.raises(fusion_core.FusionLoadError, match=r"missing key 'model\.layers\.0\.mlp\.down_proj\.weight'"):
        fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path / "partial", fusion_config={"root_test": True})


def test_a_declaration_the_core_does_not_know_is_refused_at_registration() -> None:
    """A misspelt ``preserves`` value would otherwise leave the family held to nothing but the default."""
    with pytest.raises(fusion_core.PluginError, match="preserves must be one of .*'training_loss'.*got 'loss'"):
        fusion_core.register_family(_root_family(_Root, "loss"))
