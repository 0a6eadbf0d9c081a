"""Quantizers on fused models, with the real libraries (torchao, bitsandbytes, optimum-quanto on CPU).

After a fused load, torchao's ``quantize_`` and quanto's ``quantize`` quantize the merged
projections (their containers are ``nn.Linear``) exactly as the parts on the unfused model: the
same elements quantized, each part's quantized data and scales bit-equal, one quantized GEMM per
merged projection. What cannot be quantized exactly is refused by the quantization integration
(``fusion-quantization``) naming the family, a module, the quantizer and the way out: a quantizing
load before any weight is read, ``fuse`` of a quantized model, a fused tensor a quantizer left
alone (on the first forward and on save), LoRA on a quantized merged projection. A family that
merges no ``nn.Linear`` (``patch_embeddings``) quantizes exactly as the unfused model does.

CI runs this module in its own environment with the quantizers installed (``scripts/test.sh``).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from operator import attrgetter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import fusion_core
from fusion_core import FusedModule, FusionFamily, Transpose, WeightTransform
from fusion_core.compare import TOLERANCES, relative_error
from fusion_core.testing.tiny_models import TEXT_MODELS, TINY_MODELS, TinyModel, TinyTextModel, save_tiny_model

for _library in ("torchao", "bitsandbytes", "optimum.quanto"):
    pytest.importorskip(_library, reason=f"{_library} is not installed here: scripts/test.sh runs this module in the "
                                         "quant-tf5 / quant-tf4 environments, which have the quantizers")

ALL_TEXT = {"qkv": True, "gate_up": True}
INT8_TOLERANCE = 1e-2
"""Relative error (:func:`fusion_core.compare.relative_error`) allowed between two int8-quantized models."""
WAY_OUT = r"quantize the unfused model, or leave the families out \(fusion_config=\{'gate_up': False, 'qkv': False\}\)"

# bitsandbytes 4-bit on CPU. Where bitsandbytes reports avx512-bf16 (``bitsandbytes.functional.has_avx512bf16()``:
# Intel Xeons with AVX-512 BF16 / AMX, AMD Zen 4), ``Linear4bit.forward`` repacks its weight for that kernel
# (bitsandbytes 0.50.2 ``nn/modules.py``: ``_convert_weight_packed_for_cpu``) at the first forward whose input is on
# the CPU and needs no gradient, in eval mode (inference, and QLoRA's frozen base layers). The repacking asserts
# ``out_features % 32 == 0`` and reshapes the block scales to ``(out_features, in_features // 64)``, so it fails
# unless ``in_features`` is a whole number of 64-element blocks: ``RuntimeError: shape '[32, 0]' is invalid for
# input of size 16`` at ``in_features`` 32, the unfused model as the fused one. Every model a 4-bit test quantizes is
# therefore at least that wide (``TEXT_4BIT``: hidden size 64, MLP 128, q/k/v/o 64 wide, k/v 32 rows; its
# Qwen2-VL: vision width 64, patches of 3 x 2 x 8 x 8 = 384 inputs), and ``_assert_bnb_4bit_kernel_widths`` checks
# every ``Linear4bit`` the test loads, on every CPU, so a narrower model fails everywhere, not only on those CPUs.
BNB_4BIT_BLOCK = 64
"""The 4-bit block size (elements per ``absmax`` scale): bitsandbytes' default, which transformers uses."""
BNB_CPU_ROW_BLOCK = 32
"""The rows bitsandbytes' avx512-bf16 CPU kernel packs together (``block_n``): out_features must be a multiple."""
TEXT_4BIT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)


def _llama_4bit_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**TEXT_4BIT)


def _qwen2_vl_4bit_config() -> Any:
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(TEXT_4BIT, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2, in_channels=3,
                           patch_size=8, temporal_patch_size=2, spatial_merge_size=2),
        vision_start_token_id=3, vision_end_token_id=4, image_token_id=5, video_token_id=6)


QWEN2_VL_4BIT = TinyModel("qwen2_vl", "AutoModelForImageTextToText", _qwen2_vl_4bit_config,
                          TINY_MODELS["qwen2_vl"].make_vision_input, "model.visual")


@pytest.fixture(scope="session")
def llama_4bit(checkpoint_root: Path) -> Path:
    """A tiny Llama as wide as bitsandbytes' 4-bit CPU kernel needs (``TEXT_4BIT``); built once."""
    directory = checkpoint_root / "llama-4bit"
    if not directory.exists():
        save_tiny_model(TinyTextModel("llama", "AutoModelForCausalLM", _llama_4bit_config), directory)
    return directory


@pytest.fixture(scope="session")
def llama_bias(checkpoint_root: Path) -> Path:
    """A tiny Llama whose projections have biases (split by the core, beside a quantizer's entries); built once."""
    directory = checkpoint_root / "llama-bias"
    if not directory.exists():
        save_tiny_model(TEXT_MODELS["llama_bias"], directory)
    return directory


@pytest.fixture(scope="session")
def qwen2_vl_4bit(checkpoint_root: Path) -> Path:
    """A tiny Qwen2-VL as wide as bitsandbytes' 4-bit CPU kernel needs (:data:`QWEN2_VL_4BIT`); built once."""
    directory = checkpoint_root / "qwen2-vl-4bit"
    if not directory.exists():
        save_tiny_model(QWEN2_VL_4BIT, directory)
    return directory


def _assert_bnb_4bit_kernel_widths(*models: nn.Module) -> None:
    """Every bitsandbytes ``Linear4bit`` in ``models`` can be repacked for the avx512-bf16 CPU kernel: in_features a
    positive multiple of the 64-element block, out_features a multiple of 32 (asserts there is one)."""
    import bitsandbytes as bnb

    layers = [(name, module) for model in models for name, module in model.named_modules()
              if isinstance(module, bnb.nn.Linear4bit)]
    assert layers, "no bitsandbytes 4-bit layer to check"
    narrow = [(name, module.in_features, module.out_features) for name, module in layers
              if module.in_features < BNB_4BIT_BLOCK or module.in_features % BNB_4BIT_BLOCK
              or module.out_features % BNB_CPU_ROW_BLOCK]
    assert not narrow, (f"4-bit layers (name, in_features, out_features) bitsandbytes' avx512-bf16 CPU kernel cannot "
                        f"repack (in_features: a multiple of {BNB_4BIT_BLOCK}, out_features: of {BNB_CPU_ROW_BLOCK}; "
                        f"see the comment at the top of this module): {narrow}")


