"""The decode step's own attention (``fusion_linear_kernels.decode_attention``): the attentions it verifies take it
at one-token steps and give the tokens, logits and cached keys and values their modules give; attentions of another
form run as modules, with the reason; every call it cannot take as the module would runs the module; the switched
layers keep it through pickling and drop it on unfuse.

Kernel choices are decided by the fake clocks of ``test_decode_layer`` (the layers' GEMVs run the kernels the step
runs), at the same widths.
"""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers
from fusion_linear_kernels import decode_attention
from fusion_linear_kernels.decode_attention import AttentionForm, verified
from fusion_linear_kernels.decode_layer import ATTENTION_KEY, FORM_KEY
from test_decode_layer import (  # step_kernels: the fixture deciding the GEMVs
    ALONE,
    CONFIGS,
    IDS,
    MERGED,
    TOKENS,
    _close,
    _generate,
    _model,
    step_kernels,  # noqa: F401
)
from torch import nn

import fusion_core

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("step_kernels")]

CONFIGS = {**CONFIGS, "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}


@pytest.fixture
def attended(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[nn.Module]]:
    """The attention modules each step's own attention ran for, in order."""
    ran: list[nn.Module] = []
    attend = AttentionForm._attend

    def counted(self: AttentionForm, attention: nn.Module, *args: Any) -> torch.Tensor:
        ran.append(attention)
        return attend(self, attention, *args)

    monkeypatch.setattr(AttentionForm, "_attend", counted)
    yield ran


def _of(kind: str, **extra: Any) -> nn.Module:
    if kind in ("qwen3", "mistral"):
        config = CONFIGS[kind](hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=256,
                               **{**TOKENS, **extra})
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    return _model(kind, **extra)


def _modules_attend(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose decode steps call their attention modules."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        module.__dict__.pop(ATTENTION_KEY, None)
    return copied


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


@pytest.mark.parametrize(("kind", "families"), [("llama", MERGED), ("llama", ALONE), ("qwen2", MERGED),
                                               ("gemma", MERGED), ("mistral", ALONE)],
                         ids=["llama-merged", "llama-alone", "qwen2-merged", "gemma-merged", "mistral-alone"])
def test_recognised_attentions_decode_as_their_modules_do(kind: str, families: dict[str, bool],
                                                          attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_of(kind, **({"sliding_window": None} if kind == "mistral" else {})), families)
    layers = list(fused.model.layers)
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY in layer.__dict__ for layer in layers)
    reference = _modules_attend(fused)
    attended.clear()  # the verification's
    expected = _generate(reference)
    assert not attended
    out = _generate(fused)
    assert attended == _attentions(fused) * 5  # the four-token prefill runs the modules, then five one-token steps
    assert torch.equal(out.sequences, expected.sequences)
    assert all(_close(got, want) for got, want in zip(out.logits, expected.logits, strict=True))


def test_the_step_caches_the_keys_and_values_the_module_caches(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_of("qwen2"), MERGED)
    reference = _modules_attend(fused)
    attended.clear()  # the verification's
    caches = []
    for model in (reference, fused):
        with torch.no_grad():
            out = model.generate(IDS, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                 return_dict_in_generate=True)
        caches.append(out["cache"] if "cache" in out else out["past_key_values"])  # 5.x's name, then 4.x's
    assert len(attended) == 2 * 3
    for expected, got in zip(*(cache.layers for cache in caches), strict=True):
        assert torch.equal(expected.keys, got.keys) and torch.equal(expected.values, got.values)


@pytest.mark.parametrize(("kind", "reason"), [
    ("qwen3", "not an attention of q/k/v/o projections alone"),  # norms of the queries and keys
    ("phi3", "not an attention of q/k/v/o projections alone"),  # q, k and v merged in the checkpoint
    ("glm", "cached keys or values differ"),  # the rotary embedding over half the head, interleaved
])
def test_attentions_of_another_form_run_as_modules(kind: str, reason: str, attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_of(kind), ALONE)
    layers = list(fused.model.layers)
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY not in layer.__dict__ for layer in layers)
    assert reason in str(verified(layers[0].self_attn, torch.bfloat16, 512))
    attended.clear()  # the verification's
    _generate(fused)
    assert not attended


def test_an_attention_whose_forward_computes_otherwise_does_not_verify() -> None:
    model = _of("llama")
    attention = model.model.layers[0].self_attn
    original = type(attention)

    name = "cache" if "cache" in inspect.signature(original.forward).parameters else "past_key_values"

    class Capped(original):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any,
                    cache: Any = None, **kwargs: Any) -> Any:
            output, weights = super().forward(hidden_states, position_embeddings, attention_mask, **{name: cache},
                                              **kwargs)
            return torch.tanh(output / 4.0) * 4.0, weights

    attention.__class__ = Capped
    assert "differs from the forward's" in str(verified(attention, torch.bfloat16, 512))
    attention.__class__ = original
    assert isinstance(verified(attention, torch.bfloat16, 512), AttentionForm)


def test_calls_the_attention_step_cannot_take_run_the_module(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_of("llama"), MERGED)
    reference = _modules_attend(fused)
    attended.clear()
    padded = torch.cat([IDS, torch.tensor([[0, 0, 7, 8]])])
    mask = (padded != 0).long()
    with torch.no_grad():  # left padding: an attention mask at every step
        got = fused.generate(padded, attention_mask=mask, max_new_tokens=3, do_sample=False)
        expected = reference.generate(padded, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, expected) and not attended
    seen: list[nn.Module] = []
    attention = fused.model.layers[0].self_attn
    handle = attention.register_forward_hook(lambda module, args, out: seen.append(module))
    _generate(fused, tokens=3)
    handle.remove()
    assert len(seen) == 3 and attended == [fused.model.layers[1].self_attn] * 2
    attended.clear()
    fused.config._attn_implementation = "eager"
    for layer in fused.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    _generate(fused, tokens=3)
    assert not attended


def test_a_sliding_window_cache_runs_the_module(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_of("mistral", sliding_window=3), ALONE)
    assert all(ATTENTION_KEY in layer.__dict__ for layer in fused.model.layers)
    attended.clear()
    expected = _generate(_modules_attend(fused))
    out = _generate(fused)
    assert torch.equal(out.sequences, expected.sequences)
    if int(transformers.__version__.split(".")[0]) >= 5:  # 5.x's cache keeps a window's layers apart
        assert not attended


def test_the_step_attention_survives_pickling_and_unfuse_drops_it(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_of("llama"), MERGED)
    loaded = pickle.loads(pickle.dumps(fused))
    assert all(isinstance(layer.__dict__.get(ATTENTION_KEY), AttentionForm) for layer in loaded.model.layers)
    attended.clear()
    expected = _generate(fused).sequences
    attended.clear()
    assert torch.equal(_generate(loaded).sequences, expected) and len(attended) == 2 * 5
    fusion_core.unfuse(fused)
    assert not any(ATTENTION_KEY in layer.__dict__ for layer in fused.model.layers)


def test_a_transformers_without_cache_layers_keeps_the_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_attention, "_cache_types", lambda: None)
    fused = fusion_core.fuse(_of("llama"), MERGED)
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY not in layer.__dict__ for layer in fused.model.layers)
    assert "no dynamic cache layers" in str(verified(fused.model.layers[0].self_attn, torch.bfloat16, 512))
