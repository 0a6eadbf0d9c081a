"""The decode step's own attention (``fusion_linear_kernels.decode_attention``): the attentions it verifies take it
at one-token steps and, attending with torch's kernel (``torch_attention``), give the tokens, logits and cached keys
and values their modules give; with its own kernel (``fusion_linear_kernels.attention_kernel``), each step's logits
are within the bound of the modules' and the kernel is as close to the exact attention as torch's; attentions of
another form run as modules, with the reason; every call it cannot take as the module would runs the module; the
switched layers keep it through pickling and drop it on unfuse. Layers whose norms or MLP the layer kernel does not
compute (mixtures of experts, Starcoder2) take the step's attention alone, where the model's rotary embedding gives the
rotation verified.

Kernel choices are decided by the fake clocks of ``test_decode_layer`` (the layers' GEMVs run the kernels the step
runs), at the same widths.
"""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from fusion_linear_kernels import attention_kernel, cache_growth, decode_attention, row_dot
from fusion_linear_kernels.decode_attention import AttentionForm, verified
from fusion_linear_kernels.decode_layer import (
    ATTENTION_KEY,
    FORM_KEY,
    DecodeLayerMixin,
    ModulesForm,
    drop_decode_attention,
    model_rotations,
    refusal,
)
from fusion_linear_kernels.layer_forms import relative, tolerance
from fusion_linear_kernels.row_dot import RowDotUnavailableWarning
from one_row_gemv import fresh_kernels_of, without_the_kernel_of
from test_decode_layer import (  # step_kernels: the fixture deciding the GEMVs
    ALONE,
    IDS,
    MERGED,
    _close,
    _generate,
    _model,
    _modules_only,
    step_kernels,  # noqa: F401
)
from torch import nn

import fusion_core

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("step_kernels")]

