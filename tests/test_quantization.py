"""Quantizers on fused models, with the real libraries (torchao, bitsandbytes, optimum-quanto on CPU).

Quantizing fused weights exactly is not implemented yet, so every path that would quantize the
unfused model's ``nn.Linear`` layers but leave the fused ones unquantized, or crash inside a kernel,
is refused by the quantization integration (``fusion-quantization``) with an error naming the
family, a module, the quantizer and the way out: at load before any weight is read, on ``fuse``,
and on the first forward and on save after a quantizer fusion-core did not see. A family that
merges no ``nn.Linear`` (``patch_embeddings``) quantizes exactly as the unfused model does.

CI runs this module in its own environment with the quantizers installed (``scripts/test.sh``).
"""

from __future__ import annotations

import pickle
from operator import attrgetter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import fusion_core
from fusion_core.compare import relative_error
from fusion_core.testing.tiny_models import TINY_MODELS

ALL_TEXT = {"qkv": True, "gate_up": True}
INT8_TOLERANCE = 1e-2
"""Relative error (:func:`fusion_core.compare.relative_error`) allowed between two int8-quantized models."""
WAY_OUT = r"quantize the unfused model, or leave the families out \(fusion_config=\{'gate_up': False, 'qkv': False\}\)"


def _broken_copy(source: Path, target: Path) -> Path:
    """``source`` with unreadable weight files: a load that reads any weight fails on them."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes() if file.suffix != ".safetensors" else b"not a header")
    return target


def _quantized_elements(model: nn.Module, quantized: Any) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and quantized(m))


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 5, 7, 9, 3]])


# -- torchao -----------------------------------------------------------------------------------
def _torchao_configs() -> list[Any]:
    quantization = pytest.importorskip("torchao.quantization")
    return [quantization.Int8WeightOnlyConfig(), quantization.Int8DynamicActivationInt8WeightConfig()]


@pytest.mark.parametrize("index", [0, 1], ids=["int8-weight-only", "int8-dynamic"])
def test_torchao_quantize_after_a_fused_load_is_refused_on_forward_and_save(llama: Path, tmp_path: Path,
                                                                             index: int) -> None:
    from torchao.quantization import quantize_

    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    with torch.no_grad():
        model(_ids())  # the fused model runs before it is quantized
    quantize_(model, _torchao_configs()[index])
    with pytest.raises(fusion_core.FusionError, match=r"torchao quantized 'model\.layers\.0\.self_attn\.o_proj' "
                       r"after the model was fused; this forward would use fused weights it did not quantize: "
                       r"family 'qkv', module 'model\.layers\.0\.self_attn' holds the nn\.Linear tensors of q_proj, "
                       r"k_proj, v_proj merged.*" + WAY_OUT):
        model(_ids())
    with pytest.raises(fusion_core.SaveError, match="torchao quantized .*this save would use fused weights"):
        fusion_core.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index", [0, 1], ids=["int8-weight-only", "int8-dynamic"])
def test_torchao_quantizes_a_fused_patch_embedding_model_exactly_as_the_unfused_one(index: int, tiny_checkpoint: Any
                                                                                  ) -> None:
    from torchao.quantization import quantize_

    directory, _ = tiny_checkpoint("qwen2_vl")
    plain = AutoModelForImageTextToText.from_pretrained(directory)
    fused = fusion_core.from_pretrained(AutoModelForImageTextToText, directory,
                                        fusion_config={"patch_embeddings": True})
    for model in (plain, fused):
        quantize_(model, _torchao_configs()[index])

    def quantized(module: nn.Module) -> bool:
        return type(module.weight).__module__.startswith("torchao")

    assert _quantized_elements(fused, quantized) == _quantized_elements(plain, quantized) > 0
    plan = fusion_core.get_fusion_plan(fused)
    assert plan is not None and plan.modules
    for module_plan in plan.modules:  # the fused Conv3d stays unquantized, as the unfused one does
        fused_module = fused.get_submodule(module_plan.path)
        assert type(fused_module.weight).__module__.startswith("torch")
        assert not type(plain.get_submodule(module_plan.path).weight).__module__.startswith("torchao")
    tiny = TINY_MODELS["qwen2_vl"]
    inputs = tiny.make_vision_input(plain.config, torch.Generator().manual_seed(0))
    with torch.no_grad():
        vision = [attrgetter(tiny.vision_path)(model)(**inputs) for model in (fused, plain)]
        vision = [getattr(v, "last_hidden_state", v) for v in vision]
        ids = torch.tensor([[1, 5, 7, 9]])
        logits = [model(input_ids=ids).logits for model in (fused, plain)]
    # Dynamic int8 activations round an input that differs in the last fp32 bit (Linear vs Conv3d)
    # to a neighbouring level now and then: the int8 tolerance, not fp32's.
    assert relative_error(vision[1], vision[0]) <= INT8_TOLERANCE
    assert relative_error(logits[1], logits[0]) <= INT8_TOLERANCE


def test_a_torchao_load_is_refused_before_any_weight_is_read(llama: Path, tmp_path: Path) -> None:
    from transformers import TorchAoConfig

    _torchao_configs()
    broken = _broken_copy(llama, tmp_path / "broken")
    config = TorchAoConfig(_torchao_configs()[0])
    with pytest.raises(fusion_core.FusionLoadError, match=r"the load quantizes with TorchAoConfig \(torchao\); the "
                       r"fused model would use fused weights it did not quantize: family 'qkv'.*" + WAY_OUT):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT, quantization_config=config)


def test_fuse_refuses_a_model_quantized_already(llama: Path) -> None:
    from torchao.quantization import quantize_

    model = AutoModelForCausalLM.from_pretrained(llama)
    quantize_(model, _torchao_configs()[0])
    with pytest.raises(fusion_core.FusionError, match=r"LlamaForCausalLM: is quantized \(torchao: "
                                                      r"'model\.layers\.0\.self_attn\.q_proj'\)"):
        fusion_core.fuse(model, ALL_TEXT)
    assert fusion_core.get_fusion_plan(model) is None


# -- bitsandbytes --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"load_in_8bit": True},
                                    {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                                    {"load_in_4bit": True, "bnb_4bit_use_double_quant": True}],
                         ids=["8bit", "nf4", "qlora-double-quant"])
def test_a_bitsandbytes_load_is_refused_before_any_weight_is_read(llama: Path, tmp_path: Path,
                                                                   kwargs: dict[str, Any]) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    broken = _broken_copy(llama, tmp_path / "broken")
    with pytest.raises(fusion_core.FusionLoadError, match=r"the load quantizes with BitsAndBytesConfig "
                       r"\(bitsandbytes\).*family 'qkv', module 'model\.layers\.0\.self_attn'.*" + WAY_OUT):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT,
                                    quantization_config=BitsAndBytesConfig(**kwargs))


# -- quanto --------------------------------------------------------------------------------------
def test_quanto_quantize_after_a_fused_load_is_refused_on_forward(llama: Path) -> None:
    quanto = pytest.importorskip("optimum.quanto")

    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    with pytest.raises(fusion_core.FusionError, match=r"optimum quantized 'model\.layers\.0\.self_attn\.o_proj'.*"
                                                      + WAY_OUT):
        model(_ids())


def test_a_quanto_load_is_refused_before_any_weight_is_read(llama: Path, tmp_path: Path) -> None:
    pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    broken = _broken_copy(llama, tmp_path / "broken")
    with pytest.raises(fusion_core.FusionLoadError, match=r"QuantoConfig \(quanto\).*family 'qkv'"):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT,
                                    quantization_config=QuantoConfig(weights="int8"))


# -- what the guard must leave alone ------------------------------------------------------------------
def test_the_guard_leaves_adapters_pickling_and_plain_use_alone(llama: Path) -> None:
    peft = pytest.importorskip("peft")

    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    plain = AutoModelForCausalLM.from_pretrained(llama)
    copied = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        torch.testing.assert_close(copied(_ids()).logits, plain(_ids()).logits)
    adapted = peft.get_peft_model(model, peft.LoraConfig(target_modules=["o_proj", "down_proj", "q_proj"]))
    with torch.no_grad():
        adapted(_ids())  # LoRA wraps sentinels (o_proj, down_proj): not a quantizer
