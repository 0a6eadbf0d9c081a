"""PEFT LoRA on fused models by the original module names, compared with the same LoRA on the unfused model.

Each test builds the same adapter (same seed, non-zero LoRA weights) on the unfused and the fused
model and checks what a user sees: outputs, adapter files, merged checkpoints, gradients.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM

import fusion_core
from fusion_core.compat.peft import LORA_MODULE
from fusion_core.merged import MergedSlice

BOTH = {"qkv": True, "gate_up": True}
TARGETS = ["q_proj", "v_proj", "gate_proj"]
IDS = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _plain(directory: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(directory)


def _fused(directory: Path) -> Any:
    return fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=BOTH)


def _lora(model: Any, targets: list[str] | str = TARGETS, seed: int = 0, **options: Any) -> Any:
    torch.manual_seed(seed)  # init_lora_weights=False: random A and B, so the adapter changes the output
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                            **options))


def _logits(model: Any, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _assert_same_files(a: Path, b: Path, name: str) -> None:
    left, right = load_file(a / name), load_file(b / name)
    assert list(left) and sorted(left) == sorted(right)
    for key in left:
        assert left[key].shape == right[key].shape and torch.equal(left[key], right[key]), key


def test_lora_by_original_names_matches_the_unfused_model(llama, tmp_path):
    plain, fused = _lora(_plain(llama)), _lora(_fused(llama))
    attention = fused.base_model.model.model.layers[0].self_attn
    assert isinstance(attention.q_proj.base_layer, MergedSlice)
    assert not torch.equal(_logits(plain), _logits(_plain(llama)))  # the adapter does something
    torch.testing.assert_close(_logits(fused), _logits(plain), rtol=0, atol=1e-5)
    # q, k and v still share one GEMM under the adapter
    assert attention.fused_projection.merged_gemms > 0 and attention.fused_projection.own_gemms == 0

    plain.save_pretrained(tmp_path / "plain")
    fused.save_pretrained(tmp_path / "fused")
    _assert_same_files(tmp_path / "plain", tmp_path / "fused", "adapter_model.safetensors")


def test_wrapped_model_state_dict_is_the_unfused_one(llama):
    plain, fused = _lora(_plain(llama)), _lora(_fused(llama))
    expected, got = plain.state_dict(), fused.state_dict()
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in expected
    assert list(got) == list(expected)
    assert all(torch.equal(got[key], expected[key]) for key in expected)
    # and the full state dict of the unfused wrapped model loads into the fused one
    other = _lora(_fused(llama), seed=3)
    other.load_state_dict(expected)
    torch.testing.assert_close(_logits(other), _logits(plain), rtol=0, atol=1e-5)


def test_all_linear_targets_the_same_modules(llama):
    plain, fused = _lora(_plain(llama), targets="all-linear"), _lora(_fused(llama), targets="all-linear")
    assert sorted(fused.targeted_module_names) == sorted(plain.targeted_module_names)
    assert any(name.endswith("q_proj") for name in plain.targeted_module_names)
    torch.testing.assert_close(_logits(fused), _logits(plain), rtol=0, atol=1e-5)


def test_adapters_load_both_ways(llama, tmp_path):
    plain, fused = _lora(_plain(llama), seed=1), _lora(_fused(llama), seed=2)
    plain.save_pretrained(tmp_path / "from-plain")
    fused.save_pretrained(tmp_path / "from-fused")
    onto_fused = PeftModel.from_pretrained(_fused(llama), tmp_path / "from-plain")
    onto_plain = PeftModel.from_pretrained(_plain(llama), tmp_path / "from-fused")
    torch.testing.assert_close(_logits(onto_fused), _logits(plain), rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(onto_plain), _logits(fused), rtol=0, atol=1e-5)


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_and_unload_saves_the_checkpoint_the_unfused_merge_saves(llama, tmp_path, safe_merge):
    plain = _lora(_plain(llama)).merge_and_unload(safe_merge=safe_merge)
    fused = _lora(_fused(llama)).merge_and_unload(safe_merge=safe_merge)
    assert isinstance(fused.model.layers[0].self_attn.q_proj, MergedSlice)
    torch.testing.assert_close(_logits(fused), _logits(plain), rtol=0, atol=1e-5)
    plain.save_pretrained(tmp_path / "plain")
    fusion_core.save_pretrained(fused, tmp_path / "fused")
    saved = [(tmp_path / side / "model.safetensors").read_bytes() for side in ("plain", "fused")]
    assert saved[0] == saved[1]


def test_unload_several_adapters_and_set_adapter(llama):
    reference = _logits(_fused(llama))
    plain, fused = _lora(_plain(llama)), _lora(_fused(llama))
    for model in (plain, fused):
        torch.manual_seed(5)
        model.add_adapter("second", LoraConfig(r=2, target_modules=["k_proj", "up_proj"], init_lora_weights=False))
    for name in ("second", "default"):
        plain.set_adapter(name)
        fused.set_adapter(name)
        torch.testing.assert_close(_logits(fused), _logits(plain), rtol=0, atol=1e-5)
    with fused.disable_adapter():
        torch.testing.assert_close(_logits(fused), reference, rtol=0, atol=0)
    # merging then unmerging restores the fused weights
    fused.merge_adapter()
    torch.testing.assert_close(_logits(fused), _logits(plain), rtol=0, atol=1e-5)
    fused.unmerge_adapter()
    base = fused.unload()
    assert isinstance(base.model.layers[0].self_attn.k_proj, MergedSlice)
    torch.testing.assert_close(_logits(base), reference, rtol=0, atol=1e-5)


def test_training_gradients_match(llama):
    plain, fused = _lora(_plain(llama)), _lora(_fused(llama))
    for model in (plain, fused):
        model.train()
        model(input_ids=IDS, labels=IDS).loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.requires_grad}
    assert grads and sorted(grads) == sorted(fused_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert not any(p.requires_grad for n, p in fused.named_parameters() if "qkv_proj" in n or "gate_up_proj" in n)


def test_fusing_or_unfusing_a_model_with_adapters_is_refused(llama):
    with_adapter = _lora(_plain(llama)).base_model.model
    with pytest.raises(fusion_core.FusionError, match="adapter layers"):
        fusion_core.fuse(with_adapter, BOTH)
    fused = _lora(_fused(llama)).base_model.model
    with pytest.raises(fusion_core.FusionError, match="merge_and_unload"):
        fusion_core.unfuse(fused)


def test_targeting_the_merged_container_names_the_projections(llama):
    with pytest.raises(ValueError, match="q_proj/k_proj/v_proj"):
        _lora(_fused(llama), targets=["qkv_proj"])


def test_lora_on_a_fused_patch_embedding(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("videomae")
    pixels = torch.randn(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    plain = _lora(AutoModel.from_pretrained(directory), targets=["projection"])
    fused = _lora(fusion_core.from_pretrained(AutoModel, directory, fusion_config={"patch_embeddings": True}),
                  targets=["projection"])

    def hidden(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(pixel_values=pixels).last_hidden_state

    torch.testing.assert_close(hidden(fused), hidden(plain), rtol=0, atol=1e-5)
    plain.save_pretrained(tmp_path / "plain")
    fused.save_pretrained(tmp_path / "fused")
    _assert_same_files(tmp_path / "plain", tmp_path / "fused", "adapter_model.safetensors")
    merged_plain, merged_fused = plain.merge_and_unload(), fused.merge_and_unload()
    torch.testing.assert_close(hidden(merged_fused), hidden(merged_plain), rtol=0, atol=1e-5)
    merged_plain.save_pretrained(tmp_path / "merged-plain")
    fusion_core.save_pretrained(merged_fused, tmp_path / "merged-fused")
    assert ((tmp_path / "merged-plain" / "model.safetensors").read_bytes()
            == (tmp_path / "merged-fused" / "model.safetensors").read_bytes())


def test_peft_imported_after_the_fused_load_is_taught_too(llama):
    # The integration waits for PEFT's import instead of importing it at load time.
    script = f"""