def _modules_attend(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose decode steps call their attention modules."""
    copied = copy.deepcopy(model)
    drop_decode_attention(copied)
    assert not any(ATTENTION_KEY in module.__dict__ for module in copied.modules())
    return copied


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def _decodes_as(reference: nn.Module, fused: nn.Module, attended: list[nn.Module]) -> Any:
    """``reference``'s greedy decode, after checking ``fused``'s against it: the same tokens, logits within the bound,
    and the step's own attention run in every layer at each of the five one-token steps (the four-token prefill runs
    the modules)."""
    attended.clear()  # the verification's
    expected = _generate(reference)
    assert not attended
    out = _generate(fused)
    assert attended == _attentions(fused) * 5
    assert torch.equal(out.sequences, expected.sequences)
    assert all(_close(got, want) for got, want in zip(out.logits, expected.logits, strict=True))
    return expected


@pytest.mark.usefixtures("torch_attention")
@pytest.mark.parametrize(("kind", "families"), [("llama", MERGED), ("llama", ALONE), ("qwen2", MERGED),
                                               ("gemma", MERGED), ("mistral", ALONE), ("phi3", ALONE),
                                               ("qwen3", MERGED), ("gemma3", ALONE), ("gemma2", MERGED)],
                         ids=["llama-merged", "llama-alone", "qwen2-merged", "gemma-merged", "mistral-alone",
                              "phi3-merged-in-the-checkpoint", "qwen3-norms-of-the-queries-and-keys",
                              "gemma3-norms-of-the-queries-and-keys", "gemma2-soft-capped-eager"])
def test_recognised_attentions_decode_as_their_modules_do(kind: str, families: dict[str, bool],
                                                          attended: list[nn.Module]) -> None:
    full = {"mistral": {"sliding_window": None}, "gemma3": {"layer_types": ["full_attention"] * 2}}  # dynamic caches
    fused = fusion_core.fuse(_model(kind, **full.get(kind, {})), families)
    layers = list(fused.model.layers)
    if kind == "gemma3" and int(transformers.__version__.split(".")[0]) < 5:  # 4.57's layer reads attention.is_sliding
        assert "arguments passed through" in str(refusal(layers[0]))  # and passes it one of two rotations: no step
        return
    if kind == "gemma2" and int(transformers.__version__.split(".")[0]) < 5:
        assert "returns tuple" in str(refusal(layers[0]))  # 4.57's Gemma 2 layer returns (hidden_states,)
        return
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY in layer.__dict__ for layer in layers)
    _decodes_as(reference=_modules_attend(fused), fused=fused, attended=attended)


OTHER_LAYERS = {
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 768}),
    "olmoe": (transformers.OlmoeConfig, {"num_experts": 4, "num_experts_per_tok": 2}),
    "starcoder2": (transformers.Starcoder2Config, {}),
}
"""Decoders whose layers' norms or MLP the layer kernel does not compute (mixtures of experts; Starcoder2's
LayerNorms and MLP without a gate), each with an attention the step verifies."""


def _other_model(config_class: type, **extra: Any) -> nn.Module:
    config = config_class(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=256,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


@pytest.mark.usefixtures("torch_attention")
@pytest.mark.parametrize("kind", list(OTHER_LAYERS))
def test_layers_of_another_form_take_the_attention_step_alone(kind: str, attended: list[nn.Module]) -> None:
    config_class, extra = OTHER_LAYERS[kind]
    fused = fusion_core.fuse(_other_model(config_class, **extra), ALONE)
    layers = list(fused.model.layers)
    if kind != "starcoder2" and int(transformers.__version__.split(".")[0]) < 5:
        # 4.57's experts return (output, router logits), or sit under another name (block_sparse_moe)
        assert not any(isinstance(layer, DecodeLayerMixin) for layer in layers)
        return
    assert all(isinstance(layer.__dict__.get(FORM_KEY), ModulesForm) and ATTENTION_KEY in layer.__dict__
               for layer in layers)
    expected = _decodes_as(reference=_modules_only(fused), fused=fused, attended=attended)  # the original forwards
    loaded = pickle.loads(pickle.dumps(fused))
    assert all(isinstance(layer.__dict__.get(FORM_KEY), ModulesForm) for layer in loaded.model.layers)
    assert torch.equal(_generate(loaded).sequences, expected.sequences)
    fusion_core.unfuse(fused)
    assert not any(isinstance(layer, DecodeLayerMixin) or FORM_KEY in layer.__dict__ for layer in fused.model.layers)


def test_layers_of_another_form_whose_rotation_the_step_declines_keep_their_class() -> None:
    fused = fusion_core.fuse(_other_model(transformers.OlmoConfig), ALONE)  # LayerNorms, and a float32 rotation
    layer = fused.model.layers[0]
    assert isinstance(verified(layer.self_attn, torch.bfloat16, 512), AttentionForm)  # on a rotation of the dtype
    assert (torch.bfloat16, 64) not in (model_rotations(fused, torch.bfloat16) or set())
    assert not any(isinstance(layer, DecodeLayerMixin) for layer in fused.model.layers)


def test_a_layer_whose_model_rotates_otherwise_keeps_no_attention_form(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama")
    rotary = model.model.rotary_emb
    given = rotary.forward
    monkeypatch.setattr(rotary, "forward", lambda x, position_ids: tuple(t.float() for t in given(x, position_ids)))
    fused = fusion_core.fuse(model, MERGED)  # the step verifies a rotation of the dtype; this model's is float32
    assert model_rotations(fused, torch.bfloat16) == {(torch.float32, 64)}
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY not in layer.__dict__ for layer in fused.model.layers)


@pytest.mark.usefixtures("torch_attention")
def test_the_step_caches_the_keys_and_values_the_module_caches(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("qwen2"), MERGED)
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


@pytest.mark.usefixtures("torch_attention")
@pytest.mark.parametrize("spare", [1, 64], ids=["a growth every few steps", "one buffer"])
def test_the_steps_cache_grows_in_its_buffers_and_decodes_as_the_modules(spare: int, attended: list[nn.Module],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_growth, "MIN_SPARE", spare)
    fused = fusion_core.fuse(_model("llama"), MERGED)
    reference = _modules_attend(fused)
    attended.clear()
    outputs = []
    for model in (reference, fused):
        with torch.no_grad():
            outputs.append(model.generate(IDS, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                          output_logits=True, return_dict_in_generate=True))
    assert len(attended) == 2 * 11
    expected, got = outputs
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(g, e) for g, e in zip(got.logits, expected.logits, strict=True))
    caches = [out["cache"] if "cache" in out else out["past_key_values"] for out in outputs]
    for want, layer in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(layer.keys, want.keys) and torch.equal(layer.values, want.values)
        assert not layer.keys.is_contiguous()  # a view of the step's buffer


@pytest.mark.parametrize(("kind", "reason"), [
    ("glm", "cached keys or values differ"),  # the rotary embedding over half the head, interleaved
])
def test_attentions_of_another_form_run_as_modules(kind: str, reason: str, attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model(kind), ALONE)
    layers = list(fused.model.layers)
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY not in layer.__dict__ for layer in layers)
    assert reason in str(verified(layers[0].self_attn, torch.bfloat16, 512))
    attended.clear()  # the verification's
    _generate(fused)
    assert not attended


def test_an_attention_whose_forward_computes_otherwise_does_not_verify() -> None:
    model = _model("llama")
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


def test_the_soft_cap_verified_is_the_one_the_forward_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    attention = _model("gemma2").model.layers[0].self_attn
    form = verified(attention, torch.bfloat16, 512)
    assert isinstance(form, AttentionForm)
    if form.implementation == "sdpa":  # 4.57 to 5.16 at least: Gemma 2 runs sdpa, which ignores the cap
        assert form.softcap is None  # the uncapped form verifies; the capped one, tried alone, does not:
        monkeypatch.setattr(decode_attention, "_toggled", lambda form: form)
        assert "differs from the forward's" in str(verified(attention, torch.bfloat16, 512))
        return
    assert form.implementation == "eager" and form.softcap == attention.attn_logit_softcapping
    monkeypatch.setattr(decode_attention, "SOFTCAP", "no_such_attribute")  # the cap unread: the step does not cap
    assert "differs from the forward's" in str(verified(attention, torch.bfloat16, 512))


@pytest.mark.usefixtures("torch_attention")
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_padded_batch_takes_the_step_and_decodes_as_the_modules(implementation: str,
                                                                  attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("llama", attn_implementation=implementation), MERGED)
    reference = _modules_attend(fused)
    attended.clear()
    padded = torch.cat([IDS, torch.tensor([[0, 0, 7, 8]]), torch.tensor([[0, 3, 1, 2]])])
    outputs = []
    for model in (reference, fused):
        with torch.no_grad():  # left padding: an attention mask hiding keys at every step
            outputs.append(model.generate(padded, attention_mask=(padded != 0).long(), max_new_tokens=5,
                                          min_new_tokens=5, do_sample=False, output_logits=True,
                                          return_dict_in_generate=True))
    expected, got = outputs
    assert attended == _attentions(fused) * 4  # the prefill runs the modules, then four one-token steps
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(g, e) for g, e in zip(got.logits, expected.logits, strict=True))


def test_calls_the_attention_step_cannot_take_run_the_module(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("llama"), MERGED)
    attended.clear()  # the verification's
    seen: list[nn.Module] = []
    attention = fused.model.layers[0].self_attn
    handle = attention.register_forward_hook(lambda module, args, out: seen.append(module))
    _generate(fused, tokens=3)
    handle.remove()
    assert len(seen) == 3 and attended == [fused.model.layers[1].self_attn] * 2
    attended.clear()
    fused.set_attn_implementation("eager")
    _generate(fused, tokens=3)
    assert not attended


@pytest.mark.usefixtures("torch_attention")
def test_flags_the_attention_ignores_leave_it_the_step(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("llama"), MERGED)
    reference = _modules_attend(fused)
    attended.clear()  # the verification's
    for model in (reference, fused):  # a mixture of experts' layer passes these on; some models, logits_to_keep
        for layer in model.model.layers:
            layer.forward = functools.partial(layer.forward, output_router_logits=False, logits_to_keep=1)
    expected = _generate(reference)
    assert not attended
    out = _generate(fused)
    assert len(attended) == 2 * 5 and torch.equal(out.sequences, expected.sequences)


@pytest.mark.usefixtures("torch_attention")
@pytest.mark.parametrize("window", [3, 4096], ids=["full-window-all-true-mask", "inside-the-window-no-mask"])
def test_a_sliding_window_cache_takes_the_step(window: int, attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("mistral", sliding_window=window), ALONE)
    assert all(ATTENTION_KEY in layer.__dict__ for layer in fused.model.layers)
    attended.clear()
    expected = _generate(_modules_attend(fused))
    assert not attended
    out = _generate(fused)
    assert attended == _attentions(fused) * 5  # every one-token step, the window's layers included (5.x's apart)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(_close(got, want) for got, want in zip(out.logits, expected.logits, strict=True))


def test_masks_of_one_row_a_sequence_take_the_step_and_others_run_the_module() -> None:
    fused = fusion_core.fuse(_model("llama"), MERGED)
    layer = fused.model.layers[0]
    form, attention = layer.__dict__[ATTENTION_KEY], layer.self_attn
    cache_type, _ = decode_attention._cache_types()  # type: ignore[misc]
    rotation = torch.randn(2, 1, 64).bfloat16()
    hidden = torch.randn(2, 1, 512).bfloat16()
    prior = torch.randn(2, 2, 2, 3, 64, generator=torch.Generator().manual_seed(0)).bfloat16()

    def step(mask: torch.Tensor | None, forward: bool = False) -> torch.Tensor | None:
        cache = cache_type()
        cache.update(prior[0].clone(), prior[1].clone(), form.layer_idx)
        call = {"attention_mask": mask, form.cache_name: cache, "position_embeddings": (rotation, rotation)}
        with torch.no_grad():
            return attention(hidden, **call)[0] if forward else form.run(attention, hidden, call)

    hiding = torch.tensor([[False, True, True, True], [True, True, False, True]]).view(2, 1, 1, 4)
    additive = torch.zeros(1, 1, 1, 4).index_fill_(-1, torch.tensor([1]), torch.finfo(torch.bfloat16).min)
    for mask in (hiding, additive.bfloat16(), None):
        got, expected = step(mask), step(mask, forward=True)
        assert got is not None and relative(expected, got) <= tolerance(torch.bfloat16)
    assert relative(step(hiding), step(None)) > tolerance(torch.bfloat16)  # the mask hides them
    assert torch.equal(step(torch.ones(2, 1, 1, 4, dtype=torch.bool)), step(None))  # a mask hiding none
    assert torch.equal(step(torch.zeros(1, 1, 1, 4).bfloat16()), step(None))  # eager's zeros hide none
    every = hiding.clone()
    every[1] = False
    assert step(every) is None  # a sequence with no key to see: the module's (torch gives NaN or zeros)
    assert step(hiding.expand(2, 8, 1, 4)) is None  # a mask a head
    assert step(torch.ones(2, 1, 1, 4, dtype=torch.long)) is None  # neither boolean nor added
    with torch.no_grad(), pytest.raises(RuntimeError):  # a mask of other keys than the cache's goes to torch's sdpa
        step(torch.ones(2, 1, 1, 9, dtype=torch.bool))


def test_a_boolean_masks_bias_is_float32_whatever_the_default_dtype() -> None:
    """The kernel takes a float32 bias only: one built in the default dtype would send a padded batch to torch's
    attention wherever a script set another default."""
    torch.set_default_dtype(torch.float64)
    try:
        takes, bias = decode_attention._scores_bias(torch.tensor([[[[False, True, True]]]]), 1)
    finally:
        torch.set_default_dtype(torch.float32)
    assert takes and bias is not None and bias.dtype is torch.float32
    assert bias.tolist() == [[float("-inf"), 0.0, 0.0]]


def test_the_step_attention_survives_pickling_and_unfuse_drops_it(attended: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("llama"), MERGED)
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
    fused = fusion_core.fuse(_model("llama"), MERGED)
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY not in layer.__dict__ for layer in fused.model.layers)
    assert "no dynamic cache layers" in str(verified(fused.model.layers[0].self_attn, torch.bfloat16, 512))


@pytest.mark.parametrize("dtype", attention_kernel.DTYPES, ids=str)
def test_the_kernel_builds_wherever_the_gemv_kernel_does(dtype: torch.dtype) -> None:
    """The kernel's tests skip where it cannot be built (no C++ compiler); where the GEMV kernel builds with the same
    toolchain, so must this one, or a source that does not compile would only skip them."""
    if row_dot.kernel(dtype, False) is None:
        pytest.skip(f"no C++ kernel for {dtype} builds here")
    assert attention_kernel.kernel(dtype) is not None


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, softcap: float | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's attention of ``query`` over ``keys`` and ``values`` in their dtype, the scores soft-capped as Gemma 2's
    eager attention caps them where ``softcap`` is given, then ``bias`` (``[batch or 1, length]``) added, as
    ``[batch, 1, heads * width]``."""
    scale = query.shape[-1] ** -0.5
    mask = None if bias is None else bias[:, None, None, :]
    if softcap is None:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        group = query.shape[1] // keys.shape[1]
        scores = torch.tanh(query @ keys.repeat_interleave(group, dim=1).transpose(2, 3) * scale / softcap) * softcap
        scores = scores if mask is None else scores + mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = weights @ values.repeat_interleave(group, dim=1)
    return out.transpose(1, 2).reshape(query.shape[0], 1, -1)


