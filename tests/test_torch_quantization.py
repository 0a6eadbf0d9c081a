"""torch's own quantizer, ``torch.ao.quantization.quantize_dynamic``, on fused models.

It looks module classes up by exact type, so it skips every ``nn.Linear`` subclass: a merged
projection's container and a MoE expert stand-in alike. On a fused model it would quantize the
rest and leave the fused weights float without a word; the quantization integration
(``fusion-quantization``) refuses that on the first forward and on save, naming the family, a
module, the quantizer and the way out, and ``fuse`` refuses a model it quantized. Needs torch only,
so it runs in every test environment.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.merged import MergedProjection

ALL_TEXT = {"qkv": True, "gate_up": True}
REFUSAL = (r"torch.ao.quantization quantized '.*' after the model was fused; {action} would not be quantized "
           r"exactly: family '(qkv|gate_up)', module 'model.layers.0.(self_attn|mlp)' .* exact-type lookup skips.*"
           r"quantize the unfused model, or leave the families out "
           r"\(fusion_config=\{'gate_up': False, 'qkv': False\}\)")


def _quantize_dynamic(model: nn.Module) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of torchao; still what many scripts call
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def test_quantize_dynamic_of_a_fused_model_is_refused_on_forward_and_save(llama: Path, tmp_path: Path) -> None:
    ids = torch.tensor([[1, 5, 7, 9, 3]])
    plain = _quantize_dynamic(AutoModelForCausalLM.from_pretrained(llama))
    fused = _quantize_dynamic(fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT))
    with torch.no_grad():
        plain(ids)  # the unfused model runs quantized: every projection is a dynamic quantized Linear
    assert not any(type(m) is nn.Linear for m in plain.model.modules())
    # What the refusal prevents: the merged projections were skipped, still float.
    left = [name for name, m in fused.named_modules() if type(m) is MergedProjection]
    assert left and all(fused.get_submodule(name).weight.dtype == torch.float32 for name in left)
    with pytest.raises(fusion_core.FusionError, match=REFUSAL.replace("{action}", "this forward")), torch.no_grad():
        fused(ids)
    with pytest.raises(fusion_core.SaveError, match=REFUSAL.replace("{action}", "this save")):
        fusion_core.save_pretrained(fused, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fuse_refuses_a_model_quantize_dynamic_quantized(llama: Path) -> None:
    model = _quantize_dynamic(AutoModelForCausalLM.from_pretrained(llama))
    with pytest.raises(fusion_core.FusionError, match=r"is quantized \(torch.ao.quantization: 'model.layers.0.self_attn"
                                                      r".q_proj'\); fusion-core cannot fuse quantized weights"):
        fusion_core.fuse(model, ALL_TEXT)