def _broken_copy(source: Path, target: Path) -> Path:
    """``source`` with unreadable weight files: a load that reads any weight fails on them."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes() if file.suffix != ".safetensors" else b"not a header")
    return target


def _save_both(plain: nn.Module, fused: nn.Module, tmp_path: Path) -> list[Any]:
    """Save the unfused model (transformers) to ``plain`` and the fused one (fusion-core) to ``fused``: the
    exception type each raised, or None; asserts both did the same."""
    outcomes: list[Any] = []
    for save, target in ((plain.save_pretrained, tmp_path / "plain"),
                         (lambda d: fusion_core.save_pretrained(fused, d), tmp_path / "fused")):
        try:
            save(target)
            outcomes.append(None)
        except Exception as exc:  # what transformers raises for the unfused model is the reference
            outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1], outcomes
    return outcomes


def _quantized_elements(model: nn.Module, quantized: Any) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and quantized(m))


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 5, 7, 9, 3]])


# -- torchao -----------------------------------------------------------------------------------
def _torchao_configs() -> list[Any]:
    """torchao schemes that run on CPU: per-row int8 (weight-only, dynamic activations), group-wise int4 (row groups
    of 32), float8 weight-only (per row)."""
    quantization = pytest.importorskip("torchao.quantization")
    from torchao.quantization.granularity import PerGroup

    return [quantization.Int8WeightOnlyConfig(), quantization.Int8DynamicActivationInt8WeightConfig(),
            quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
            quantization.Float8WeightOnlyConfig()]


TORCHAO_SCHEMES = pytest.mark.parametrize("index", [0, 1, 2, 3], ids=["int8-weight-only", "int8-dynamic",
                                                                       "int4-group-32", "float8-weight-only"])


def _inner(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A quantized weight's inner tensors (torchao: qdata, scale, zero_point), by name."""
    names, _ = weight.__tensor_flatten__()  # type: ignore[attr-defined]
    return {name: getattr(weight, name) for name in names}


def _merged_projections(fused: nn.Module) -> list[tuple[str, Any]]:
    """``(module path, merged projection)`` of every fused module; asserts there is one."""
    plan = fusion_core.get_fusion_plan(fused)
    assert plan is not None and plan.modules
    return [(module_plan.path, fused.get_submodule(module_plan.path).fused_projection) for module_plan in plan.modules]


def _assert_parts_are_the_unfused_quantization(fused: nn.Module, plain: nn.Module) -> None:
    """Each part's rows of every merged quantized tensor are bit-equal to the unfused model's quantized part."""
    for path, merged in _merged_projections(fused):
        for name, (start, stop) in zip(merged.originals, merged.bounds, strict=True):
            part = plain.get_submodule(f"{path}.{name}").weight
            for inner, tensor in _inner(merged.weight).items():
                assert torch.equal(tensor[start:stop], _inner(part)[inner]), (path, name, inner)


@TORCHAO_SCHEMES
def test_torchao_quantize_after_a_fused_load_quantizes_the_merged_weights_exactly(llama: Path, index: int) -> None:
    from torchao.quantization import quantize_

    plain = AutoModelForCausalLM.from_pretrained(llama)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    for model in (plain, fused):
        quantize_(model, _torchao_configs()[index])

    def quantized(module: nn.Module) -> bool:
        return type(module.weight).__module__.startswith("torchao")

    # The same weights quantized: every projection's elements, the merged ones in their container.
    assert _quantized_elements(fused, quantized) == _quantized_elements(plain, quantized) > 0
    _assert_parts_are_the_unfused_quantization(fused, plain)
    attention = fused.model.layers[0].self_attn
    with torch.no_grad():
        logits = [model(_ids()).logits for model in (fused, plain)]
    assert relative_error(logits[1], logits[0]) <= INT8_TOLERANCE
    assert attention.q_proj.merged.merged_gemms > 0 and attention.q_proj.merged.own_gemms == 0  # one int8 GEMM


def test_quantized_merged_weights_unfuse_into_the_unfused_models_quantized_parts(llama: Path) -> None:
    from torchao.quantization import quantize_

    plain = AutoModelForCausalLM.from_pretrained(llama)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    for model in (plain, fused):
        quantize_(model, _torchao_configs()[0])
    fusion_core.unfuse(fused)
    for name, module in plain.named_modules():
        if isinstance(module, nn.Linear):
            other = fused.get_submodule(name)
            assert all(torch.equal(a, b) for a, b in zip(_inner(other.weight).values(), _inner(module.weight).values(),
                                                         strict=True)), name


class _TransposedMixin(FusedModule):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = input @ self.weight_t
        return out if self.bias is None else out + self.bias


class TransposedDown(FusionFamily):
    """A third-party family whose fused Linear keeps no ``weight``: no nn.Linear quantizer can see it."""

    name = "transposed_down"
    fused_mixin = _TransposedMixin
    target_modules_patterns = (r"mlp\.down_proj$",)

    def is_fusable(self, module: nn.Module, options: Any) -> bool:
        return type(module) is nn.Linear

    def make_transforms(self, config: Any, options: Any) -> list[WeightTransform]:
        return [WeightTransform(("weight",), ("weight_t",), Transpose(0, 1))]


def test_fused_weights_no_quantizer_can_see_are_refused_on_forward_and_save(llama: Path, tmp_path: Path) -> None:
    from torchao.quantization import quantize_

    fusion_core.register_family(TransposedDown())
    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"transposed_down": True})
    with torch.no_grad():
        model(_ids())  # the fused model runs before it is quantized

    def linear_with_weight(module: nn.Module, name: str) -> bool:  # torchao's default, minus weightless Linears
        return isinstance(module, nn.Linear) and getattr(module, "weight", None) is not None

    quantize_(model, _torchao_configs()[0], filter_fn=linear_with_weight)  # every projection but the fused one
    with pytest.raises(fusion_core.FusionError, match=r"torchao quantized 'model\.layers\.0\.self_attn\.q_proj' "
                       r"after the model was fused; this forward would not be quantized exactly: family "
                       r"'transposed_down', module 'model\.layers\.0\.mlp\.down_proj' holds the nn\.Linear "
                       r"tensors of itself in modules no nn\.Linear quantizer sees.*quantize the unfused model, or "
                       r"leave the families out \(fusion_config=\{'transposed_down': False\}\)"):
        model(_ids())
    with pytest.raises(fusion_core.SaveError, match="torchao quantized .*this save would not be quantized exactly"):
        fusion_core.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_what_a_filter_leaves_out_stays_the_users_choice(llama: Path) -> None:
    from torchao.quantization import quantize_

    def not_attention(module: nn.Module, name: str) -> bool:  # the same filter on both models
        return isinstance(module, nn.Linear) and ".self_attn." not in f"{name}."

    plain = AutoModelForCausalLM.from_pretrained(llama)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    for model in (plain, fused):
        quantize_(model, _torchao_configs()[0], filter_fn=not_attention)

    def quantized(module: nn.Module) -> bool:
        return type(module.weight).__module__.startswith("torchao")

    assert _quantized_elements(fused, quantized) == _quantized_elements(plain, quantized) > 0
    with torch.no_grad():
        assert relative_error(plain(_ids()).logits, fused(_ids()).logits) <= INT8_TOLERANCE


