"""The moe_experts family: which blocks it takes, and that the fused ones compute what the originals did.

Every model here is a tiny random model of a real transformers architecture (hidden 32, four
experts, two layers). On transformers 4.57 the sparse MoE blocks keep ``nn.ModuleList`` experts and
the family fuses them; on 5.x the experts are stacked already and the family declines every block
with its reason, which the architecture and plan tests assert on that line; the tests of fused
blocks are skipped there (:data:`needs_per_expert_blocks`), so the summary lists them with why.
"""

from __future__ import annotations

import copy
import io
import pickle
import re

import pytest
import torch
import transformers
from fusion_moe_experts import (
    ExpertProjection,
    ExpertProjectionError,
    MoeExpertsFamily,
    StackedExpertsMixin,
    StackExperts,
    StackPairs,
    dispatch,
)
from fusion_moe_experts.family import EXPERT_FORWARDS, TEMPLATES, refusal, template_for
from fusion_moe_experts.recognise import method_fingerprints
from torch import nn

import fusion_core
from fusion_core import DiscoveryError
from fusion_core.testing import kit
from fusion_core.testing.kit import TOLERANCES

FAMILY = MoeExpertsFamily()
OPTIONS = FAMILY.options_model()
PER_EXPERT = transformers.__version__.startswith("4.")
"""transformers 4.57 keeps one module per expert; 5.x stacks them (nothing for this family to do)."""
needs_per_expert_blocks = pytest.mark.skipif(
    not PER_EXPERT, reason=f"transformers {transformers.__version__} holds the experts stacked: no per-expert block "
                           "to fuse (test_each_architecture_block_is_recognised_or_absent checks each is declined)")
"""The mark of every test of a fused block: it has nothing to run on 5.x."""

_BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=4, head_dim=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=64, num_experts=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=64, num_experts=4, moe_intermediate_size=32,
                                         head_dim=8, decoder_sparse_step=1, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=64, num_experts=4)),
    "phimoe": ("PhimoeConfig", dict(intermediate_size=64, num_local_experts=4)),
    "deepseek_v2": ("DeepseekV2Config", dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                             n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16,
                                             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                             head_dim=8, topk_method="greedy", n_group=1, topk_group=1)),
    # two groups of two experts, one group kept: the group limit leaves out half the experts of every token
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                             n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16,
                                             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                             head_dim=8, n_group=2, topk_group=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(intermediate_size=64, moe_num_experts=4, moe_intermediate_size=32,
                                                moe_num_shared_experts=1, moe_layer_start_index=0,
                                                moe_layer_interval=1, head_dim=8)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(intermediate_size=64, num_experts=4, moe_topk=2, head_dim=8)),
    # every layer attention (no Mamba mixer: its CPU path is slow) and every layer MoE
    "jamba": ("JambaConfig", dict(intermediate_size=64, num_experts=4, expert_layer_period=1, expert_layer_offset=0,
                                  attn_layer_period=1, attn_layer_offset=0, use_mamba_kernels=False)),
}
BLOCK = {"mixtral": "block_sparse_moe", "phimoe": "block_sparse_moe", "jamba": "feed_forward"}
#: The architectures whose experts name their projections ``w1``/``w3``/``w2``.
W1_NAMES = {"mixtral", "phimoe"}
#: The blocks that return no router logits (their models compute no auxiliary loss).
NO_ROUTER_LOGITS = {"deepseek_v2", "deepseek_v3", "hunyuan_v1_moe"}
#: Ernie 4.5's router runs in float32 (transformers' loader keeps ``gate`` and ``moe_statics`` float32,
#: ``_keep_in_fp32_modules_strict``): a block cast whole to bfloat16 fails in the original forward itself.
FLOAT32_ROUTER = {"ernie4_5_moe"}
ARCHS = list(CONFIGS)


def _config(name: str):
    class_name, overrides = CONFIGS[name]
    try:
        return getattr(transformers, class_name)(**_BASE, **overrides)
    except Exception as exc:  # 5.4.0 with a newer huggingface_hub: its strict config dataclass rejects its own default
        if type(exc).__name__ != "StrictDataclassFieldValidationError":
            raise
        pytest.skip(f"transformers {transformers.__version__} cannot build {class_name} itself: "
                    f"{str(exc).splitlines()[-1].strip()}")


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(name)).eval()


def _block_path(name: str, layer: int = 0) -> str:
    renamed = not PER_EXPERT and name != "jamba"  # 5.x renamed Mixtral's and PhiMoE's block_sparse_moe, not Jamba's
    return f"model.layers.{layer}.{'mlp' if renamed else BLOCK.get(name, 'mlp')}"


def _inputs(dtype: torch.dtype):
    return [torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)).to(dtype)]


def _fused_model(model: nn.Module, fusion_config=None) -> nn.Module:
    return fusion_core.fuse(copy.deepcopy(model), fusion_config or {"moe_experts": True})


IDS = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(2))


