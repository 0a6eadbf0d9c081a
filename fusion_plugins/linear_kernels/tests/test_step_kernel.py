"""A decoder layer's whole one-token step in one C++ call (``fusion_linear_kernels.step_kernel``): where the step's own
attention runs its kernels throughout (a merged q/k/v projection and an output projection the GEMV kernel reads, a cache
it appends to in its buffer), the layer takes one call, and gives the tokens, logits and cache its kernels give called
one by one, bit for bit, over every form the step knows (biases, norms of the queries and keys, q/k/v merged in the
checkpoint, the sandwich form with soft-capped scores), a padded batch and a sliding window's cache layer; load
verification runs the call, so a step kernel that computed otherwise would leave the layer its calls one by one; a step
kernel that cannot be built does the same, said once.

The attentions are as wide as ``test_decode_projections``'s, so that their projections are weights the GEMV kernel
reads; kernel choices are decided by its fake clocks."""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers
from fusion_linear_kernels import cache_growth, row_dot, step_kernel
from fusion_linear_kernels.decode_layer import ATTENTION_KEY, FORM_KEY, ONE_CALL_KEY, LayerForm, drop_one_call
from fusion_linear_kernels.row_dot import RowDotUnavailableWarning
from one_row_gemv import fresh_kernels_of, recorded_calls, skip_unless_built, without_the_kernel_of
from test_decode_layer import (  # step_kernels: the fixture deciding the GEMVs
    ALONE,
    IDS,
    MERGED,
    _generate,
    _model,
    step_kernels,  # noqa: F401
)
from test_decode_projections import WIDE
from torch import nn

import fusion_core

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("step_kernels")]