def test_what_lora_on_a_quantized_merged_slice_cannot_do_exactly_is_refused(llama: Path) -> None:
    """DoRA and weight-derived initialisations read the base weight in the original layout, before training;
    merging would dequantize and requantize the merged weight as a whole."""
    peft = pytest.importorskip("peft")
    from torchao.quantization import quantize_

    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    quantize_(model, _torchao_configs()[0])
    for refused in ({"use_dora": True}, {"init_lora_weights": "pissa"}):
        with pytest.raises(ValueError, match=r"on this slice of fusion-core's merged projection is not supported once "
                                             r"the projection is quantized \(MergedProjection with a Int8Tensor"):
            peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"], **refused))
    adapted = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"merging a LoRA adapter into a slice of fusion-core's quantized merged "
                                         r"projection \(MergedProjection with a Int8Tensor weight\) is not supported"):
        adapted.merge_and_unload()
    with torch.no_grad():
        before = adapted(_ids()).logits
        adapted.unmerge_adapter()  # nothing was merged: PEFT only warns, and the quantized weight stays as it was
        assert torch.equal(adapted(_ids()).logits, before)


def _adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


@pytest.mark.parametrize("kwargs", [{"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, {"load_in_8bit": True}],
                         ids=["qlora-nf4", "llm-int8"])
def test_lora_on_a_bitsandbytes_fused_model_trains_and_saves_the_unfused_models_adapter(
        llama_4bit: Path, tmp_path: Path, kwargs: dict[str, Any]) -> None:
    """QLoRA-style (bitsandbytes base, LoRA on q_proj / v_proj): the same adapter at initialisation, the same after
    a training step and in the adapter files, within the model dtype's tolerance (the merged GEMM's backward blocks
    differently; transformers 4.57 loads bitsandbytes models in float16), or the int8 tolerance for LLM.int8."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import BitsAndBytesConfig

    def config() -> Any:
        return BitsAndBytesConfig(**kwargs)

    models = [AutoModelForCausalLM.from_pretrained(llama_4bit, quantization_config=config()),
              fusion_core.from_pretrained(AutoModelForCausalLM, llama_4bit, fusion_config=ALL_TEXT,
                                          quantization_config=config())]
    if kwargs.get("load_in_4bit"):
        _assert_bnb_4bit_kernel_widths(*models)
    adapted, initial, trained = [], [], []
    for model in models:
        torch.manual_seed(0)
        lora = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4,
                                                          init_lora_weights="gaussian"))
        adapted.append(lora)
        initial.append(_adapter(lora))
        optimizer = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.5)
        lora(_ids(), labels=_ids()).loss.backward()
        optimizer.step()
        trained.append(_adapter(lora))
    tolerance = INT8_TOLERANCE if kwargs.get("load_in_8bit") else TOLERANCES[models[0].dtype]
    assert list(initial[1]) == list(initial[0]) and initial[0]
    assert all(torch.equal(initial[1][name], initial[0][name]) for name in initial[0])
    for name in trained[0]:
        steps = [trained[i][name] - initial[i][name] for i in (0, 1)]
        assert "lora_B" not in name or steps[0].abs().max() > 0, name
        assert relative_error(steps[0], steps[1]) <= tolerance, name
    for lora, target in zip(adapted, ("plain", "fused"), strict=True):
        lora.save_pretrained(tmp_path / target)
    files = [load_file(tmp_path / target / "adapter_model.safetensors") for target in ("plain", "fused")]
    assert list(files[1]) == list(files[0])
    assert all(relative_error(files[0][name], files[1][name]) <= tolerance for name in files[0])


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
        assert not type(fused_module.weight).__module__.startswith("torchao")
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


def _at_load_quantizers() -> dict[str, Any]:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig, QuantoConfig, TorchAoConfig

    return {"bnb-int8": BitsAndBytesConfig(load_in_8bit=True),
            "bnb-nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
            "quanto-int8": QuantoConfig(weights="int8"), "torchao-int8": TorchAoConfig(Int8WeightOnlyConfig())}


@pytest.mark.parametrize("quantizer", ["bnb-int8", "bnb-nf4", "quanto-int8"])
def test_the_save_hooks_of_merged_quantized_layers_hold_no_tensors(llama_4bit: Path, quantizer: str) -> None:
    """The hooks that write each part's entries back bind only where the parts are; the tensors are read from the
    module at save time (a load-time copy kept by a hook would outlive a move to another device)."""
    import dataclasses
    import functools

    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama_4bit, fusion_config=ALL_TEXT,
                                        quantization_config=_at_load_quantizers()[quantizer])
    if quantizer == "bnb-nf4":
        _assert_bnb_4bit_kernel_widths(fused)
    bound = [argument for module in fused.modules() for hook in module._state_dict_hooks.values()
             if isinstance(hook, functools.partial) and hook.func.__module__.startswith("fusion_quantization")
             for argument in hook.args]
    assert bound
    values = [getattr(item, field.name) for argument in bound
              for item in (argument if isinstance(argument, tuple) else (argument,))
              for field in dataclasses.fields(item)]
    assert values and not any(isinstance(value, torch.Tensor) for value in values)


@pytest.mark.parametrize("quantizer", ["bnb-int8", "bnb-nf4", "quanto-int8", "torchao-int8"])
def test_a_quantizing_load_of_a_fused_patch_embedding_model_quantizes_what_the_unfused_load_does(
        quantizer: str, qwen2_vl_4bit: Path) -> None:
    """The fused Conv3d (a flattened matmul) is left unquantized where the unfused Conv3d is; every nn.Linear the
    unfused load quantizes is quantized the same way; the vision tower computes the same."""
    plain = AutoModelForImageTextToText.from_pretrained(qwen2_vl_4bit,
                                                        quantization_config=_at_load_quantizers()[quantizer])
    fused = fusion_core.from_pretrained(AutoModelForImageTextToText, qwen2_vl_4bit,
                                        fusion_config={"patch_embeddings": True},
                                        quantization_config=_at_load_quantizers()[quantizer])
    if quantizer == "bnb-nf4":
        _assert_bnb_4bit_kernel_widths(plain, fused)

    def quantized(model: nn.Module) -> dict[str, str]:
        found = {}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            owner = type(module) if type(module).__module__.split(".")[0] in ("bitsandbytes", "optimum") else None
            owner = owner or (type(weight) if type(weight).__module__.startswith("torchao") else None)
            if owner is not None:
                found[name] = owner.__qualname__
        return found

    assert quantized(fused) == quantized(plain) and quantized(plain)
    plan = fusion_core.get_fusion_plan(fused)
    assert plan is not None and plan.modules
    tiny = QWEN2_VL_4BIT
    inputs = tiny.make_vision_input(plain.config, torch.Generator().manual_seed(0))
    inputs = {key: value.to(plain.dtype) if value.is_floating_point() else value for key, value in inputs.items()}
    with torch.no_grad():
        vision = [attrgetter(tiny.vision_path)(model)(**inputs) for model in (fused, plain)]
    vision = [getattr(v, "last_hidden_state", v) for v in vision]
    assert relative_error(vision[1], vision[0]) <= INT8_TOLERANCE


@TORCHAO_SCHEMES
def test_a_torchao_quantizing_load_merges_the_quantized_parts_exactly(llama: Path, index: int) -> None:
    """``quantization_config=TorchAoConfig(...)``: transformers quantizes q/k/v (gate/up) as it loads them, the
    conversion concatenates their quantized data and scales; the same as the unfused quantizing load, bit for bit."""
    from transformers import TorchAoConfig

    plain = AutoModelForCausalLM.from_pretrained(llama, quantization_config=TorchAoConfig(_torchao_configs()[index]))
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT,
                                        quantization_config=TorchAoConfig(_torchao_configs()[index]))

    def quantized(module: nn.Module) -> bool:
        return type(module.weight).__module__.startswith("torchao")

    assert _quantized_elements(fused, quantized) == _quantized_elements(plain, quantized) > 0
    _assert_parts_are_the_unfused_quantization(fused, plain)
    with torch.no_grad():
        logits = [model(_ids()).logits for model in (fused, plain)]
    assert relative_error(logits[1], logits[0]) <= INT8_TOLERANCE
    attention = fused.model.layers[0].self_attn
    assert attention.q_proj.merged.merged_gemms > 0 and attention.q_proj.merged.own_gemms == 0  # one int8 GEMM
    # Where one int8 GEMM per part is faster (the merge policy measures it per kind, weight class included), each
    # part runs its rows of the merged quantized weight: the same as the merged GEMM's columns.
    from fusion_core.merge_policy import merge_policy_set_to

    with merge_policy_set_to("never"), torch.inference_mode():  # what generate runs in
        assert relative_error(fused(_ids()).logits, logits[0]) <= INT8_TOLERANCE
    assert attention.q_proj.merged.own_gemms > 0
    with merge_policy_set_to("measure"), torch.inference_mode():  # times both ways on the Int8Tensor slices
        assert relative_error(fused(_ids()).logits, logits[0]) <= INT8_TOLERANCE


def test_a_torchao_loaded_fused_model_saves_what_the_unfused_one_saves_and_loads_it_back(llama: Path,
                                                                                         tmp_path: Path) -> None:
    """Saving: the same keys, shapes, dtypes and bytes as the unfused model's save (5.x: torchao's safetensors
    keys), or the same refusal with nothing written (4.57: transformers cannot serialize it to safetensors). A
    checkpoint plain transformers pre-quantized loads fused, its stored quantization config included."""
    from transformers import TorchAoConfig

    from fusion_core.compare import compare_checkpoints

    plain = AutoModelForCausalLM.from_pretrained(llama, quantization_config=TorchAoConfig(_torchao_configs()[0]))
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT,
                                        quantization_config=TorchAoConfig(_torchao_configs()[0]))
    outcomes = _save_both(plain, fused, tmp_path)
    if outcomes[0] is not None:
        assert not (tmp_path / "fused").exists()  # nothing half-written
        return
    report = compare_checkpoints(tmp_path / "plain", tmp_path / "fused")
    assert report.ok and report.tensors > 0, report
    again = fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path / "plain", fusion_config=ALL_TEXT)
    _assert_parts_are_the_unfused_quantization(again, plain)
    with torch.no_grad():
        assert torch.equal(again(_ids()).logits, plain(_ids()).logits)


@pytest.mark.parametrize(("family", "model"), [("patch_embeddings", "qwen2_vl"), ("qkv", "llama"),
                                               ("gate_up", "llama")])
def test_the_kit_checks_torchao_quantizes_the_same_weights_fused_and_unfused(family: str, model: str) -> None:
    """The conformance kit's quantizer check, with the real quantize_: what a third-party family runs too."""
    from torchao.quantization import quantize_

    from fusion_core.testing import kit

    spec = fusion_core.get_registry().get(family).spec
    counts = kit.assert_quantizers_see_the_same_weights(
        spec, model, quantize=lambda m: quantize_(m, _torchao_configs()[0]))
    assert counts["fused_quantized"] == counts["unfused_quantized"] > 0


def test_merging_quantized_tensors_refuses_what_it_cannot_merge_exactly() -> None:
    """Row-wise scales concatenate; a scale shared by all rows must be equal in every part; mixed schemes refused."""
    from torchao.quantization import quantize_

    from fusion_core.wrapped import ConcatRefused, concat

    layers = [nn.Linear(16, rows, bias=False) for rows in (8, 4, 4)]
    for layer in layers:
        quantize_(layer, _torchao_configs()[0])
    merged = concat([layer.weight for layer in layers], 0)
    assert merged.shape == (16, 16) and type(merged) is type(layers[0].weight)
    assert torch.equal(merged.dequantize(), torch.cat([layer.weight.dequantize() for layer in layers]))
    other = nn.Linear(16, 4, bias=False)
    quantize_(other, _torchao_configs()[1])  # another scheme: its tensor differs in class or context
    with pytest.raises(ConcatRefused, match="different classes|quantized differently"):
        concat([layers[0].weight, other.weight], 0)
    with pytest.raises(ConcatRefused, match="neither per row along dim 1 nor equal in every part"):
        concat([layers[1].weight, layers[2].weight], 1)  # per-row scales, joined along the columns


def test_fuse_refuses_a_model_quantized_already(llama: Path) -> None:
    from torchao.quantization import quantize_

    model = AutoModelForCausalLM.from_pretrained(llama)
    quantize_(model, _torchao_configs()[0])
    with pytest.raises(fusion_core.FusionError, match=r"LlamaForCausalLM: is quantized \(torchao: "
                                                      r"'model\.layers\.0\.self_attn\.q_proj'\)"):
        fusion_core.fuse(model, ALL_TEXT)
    assert fusion_core.get_fusion_plan(model) is None


# -- bitsandbytes --------------------------------------------------------------------------------
def _int8_scales(layer: nn.Module) -> torch.Tensor:
    scales = getattr(layer.weight, "SCB", None)
    return scales if scales is not None else layer.state.SCB


def _runs_merged_and_saves_what_the_unfused_model_saves(fused: nn.Module, plain: nn.Module, tmp_path: Path
                                                       ) -> torch.Tensor:
    """The fused model's logits are the unfused model's within the int8 tolerance, its merged projections ran one
    quantized GEMM each, and it saves the keys and bytes the unfused model saves (to ``tmp_path / "plain"`` and
    ``"fused"``); returns the fused logits."""
    from fusion_core.compare import compare_checkpoints

    with torch.no_grad():
        logits = [model(_ids()).logits for model in (fused, plain)]
    assert relative_error(logits[1], logits[0]) <= INT8_TOLERANCE
    merged = fused.model.layers[0].self_attn.q_proj.merged
    assert merged.merged_gemms > 0 and merged.own_gemms == 0
    plain.save_pretrained(tmp_path / "plain")
    fusion_core.save_pretrained(fused, tmp_path / "fused")
    report = compare_checkpoints(tmp_path / "plain", tmp_path / "fused")
    assert report.ok and report.tensors > 0, report
    return logits[0]


def test_a_bitsandbytes_8bit_load_merges_the_int8_rows_and_scales_exactly(llama: Path, tmp_path: Path) -> None:
    """LLM.int8 at load: the merged container is a Linear8bitLt of the parts' int8 rows and per-row scales, bit for
    bit; one int8 matmul per merged projection; saving writes the unfused model's keys (SCB, weight_format) and
    bytes."""
    import bitsandbytes as bnb  # the module is skipped as a whole where it is missing
    from transformers import BitsAndBytesConfig


    plain = AutoModelForCausalLM.from_pretrained(llama, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT,
                                        quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    for path, merged in _merged_projections(fused):
        container = merged.owner
        assert isinstance(container, bnb.nn.Linear8bitLt)
        for name, (start, stop) in zip(merged.originals, merged.bounds, strict=True):
            part = plain.get_submodule(f"{path}.{name}")
            assert torch.equal(container.weight.data[start:stop], part.weight.data), (path, name)
            assert torch.equal(_int8_scales(container)[start:stop], _int8_scales(part)), (path, name)

    def quantized(module: nn.Module) -> bool:
        return isinstance(module, bnb.nn.Linear8bitLt)

    assert _quantized_elements(fused, quantized) == _quantized_elements(plain, quantized) > 0
    _runs_merged_and_saves_what_the_unfused_model_saves(fused, plain, tmp_path)
    attention = fused.model.layers[0].self_attn
    with pytest.raises(fusion_core.FusionError, match=r"its merged 'qkv_proj' was replaced by Linear8bitLt"):
        fusion_core.unfuse(fused)
    # The checkpoint plain transformers wrote (int8 rows, SCB, its quantization config) loads fused.
    reloaded = fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path / "plain", fusion_config=ALL_TEXT)
    reloaded_container = reloaded.model.layers[0].self_attn.qkv_proj
    assert isinstance(reloaded_container, bnb.nn.Linear8bitLt)
    assert torch.equal(reloaded_container.weight.data, attention.qkv_proj.weight.data)
    assert torch.equal(_int8_scales(reloaded_container), _int8_scales(attention.qkv_proj))


def _packed_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A 4-bit layer's packed bytes and block scales."""
    return {"packed": layer.weight.data, "absmax": layer.weight.quant_state.absmax}


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_a_bitsandbytes_4bit_load_merges_the_packed_blocks_exactly(llama_4bit: Path, tmp_path: Path,
                                                                   quant_type: str) -> None:
    """4-bit at load: the merged container is a Linear4bit whose packed bytes and block scales are the parts',
    bit for bit; one 4-bit matmul per merged projection; the save writes the unfused model's keys and bytes; the
    checkpoint plain transformers wrote loads fused again; LoRA on a 4-bit merged slice (QLoRA) is refused."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    from fusion_core.compare import compare_checkpoints

    def config() -> Any:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type)

    plain = AutoModelForCausalLM.from_pretrained(llama_4bit, quantization_config=config())
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama_4bit, fusion_config=ALL_TEXT,
                                        quantization_config=config())
    _assert_bnb_4bit_kernel_widths(plain, fused)
    for path, merged in _merged_projections(fused):
        container = merged.owner
        assert isinstance(container, bnb.nn.Linear4bit)
        packed = [_packed_state(plain.get_submodule(f"{path}.{name}")) for name in merged.originals]
        for entry in ("packed", "absmax"):
            assert torch.equal(_packed_state(container)[entry], torch.cat([p[entry] for p in packed])), entry

    def quantized(module: nn.Module) -> bool:
        return isinstance(module, bnb.nn.Linear4bit)

    def logical_elements(model: nn.Module) -> int:
        return sum(m.in_features * m.out_features for m in model.modules() if quantized(m))

    assert logical_elements(fused) == logical_elements(plain) > 0
    # Saved before any forward: after one, on a CPU with avx512-bf16 the layers are saved in the layout of
    # bitsandbytes' CPU kernel (block scales transposed, in bfloat16), which the fused save mirrors (checked below)
    # but a load does not read back as it was.
    AutoModelForCausalLM.from_pretrained(llama_4bit, quantization_config=config()).save_pretrained(tmp_path / "saved")
    logits = _runs_merged_and_saves_what_the_unfused_model_saves(fused, plain, tmp_path)
    # The checkpoint plain transformers wrote, with its quantization config, loads fused: the same logits.
    reloaded = fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path / "saved", fusion_config=ALL_TEXT)
    assert isinstance(reloaded.model.layers[0].self_attn.qkv_proj, bnb.nn.Linear4bit)
    _assert_bnb_4bit_kernel_widths(reloaded)
    plain_again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(reloaded(_ids()).logits, logits)
        plain_again(_ids())  # both ran (and were repacked where the CPU has avx512-bf16) before they are saved
    # Saved again: what saving the unfused pre-quantized model does (transformers 5.x cannot revert its own
    # bitsandbytes loading ops, NotImplementedError, and the fused save writes nothing), else the same bytes.
    (tmp_path / "again").mkdir()
    if _save_both(plain_again, reloaded, tmp_path / "again") == [None, None]:
        assert compare_checkpoints(tmp_path / "again" / "plain", tmp_path / "again" / "fused").ok
    else:
        assert not (tmp_path / "again" / "fused").exists()


def test_a_4bit_checkpoint_saved_in_the_cpu_kernels_layout_is_refused_by_name(llama_4bit: Path, tmp_path: Path
                                                                             ) -> None:
    """After its avx512-bf16 CPU kernel ran, bitsandbytes 0.50.2 saves a layer's block scales as a (blocks per row,
    rows) bfloat16 table: such parts are refused by name (not a tensor-size error), on every CPU."""
    from safetensors.torch import load_file, save_file
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    AutoModelForCausalLM.from_pretrained(llama_4bit, quantization_config=config).save_pretrained(tmp_path / "saved")
    weights = tmp_path / "saved" / "model.safetensors"
    tensors = load_file(weights)
    merged_parts = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")  # hidden_size inputs each
    for key in [k for k in tensors if k.endswith(".weight.absmax") and any(p in k for p in merged_parts)]:
        rows = tensors[key.removesuffix(".absmax")].numel() * 2 // TEXT_4BIT["hidden_size"]  # 2 codes a byte
        tensors[key] = tensors[key].reshape(rows, -1).T.to(torch.bfloat16).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(fusion_core.FusionLoadError, match=r"family '(qkv|gate_up)'.*cannot be merged exactly: their "
                       r"block scales are in the \(blocks per row, rows\) bfloat16 layout"):
        fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path / "saved", fusion_config=ALL_TEXT)


def test_bitsandbytes_double_quantization_is_refused_before_any_weight_is_read(llama_4bit: Path, tmp_path: Path
                                                                               ) -> None:
    """QLoRA's default (nested scales quantized around the mean of a whole layer's) cannot be merged exactly."""
    from transformers import BitsAndBytesConfig

    broken = _broken_copy(llama_4bit, tmp_path / "broken")
    with pytest.raises(fusion_core.FusionLoadError, match=r"the load quantizes with BitsAndBytesConfig "
                       r"\(bitsandbytes\).*family 'qkv', module 'model\.layers\.0\.self_attn'.*double quantization "
                       r"\(bnb_4bit_use_double_quant\).*" + WAY_OUT):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT,
                                    quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                                                           bnb_4bit_use_double_quant=True))


def test_a_4bit_part_that_does_not_fill_whole_blocks_is_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    from transformers import BitsAndBytesConfig, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=20, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=10)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "odd")  # q_proj: 400 elements, 6.25 blocks
    broken = _broken_copy(tmp_path / "odd", tmp_path / "broken")
    with pytest.raises(fusion_core.FusionLoadError, match=r"family 'qkv', module 'model\.layers\.0\.self_attn'.*"
                       "does not fill whole 4-bit blocks of 64 elements"):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT,
                                    quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def _mixed_configs() -> dict[str, tuple[Any, str]]:
    """Loads that would quantize q, k and v differently, with the parts' schemes the refusal names."""
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig, QuantoConfig, TorchAoConfig

    return {
        "bnb-skip-list": (BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["v_proj", "lm_head"]),
                          "v_proj: left unquantized"),
        "quanto-skip-list": (QuantoConfig(weights="int8", modules_to_not_convert=["k_proj"]),
                             "k_proj: left unquantized"),
        "torchao-per-module": (TorchAoConfig(FqnToConfig({r"re:.*\.q_proj": Int8WeightOnlyConfig()})),
                               r"q_proj: Int8WeightOnlyConfig\(.*k_proj: left unquantized"),
    }


