"""The decode step's q/k/v projection in one C++ call (``fusion_linear_kernels.projection_kernel``): the kernel gives
the queries, keys and values the module's GEMV and transformers' rotation give, bit for bit; a merged attention's
decode steps run it (and its output projection through the GEMV kernel directly) and cache the keys and values, and
give the logits, that its modules give, whether the ``qkv`` family merged it or the checkpoint (Phi-3's ``qkv_proj``);
a hooked projection, or q/k/v not merged, runs the modules; load verification
runs the kernel, so a kernel that rotated otherwise would leave the attention its modules.

The attentions here are wider than ``test_decode_layer``'s (1024, 16 query heads) so that the merged projection and the
output projection are weights the GEMV kernel reads (``row_dot.MIN_BYTES``); kernel choices are decided by its fake
clocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fusion_linear_kernels import projection_kernel, row_dot
from fusion_linear_kernels.decode_attention import _rotated, verified
from fusion_linear_kernels.decode_layer import ATTENTION_KEY, FORM_KEY, drop_one_call
from fusion_linear_kernels.layer_forms import relative, tolerance
from one_row_gemv import skip_unless_built
from test_decode_layer import (  # step_kernels: the fixture deciding the GEMVs
    ALONE,
    MERGED,
    _close,
    _generate,
    _model,
    step_kernels,  # noqa: F401
)
from torch import nn

import fusion_core

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("step_kernels")]

WIDE = {"hidden_size": 1024, "num_attention_heads": 16}
"""A merged q/k/v weight of 1280x1024 and an output projection of 1024x1024: above ``row_dot.MIN_BYTES``."""


@pytest.fixture
def projected(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The merged weight's shape of every call of the projection kernel from now on (the kernel still runs)."""
    skip_unless_built(lambda: projection_kernel.kernel(torch.bfloat16), "the decode projection kernel")
    calls: list[tuple[int, ...]] = []
    project = projection_kernel.project

    def recorded(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> Any:
        calls.append(tuple(weight.shape))
        return project(x, weight, *args)

    monkeypatch.setattr(projection_kernel, "project", recorded)
    return calls


@pytest.mark.parametrize("dtype", projection_kernel.DTYPES, ids=str)
def test_the_kernel_builds_wherever_the_gemv_kernel_does(dtype: torch.dtype) -> None:
    """The tests beside this one skip where the kernel cannot be built; a source that does not compile must fail."""
    if row_dot.kernel(dtype, False) is None:
        pytest.skip("the GEMV kernel cannot be built here")
    assert projection_kernel.kernel(dtype) is not None


@pytest.mark.parametrize("dtype", projection_kernel.DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "block"), [(1, 1), (1, 8), (3, 1), (3, 4)])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rotations", ["one", "each"])
def test_the_kernel_projects_and_rotates_as_the_gemv_and_transformers_do(dtype: torch.dtype, rows: int, block: int,
                                                                         biased: bool, rotations: str) -> None:
    skip_unless_built(lambda: projection_kernel.kernel(dtype), "the decode projection kernel")
    heads, kv_heads, width, hidden = 6, 2, 64, 320
    generator = torch.Generator().manual_seed(rows * 10 + block)
    weight = (torch.randn((heads + 2 * kv_heads) * width, hidden, generator=generator) / 8).to(dtype)
    bias = torch.randn(weight.shape[0], generator=generator).to(dtype) if biased else None
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    angles = torch.rand(rows if rotations == "each" else 1, 1, width, generator=generator) * 20
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    query, key, value = projection_kernel.project(x, weight, bias, cos, sin, heads, kv_heads, width, block)
    merged = row_dot.gemv(x, weight, bias, block)  # the GEMV the module runs for this kind
    parts = merged.split([heads * width, kv_heads * width, kv_heads * width], dim=-1)
    want_query, want_key, want_value = (part.reshape(rows, 1, -1, width).transpose(1, 2) for part in parts)
    rotation = (cos.unsqueeze(1), sin.unsqueeze(1))
    assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    assert torch.equal(query, _rotated(want_query, *rotation))
    assert torch.equal(key, _rotated(want_key, *rotation))
    assert torch.equal(value, want_value)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, plus_one: bool) -> torch.Tensor:
    """transformers' RMSNorm of ``x`` over its last dimension: Llama's (times the weight) or Gemma's (1 + it)."""
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * (1.0 + weight.float())).to(x.dtype) if plus_one else weight * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", projection_kernel.DTYPES, ids=str)
@pytest.mark.parametrize("over", ["each-head", "all-heads"])
@pytest.mark.parametrize("plus_one", [False, True], ids=["llama-norms", "gemma-norms"])
def test_the_kernel_norms_the_queries_and_keys_within_the_bound(dtype: torch.dtype, over: str,
                                                                plus_one: bool) -> None:
    skip_unless_built(lambda: projection_kernel.kernel(dtype), "the decode projection kernel")
    heads, kv_heads, width, hidden, rows = 6, 2, 64, 320, 3
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn((heads + 2 * kv_heads) * width, hidden, generator=generator) / 8).to(dtype)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    angles = torch.rand(1, 1, width, generator=generator) * 20
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    sizes = (width, width) if over == "each-head" else (heads * width, kv_heads * width)
    q_norm, k_norm = ((torch.randn(size, generator=generator) * 0.2 + (0.0 if plus_one else 1.0)).to(dtype)
                      for size in sizes)
    norms = projection_kernel.Norms(q_norm, k_norm, 1e-6, plus_one)
    query, key, value = projection_kernel.project(x, weight, None, cos, sin, heads, kv_heads, width, 1, norms)
    parts = row_dot.gemv(x, weight, None, 1).split([heads * width, kv_heads * width, kv_heads * width], dim=-1)
    rotation = (cos.unsqueeze(1), sin.unsqueeze(1))
    for got, part, norm in ((query, parts[0], q_norm), (key, parts[1], k_norm)):
        normed = (_rms_norm(part.reshape(rows, 1, -1, width), norm, plus_one) if over == "each-head"
                  else _rms_norm(part.reshape(rows, 1, -1), norm, plus_one).reshape(rows, 1, -1, width))
        want = _rotated(normed.transpose(1, 2), *rotation)
        assert relative(want, got) <= tolerance(dtype)
        assert (got == want).float().mean() > 0.9  # the same bits but where the means of squares round apart
    assert torch.equal(value, parts[2].reshape(rows, 1, -1, width).transpose(1, 2))