@pytest.mark.parametrize("dtype", attention_kernel.DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "width", "length"), [
    (1, 14, 2, 64, 1), (1, 14, 2, 64, 37), (2, 8, 8, 128, 300), (1, 6, 1, 80, 19), (3, 4, 2, 24, 5)])
def test_the_kernel_attends_as_close_to_the_exact_attention_as_torch(
        dtype: torch.dtype, softcap: float | None, batch: int, heads: int, kv_heads: int, width: int,
        length: int) -> None:
    if attention_kernel.kernel(dtype) is None:
        pytest.skip(f"the attention kernel for {dtype} cannot be built here")
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, 1, width, generator=generator).to(dtype)
    keys, values = (torch.randn(2, batch, kv_heads, length, width, generator=generator) * 4).to(dtype)
    exact = _attention(query.double(), keys.double(), values.double(), softcap)
    torch_ = _attention(query, keys, values, softcap)
    got = attention_kernel.attend(query, keys, values, width**-0.5, softcap)
    assert got is not None and got.shape == exact.shape and got.dtype is dtype
    worst = float((torch_.double() - exact).abs().max())
    assert float((got.double() - exact).abs().max()) <= max(worst, torch.finfo(dtype).eps * float(exact.abs().max()))
    if softcap is not None and length > 1:  # the cap bites: the uncapped attention is further off
        uncapped = attention_kernel.attend(query, keys, values, width**-0.5)
        assert uncapped is not None and float((uncapped.double() - exact).abs().max()) > 4 * max(worst, 1e-3)