@pytest.mark.parametrize("case", ["bnb-skip-list", "quanto-skip-list", "torchao-per-module"])
def test_parts_a_load_would_quantize_differently_are_refused_before_any_weight_is_read(
        llama: Path, tmp_path: Path, case: str) -> None:
    quantization, schemes = _mixed_configs()[case]
    broken = _broken_copy(llama, tmp_path / "broken")
    way_out = r"quantize the unfused model, or leave the families out \(fusion_config=\{'qkv': False\}\)"
    with pytest.raises(fusion_core.FusionLoadError, match=r"family 'qkv', module 'model\.layers\.0\.self_attn'.*the "
                       r"load would quantize those parts differently \(.*" + schemes + ".*" + way_out):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT,
                                    quantization_config=quantization)


def test_a_skip_list_that_leaves_whole_merged_projections_alone_loads_them_plain(llama: Path) -> None:
    """Skipping q, k and v together is one scheme: qkv_proj stays a plain merged projection, gate/up quantized."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    def config() -> Any:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["q_proj", "k_proj", "v_proj", "lm_head"])

    plain = AutoModelForCausalLM.from_pretrained(llama, quantization_config=config())
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT,
                                        quantization_config=config())
    layer = fused.model.layers[0]
    assert type(layer.self_attn.qkv_proj.weight) is nn.Parameter
    assert isinstance(layer.mlp.gate_up_proj, bnb.nn.Linear8bitLt)
    with torch.no_grad():
        assert relative_error(plain(_ids()).logits, fused(_ids()).logits) <= INT8_TOLERANCE


def _layer_replacing_configs() -> dict[str, Any]:
    """Quantizing loads that swap the ``nn.Linear`` layers they quantize for layers of their own."""
    from transformers import BitsAndBytesConfig, QuantoConfig

    return {"bnb-int8": BitsAndBytesConfig(load_in_8bit=True), "quanto-int8": QuantoConfig(weights="int8")}


@pytest.mark.parametrize("case", ["bnb-int8", "quanto-int8"])
def test_layers_fused_by_class_that_the_quantizer_would_replace_are_refused_before_any_weight_is_read(
        llama: Path, tmp_path: Path, case: str) -> None:
    """``linear_kernels`` fuses each ``nn.Linear`` by class as the model is built. Without the refusal, transformers
    5.x's bitsandbytes (``type(module) is nn.Linear``) passes over the fused layers and the model loads unquantized
    with no word; 4.57's bitsandbytes and quanto replace them and the load fails after reading every weight."""
    broken = _broken_copy(llama, tmp_path / "broken")
    with pytest.raises(fusion_core.FusionLoadError, match=r"quantizes with .*family 'linear_kernels' fuses 15 "
                       r"nn\.Linear layer\(s\) by class, module 'model\.layers\.0\.self_attn\.q_proj' first.*"
                       r"fusion_config=\{'linear_kernels': False\}"):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config={"linear_kernels": True},
                                    quantization_config=_layer_replacing_configs()[case])