def _hooked(model: nn.Module) -> nn.Module:
    """``model`` with a forward hook that changes nothing on each attention's output projection: its decode steps run
    the attention's modules (a hook must see its module's call)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(lambda module, args, output: None)
    return model


@pytest.mark.parametrize(("kind", "families"), [("qwen2", MERGED), ("llama", MERGED), ("phi3", ALONE),
                                               ("qwen3", MERGED)],
                         ids=["bias", "no-bias", "merged-in-the-checkpoint", "norms-of-the-queries-and-keys"])
def test_merged_attentions_project_in_one_call_and_give_what_their_modules_give(
        kind: str, families: dict[str, bool], projected: list[tuple[int, ...]]) -> None:
    """Bit for bit, but where the attention norms its queries and keys: the kernel's norms sum in another order than
    torch's, so the keys and the logits are within the bound."""
    same = torch.equal if kind != "qwen3" else _close
    fused = fusion_core.fuse(_model(kind, **WIDE), families)
    drop_one_call(fused)  # each kernel called on its own (the step kernel calls them in one: test_step_kernel.py)
    reference = _hooked(fusion_core.fuse(_model(kind, **WIDE), families))
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY in layer.__dict__
               for model in (fused, reference) for layer in model.model.layers)
    projected.clear()  # the verification's
    expected = _generate(reference)
    assert not projected
    out = _generate(fused)
    assert projected == [(1280, 1024)] * 2 * 5  # the four-token prefill runs the modules, then five one-token steps
    assert torch.equal(out.sequences, expected.sequences)
    assert all(same(got, want) for got, want in zip(out.logits, expected.logits, strict=True))
    caches = [result["cache"] if "cache" in result else result["past_key_values"] for result in (out, expected)]
    for got, want in zip(*(cache.layers for cache in caches), strict=True):
        assert same(got.keys, want.keys) and same(got.values, want.values)


def test_projections_not_merged_run_the_modules(projected: list[tuple[int, ...]]) -> None:
    fused = fusion_core.fuse(_model("qwen2", **WIDE), ALONE)
    assert all(ATTENTION_KEY in layer.__dict__ for layer in fused.model.layers)
    out = _generate(fused)
    assert not projected
    assert torch.equal(out.sequences, _generate(_hooked(fusion_core.fuse(_model("qwen2", **WIDE), ALONE))).sequences)


def test_load_verification_runs_the_projection_kernel(monkeypatch: pytest.MonkeyPatch,
                                                       projected: list[tuple[int, ...]]) -> None:
    project = projection_kernel.project

    def turned(*args: Any) -> tuple[torch.Tensor, ...]:  # the keys' halves rotated the other way round
        query, key, value = project(*args)
        return query, torch.cat(key.chunk(2, dim=-1)[::-1], dim=-1), value

    monkeypatch.setattr(projection_kernel, "project", turned)
    fused = fusion_core.fuse(_model("qwen2", **WIDE), MERGED)
    assert all(FORM_KEY in layer.__dict__ and ATTENTION_KEY not in layer.__dict__ for layer in fused.model.layers)
    reason = verified(fused.model.layers[0].self_attn, torch.bfloat16, 1024)
    assert isinstance(reason, str) and "cached keys or values differ" in reason


@pytest.mark.parametrize(("kind", "replaced"), [("qwen2", ("o_proj", "qkv_proj")), ("qwen3", ("q_norm",))],
                         ids=["projections", "norm-of-the-queries"])
def test_a_weight_replaced_after_the_blocks_were_kept_runs_the_module(kind: str, replaced: tuple[str, ...],
                                                                      projected: list[tuple[int, ...]]) -> None:
    """The blocks are worked out once per kind; a weight replaced after that (here by a copy of the same values laid
    out with other strides, which the kernels do not read) sends its projection to the module at the next step, so
    the tokens stay."""
    fused = fusion_core.fuse(_model(kind, **WIDE), MERGED)
    expected = _generate(fused)
    assert projected  # the blocks were kept
    with torch.no_grad():
        for layer in fused.model.layers:
            for name in replaced:
                weight = getattr(layer.self_attn, name).weight
                weight.data = (weight.data.t().contiguous().t() if weight.dim() == 2
                               else torch.stack([weight.data, weight.data], dim=1)[:, 0])
                assert not weight.is_contiguous()
    projected.clear()
    out = _generate(fused)
    assert not projected
    assert torch.equal(out.sequences, expected.sequences)
    assert all(_close(got, want) for got, want in zip(out.logits, expected.logits, strict=True))