@pytest.mark.parametrize("dtype", attention_kernel.DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize("kind", ["boolean, a row a sequence", "added, one row for all"])
def test_the_kernel_adds_a_masks_bias_to_the_scores_as_torch_adds_the_mask(dtype: torch.dtype, softcap: float | None,
                                                                           kind: str) -> None:
    if attention_kernel.kernel(dtype) is None:
        pytest.skip(f"the attention kernel for {dtype} cannot be built here")
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 8, 1, 64, generator=generator).to(dtype)
    keys, values = (torch.randn(2, 3, 2, 40, 64, generator=generator) * 4).to(dtype)
    if kind.startswith("boolean"):  # left padding of 7 and none, and a hole of 4
        visible = torch.ones(3, 40, dtype=torch.bool)
        visible[0, :7] = visible[2, 5:9] = False
        bias = torch.zeros(3, 40).masked_fill_(~visible, float("-inf"))
    else:  # eager's minimum on some keys, and values of another kind on others
        bias = torch.randn(1, 40, generator=generator).index_fill_(-1, torch.arange(0, 40, 3), torch.finfo(dtype).min)
    exact = _attention(query.double(), keys.double(), values.double(), softcap, bias.double())
    torch_ = _attention(query, keys, values, softcap, bias.to(dtype))
    got = attention_kernel.attend(query, keys, values, 64**-0.5, softcap, bias)
    assert got is not None and got.shape == exact.shape
    worst = float((torch_.double() - exact).abs().max())
    assert float((got.double() - exact).abs().max()) <= max(worst, torch.finfo(dtype).eps * float(exact.abs().max()))
    unmasked = attention_kernel.attend(query, keys, values, 64**-0.5, softcap)
    assert unmasked is not None and float((unmasked.double() - exact).abs().max()) > 4 * max(worst, 1e-3)