def test_a_layer_the_quantizer_skips_is_fused_by_class_and_the_rest_quantized(llama: Path) -> None:
    """The way out the refusal names: the head, in the quantizer's skip list, is the family's; q/k/v are merged
    quantized (``qkv``), every other layer quantized as in the unfused load."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    def config() -> Any:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])

    fusion_config = {"qkv": True, "linear_kernels": {"target_modules": [r"^lm_head$"]}}
    plain = AutoModelForCausalLM.from_pretrained(llama, quantization_config=config())
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=fusion_config,
                                        quantization_config=config())
    assert isinstance(fused.lm_head, FusedModule) and type(fused.lm_head.weight) is not bnb.nn.Int8Params
    assert isinstance(fused.model.layers[0].self_attn.qkv_proj, bnb.nn.Linear8bitLt)
    assert isinstance(fused.model.layers[0].mlp.down_proj, bnb.nn.Linear8bitLt)
    with torch.no_grad():
        assert relative_error(plain(_ids()).logits, fused(_ids()).logits) <= INT8_TOLERANCE


def test_parts_are_matched_against_a_configs_patterns_in_linear_time() -> None:
    """Skip lists and torchao's ``re:`` keys come from a downloaded config: ``(.*.*)*X`` backtracks for minutes in
    Python's re on a module path. The planning runs in a subprocess under a timeout (a bound, not a measurement)."""
    script = (
        "from types import SimpleNamespace\n"
        "from fusion_quantization.schemes import part_schemes\n"
        "paths = ['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.k_proj']\n"
        "print(part_schemes({'llm_int8_skip_modules': ['(.*.*)*X']}, paths))\n"
        "print(part_schemes({'quant_type': SimpleNamespace(fqn_to_config={'re:(.*.*)*X': None, '_default': 8})},"
        " paths))\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("matching '(.*.*)*X' against the parts' paths did not finish within 60 s")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["['quantized', 'quantized']", "['8', '8']"]


@pytest.mark.parametrize(("pattern", "path", "skipped"), [
    (r"model\.layers\.1", "model.layers.1.mlp", True), (r"model\.layers\.1", "model.layers.11.mlp", False),
    (r"model\.layers\.\d+\.self_attn", "model.layers.3.self_attn.q_proj", True), (r"mlp\.gate", "mlp.gate_proj", False),
    (r"model\.", "model.layers.0", True), (r"model\.$", "model.layers.0", False), (r"model\b", "model.layers", True),
    ("fc1", "model.decoder.layers.23.fc1", True), ("q_proj|v_proj", "q_proj.base_layer", True),
    ("(?<=x)q", "model.q", False),
])
def test_skip_lists_match_as_transformers_matches_them(pattern: str, path: str, skipped: bool) -> None:
    """RE2 with transformers' boundary rule gives what its ``re.match(rf"(?:{key})" + boundary)`` gives (a pattern
    RE2 cannot run, lookaround, matches nothing); the suffix and substring rules apply as well."""
    import re

    from fusion_quantization.schemes import skipped as is_skipped

    boundary = r"(?:(?<=\.)|(?=\.|$))"
    transformers_rule = bool(re.match(rf"(?:{pattern}){boundary}", path)) or path.endswith(pattern) or pattern in path
    assert is_skipped(path, [pattern]) is skipped
    assert transformers_rule is skipped or pattern.startswith("(?<=")


def test_the_quantizers_internal_names_exist_on_the_installed_releases_which_are_checked() -> None:
    """Every internal name fusion_quantization.compat reads, calls or writes, on real layers of the installed
    bitsandbytes, optimum-quanto and torchao, which must be releases the module was checked on."""
    import bitsandbytes as bnb
    from fusion_quantization import compat
    from optimum.quanto import freeze, qint8, quantize
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig

    for library, checked in compat.CHECKED_RELEASES.items():
        assert compat.release(library) in checked, f"{library} {compat.release(library)}: check compat.py, then list it"
    x = torch.randn(2, 64)
    four = bnb.nn.Linear4bit(64, 64, bias=False, compress_statistics=False, quant_type="nf4").to("cpu").eval()
    state = compat.read_4bit(four)
    assert state is not None and state.shape == (64, 64) and not state.nested and not state.repacked_for_cpu
    rebuilt = compat.linear_4bit(state.packed, state.absmax, state.shape, state, bias=False).eval()
    saved = four.state_dict()
    for name, value in compat.state_4bit_entries(compat.part_block_scales(state, 0, 64), (64, 64), state).items():
        assert torch.equal(saved[f"weight.{name}"], value), name
    with torch.no_grad():
        assert torch.equal(rebuilt(x), four(x))
    eight = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False, threshold=6.0).to("cpu")
    scales, (threshold, float_weights) = compat.int8_scales(eight), compat.int8_settings(eight)
    assert scales is not None and threshold == 6.0 and not float_weights
    saved = eight.state_dict()
    assert all(torch.equal(saved[name], value) for name, value in compat.int8_part_entries(scales).items())
    with torch.no_grad():
        assert torch.equal(compat.int8_linear(eight.weight.data, scales, threshold, bias=False)(x), eight(x))
    quanto = nn.Sequential(nn.Linear(64, 64, bias=False))
    quantize(quanto, weights=qint8)
    freeze(quanto)
    rows = compat.read_quanto(quanto[0])
    assert rows is not None and rows.axis == 0 and rows.qtype_name == "qint8" and rows.activation_type is None
    saved = quanto.state_dict()
    assert all(torch.equal(saved[f"0.{name}"], value)
               for name, value in compat.quanto_part_entries(rows.data, rows.scale).items())
    with torch.no_grad():
        assert torch.equal(compat.quanto_linear(rows.data, rows.scale, rows.qtype, bias=False)(x), quanto(x))
    table = {"re:.*q_proj": Int8WeightOnlyConfig()}
    assert compat.torchao_module_table(FqnToConfig(table)) == table
    assert compat.bnb_loads_in(BitsAndBytesConfig(load_in_4bit=True), 4)
    assert compat.bnb_loads_in({"_load_in_8bit": True}, 8) and not compat.bnb_loads_in({"load_in_4bit": True}, 8)


