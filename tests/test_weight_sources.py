"""Weights from elsewhere than safetensors files load fused as plain transformers loads them.

Two of ``from_pretrained``'s sources have no safetensors headers to check before the load, so transformers'
loading report alone proves every fused weight was loaded (a tensor missing from the source raises, naming it):

- a GGUF file (``gguf_file=``): transformers reads it, dequantizes its tensors and renames them to the model's
  keys. transformers 4.57 first builds a throwaway model on the meta device to name the file's tensors; the
  fused load routes the model it returns, not that one. A save does what plain's does: 4.57 to 5.16 write
  the original layout, later 5.x releases refuse to serialize a GGUF-loaded model, and so does a fused one,
  writing nothing.
- a state dict in memory (``from_pretrained(None, config=..., state_dict=...)``).

A checkpoint saved as a ``variant`` (``model.fp16.safetensors``, sharded or not) has headers, under the
variant's file names: they are checked, and a save with the variant writes plain's bytes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import fusion_core
from fusion_core.errors import CheckpointError, FusionLoadError
from fusion_core.testing.tiny_models import TEXT_MODELS, save_tiny_model

pytest.importorskip("gguf", reason="GGUF loads need the gguf package (the test environments install it)")

from gguf_files import VOCAB, write_gguf

FIVE = int(transformers.__version__.split(".")[0]) >= 5
# transformers 4.57 splits a qwen2moe file's stacked experts by a count it does not read from the file (60),
# so plain 4.57 cannot load a tiny one; 5.x keeps them stacked.
ARCHS = ["llama", "qwen2", *(["qwen2moe"] if FIVE else [])]
FAMILIES = {"qkv": True, "gate_up": True, "linear_cross_entropy": True}
IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def integration_off():
    fusion_core.integrate_transformers(False)
    yield
    fusion_core.integrate_transformers(False)


def _file(directory: Path, arch: str, **kwargs: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    write_gguf(directory / "model.gguf", arch, **kwargs)
    return directory


def _routed(cls: Any, path: Path, fusion_config: Any, **kwargs: Any) -> Any:
    with fusion_core.integrate_transformers():
        return cls.from_pretrained(path, fusion_config=fusion_config, **kwargs)


@pytest.mark.parametrize("load", [fusion_core.from_pretrained, _routed], ids=["from_pretrained", "native-route"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_file_loads_fused_with_plain_outputs_loss_and_gradients(tmp_path: Path, arch: str, load: Any) -> None:
    path = _file(tmp_path, arch)
    plain = AutoModelForCausalLM.from_pretrained(path, gguf_file="model.gguf")
    fused = load(AutoModelForCausalLM, path, fusion_config=FAMILIES, gguf_file="model.gguf")
    plan = fusion_core.get_fusion_plan(fused)
    assert plan is not None and {m.family for m in plan.modules} == set(FAMILIES)
    assert any(isinstance(m, fusion_core.FusedModule) for m in fused.modules())

    plain.eval(), fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=IDS).logits, plain(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)

    plain.train(), fused.train()
    expected, got = plain(input_ids=IDS, labels=IDS).loss, fused(input_ids=IDS, labels=IDS).loss
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    fused_grads = {name: p.grad for name, p in fused.named_parameters()}
    for name, parameter in plain.named_parameters():
        if name in fused_grads:  # the merged q/k/v and gate/up parts: compared through the original names below
            torch.testing.assert_close(fused_grads[name], parameter.grad, rtol=1e-5, atol=1e-6, msg=name)
    merged = fused.get_submodule("model.layers.0.self_attn.qkv_proj").weight.grad
    parts = [plain.get_submodule(f"model.layers.0.self_attn.{p}_proj").weight.grad for p in "qkv"]
    torch.testing.assert_close(merged, torch.cat(parts), rtol=1e-5, atol=1e-6)


def test_a_tensor_missing_from_the_gguf_file_is_refused_by_name(tmp_path: Path) -> None:
    path = _file(tmp_path, "llama", leave_out=("blk.1.attn_k.weight",))
    _, info = AutoModelForCausalLM.from_pretrained(path, gguf_file="model.gguf", output_loading_info=True)
    assert "model.layers.1.self_attn.k_proj.weight" in info["missing_keys"]  # plain initialises it at random
    with pytest.raises(FusionLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config={"qkv": True}, gguf_file="model.gguf")


def test_saving_a_gguf_loaded_fused_model_does_what_saving_the_plain_one_does(tmp_path: Path) -> None:
    """Later 5.x releases treat a GGUF load as quantized and will not serialize it (5.22 to 5.25: "not
    serializable"), earlier ones save it (4.57 to 5.16): the fused save refuses as plain's does, writing nothing,
    or writes plain's bytes."""
    path = _file(tmp_path / "in", "qwen2")
    plain = AutoModelForCausalLM.from_pretrained(path, gguf_file="model.gguf")
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=FAMILIES, gguf_file="model.gguf")
    try:
        plain.save_pretrained(tmp_path / "plain")
    except ValueError as refused:
        with pytest.raises(type(refused), match=re.escape(str(refused)[:40])):
            fusion_core.save_pretrained(fused, tmp_path / "fused")
        assert not (tmp_path / "fused").exists() or not any((tmp_path / "fused").iterdir())
        return
    fusion_core.save_pretrained(fused, tmp_path / "fused")
    weights = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert weights and sorted(p.name for p in (tmp_path / "fused").glob("*.safetensors")) == weights
    for name in weights:
        assert (tmp_path / "fused" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


@pytest.fixture(scope="module")
def llama_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, state dict) of a tiny Llama."""
    directory = tmp_path_factory.mktemp("llama")
    save_tiny_model(TEXT_MODELS["llama"], directory)
    model = LlamaForCausalLM.from_pretrained(directory)
    return model.config, {key: tensor.clone() for key, tensor in model.state_dict().items()}


def test_a_state_dict_loads_fused_with_plain_outputs(llama_state: tuple[Any, dict[str, torch.Tensor]]) -> None:
    config, state = llama_state
    plain = LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state).eval()
    fused = fusion_core.from_pretrained(LlamaForCausalLM, None, config=config, state_dict=state,
                                        fusion_config={"qkv": True, "gate_up": True}).eval()
    assert hasattr(fused.model.layers[0].self_attn, "qkv_proj") and hasattr(fused.model.layers[0].mlp, "gate_up_proj")
    ids = IDS.clamp(max=config.vocab_size - 1)
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_a_tensor_missing_from_the_state_dict_is_refused_by_name(
    llama_state: tuple[Any, dict[str, torch.Tensor]],
) -> None:
    config, state = llama_state
    partial = {key: tensor for key, tensor in state.items() if key != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(FusionLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        fusion_core.from_pretrained(LlamaForCausalLM, None, config=config, state_dict=partial,
                                    fusion_config={"qkv": True, "gate_up": True})


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single-file", "sharded"])
def test_a_variant_checkpoint_loads_fused_and_saves_plain_bytes(tmp_path: Path, shard: str | None) -> None:
    source = tmp_path / "source"
    save_tiny_model(TEXT_MODELS["llama"], source)
    shards = {"max_shard_size": shard} if shard else {}
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(tmp_path / "variant", variant="fp16", **shards)
    assert not any((tmp_path / "variant" / name).exists()
                   for name in ("model.safetensors", "model.safetensors.index.json"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "variant", variant="fp16").eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path / "variant", variant="fp16",
                                        fusion_config={"qkv": True, "gate_up": True}).eval()
    assert hasattr(fused.model.layers[0].self_attn, "qkv_proj")
    ids = IDS.clamp(max=plain.config.vocab_size - 1)
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    plain.save_pretrained(tmp_path / "plain", variant="fp16", **shards)
    fusion_core.save_pretrained(fused, tmp_path / "fused", variant="fp16", **shards)
    weights = sorted(p.name for p in (tmp_path / "plain").glob("*.fp16*"))  # the shards and their index
    assert weights and sorted(p.name for p in (tmp_path / "fused").glob("*.fp16*")) == weights
    for name in weights:
        assert (tmp_path / "fused" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


def test_a_variant_the_checkpoint_lacks_is_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    save_tiny_model(TEXT_MODELS["llama"], tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.fp16\.safetensors"):
        fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path, variant="fp16", fusion_config={"qkv": True})