def test_the_kernel_declines_what_it_does_not_take() -> None:
    if attention_kernel.kernel(torch.bfloat16) is None:
        pytest.skip("the attention kernel cannot be built here")
    query, keys = torch.randn(1, 4, 1, 16).bfloat16(), torch.randn(1, 2, 5, 16).bfloat16()
    assert attention_kernel.attend(query, keys, keys, 0.25) is not None
    assert attention_kernel.attend(query, keys.float(), keys.float(), 0.25) is None  # another dtype
    assert attention_kernel.attend(query.float(), keys.float(), keys.float(), 0.25) is None  # float32: torch's
    assert attention_kernel.attend(query, keys.transpose(2, 3).contiguous().transpose(2, 3), keys, 0.25) is None
    assert attention_kernel.attend(query, torch.randn(1, 3, 5, 16).bfloat16(), keys, 0.25) is None  # 4 heads, 3 kv
    assert attention_kernel.attend(query.expand(1, 4, 2, 16), keys, keys, 0.25) is None  # two query tokens
    assert attention_kernel.attend(query[0], keys, keys, 0.25) is None  # no batch dimension
    assert attention_kernel.attend(query, keys[:, :0], keys[:, :0], 0.25) is None  # no key/value heads
    assert attention_kernel.attend(query, keys, keys, 0.25, softcap=0.0) is None  # no cap is None, not 0
    for bias in (torch.zeros(1, 4), torch.zeros(2, 5), torch.zeros(1, 5).bfloat16(), torch.zeros(1, 10)[:, ::2]):
        assert attention_kernel.attend(query, keys, keys, 0.25, bias=bias) is None  # not [1, 5] float32, contiguous