import sys
import fusion_core
from transformers import AutoModelForCausalLM
model = fusion_core.from_pretrained(AutoModelForCausalLM, {str(llama)!r}, fusion_config={BOTH!r})
assert "peft" not in sys.modules
from peft import LoraConfig, get_peft_model
lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
print(type(lora.base_model.model.model.layers[0].self_attn.q_proj).__name__)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "FusedLinear", result.stderr[-3000:]



# A PEFT release whose LoraModel has no _create_new_module of its own (it inherits the factory from BaseTuner, so
# PEFT's LoRA still works): its LoRA module runs, then the name moves, before the integration's import hook wraps it.
_RELEASE_WITHOUT_THE_FACTORY = """
import importlib.machinery
find_spec = importlib.machinery.PathFinder.find_spec

def without_the_factory(fullname, path=None, target=None):
    spec = find_spec(fullname, path, target)
    if fullname == "peft.tuners.lora.model" and spec is not None:
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.BaseTuner._create_new_module = module.LoraModel.__dict__["_create_new_module"]
            del module.LoraModel._create_new_module

        spec.loader.exec_module = exec_module
    return spec

importlib.machinery.PathFinder.find_spec = without_the_factory
"""


def test_a_peft_release_without_the_factory_imports_and_refuses_only_lora_on_a_fused_model(llama):
    script = _RELEASE_WITHOUT_THE_FACTORY + f"""
import fusion_core
from transformers import AutoModelForCausalLM
fused = fusion_core.from_pretrained(AutoModelForCausalLM, {str(llama)!r}, fusion_config={BOTH!r})
import peft
from peft import LoraConfig, get_peft_model
assert "_create_new_module" not in peft.tuners.lora.model.LoraModel.__dict__
config = LoraConfig(r=2, target_modules=["q_proj"])
plain = get_peft_model(AutoModelForCausalLM.from_pretrained({str(llama)!r}), config)
assert type(plain.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear"
try:
    get_peft_model(fused, config)
except ImportError as exc:
    print(exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    message = result.stdout.strip()
    assert f"peft {peft.__version__} has no LoraModel._create_new_module" in message, message
    assert "needs fusion-peft" in message and "'model.layers.0.self_attn'" in message, message


def test_a_fused_load_next_to_such_a_peft_loads_and_refuses_lora_there(llama, monkeypatch):
    from fusion_peft import lora

    class LoraModel:  # the release's LoRA tuner, without the private factory
        def __init__(self, model: Any, peft_config: Any, adapter_name: str) -> None:
            self.model = model

    release = types.ModuleType(LORA_MODULE)
    release.LoraModel = LoraModel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, LORA_MODULE, release)  # imported before the fused load
    monkeypatch.setattr(lora, "_state", {"installed": False, "finder": False})  # as in a fresh process
    fused = _fused(llama)
    assert LoraModel(_plain(llama), None, "default").model is not None
    with pytest.raises(ImportError, match=rf"needs fusion-peft.*peft {peft.__version__} has no LoraModel\."
                                          r"_create_new_module.*'model\.layers\.0\.self_attn'"):
        LoraModel(model=fused, peft_config=None, adapter_name="default")


def test_lora_on_a_merged_container_is_refused_naming_its_parts(llama: Path) -> None:
    """The merged container holds rows of several projections: LoRA targets those by their original names."""
    with pytest.raises(ValueError, match=r"merged container of q_proj/k_proj/v_proj.*target.*original"):
        _lora(_fused(llama), ["qkv_proj"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_initialisation_that_rewrites_the_base_weight_reaches_the_fused_tensors(llama, init, dtype, tmp_path):
    """PiSSA sets ``base_layer.weight.data`` to the residual, and OLoRA does too where the weight is not float32.
    PEFT does this on fusion-core's stand-in of the original layer, whose tensors were then dropped: the fused
    model kept the original weights, and adapter plus base gave other outputs than plain's (0.17 and 0.24 in
    bfloat16), with no word."""
    plain = AutoModelForCausalLM.from_pretrained(llama, dtype=dtype)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=BOTH, dtype=dtype)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    targets = [*TARGETS, "o_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=init)
    plain, fused = get_peft_model(plain, config), get_peft_model(fused, config)
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits, **tolerance)
    second = LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, init_lora_weights=init)
    for model in (plain, fused):  # a second adapter goes through update_layer on the existing LoRA layers
        model.add_adapter("second", second)
        model.set_adapter("second")
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits, **tolerance)
    for model, side in ((plain, "plain"), (fused, "fused")):
        model.get_base_model().save_pretrained(tmp_path / side)  # the residual base, as PiSSA users save it
    saved = [load_file(tmp_path / side / "model.safetensors") for side in ("plain", "fused")]
    assert sorted(saved[0]) == sorted(saved[1])
    for key in saved[0]:
        torch.testing.assert_close(saved[1][key], saved[0][key], **tolerance)