# -- what it recognises ------------------------------------------------------------------------
def test_transform_op_and_options_through_the_kit():
    kit.assert_transform_op(StackPairs(3), [(4, 5)] * 6, bad_shapes=[(4, 5)] * 5 + [(4, 6)])
    kit.assert_options_schema(FAMILY)


def test_registered_through_its_entry_point():
    family = fusion_core.get_registry().get("moe_experts")
    assert family.source.distribution == "fusion-moe-experts" and isinstance(family.spec, MoeExpertsFamily)


@pytest.mark.parametrize("name", ARCHS)
def test_each_architecture_block_is_recognised_or_absent(name):
    """4.57: each block is recognised by its template. 5.x: each block, its experts stacked, is declined with the
    family's reason; discovery finds nothing, a clear error by default, nothing fused under required: false."""
    model = _model(name)
    block = model.get_submodule(_block_path(name))
    if PER_EXPERT:
        assert refusal(block) is None and FAMILY.is_fusable(block, OPTIONS)
        assert template_for(type(block)).name == name
    else:
        assert "no experts ModuleList" in refusal(block)
        declined = rf"found nothing to fuse.*declined, e.g. {re.escape(_block_path(name))}: no experts ModuleList "
        with pytest.raises(DiscoveryError, match=declined + r"\(transformers 5.x blocks hold their experts stacked"):
            fusion_core.fuse(copy.deepcopy(model), {"moe_experts": True})
        fused = fusion_core.fuse(model, {"moe_experts": {"required": False}})
        assert not any(isinstance(m, StackedExpertsMixin) for m in fused.modules())


def test_fingerprints_ignore_comments_and_docstrings_but_not_code():
    class A:
        def forward(self, x):
            """Docs."""
            return x + 1  # a comment

    class B:
        def forward(self, x):

            return x + 1

    class C:
        def forward(self, x):
            return x + 2

    assert method_fingerprints(A, object) == method_fingerprints(B, object) != method_fingerprints(C, object)


class _Describer:
    def describe(self, x):
        return f"{x!r:>8} {{" + f"""{f'{x}'}
        """


#: ``_Describer.describe``'s source as Python 3.12.1 and 3.13.0 tokenize it (recorded: PEP 701 splits each f-string
#: into FSTRING_START, its text and fields, FSTRING_END; 3.12.1 misplaces the text after ``{{``, as here).
_DESCRIBE_TOKENS_312 = [
    ("NAME", "def", (1, 0), (1, 3)), ("NAME", "describe", (1, 4), (1, 12)), ("OP", "(", (1, 12), (1, 13)),
    ("NAME", "self", (1, 13), (1, 17)), ("OP", ",", (1, 17), (1, 18)), ("NAME", "x", (1, 19), (1, 20)),
    ("OP", ")", (1, 20), (1, 21)), ("OP", ":", (1, 21), (1, 22)), ("NEWLINE", "\n", (1, 22), (1, 23)),
    ("INDENT", "    ", (2, 0), (2, 4)), ("NAME", "return", (2, 4), (2, 10)),
    ("FSTRING_START", 'f"', (2, 11), (2, 13)), ("OP", "{", (2, 13), (2, 14)), ("NAME", "x", (2, 14), (2, 15)),
    ("OP", "!", (2, 15), (2, 16)), ("NAME", "r", (2, 16), (2, 17)), ("OP", ":", (2, 17), (2, 18)),
    ("FSTRING_MIDDLE", ">8", (2, 18), (2, 20)), ("OP", "}", (2, 20), (2, 21)),
    ("FSTRING_MIDDLE", " {", (2, 21), (2, 23)), ("FSTRING_END", '"', (2, 24), (2, 25)), ("OP", "+", (2, 26), (2, 27)),
    ("FSTRING_START", 'f"""', (2, 28), (2, 32)), ("OP", "{", (2, 32), (2, 33)),
    ("FSTRING_START", "f'", (2, 33), (2, 35)), ("OP", "{", (2, 35), (2, 36)), ("NAME", "x", (2, 36), (2, 37)),
    ("OP", "}", (2, 37), (2, 38)), ("FSTRING_END", "'", (2, 38), (2, 39)), ("OP", "}", (2, 39), (2, 40)),
    ("FSTRING_MIDDLE", "\n    ", (2, 40), (3, 4)), ("FSTRING_END", '"""', (3, 4), (3, 7)),
    ("NEWLINE", "\n", (3, 7), (3, 8)), ("DEDENT", "", (4, 0), (4, 0)), ("ENDMARKER", "", (4, 0), (4, 0)),
]