@pytest.mark.parametrize(("sequences", "padding"), [(1, 0), (3, 0), (3, 2)],
                         ids=["one-sequence", "three-sequences", "three-sequences-left-padded"])
@pytest.mark.parametrize(("kind", "extra"), [("qwen2", {}), ("mistral", {"sliding_window": 3}), ("gemma2", {})],
                         ids=["qwen2", "mistral-full-sliding-window", "gemma2-soft-capped-eager"])
def test_with_its_kernel_each_step_is_within_the_bound_of_the_modules(sequences: int, padding: int, kind: str,
                                                                      extra: dict[str, Any],
                                                                      attended: list[nn.Module]) -> None:
    if attention_kernel.kernel(torch.bfloat16) is None:
        pytest.skip("the attention kernel cannot be built here")
    fused = fusion_core.fuse(_model(kind, **extra), MERGED)
    if kind == "gemma2" and int(transformers.__version__.split(".")[0]) < 5:
        assert "returns tuple" in str(refusal(fused.model.layers[0]))  # 4.57's Gemma 2 layer gets no step
        return
    reference = _modules_attend(fused)
    prompts = torch.cat([IDS, IDS.flip(-1), IDS + 1])[:sequences]
    mask = torch.ones_like(prompts)
    mask[1:, :padding] = 0  # the sequences after the first padded on the left: a mask hiding keys at every step
    prompts = prompts.masked_fill(mask == 0, 0)
    attended.clear()
    with torch.no_grad():
        tokens = fused.generate(prompts, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                do_sample=False)[:, IDS.shape[1]:]
    assert len(attended) >= 2 * 4  # a first call of a few rows' kind runs the modules, which decide it
    caches: list[Any] = [None, None]
    with torch.no_grad():
        for step, ids in enumerate([prompts, *tokens[:, :-1].T.unsqueeze(-1)]):
            mask = mask if step == 0 else torch.cat([mask, torch.ones_like(ids)], dim=-1)
            logits = []
            for index, model in enumerate((reference, fused)):
                out = model(input_ids=ids, attention_mask=mask, past_key_values=caches[index], use_cache=True)
                caches[index] = out.past_key_values
                logits.append(out.logits[:, -1])
            assert _close(logits[1], logits[0]), step