# -- quanto --------------------------------------------------------------------------------------
def test_quanto_quantize_after_a_fused_load_quantizes_the_merged_weights(llama: Path) -> None:
    quanto = pytest.importorskip("optimum.quanto")

    plain = AutoModelForCausalLM.from_pretrained(llama)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    for model in (plain, fused):
        quanto.quantize(model, weights=quanto.qint8)
        quanto.freeze(model)

    def quantized(module: nn.Module) -> bool:
        return isinstance(module, quanto.QModuleMixin)

    assert _quantized_elements(fused, quantized) == _quantized_elements(plain, quantized) > 0
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, quanto.QModuleMixin)  # the container, replaced by quanto's QLinear
    with torch.no_grad():
        logits = [model(_ids()).logits for model in (fused, plain)]
    assert relative_error(logits[1], logits[0]) <= INT8_TOLERANCE
    assert attention.q_proj.merged.merged_gemms > 0 and attention.q_proj.merged.own_gemms == 0
    with pytest.raises(fusion_core.FusionError, match=r"its merged 'qkv_proj' was replaced by QLinear \(optimum\)"):
        fusion_core.unfuse(fused)


@pytest.mark.parametrize(("checkpoint", "weights", "frozen"), [
    ("llama", "qint8", True), ("llama", "qfloat8", True), ("llama", "qint4", False), ("llama_bias", "qint8", True),
], ids=["int8", "float8", "int4-before-freeze", "int8-biases"])
def test_quanto_after_a_fused_load_saves_the_unfused_models_keys_and_bytes(
        request: pytest.FixtureRequest, tmp_path: Path, checkpoint: str, weights: str, frozen: bool) -> None:
    """quanto's quantize (and freeze) on a fused model saves what the unfused quantized model saves: each part's
    8-bit rows and per-row scales (before freeze, its float rows), and its own copy of the merged layer's activation
    scales (ones: activations are not quantized), in the unfused model's key order, byte for byte; the file reloads
    into the unfused model with quanto's requantize to the unfused quantized model's logits."""
    quanto = pytest.importorskip("optimum.quanto")
    from safetensors.torch import load_file

    directory = request.getfixturevalue(checkpoint)
    plain = AutoModelForCausalLM.from_pretrained(directory)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=ALL_TEXT)
    for model in (plain, fused):
        quanto.quantize(model, weights=getattr(quanto, weights))
        if frozen:
            quanto.freeze(model)
    assert list(fused.state_dict()) == list(plain.state_dict())
    _runs_merged_and_saves_what_the_unfused_model_saves(fused, plain, tmp_path)
    reloaded = AutoModelForCausalLM.from_config(plain.config)  # how quanto reloads: the plain model, requantized
    quanto.requantize(reloaded, load_file(tmp_path / "fused" / "model.safetensors"), quanto.quantization_map(plain))
    with torch.no_grad():
        assert torch.equal(reloaded(_ids()).logits, plain(_ids()).logits)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"weights": "qint8", "activations": "qint8"},
     r"it quantizes activations too \(qint8\): the merged layer has one output_scale, calibrated over every part's"),
    ({"weights": "qint4"}, r"its frozen weight is a WeightQBitsTensor, which fusion-core does not split back"),
], ids=["int8-activations", "int4"])
def test_quanto_after_a_fused_load_refuses_by_name_to_save_what_it_cannot_split(
        llama: Path, tmp_path: Path, kwargs: dict[str, str], reason: str) -> None:
    """Calibrated activation scales (one output_scale over all the parts' outputs) and packed int4 rows cannot be
    written as the unfused model's: the save is refused naming the module before anything is written; the fused
    layout (save_original_format=False) is saved as it is."""
    quanto = pytest.importorskip("optimum.quanto")

    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    quanto.quantize(fused, **{name: getattr(quanto, value) for name, value in kwargs.items()})
    with quanto.Calibration(), torch.no_grad():
        fused(_ids())
    quanto.freeze(fused)
    with pytest.raises(fusion_core.SaveError, match=r"family 'qkv', module 'model\.layers\.0\.self_attn': quanto's "
                                                    r"QLinear replaced its merged 'qkv_proj' \(the parts \['q_proj', "
                                                    r"'k_proj', 'v_proj'\]\), and " + reason):
        fusion_core.save_pretrained(fused, tmp_path / "fused")
    assert not (tmp_path / "fused").exists()
    fusion_core.save_pretrained(fused, tmp_path / "fused-layout", save_original_format=False)
    assert (tmp_path / "fused-layout" / "model.safetensors").exists()


