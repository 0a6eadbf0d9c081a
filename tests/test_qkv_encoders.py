"""qkv on encoders and encoder-decoders: q/k/v found by structure, whatever the architecture calls them.

BERT, RoBERTa, XLM-R and ELECTRA name them ``query``/``key``/``value``, DistilBERT ``q_lin``/``k_lin``/
``v_lin``, Whisper ``q_proj``/``k_proj``/``v_proj`` with no bias on ``k_proj``. Each tiny model is built
from its real config class here (the configs live in this file, not in ``tiny_models``: no other suite
needs them), saved, loaded fused, compared with the plain model, saved back byte for byte and
reloaded by plain transformers. Cross-attention is left unfused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from fusion_qkv import QkvFamily, QkvMixin
from fusion_qkv.family import ZeroFilledConcat, refusal

import fusion_core
from fusion_core.merged import MergedSlice
from fusion_core.testing import kit
from fusion_core.testing.kit import TOLERANCES

FAMILY = QkvFamily()
OPTIONS = FAMILY.options_model()
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)


def _bert(**extra: Any) -> Any:
    return transformers.BertConfig(**SMALL, **extra)


def _whisper() -> Any:
    return transformers.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )


IDS = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
TEXT_INPUTS = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
WHISPER_INPUTS = {"input_features": torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)),
                  "decoder_input_ids": IDS[:, :4]}

#: name -> (model class, config factory, inputs, the fused attention paths)
CASES: dict[str, tuple[Any, Any, dict[str, torch.Tensor], list[str]]] = {
    "bert": (transformers.AutoModel, _bert, TEXT_INPUTS, [f"encoder.layer.{i}.attention.self" for i in range(2)]),
    "bert-classifier": (transformers.AutoModelForSequenceClassification, _bert, TEXT_INPUTS,
                        [f"bert.encoder.layer.{i}.attention.self" for i in range(2)]),
    "roberta-mlm": (transformers.AutoModelForMaskedLM, lambda: transformers.RobertaConfig(**SMALL, pad_token_id=1),
                    TEXT_INPUTS, [f"roberta.encoder.layer.{i}.attention.self" for i in range(2)]),
    "xlm-roberta": (transformers.AutoModel, lambda: transformers.XLMRobertaConfig(**SMALL, pad_token_id=1),
                    TEXT_INPUTS, [f"encoder.layer.{i}.attention.self" for i in range(2)]),
    "electra": (transformers.AutoModelForSequenceClassification,
                lambda: transformers.ElectraConfig(**SMALL, embedding_size=16), TEXT_INPUTS,
                [f"electra.encoder.layer.{i}.attention.self" for i in range(2)]),
    "distilbert": (transformers.AutoModel,
                   lambda: transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                         max_position_embeddings=64),
                   TEXT_INPUTS, [f"transformer.layer.{i}.attention" for i in range(2)]),
    "whisper": (transformers.WhisperForConditionalGeneration, _whisper, WHISPER_INPUTS,
                ["model.encoder.layers.0.self_attn", "model.decoder.layers.0.self_attn"]),
}


def _save(name: str, directory: Path) -> Any:
    model_cls, make_config, _, _ = CASES[name]
    torch.manual_seed(0)
    config = make_config()
    model = (transformers.WhisperForConditionalGeneration(config) if name == "whisper"
             else model_cls.from_config(config)).eval()
    model.save_pretrained(directory)
    return model


def _output(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float()


def _close(expected: torch.Tensor, got: torch.Tensor) -> None:
    error = float((expected - got).abs().max()) / (float(expected.abs().max()) + 1.0)
    assert error <= TOLERANCES[torch.float32], error


def _fused(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, QkvMixin)]


def _takes_separate_inputs(name: str) -> bool:
    """transformers 4.57's DistilBERT attention is ``forward(query, key, value, ...)``: only its caller
    passes one tensor three times, so its own forward cannot show q, k and v read one input."""
    return name == "distilbert" and transformers.__version__.startswith("4.")


@pytest.mark.parametrize("name", list(CASES))
def test_encoder_attention_fuses_exactly_and_saves_the_source(name, tmp_path):
    model_cls, _, inputs, expected = CASES[name]
    reference = _save(name, tmp_path / "source")
    if _takes_separate_inputs(name):
        with pytest.raises(fusion_core.errors.DiscoveryError, match="applies the projections to different inputs"):
            fusion_core.from_pretrained(model_cls, tmp_path / "source", fusion_config={"qkv": True})
        return
    model, info = fusion_core.from_pretrained(model_cls, tmp_path / "source", fusion_config={"qkv": True},
                                              output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert _fused(model) == expected
    for path in expected:
        attention = model.get_submodule(path)
        assert type(attention).__name__ == type(reference.get_submodule(path)).__name__
        names = [n for n, child in attention.named_children() if isinstance(child, MergedSlice)]
        assert len(names) == 3 and attention.qkv_proj.weight.shape == (96, 32)
    _close(_output(reference, inputs), _output(model, inputs))
    assert all(model.get_submodule(p).fused_projection.merged_gemms >= 1 for p in expected)
    fusion_core.save_pretrained(model, tmp_path / "saved")
    assert (tmp_path / "saved/model.safetensors").read_bytes() == (tmp_path / "source/model.safetensors").read_bytes()
    plain = type(reference).from_pretrained(tmp_path / "saved").eval()
    assert not _fused(plain)
    _close(_output(reference, inputs), _output(plain, inputs))


def test_whisper_k_proj_without_bias_merges_with_zero_rows_and_saves_no_bias(tmp_path):
    reference = _save("whisper", tmp_path / "source")
    model = fusion_core.from_pretrained(transformers.WhisperForConditionalGeneration, tmp_path / "source",
                                        fusion_config={"qkv": True})
    attention = model.model.encoder.layers[0].self_attn
    original = reference.model.encoder.layers[0].self_attn
    assert original.k_proj.bias is None and attention.qkv_proj.bias.shape == (96,)
    assert torch.equal(attention.qkv_proj.bias[32:64], torch.zeros(32))
    assert torch.equal(attention.qkv_proj.bias[:32], original.q_proj.bias)
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in model.state_dict()
    assert not model.model.decoder.layers[0].encoder_attn.__class__.__name__.endswith("Mixin")
    assert not isinstance(model.model.decoder.layers[0].encoder_attn, QkvMixin)
    with torch.no_grad():
        attention.qkv_proj.bias[40] = 1.0  # a value the original layout has no tensor for
    with pytest.raises(Exception, match="no bias in the original layout"):
        fusion_core.save_pretrained(model, tmp_path / "saved")


def test_cross_attention_is_declined_by_its_forward():
    config = _bert(is_decoder=True, add_cross_attention=True)
    with torch.device("meta"):
        model = transformers.BertModel(config)
    layer = model.encoder.layer[0]
    assert FAMILY.is_fusable(layer.attention.self, OPTIONS) is True
    cross = layer.crossattention.self
    if type(cross) is type(layer.attention.self):
        pytest.skip(f"transformers {transformers.__version__} builds BERT's self- and cross-attention from one class "
                    "whose forward picks its input at run time: only the path tells them apart (discovery leaves "
                    "crossattention out; test_bert_decoder_with_cross_attention_fuses_only_self_attention loads one)")
    assert FAMILY.is_fusable(cross, OPTIONS) is False
    cross.is_cross_attention = False  # not the flag: the forward's inputs, or its class name, decide
    reason = refusal(cross)
    assert reason is not None and "cross" in reason.lower()


def test_bert_decoder_with_cross_attention_fuses_only_self_attention(tmp_path):
    torch.manual_seed(0)
    reference = transformers.BertModel(_bert(is_decoder=True, add_cross_attention=True)).eval()
    reference.save_pretrained(tmp_path)
    model = fusion_core.from_pretrained(transformers.BertModel, tmp_path, fusion_config={"qkv": True})
    assert _fused(model) == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    states = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    inputs = {**TEXT_INPUTS, "encoder_hidden_states": states}
    _close(_output(reference, inputs), _output(model, inputs))


def test_forward_applying_projections_to_different_arguments_is_declined():
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_lin, self.k_lin, self.v_lin = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            return self.q_lin(query) + self.k_lin(key) + self.v_lin(value)

    reason = refusal(Attention())
    assert reason is not None and "different inputs" in reason and "q_lin(query)" in reason


def test_conformance_kit_on_whisper_mixed_biases_and_bert(tmp_path):
    model = (transformers.WhisperForConditionalGeneration, _whisper())
    attention = kit.module_factory(model, "model.encoder.layers.0.self_attn")
    bound = kit.assert_transform_round_trip(attention(), FAMILY)
    assert [(t.targets[0].name, type(t.op).__name__) for t in bound] == [
        ("qkv_proj.weight", "Concat"), ("qkv_proj.bias", "ZeroFilledConcat")]
    kit.assert_state_dict_round_trip(attention(), FAMILY)
    kit.assert_transform_op(ZeroFilledConcat((4, 2, 4), (0, 2)), [(4,), (4,)], bad_shapes=[(4,), (2,)])
    kit.assert_options_schema(FAMILY)
    # The kit has no generic inputs for Whisper's forward; its fused load compares BERT end to end.
    comparison = kit.assert_fused_load(FAMILY, (transformers.AutoModelForMaskedLM, _bert()), tmp_path)
    assert [m.module for m in comparison.modules] == [f"bert.encoder.layer.{i}.attention.self" for i in range(2)]


def test_lora_targets_query_and_value_by_their_names(tmp_path):
    peft = pytest.importorskip("peft")
    reference = _save("bert", tmp_path)
    model = fusion_core.from_pretrained(transformers.AutoModel, tmp_path, fusion_config={"qkv": True})

    def lora(m: Any) -> Any:
        torch.manual_seed(1)
        return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                                      init_lora_weights=False))

    plain, fused = lora(reference), lora(model)
    targets = [n for n, m in fused.named_modules() if n.endswith((".query", ".value"))]
    assert len(targets) == 4 and all(hasattr(fused.get_submodule(n), "lora_A") for n in targets)
    _close(_output(plain, TEXT_INPUTS), _output(fused, TEXT_INPUTS))
