"""``linear_kernels`` on weights torchao already holds in int8 (``Int8WeightOnlyConfig``): at decode, torch's int8
weight-only GEMM on torchao's own int8 data and scales where it is admitted, the quantizer's kernel otherwise.

Runs where torchao is installed (the quantizer environments of ``scripts/test.sh``). The kernel timer reports
every candidate but ``F.linear`` fastest and the packing timer reports packing slower (a weight must stay dense
for torchao to quantize it after the load), so the tests see what the choice may take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fusion_linear_kernels import choice, compat, kernels
from fusion_linear_kernels.tolerance import admission_bound
from onednn_packing import BF16_PACKS
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.testing.kit import TOLERANCES
from fusion_core.testing.tiny_models import TEXT_MODELS

quantization = pytest.importorskip("torchao.quantization", reason="torchao is installed in the quantizer environments")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("other_kernels_dense_weights")]

IDS = torch.tensor([[5, 17, 42, 9]])
MERGED = {"qkv": True, "gate_up": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("int8")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TEXT_MODELS["llama"].make_config()).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _quantized(directory: Path, fusion_config: dict[str, Any] | None) -> Any:
    if fusion_config is None:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    else:
        model = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=fusion_config, dtype="auto")
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    return model.eval()


def _decode(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, out.logits[-1]


@pytest.mark.parametrize("others", [{}, MERGED], ids=["alone", "with-qkv-gate_up"])
def test_decode_runs_the_int8_kernel_within_the_bound(checkpoint, others):
    plain, fused = _quantized(checkpoint, None), _quantized(checkpoint, {**others, "linear_kernels": True})
    assert compat.int8_rows(fused.model.layers[0].self_attn.o_proj.weight) is not None
    tokens, logits = _decode(fused)
    expected_tokens, expected_logits = _decode(plain)
    assert torch.equal(tokens, expected_tokens)
    assert float((logits.float() - expected_logits.float()).abs().max()) <= TOLERANCES[torch.bfloat16] * (
        float(expected_logits.abs().max()) + 1)
    assert kernels.INT8.name in choice.decisions().values()


@BF16_PACKS
def test_quantize_after_a_load_that_packed_the_weights(checkpoint, fake_times):
    """``quantize_`` reads each layer's ``weight`` as a dense tensor: a packed layer gives it through its dense view
    (before: torch's ``MkldnnCPU`` error), and the layer then holds and runs the quantized weight, exact mode giving
    the plain quantized model's tokens and logits bit for bit."""
    from fusion_linear_kernels import packing

    from fusion_core.testing.decisions import original_slowest

    fake_times(packing, original_slowest)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config={"linear_kernels": {
        "exact": True}}, dtype="auto")
    assert fused.model.layers[0].mlp.down_proj.packed and fused.lm_head.packed
    quantization.quantize_(fused, quantization.Int8WeightOnlyConfig())
    assert compat.int8_rows(fused.model.layers[0].mlp.down_proj.weight) is not None
    assert not fused.model.layers[0].mlp.down_proj.packed
    tokens, logits = _decode(fused.eval())
    expected_tokens, expected_logits = _decode(_quantized(checkpoint, None))
    assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)


def test_exact_mode_keeps_the_quantizers_kernel(checkpoint):
    plain, fused = _quantized(checkpoint, None), _quantized(checkpoint, {"linear_kernels": {"exact": True}})
    tokens, logits = _decode(fused)
    expected_tokens, expected_logits = _decode(plain)
    assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)
    assert kernels.INT8.name not in choice.decisions().values()  # scales in bf16: not bit-identical here


def test_the_int8_kernel_reads_torchaos_data_and_scales():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16))
    quantization.quantize_(layer, quantization.Int8WeightOnlyConfig())
    weight = layer[0].weight
    rows = compat.int8_rows(weight)
    assert rows is not None and rows[0].dtype == torch.int8 and rows[1].shape == (48,)
    assert compat.int8_rows(torch.randn(48, 64)) is None  # torch's own tensor: not a quantizer's
    x = torch.randn(1, 3, 64).bfloat16()
    reference = F.linear(x, weight)
    got = kernels.INT8.run(x, weight, None)
    assert got.shape == reference.shape and got.dtype == reference.dtype
    assert float((got.float() - reference.float()).abs().max()) <= admission_bound(x, weight, reference)