def test_rotations_of_another_shape_run_the_module() -> None:
    fused = fusion_core.fuse(_model("llama"), MERGED)
    layer = fused.model.layers[0]
    form, attention = layer.__dict__[ATTENTION_KEY], layer.self_attn
    hidden = torch.randn(1, 1, 512).bfloat16()
    cache_type, _ = decode_attention._cache_types()  # type: ignore[misc]
    cache = cache_type()
    cache.update(*torch.randn(2, 1, 2, 3, 64).bfloat16(), form.layer_idx)
    rotation = torch.randn(1, 1, 64).bfloat16()
    call = {"attention_mask": None, "cache": cache}
    with torch.no_grad():
        assert form.run(attention, hidden, {**call, "position_embeddings": (rotation, rotation)}) is not None
        sections = rotation.expand(3, 1, 1, 64)  # a multimodal rotation: one a section
        assert form.run(attention, hidden, {**call, "position_embeddings": (sections, sections)}) is None
        assert form.run(attention, hidden, {**call, "position_embeddings": (rotation, rotation), "output_attentions":
                                            True}) is None
        assert form.run(attention, hidden, {**call, "position_embeddings": (rotation, rotation), "other": 1}) is None


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """The attention kernel forgotten before the test, and gone after ``fusion_core.reset_state()``."""
    yield from fresh_kernels_of(attention_kernel)


def test_an_attention_kernel_that_cannot_be_built_leaves_torchs_and_says_so_once(
        fresh_kernels: None, monkeypatch: pytest.MonkeyPatch, attended: list[nn.Module]) -> None:
    without_the_kernel_of(monkeypatch, "softmax_numerators")
    with pytest.warns(RowDotUnavailableWarning, match="decode attention kernel") as caught:
        fused = fusion_core.fuse(_model("llama"), MERGED)
        attended.clear()
        out = _generate(fused)
    assert len([w for w in caught if "decode attention kernel" in str(w.message)]) == 1
    assert len(attended) == 2 * 5  # the step's attention, with torch's kernel
    assert torch.equal(out.sequences, _generate(_modules_attend(fused)).sequences)


def test_reset_state_forgets_the_built_attention_kernels(fresh_kernels: None) -> None:
    fused = fusion_core.fuse(_model("llama"), MERGED)
    assert all(ATTENTION_KEY in layer.__dict__ for layer in fused.model.layers)
    assert len(attention_kernel._KERNELS)  # fresh_kernels checks they are gone after fusion_core.reset_state()