@pytest.fixture
def one_calls(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The input of every layer step run in one call from now on (the call still runs)."""
    skip_unless_built(lambda: step_kernel.kernel(torch.bfloat16), "the decode layer step kernel")
    return recorded_calls(monkeypatch, LayerForm, "_in_one_call")


def _one_by_one(model: nn.Module) -> nn.Module:
    copied = copy.deepcopy(model)
    drop_one_call(copied)
    return copied


def _caches_equal(first: Any, second: Any) -> bool:
    caches = [out["cache"] if "cache" in out else out["past_key_values"] for out in (first, second)]
    return all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(*(cache.layers for cache in caches), strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_kernel_builds_wherever_the_projection_and_layer_kernels_do(dtype: torch.dtype) -> None:
    """The tests beside this one skip where the kernel cannot be built; a source that does not compile must fail."""
    if row_dot.kernel(dtype, False) is None:
        pytest.skip("the GEMV kernel cannot be built here")
    assert step_kernel.kernel(dtype) is not None


@pytest.mark.parametrize(("kind", "families"), [("qwen2", MERGED), ("llama", MERGED), ("phi3", ALONE),
                                               ("qwen3", MERGED), ("gemma2", MERGED)],
                         ids=["bias", "no-bias", "merged-in-the-checkpoint", "norms-of-the-queries-and-keys",
                              "sandwich-soft-capped-eager"])
def test_a_layer_steps_in_one_call_and_gives_the_bits_of_its_kernels_one_by_one(
        kind: str, families: dict[str, bool], one_calls: list[torch.Tensor], attended: list[nn.Module]) -> None:
    full = {"layer_types": ["full_attention"] * 2} if kind == "gemma2" else {}  # its sliding layers: below
    fused = fusion_core.fuse(_model(kind, **WIDE, **full), families)
    layers = list(fused.model.layers)
    if kind == "gemma2" and int(transformers.__version__.split(".")[0]) < 5:
        assert all(FORM_KEY not in layer.__dict__ for layer in layers)  # 4.57's Gemma 2 layer returns a tuple
        return
    assert all(ONE_CALL_KEY in layer.__dict__ for layer in layers)
    reference = _one_by_one(fused)
    one_calls.clear()  # the verification's
    attended.clear()
    expected = _generate(reference)
    assert not one_calls and len(attended) == len(layers) * 5
    attended.clear()
    out = _generate(fused)
    assert len(one_calls) == len(layers) * 5 and not attended  # the four-token prefill runs the modules
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(got, want) for got, want in zip(out.logits, expected.logits, strict=True))
    assert _caches_equal(out, expected)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_padded_batch_steps_in_one_call_with_its_mask(implementation: str, one_calls: list[torch.Tensor]) -> None:
    fused = fusion_core.fuse(_model("llama", attn_implementation=implementation, **WIDE), MERGED)
    reference = _one_by_one(fused)
    padded = torch.cat([IDS, torch.tensor([[0, 0, 7, 8]]), torch.tensor([[0, 3, 1, 2]])])
    outputs = []
    for model in (reference, reference, fused):  # the first decides the GEMVs' kinds at three rows
        one_calls.clear()
        with torch.no_grad():  # left padding: an attention mask hiding keys at every step
            outputs.append(model.generate(padded, attention_mask=(padded != 0).long(), max_new_tokens=5,
                                          min_new_tokens=5, do_sample=False, output_logits=True,
                                          return_dict_in_generate=True))
    _, expected, got = outputs
    assert len(one_calls) == 2 * 4  # the prefill runs the modules, then four one-token steps
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(g, e) for g, e in zip(got.logits, expected.logits, strict=True))
    assert _caches_equal(got, expected)


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sliding_windows_layer_steps_in_one_call_and_gives_the_bits_of_its_update(
        kind: str, one_calls: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of three tokens slides from the prompt on: the one call, the calls one by one and the calls one by one
    over the layer's own ``update`` give the same tokens, logits and cache, bit for bit."""
    fused = fusion_core.fuse(_model(kind, sliding_window=3, **WIDE), MERGED)
    layers = list(fused.model.layers)
    if not all(ONE_CALL_KEY in layer.__dict__ for layer in layers):
        assert kind == "gemma2" and int(transformers.__version__.split(".")[0]) < 5  # 4.57's layer returns a tuple
        return
    one_by_one = _one_by_one(fused)
    outputs = [_generate(one_by_one)]
    with monkeypatch.context() as patched:
        patched.setattr(cache_growth, "slides", lambda layer_type: False)  # the layer's own update, as before
        outputs.append(_generate(one_by_one))
    one_calls.clear()
    outputs.append(_generate(fused))
    assert len(one_calls) == len(layers) * 5
    cache = outputs[-1]["cache"] if "cache" in outputs[-1] else outputs[-1]["past_key_values"]
    assert any(layer.keys.shape[2] == 2 for layer in cache.layers)  # a window's: its last two tokens
    for got, expected in itertools.pairwise(outputs):
        assert torch.equal(got.sequences, expected.sequences)
        assert all(torch.equal(g, e) for g, e in zip(got.logits, expected.logits, strict=True))
        assert _caches_equal(got, expected)


def test_calls_the_step_kernel_cannot_take_run_the_kernels_one_by_one(one_calls: list[torch.Tensor],
                                                                       attended: list[nn.Module]) -> None:
    """A hooked output projection runs as its module (the step's attention without its GEMV): not the step kernel's
    to run."""
    hooked = fusion_core.fuse(_model("llama", **WIDE), MERGED)
    hooked.model.layers[0].self_attn.o_proj.register_forward_hook(lambda module, args, output: None)
    _generate(hooked)  # the first decides the GEMVs' kinds
    one_calls.clear()
    attended.clear()
    _generate(hooked)
    assert len(one_calls) == 5 and len(attended) == 2 * 5 - 5  # the hooked layer one by one, the other in one call


def test_load_verification_runs_the_step_kernel(monkeypatch: pytest.MonkeyPatch, one_calls: list[torch.Tensor]) -> None:
    one_call = LayerForm._in_one_call

    def otherwise(self: LayerForm, hidden: torch.Tensor, *args: Any) -> torch.Tensor:  # a last bit changed
        out = one_call(self, hidden, *args)
        return out.view(torch.int16).add_(1).view(out.dtype)

    monkeypatch.setattr(LayerForm, "_in_one_call", otherwise)
    fused = fusion_core.fuse(_model("qwen2", **WIDE), MERGED)
    assert all(ATTENTION_KEY in layer.__dict__ and ONE_CALL_KEY not in layer.__dict__ for layer in fused.model.layers)
    one_calls.clear()
    _generate(fused)
    assert not one_calls


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """The step kernel forgotten before the test, and gone after ``fusion_core.reset_state()``."""
    yield from fresh_kernels_of(step_kernel)


def test_a_step_kernel_that_cannot_be_built_leaves_the_kernels_one_by_one_and_says_so_once(
        fresh_kernels: None, monkeypatch: pytest.MonkeyPatch, attended: list[nn.Module]) -> None:
    without_the_kernel_of(monkeypatch, "static void layer_kernel(")
    with pytest.warns(RowDotUnavailableWarning, match="decode layer step kernel") as caught:
        fused = fusion_core.fuse(_model("llama", **WIDE), MERGED)
        attended.clear()
        out = _generate(fused)
    assert len([w for w in caught if "decode layer step kernel" in str(w.message)]) == 1
    assert all(ATTENTION_KEY in layer.__dict__ and ONE_CALL_KEY not in layer.__dict__ for layer in fused.model.layers)
    assert len(attended) == 2 * 5
    assert torch.equal(out.sequences, _generate(_one_by_one(fused)).sequences)


def test_the_one_call_survives_pickling_and_unfuse_drops_it(one_calls: list[torch.Tensor]) -> None:
    fused = fusion_core.fuse(_model("llama", **WIDE), MERGED)
    loaded = pickle.loads(pickle.dumps(fused))
    expected = _generate(fused)
    one_calls.clear()
    out = _generate(loaded)
    assert len(one_calls) == 2 * 5
    assert torch.equal(out.sequences, expected.sequences)
    fusion_core.unfuse(fused)
    assert not any(ONE_CALL_KEY in layer.__dict__ for layer in fused.model.layers)