@pytest.mark.parametrize("weights", ["int8", "float8"])
def test_a_quanto_load_merges_the_quantized_rows_and_scales_exactly(llama: Path, tmp_path: Path, weights: str) -> None:
    """QuantoConfig at load: the merged container is a frozen QLinear whose rows and per-row scales are the parts',
    bit for bit; one quantized GEMM per merged projection; the state dict is the unfused model's, key for key and
    bit for bit; saving refuses as it does for the unfused model (transformers does not serialize quanto)."""
    quanto = pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    plain = AutoModelForCausalLM.from_pretrained(llama, quantization_config=QuantoConfig(weights=weights))
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT,
                                        quantization_config=QuantoConfig(weights=weights))
    for path, merged in _merged_projections(fused):
        assert isinstance(merged.owner, quanto.QLinear)
        parts = [plain.get_submodule(f"{path}.{name}").weight for name in merged.originals]
        for inner in ("_data", "_scale"):
            assert torch.equal(getattr(merged.weight, inner), torch.cat([getattr(p, inner) for p in parts])), inner

    def quantized(module: nn.Module) -> bool:
        return isinstance(module, quanto.QModuleMixin)

    assert _quantized_elements(fused, quantized) == _quantized_elements(plain, quantized) > 0
    with torch.no_grad():
        logits = [model(_ids()).logits for model in (fused, plain)]
    assert relative_error(logits[1], logits[0]) <= INT8_TOLERANCE
    attention = fused.model.layers[0].self_attn
    assert attention.q_proj.merged.merged_gemms > 0 and attention.q_proj.merged.own_gemms == 0
    expected, presented = plain.state_dict(), fused.state_dict()
    assert list(presented) == list(expected)
    assert all(torch.equal(presented[key], expected[key]) for key in expected)
    assert _save_both(plain, fused, tmp_path) == [ValueError, ValueError]
    assert not (tmp_path / "fused").exists()


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"weights": "int4"}, r"quanto's weights='int4' packs rows in groups fusion-core does not merge"),
    ({"weights": "int8", "activations": "int8"}, r"quanto quantizes activations too \(activations='int8'\)"),
], ids=["int4", "int8-activations"])
def test_a_quanto_load_fusion_core_cannot_merge_is_refused_before_any_weight_is_read(
        llama: Path, tmp_path: Path, kwargs: dict[str, Any], reason: str) -> None:
    pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    broken = _broken_copy(llama, tmp_path / "broken")
    with pytest.raises(fusion_core.FusionLoadError, match=r"QuantoConfig \(quanto\).*family 'qkv'.*" + reason):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT,
                                    quantization_config=QuantoConfig(**kwargs))


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