def test_an_fstring_is_one_token_of_the_fingerprint_on_every_python(monkeypatch):
    """The fingerprint is the hash of the code's tokens with each literal one token, its source text, whether this
    Python's tokenize gives an f-string whole (3.11) or in parts (3.12 on; fed here as 3.12.1 gave them)."""
    import hashlib
    import inspect
    import textwrap
    import tokenize

    from fusion_moe_experts import recognise

    code = ["def", "<name>", "(", "self", ",", "x", ")", ":", "return", 'f"{x!r:>8} {{"', "+",
            'f"""{f\'{x}\'}\n    """']
    expected = hashlib.sha256(" ".join(code).encode()).hexdigest()[:16]
    assert recognise.function_fingerprint(_Describer.describe) == expected  # this Python's own tokens

    unused = max(tokenize.tok_name) + 1  # for the FSTRING_* types on a Python that has none
    kinds = sorted({kind for kind, *_ in _DESCRIBE_TOKENS_312})
    types = {kind: getattr(tokenize, kind, unused + i) for i, kind in enumerate(kinds)}
    monkeypatch.setattr(recognise, "_FSTRING_START", types["FSTRING_START"])
    monkeypatch.setattr(recognise, "_FSTRING_END", types["FSTRING_END"])
    source = textwrap.dedent(inspect.getsource(_Describer.describe))
    recorded = [tokenize.TokenInfo(types[kind], text, start, end, "") for kind, text, start, end in
                _DESCRIBE_TOKENS_312]
    own_tokens = tokenize.generate_tokens

    def as_python_312(readline):
        lines = list(iter(readline, ""))
        return iter(recorded) if "".join(lines) == source else own_tokens(iter(lines).__next__)

    monkeypatch.setattr(tokenize, "generate_tokens", as_python_312)
    assert recognise.function_fingerprint(_Describer.describe) == expected


def _mutate(name: str, mutate) -> nn.Module:
    block = _model(name).get_submodule(_block_path(name))
    mutate(block)
    return block


class _NotAnActivation(nn.Module):
    pass


def _subclass_with_forward(block: nn.Module) -> None:
    original = type(block)
    block.__class__ = type(original.__name__, (original,), {"forward": lambda self, x: original.forward(self, x * 2)})


def _set_act(block: nn.Module, act: nn.Module, index: int = 1) -> None:
    block.experts[index].act_fn = act


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (_subclass_with_forward, "not one this family reproduces"),
        (lambda b: setattr(b, "gate", nn.Sequential(nn.Linear(32, 4, bias=False))), "router gate"),
        (lambda b: setattr(b.experts[1], "up_proj", nn.Linear(32, 32)), "bias"),
        (lambda b: setattr(b.experts[2], "down_proj", nn.Linear(16, 32, bias=False)), "not a gated MLP"),
        (lambda b: _set_act(b, nn.GELU()), "different activations"),
        (lambda b: _set_act(b, _NotAnActivation()), "not an activation"),
        (lambda b: b.experts[3].to(torch.float16), "dtype"),
        (lambda b: setattr(b, "experts", nn.ModuleList()), "no experts"),
        (lambda b: delattr(b, "shared_expert_gate"), "shared_expert_gate"),
    ],
    ids=["changed-forward", "gate-not-linear", "expert-bias", "expert-shape", "mixed-activations",
         "unknown-activation", "mixed-dtypes", "empty", "no-shared-gate"],
)
@needs_per_expert_blocks
def test_refuses_what_it_does_not_reproduce(mutate, reason):
    block = _mutate("qwen2_moe", mutate)
    assert FAMILY.is_fusable(block, OPTIONS) is False
    assert reason in (refusal(block) or "")


@needs_per_expert_blocks
def test_refuses_hunyuan_with_per_layer_expert_counts():
    block = _model("hunyuan_v1_moe").get_submodule("model.layers.0.mlp")
    block.config = copy.copy(block.config)
    block.config.num_experts = [4, 4]
    assert "num_experts is a per-layer list" in refusal(block)


@needs_per_expert_blocks
def test_refuses_an_expert_mlp_whose_forward_changed():
    block = _model("olmoe").get_submodule("model.layers.0.mlp")
    expert_cls = type(block.experts[0])
    block.experts[0].__class__ = type(expert_cls.__name__, (expert_cls,), {"forward": lambda self, x: -x})
    assert "not a gated expert MLP" in refusal(block)


# -- 4.57: numerics, layout, round trips ------------------------------------------------------
@pytest.mark.parametrize("name", ARCHS)
@needs_per_expert_blocks
def test_block_matches_the_original(name):
    errors = kit.assert_numerically_equivalent(
        kit.module_factory((transformers.AutoModelForCausalLM, _config(name)), _block_path(name)), _inputs, FAMILY,
        dtypes=(torch.float32,) if name in FLOAT32_ROUTER else (torch.float32, torch.bfloat16), config=_config(name))
    assert errors[torch.float32] <= TOLERANCES[torch.float32]


@needs_per_expert_blocks
def test_ernie_bfloat16_experts_under_its_float32_router_match_the_original():
    """Ernie 4.5 as transformers loads it in bfloat16: experts bfloat16, ``gate`` and ``moe_statics`` float32."""
    block = _model("ernie4_5_moe").get_submodule("model.layers.0.mlp").to(torch.bfloat16)
    block.gate.float(), block.moe_statics.float()
    block.moe_statics.e_score_correction_bias.data.normal_(generator=torch.Generator().manual_seed(4))
    fused = kit.fuse_module(block, FAMILY, config=_config("ernie4_5_moe"))
    x = _inputs(torch.bfloat16)[0]
    with torch.no_grad():
        for got, expected in zip(fused(x), block(x), strict=True):
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=TOLERANCES[torch.bfloat16], atol=TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("name", ARCHS)
@needs_per_expert_blocks
def test_layout_and_state_dict_round_trip(name):
    block = _model(name).get_submodule(_block_path(name))
    kit.assert_state_dict_round_trip(block, FAMILY, config=_config(name))
    bound = kit.assert_transform_round_trip(block, FAMILY, config=_config(name))
    assert [t.targets[0].name for t in bound] == ["experts.gate_up_proj", "experts.down_proj"]
    fused = kit.fuse_module(block, FAMILY, config=_config(name))
    gate, up, down = (("w1", "w3", "w2") if name in W1_NAMES else ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(fused.experts.gate_up_proj[2], torch.cat([getattr(block.experts[2], gate).weight,
                                                                  getattr(block.experts[2], up).weight]))
    assert torch.equal(fused.experts.down_proj[3], getattr(block.experts[3], down).weight)
    x = torch.randn(3, 32)
    assert torch.allclose(fused.experts[1](x), block.experts[1](x), atol=1e-6)  # one expert still runs alone


@pytest.mark.parametrize("name", ARCHS)
@needs_per_expert_blocks
def test_fused_load_saves_the_source_and_plain_transformers_reloads_it(name, tmp_path):
    comparison = kit.assert_fused_load(FAMILY, (transformers.AutoModelForCausalLM, _config(name)), tmp_path)
    assert [m.module for m in comparison.modules] == [_block_path(name, 0), _block_path(name, 1)]
    assert comparison.whole_model.ran and comparison.round_trip.ok
    checkpoint = tmp_path / _config(name).model_type  # where the kit saved the plain model
    fused = fusion_core.from_pretrained(transformers.AutoModelForCausalLM, checkpoint,
                                        fusion_config={"moe_experts": True})
    fusion_core.save_pretrained(fused, tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (checkpoint / "model.safetensors").read_bytes()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert not any(isinstance(m, StackedExpertsMixin) for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits, rtol=1e-4, atol=1e-5)


@needs_per_expert_blocks
def test_no_python_loop_over_experts(monkeypatch):
    fused = _fused_model(_model("olmoe"))
    calls = []
    grouped_mm = dispatch.F.grouped_mm
    monkeypatch.setattr(dispatch.F, "grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    monkeypatch.setattr(ExpertProjection, "forward", lambda self, x: pytest.fail("an expert ran on its own"))
    with torch.no_grad():
        fused(IDS)
    assert len(calls) == 2 * 2  # two grouped GEMMs per block, two blocks


@needs_per_expert_blocks
def test_float64_uses_the_gather_kernel_and_matches():
    block = _model("qwen3_moe").get_submodule("model.layers.0.mlp").double()
    fused = kit.fuse_module(block, FAMILY, config=_config("qwen3_moe"))
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        for got, expected in zip(fused(x), block(x), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_without_grouped_mm_each_expert_runs_one_gemm_on_its_rows(monkeypatch):
    """``F.grouped_mm`` is public from torch 2.10, above the floor (2.6): on a torch without it each expert's rows
    run one GEMM (an expert with none included), forward and backward, and the bf16 upcast (grouped GEMMs too) is
    not chosen; each sorted row is its expert's gated MLP ``down(act(gate x) * up x)``, computed row by row."""
    from fusion_core.testing.kit import relative_error

    generator = torch.Generator().manual_seed(5)
    experts, inner = 5, 16
    x = torch.randn(40, 32, generator=generator)
    gate_up = (torch.randn(experts, 2 * inner, 32, generator=generator) / 32**0.5).requires_grad_()
    down = (torch.randn(experts, 32, inner, generator=generator) / inner**0.5).requires_grad_()
    routed = dispatch.Routed(torch.randint(0, experts - 1, (40, 2), generator=generator), experts)  # none for the last
    act = nn.SiLU()
    expected = torch.stack([down[e] @ (act(gate_up[e, :inner] @ x[t]) * (gate_up[e, inner:] @ x[t]))
                            for t, e in zip(routed.token.tolist(), routed.expert.tolist(), strict=True)])
    expected_grads = torch.autograd.grad(expected.square().sum(), (gate_up, down))
    monkeypatch.delattr(dispatch.F, "grouped_mm")
    got = dispatch.expert_outputs(x, gate_up, down, act, routed)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for got_grad, expected_grad in zip(torch.autograd.grad(got.square().sum(), (gate_up, down)), expected_grads,
                                       strict=True):  # float32 sums in another order: the documented tolerance
        assert relative_error(expected_grad, got_grad) <= TOLERANCES[torch.float32]
    monkeypatch.setattr(dispatch, "native_bf16", lambda: False)
    assert routed.token.shape[0] >= dispatch.UPCAST_ROWS_PER_EXPERT * experts  # where the upcast would be chosen
    with torch.no_grad():
        rows = dispatch.expert_outputs(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), act, routed)
    assert relative_error(expected.detach(), rows) <= TOLERANCES[torch.bfloat16]


@needs_per_expert_blocks
def test_a_fused_model_runs_on_a_torch_without_grouped_mm(monkeypatch):
    """The same fallback in a whole fused model: its logits are the unfused model's."""
    monkeypatch.delattr(dispatch.F, "grouped_mm")
    plain = _model("olmoe")
    fused = _fused_model(plain)
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits, rtol=1e-4, atol=1e-5)


@needs_per_expert_blocks
def test_bf16_experts_are_upcast_on_a_cpu_without_native_bf16_only_where_it_pays(monkeypatch):
    """The kernel rule's exception (dispatch.upcasts), forced on so the test does not depend on the CPU it runs on:
    from UPCAST_ROWS_PER_EXPERT rows per expert, in inference only; the block computes what the original does."""
    from fusion_core.testing.kit import relative_error

    monkeypatch.setattr(dispatch, "native_bf16", lambda: False)
    block = _model("olmoe").get_submodule("model.layers.0.mlp").to(torch.bfloat16)
    fused = kit.fuse_module(copy.deepcopy(block), FAMILY, config=_config("olmoe"))
    calls = []
    upcast = dispatch.upcast_expert_outputs
    monkeypatch.setattr(dispatch, "upcast_expert_outputs", lambda *args: calls.append(1) or upcast(*args))
    many = torch.randn(1, 48, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # 24 rows/expert
    few = many[:, :8]  # 4 rows per expert: the conversion would cost more than it saves
    assert 48 * 2 >= dispatch.UPCAST_ROWS_PER_EXPERT * 4 > 8 * 2  # tokens x top-2 vs the threshold for 4 experts
    with torch.no_grad():
        for x, upcast_calls in ((few, 0), (many, 1)):
            assert relative_error(block(x)[0], fused(x)[0]) <= TOLERANCES[torch.bfloat16]
            assert len(calls) == upcast_calls
        monkeypatch.setattr(dispatch, "native_bf16", lambda: True)
        fused(many)  # native bf16 GEMMs: the default kernel
        monkeypatch.setattr(dispatch, "native_bf16", lambda: False)
    assert len(calls) == 1
    fused(many)[0].float().sum().backward()  # autograd through the experts: the default kernel
    assert len(calls) == 1 and fused.experts.gate_up_proj.grad is not None


# -- training ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ARCHS)
@needs_per_expert_blocks
def test_gradients_and_router_loss_equal_the_unfused_model(name):
    plain = _model(name).train()
    fused = _fused_model(plain).train()
    kwargs = {"output_router_logits": True} if name not in NO_ROUTER_LOGITS else {}
    losses = []
    for model in (plain, fused):
        torch.manual_seed(3)  # PhiMoE's sparsemixer samples in training: same draws for both
        out = model(IDS, labels=IDS, **kwargs)
        out.loss.backward()
        losses.append(out)
    torch.testing.assert_close(losses[1].loss, losses[0].loss, rtol=1e-5, atol=1e-6)
    if kwargs:
        torch.testing.assert_close(losses[1].aux_loss, losses[0].aux_loss, rtol=1e-5, atol=1e-6)
    block, fused_block = plain.get_submodule(_block_path(name)), fused.get_submodule(_block_path(name))
    gate, up, down = (("w1", "w3", "w2") if name in W1_NAMES else ("gate_proj", "up_proj", "down_proj"))
    expected_gate_up = torch.stack([torch.cat([getattr(e, gate).weight.grad, getattr(e, up).weight.grad])
                                    for e in block.experts])
    expected_down = torch.stack([getattr(e, down).weight.grad for e in block.experts])
    torch.testing.assert_close(fused_block.experts.gate_up_proj.grad, expected_gate_up, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fused_block.experts.down_proj.grad, expected_down, rtol=1e-4, atol=1e-6)
    router = "router.weight" if name == "jamba" else "gate.wg.weight" if name == "hunyuan_v1_moe" else "gate.weight"
    torch.testing.assert_close(fused_block.get_parameter(router).grad, block.get_parameter(router).grad,
                               rtol=1e-4, atol=1e-6)


# -- a fused model is a model -----------------------------------------------------------------
@needs_per_expert_blocks
def test_compiles_fullgraph_and_matches():
    block = _model("qwen2_moe").get_submodule("model.layers.0.mlp")
    fused = kit.fuse_module(block, FAMILY, config=_config("qwen2_moe"))
    x = _inputs(torch.float32)[0]
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for got, expected in zip(compiled(x), block(x), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@needs_per_expert_blocks
def test_pickle_deepcopy_and_unfuse():
    plain = _model("mixtral")
    fused = _fused_model(plain)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (loaded, copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        with torch.no_grad():
            torch.testing.assert_close(other(IDS).logits, fused(IDS).logits, rtol=0, atol=0)
        with torch.no_grad():  # the copy's stand-ins read the copy's stacked weight, not the original's
            other.model.layers[0].block_sparse_moe.experts.gate_up_proj.zero_()
        assert other.model.layers[0].block_sparse_moe.experts[0].w1.weight.eq(0).all()
        assert not fused.model.layers[0].block_sparse_moe.experts[0].w1.weight.eq(0).all()
    fusion_core.unfuse(fused)
    assert not any(isinstance(m, (StackedExpertsMixin, ExpertProjection)) for m in fused.modules())
    expected, got = plain.state_dict(), fused.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


@needs_per_expert_blocks
def test_lora_on_one_expert_is_refused_by_name():
    peft = pytest.importorskip("peft")
    fused = _fused_model(_model("qwen3_moe"))
    for targets in (["gate_proj"], "all-linear"):
        with pytest.raises(ExpertProjectionError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj is expert 0"):
            peft.get_peft_model(copy.deepcopy(fused), peft.LoraConfig(target_modules=targets, r=2))
    plain = _model("qwen3_moe")  # LoRA elsewhere works, and computes what it computes on the unfused model
    config = dict(target_modules=["q_proj", "v_proj"], r=2, init_lora_weights=False)
    adapted = []
    for model in (copy.deepcopy(plain), _fused_model(plain)):
        torch.manual_seed(4)  # the same random adapters
        adapted.append(peft.get_peft_model(model, peft.LoraConfig(**config)))
    with torch.no_grad():
        torch.testing.assert_close(adapted[1](IDS).logits, adapted[0](IDS).logits, rtol=1e-4, atol=1e-5)


# -- quantisers ---------------------------------------------------------------------------------
@needs_per_expert_blocks
def test_torchao_quantize_refuses_an_expert_by_name_and_quantizes_the_rest_when_told_to():
    """torchao quantises the unfused experts (nn.Linear); on the fused block it would silently skip them, so
    quantize_ is refused at the first expert, naming it; a filter_fn that leaves the experts out is the way on."""
    torchao = pytest.importorskip("torchao.quantization")
    plain = _model("olmoe")
    reference = copy.deepcopy(plain)
    torchao.quantize_(reference, torchao.Int8WeightOnlyConfig())
    assert type(reference.model.layers[0].mlp.experts[0].gate_proj.weight).__name__ == "Int8Tensor"
    with pytest.raises(ExpertProjectionError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj .*assigning its "
                                                    r"weight .*quantize_.*fusion_core\.unfuse"):
        torchao.quantize_(_fused_model(plain), torchao.Int8WeightOnlyConfig())

    def not_experts(module, fqn):
        return type(module) is nn.Linear and ".experts." not in fqn

    quantized = [_fused_model(plain), copy.deepcopy(plain)]
    for model in quantized:
        torchao.quantize_(model, torchao.Int8WeightOnlyConfig(), filter_fn=not_experts)
    assert type(quantized[0].model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    with torch.no_grad():
        torch.testing.assert_close(quantized[0](IDS).logits, quantized[1](IDS).logits, rtol=1e-4, atol=1e-5)


@needs_per_expert_blocks
def test_a_torchao_quantizing_load_is_refused_before_any_weight_is_read(tmp_path):
    """At load the quantization integration merges torchao tensors by concatenating rows only: stacking quantized
    experts is refused, naming the block, before the (unreadable) weights are touched."""
    torchao = pytest.importorskip("torchao.quantization")
    _model("olmoe").save_pretrained(tmp_path / "model")
    for file in (tmp_path / "model").glob("*.safetensors"):
        file.write_bytes(b"not a header")
    with pytest.raises(fusion_core.FusionLoadError, match=r"TorchAoConfig \(torchao\).*family 'moe_experts', module "
                                                           r"'model.layers.0.mlp'.*concatenation of rows"):
        fusion_core.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "model",
                                    fusion_config={"moe_experts": True},
                                    quantization_config=transformers.TorchAoConfig(torchao.Int8WeightOnlyConfig()))


@needs_per_expert_blocks
def test_torch_quantize_dynamic_skipping_the_experts_is_refused_naming_the_block(tmp_path):
    """torch's quantize_dynamic looks classes up by exact type: it quantises the unfused experts but skips the fused
    block's ExpertProjections, so the quantization integration refuses the fused model's forward and save."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    plain, fused = _model("olmoe"), _fused_model(_model("olmoe"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of torchao
        for model in (plain, fused):
            quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    assert type(plain.model.layers[0].mlp.experts[0].gate_proj).__module__.startswith("torch.ao.nn.quantized")
    assert type(fused.model.layers[0].mlp.experts[0].gate_proj) is ExpertProjection  # skipped: still float
    refused = (r"torch.ao.quantization quantized .* would not be quantized exactly: family 'moe_experts', module "
               r"'model.layers.0.mlp' holds the nn.Linear tensors of experts.0.gate_proj")
    with pytest.raises(fusion_core.FusionError, match=refused), torch.no_grad():
        fused(IDS)
    with pytest.raises(fusion_core.SaveError, match=refused):
        fusion_core.save_pretrained(fused, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@needs_per_expert_blocks
def test_expert_projection_is_a_linear_that_refuses_replacement():
    fused = _fused_model(_model("olmoe"))
    projection = fused.model.layers[1].mlp.experts[2].down_proj
    assert isinstance(projection, nn.Linear) and projection.weight.shape == (32, 64)
    for action in (lambda: setattr(projection, "weight", nn.Parameter(torch.zeros(32, 64))),
                   lambda: projection.in_features, lambda: projection.out_features):
        with pytest.raises(ExpertProjectionError, match=r"model\.layers\.1\.mlp\.experts\.2\.down_proj is expert 2"):
            action()


# -- composing with gate_up ------------------------------------------------------------------
@needs_per_expert_blocks
def test_composes_with_gate_up_when_gate_up_leaves_the_experts():
    plain = _model("qwen2_moe")
    fused = _fused_model(plain, {"gate_up": {"exclude_modules": [r"\.experts\.\d+$"]}, "moe_experts": True})
    plan = fusion_core.get_fusion_plan(fused)
    owners = {m.path: m.family for m in plan.modules}
    assert owners["model.layers.0.mlp"] == "moe_experts"
    assert owners["model.layers.0.mlp.shared_expert"] == "gate_up"
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("order", ["gate_up first", "moe_experts first"])
@needs_per_expert_blocks
def test_composes_with_gate_up_by_default(order):
    """The experts' MLPs lie inside the block moe_experts fuses whole: gate_up leaves them to it, in either order,
    and fuses the shared expert; the plan says which modules were left to the outer fusion."""
    plain = _model("qwen2_moe")
    config = {"gate_up": True, "moe_experts": True}
    if order == "moe_experts first":
        config = dict(reversed(list(config.items())))
    fused = _fused_model(plain, config)
    plan = fusion_core.get_fusion_plan(fused)
    owners = {m.path: m.family for m in plan.modules}
    assert owners["model.layers.0.mlp"] == "moe_experts"
    assert owners["model.layers.0.mlp.shared_expert"] == "gate_up"
    assert not [path for path in owners if ".experts." in path]
    assert ("gate_up", "model.layers.0.mlp.experts.0", "moe_experts", "model.layers.0.mlp") in plan.nested
    with torch.no_grad():
        torch.testing.assert_close(fused(IDS).logits, plain(IDS).logits, rtol=1e-4, atol=1e-5)


@needs_per_expert_blocks
def test_expert_forward_table_covers_the_architectures():
    """The expert MLP fingerprints name each scheme once per naming, and every template is used."""
    used = {template_for(type(_model(n).get_submodule(_block_path(n)))).name for n in ARCHS}
    assert used == {t.name for t in TEMPLATES}
    assert set(EXPERT_FORWARDS.values()) == {"w1", "gate_proj"}


def test_fusion_plan_says_why_a_block_was_declined(tmp_path, caplog):
    """Each declined MoE block is listed with the family's reason (4.57: a block whose forward was changed; 5.x:
    every block, its experts stacked already); the fused blocks and the dense modules are not listed."""
    import subprocess
    import sys

    from fusion_core import parse_fusion_config
    from fusion_core.plugin import discover

    config = _config("olmoe")
    base = transformers.OlmoeForCausalLM

    class ChangedFirstBlock(base):  # layer 0's block runs another forward: not one the family reproduces
        def __init__(self, config):
            super().__init__(config)
            block = self.model.layers[0].mlp
            block.__class__ = type("EditedBlock", (type(block),), {"forward": lambda self, x: x})

    plan = discover(ChangedFirstBlock, config, parse_fusion_config({"moe_experts": {"required": False}})).plan
    if PER_EXPERT:
        assert [m.path for m in plan.modules] == ["model.layers.1.mlp"]
        assert plan.refused == (("moe_experts", "model.layers.0.mlp",
                                 "the forward of EditedBlock is not one this family reproduces (see TEMPLATES)"),)
    else:
        declined = [path for _, path, _ in plan.refused]
        assert plan.modules == () and declined == ["model.layers.0.mlp", "model.layers.1.mlp"]
    base(config).save_pretrained(tmp_path / "model")
    (tmp_path / "fusion.json").write_text('{"moe_experts": {"required": false}}')
    done = subprocess.run([sys.executable, "-m", "fusion_core", "plan", str(tmp_path / "model"), "--config",
                           str(tmp_path / "fusion.json")], capture_output=True, text=True, timeout=300)
    if PER_EXPERT:
        assert "Declined by the family" not in done.stdout, done.stdout
    else:
        assert "Declined by the family, with its reason (2):" in done.stdout, done.stdout + done.stderr
        assert "model.layers.1.mlp (moe_experts): no experts ModuleList" in done.stdout
        with caplog.at_level("WARNING", logger="fusion_core"):  # the skip warning of a load quotes a reason too
            fusion_core.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "model",
                                        fusion_config={"moe_experts": {"required": False}})
        assert "is left out (required=False); it declined model.layers.0.mlp: no experts ModuleList" in caplog.text


def test_a_model_without_experts_finds_nothing_to_fuse():
    """A dense model's config names no expert count: the family finds nothing, like any family (no other error)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(DiscoveryError, match="found nothing to fuse"):
        fusion_core.fuse(copy.deepcopy(model), {"moe_experts": True})


# -- FSDP2 and tensor parallelism, in a real gloo process group --------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@needs_per_expert_blocks
def test_fsdp2_training_and_tensor_parallel_loads_in_a_process_group(tmp_path):
    """Two ranks (tests/moe_distributed_worker.py): FSDP2 per layer then model, one SGD step: loss and updated
    weights equal the unfused model's; tp_plan='auto' sharding the experts is refused naming family, module and
    key; a plan of attention only runs the fused experts replicated, logits and greedy tokens unchanged."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    world = 2
    worker = Path(__file__).with_name("moe_distributed_worker.py")
    result = subprocess.run([sys.executable, str(worker), str(world), str(tmp_path)], capture_output=True, text=True,
                            timeout=600)
    reports = [tmp_path / f"rank{rank}.json" for rank in range(world)]
    assert result.returncode == 0 and all(r.exists() for r in reports), result.stderr[-4000:]
    expected = {"FSDP2: stacked experts are sharded", "FSDP2: no expert ran on its own", "FSDP2 loss",
                "FSDP2 trained weights (original layout)", "FSDP2 logits after the step", "save after FSDP2 training",
                "TP: a plan sharding the experts is refused by name", "TP: logits (experts replicated)",
                "TP: generate", "TP: save, original layout, same bytes"}
    failed = {}
    for rank, report in enumerate(reports):
        checks = json.loads(report.read_text())
        failed.update({f"rank {rank}: {name}": detail for name, (ok, detail) in checks.items() if not ok})
        if rank == 0:
            failed.update({f"rank 0: {name}": "did not run" for name in expected - checks.keys()})
    assert not failed, "\n".join(f"{name}: {detail}" for name, detail in failed.items())


def test_stack_experts_is_stack_and_unstacks_what_fsdp2_sharded():
    """The plain-tensor path is the shipped Stack's; the DTensor path is the multi-process test's."""
    kit.assert_transform_op(StackExperts(3), [(4, 5)] * 3, bad_shapes=[(4, 5), (4, 5), (4, 6)])
    parts = [torch.randn(4, 5) for _ in range(3)]
    (stacked,) = StackExperts(3).forward(parts)
    assert torch.equal(stacked, torch.stack(parts))
    assert all(torch.equal(a, b) for a, b in zip(StackExperts(3).inverse([stacked], [(4, 5)] * 3), parts, strict=True))


# -- the end-to-end benchmark harness ---------------------------------------------------------------
@pytest.mark.slow
@needs_per_expert_blocks
def test_end_to_end_benchmark_quick_prints_the_table_and_fused_tokens_equal_plain(tmp_path):
    """``bench_moe_e2e.py --quick`` in a subprocess: the whole harness (save, plain/fused rounds, and the 5.x anchor
    where the repository's tf5 environment exists) on a tiny OLMoE; no timing is asserted."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "bench_moe_e2e.py"
    anchor = Path(__file__).parents[3] / ".venvs" / "tf5" / "bin" / "python"
    command = [sys.executable, str(script), "--quick", "--json", str(tmp_path / "out.json")]
    if not anchor.exists():
        command.append("--no-anchor")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "| speed-up of fused (other / fused, per round) | prefill | decode |" in result.stdout
    assert "| fused vs plain 4.57 |" in result.stdout
    measured = json.loads((tmp_path / "out.json").read_text())
    plain, fused = measured["pair"]["plain"], measured["pair"]["fused"]
    assert len(plain) == len(fused) == 2 and len(plain[0]["tokens"]) == 4
    assert [r["tokens"] for r in fused] == [r["tokens"] for r in plain]
    if anchor.exists():
        assert "| fused vs 5.x anchor |" in result.stdout
        assert measured["anchor"]["info"]["experts"] != "ModuleList"  # 5.x's own stacked experts ran
        assert len(measured["anchor"]["anchor"]) == 2


@needs_per_expert_blocks
def test_block_benchmark_quick_prints_every_kernel_and_the_rules_choice():
    """``bench_moe.py --quick --kernels`` in a subprocess (toy widths, one round): a row per token count with the
    plain/fused ratio, every kernel's time and the kernel rule's pick for this CPU; no timing is asserted."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "bench_moe.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--kernels"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert all(column in lines[1] for column in ("grouped ms", "gather ms", "upcast ms", "kept ms", "chunked ms"))
    assert lines[1].endswith("rule")
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "16", "128"]
    expected = "grouped" if dispatch.native_bf16() else "upcast"
    assert [row[-1] for row in rows] == ["grouped", "grouped", expected]  # 128 tokens x top-2 / 8 experts = 32 rows