def test_saving_a_quantized_fused_model_does_what_saving_the_unfused_one_does(llama: Path, tmp_path: Path) -> None:
    """Both refuse the same way, or both write the same keys, shapes, dtypes and bytes."""
    from torchao.quantization import quantize_

    from fusion_core.compare import compare_checkpoints

    plain = AutoModelForCausalLM.from_pretrained(llama)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT)
    for model in (plain, fused):
        quantize_(model, _torchao_configs()[0])
    outcomes = _save_both(plain, fused, tmp_path)
    if outcomes[0] is None:
        report = compare_checkpoints(tmp_path / "plain", tmp_path / "fused")
        assert report.ok, report
    else:
        assert not (tmp_path / "fused").exists()  # nothing half-written


def test_the_quantized_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/bench_quantized.py --quick prints its tables and the fused int8 tokens equal the unfused ones."""
    import json

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_quantized.py"), "--quick", "--json",
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FUSION_BENCH_CHECKPOINTS": str(tmp_path / "ckpt")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fused int8 vs plain int8" in done.stdout and "decode ms/token" in done.stdout
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["tokens_equal"]["fused int8"] is True and result["tokens_equal"]["fused fp32"] is True


def test_the_quantization_pages_python_runs(tmp_path: Path) -> None:
    """docs/quantization.md's snippets (one per quantizer, and a refusal) run as they are, here, where the
    quantizers are installed (tests/test_docs.py runs the other pages in every environment)."""
    from doc_snippets import python_blocks, run_python_blocks  # tests/doc_snippets.py, beside this module

    assert len(python_blocks("quantization.md")) >= 5, "docs/quantization.md lost its runnable snippets"
    result = run_python_blocks("quantization.md", tmp_path)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

