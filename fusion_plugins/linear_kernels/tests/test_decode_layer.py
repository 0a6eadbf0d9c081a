"""The decode step of the decoder layers ``linear_kernels`` recognises (``fusion_linear_kernels.decode_layer``): the
layers it verifies take it at steps of one to eight rows and give the tokens and logits their own modules give;
layers of another form keep their class, with the reason; every call the step cannot take as the original would
runs the original forward; and the switched layers unfuse and pickle.

Every kernel choice is decided by a fake clock on which ``blocked-rows`` measures fastest (or ``row-dot``), so the
layers' GEMVs run the kernels the step runs, and the step's own attention attends with torch's kernel, as the modules
do (``torch_attention``; ``test_decode_attention.py`` covers the step's attention kernel). The widths are the smallest
the GEMV kernel takes (weights of 1 MiB).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import transformers
from fusion_linear_kernels import choice, layer_kernel, packing, step_blocks
from fusion_linear_kernels.decode_layer import (
    ATTENTION_KEY,
    FORM_KEY,
    DecodeLayerMixin,
    LayerForm,
    ModulesForm,
    drop_decode_steps,
    refusal,
)
from fusion_linear_kernels.row_dot import RowDotUnavailableWarning
from one_row_gemv import fresh_kernels_of, recorded_calls, skip_unless_built, without_the_kernel_of
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    Glm4Config,
    GlmConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

import fusion_core
from fusion_core.testing.decisions import original_fastest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_attention")]

IDS = torch.tensor([[5, 17, 42, 9]])
MERGED = {"qkv": True, "gate_up": True, "linear_kernels": True}
ALONE = {"linear_kernels": True}
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma": GemmaConfig, "gemma2": Gemma2Config,
           "gemma3": Gemma3TextConfig, "phi3": Phi3Config,
           "glm": GlmConfig, "glm4": Glm4Config, "qwen3": Qwen3Config, "mistral": MistralConfig}
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special tokens inside the tiny vocabulary (Phi-3's and GLM's defaults lie beyond it)."""


def _model(kind: str, **extra: Any) -> nn.Module:
    """A bf16 decoder of ``kind`` with two layers (its config's other fields, and these, from ``extra``), its norms'
    weights random as trained ones are (around 1, or around 0 for Gemma's, which multiply by 1 + the weight)."""
    config = CONFIGS[kind](**{"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2,
                              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
                              "max_position_embeddings": 256, **TOKENS, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.2)
    return model


def _fastest(index: int) -> Callable[[int], list[float]]:
    """Times on which the way at ``index`` (from the end where negative) measures fastest."""
    def times(ways: int) -> list[float]:
        out = [1.0] * ways
        out[index] = 0.25
        return out
    return times


@pytest.fixture(params=["blocked-rows", "row-dot"])
def step_kernels(request: pytest.FixtureRequest, fake_times: Callable[[Any, Any], None]) -> str:
    """The one-row GEMVs decided for ``blocked-rows`` (the last one-row candidate) or ``row-dot`` (the one before);
    weights stay dense."""
    skip_unless_built(lambda: layer_kernel.kernel(torch.bfloat16), "the decode layer kernel")
    fake_times(choice, _fastest(-1 if request.param == "blocked-rows" else -2))
    fake_times(packing, original_fastest)
    return str(request.param)


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """The layer kernel forgotten before the test, and gone after ``fusion_core.reset_state()``."""
    yield from fresh_kernels_of(layer_kernel)


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The layers each decode step ran on, in order."""
    return recorded_calls(monkeypatch, LayerForm, "run")


def _generate(model: nn.Module, tokens: int = 6) -> Any:
    with torch.no_grad():
        return model.generate(IDS, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)


def _modules_only(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose layers run their modules (the step's form dropped)."""
    copied = copy.deepcopy(model)
    drop_decode_steps(copied)
    assert not any(FORM_KEY in module.__dict__ for module in copied.modules())
    return copied


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within two steps of bfloat16's precision (the models' dtype; transformers widens the logits to float32) of the
    largest logit: where the step runs another GEMV than the modules (a kind decided for ``torch.mv``), their sums
    may round apart by a unit in a bfloat16 hidden state (seen on a CPU with AVX2 alone)."""
    bound = 2 * torch.finfo(torch.bfloat16).eps * float(expected.float().abs().max())
    return float((got.float() - expected.float()).abs().max()) <= bound


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize(("kind", "families"), [("llama", MERGED), ("llama", ALONE), ("qwen2", MERGED),
                                               ("gemma", MERGED), ("gemma2", MERGED), ("phi3", ALONE),
                                               ("glm", {"qkv": True, "linear_kernels": True}),
                                               ("glm4", {"qkv": True, "linear_kernels": True})],
                         ids=["llama-merged", "llama-alone", "qwen2-merged", "gemma-merged", "gemma2-merged",
                              "phi3-its-own-merged", "glm-its-own-merged", "glm4-sandwich"])
def test_recognised_layers_decode_as_their_modules_do(kind: str, families: dict[str, bool],
                                                      steps: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model(kind), families)
    steps.clear()  # the verification's
    layers = list(fused.model.layers)
    if kind == "gemma2" and int(transformers.__version__.split(".")[0]) < 5:
        assert "returns tuple" in str(refusal(layers[0]))  # 4.57's Gemma 2 layer returns (hidden_states,)
        return
    assert all(isinstance(layer, DecodeLayerMixin) and FORM_KEY in layer.__dict__ for layer in layers)
    assert "decode step" in repr(layers[0])
    reference = _generate(_modules_only(fused))
    assert not steps
    out = _generate(fused)
    assert steps == layers * 6  # six new tokens: the four-token prefill, then five one-token steps
    assert torch.equal(out.sequences, reference.sequences)
    assert all(_close(got, expected) for got, expected in zip(out.logits, reference.logits, strict=True))


@pytest.mark.usefixtures("step_kernels")
def test_a_batch_of_sequences_decodes_as_the_modules_do(steps: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("qwen2"), MERGED)
    steps.clear()  # the verification's
    batch = torch.cat([IDS, IDS.flip(-1), IDS + 1])
    with torch.no_grad():  # the modules first: they decide the kernels of each kind of call
        reference = _modules_only(fused).generate(batch, max_new_tokens=4, do_sample=False, output_logits=True,
                                                  return_dict_in_generate=True)
        out = fused.generate(batch, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert len(steps) == 2 * 3  # three one-token steps of three rows (the twelve-row prefill runs the modules)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(_close(got, expected) for got, expected in zip(out.logits, reference.logits, strict=True))


def _one_row_steps() -> dict[str, str]:
    """The one-row block each kind's step took where its kind decided a kernel the step does not run."""
    return {str(kind[2]): candidate.name for kind, candidate in step_blocks._DECISIONS.items()}


@pytest.mark.parametrize("one_row", ["blocked-rows", "row-dot"])
def test_a_one_row_kind_decided_for_mv_takes_the_faster_of_the_kernels_one_row_blocks(
        one_row: str, fake_times: Callable[[Any, Any], None], steps: list[nn.Module]) -> None:
    skip_unless_built(lambda: layer_kernel.kernel(torch.bfloat16), "the decode layer kernel")
    fake_times(choice, _fastest(1))  # torch.mv, the second of the candidates timed
    fake_times(packing, original_fastest)
    fake_times(step_blocks, _fastest(0 if one_row == "blocked-rows" else 1))
    fused = fusion_core.fuse(_model("llama"), MERGED)
    steps.clear()  # the verification's
    layers = list(fused.model.layers)
    assert all(FORM_KEY in layer.__dict__ for layer in layers), refusal(layers[0])
    mlp_kinds = {kind: name for kind, name in choice.decisions().items() if kind[2] in ((3072, 512), (512, 1536))}
    assert set(mlp_kinds.values()) == {"mv"}
    assert _one_row_steps() == {"(3072, 512)": one_row, "(512, 1536)": one_row}
    reference = _generate(_modules_only(fused))
    out = _generate(fused)
    assert steps == layers * 6
    assert torch.equal(out.sequences, reference.sequences)
    assert all(_close(got, expected) for got, expected in zip(out.logits, reference.logits, strict=True))


def test_kinds_of_a_few_rows_decided_for_f_linear_keep_the_modules(fake_times: Callable[[Any, Any], None],
                                                                   steps: list[nn.Module]) -> None:
    skip_unless_built(lambda: layer_kernel.kernel(torch.bfloat16), "the decode layer kernel")
    fake_times(choice, original_fastest)  # every kind keeps F.linear
    fake_times(packing, original_fastest)
    fake_times(step_blocks, _fastest(0))
    fused = fusion_core.fuse(_model("qwen2"), MERGED)
    steps.clear()  # the verification's
    with torch.no_grad():
        fused.generate(IDS, max_new_tokens=3, do_sample=False)
        assert len(steps) == 2 * 2  # one-row steps: the kernel's own block
        steps.clear()
        fused.generate(torch.cat([IDS, IDS.flip(-1)]), max_new_tokens=3, do_sample=False)
    assert not steps  # two-row steps: F.linear's GEMM, as decided, in the layers' modules


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize(("kind", "extra", "reason"), [
    ("llama", {"hidden_act": "gelu"}, "activation is neither SiLU nor GELU's tanh approximation"),
    ("llama", {"hidden_act": "relu"}, "activation is neither SiLU nor GELU's tanh approximation"),
], ids=["exact-gelu", "relu"])
def test_layers_of_another_mlp_take_the_attention_step_alone(kind: str, extra: dict[str, Any], reason: str) -> None:
    plain = _model(kind, **extra)
    fused = fusion_core.fuse(copy.deepcopy(plain), MERGED)
    layer = fused.model.layers[0]
    assert isinstance(layer.__dict__.get(FORM_KEY), ModulesForm) and ATTENTION_KEY in layer.__dict__
    found = refusal(layer)  # why its norms and MLP are not the kernel's
    assert found is not None and reason in found


@pytest.mark.usefixtures("step_kernels")
def test_layers_of_another_mlp_whose_attention_does_not_verify_keep_their_class() -> None:
    plain = _model("glm", hidden_act="relu")  # GLM's rotary embedding is interleaved: its attention is the module's
    fused = fusion_core.fuse(copy.deepcopy(plain), ALONE)
    assert all(type(layer) is type(plain.model.layers[0]) for layer in fused.model.layers)
    assert "activation is neither SiLU" in str(refusal(fused.model.layers[0]))


class _UpRowsFirst(nn.Module):
    """A checkpoint-merged MLP whose ``gate_up_proj`` holds the up projection's rows first (built by class switch)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up, gate = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


@pytest.mark.usefixtures("step_kernels")
def test_a_checkpoint_merged_mlp_of_another_row_order_keeps_its_class() -> None:
    model = _model("phi3")
    for layer in model.model.layers:
        layer.mlp.__class__ = type("UpFirstMLP", (_UpRowsFirst, type(layer.mlp)), {})
    fused = fusion_core.fuse(model, ALONE)
    assert not any(isinstance(layer, DecodeLayerMixin) for layer in fused.model.layers)
    assert "the decode step's output differs from the forward's" in str(refusal(fused.model.layers[0]))


class _DropsPositions(nn.Module):
    """A decoder layer's forward that does not pass the attention its position ids (built by class switch)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,
                **kwargs: Any) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                          attention_mask=attention_mask, **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class _ScalesTheMlp(nn.Module):
    """A decoder layer's forward that scales its MLP's output before the residual, as Granite's multipliers do."""

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)) * 0.5


@pytest.mark.usefixtures("step_kernels")
@pytest.mark.parametrize(("edit", "reason"), [
    (_DropsPositions, "does not pass the attention the arguments"),
    (_ScalesTheMlp, "its forward is not r = h + attn(norm(h))"),
], ids=["drops-an-argument", "scales-the-mlp"])
def test_an_edited_layer_keeps_its_class(edit: type[nn.Module], reason: str) -> None:
    model = _model("llama")
    for layer in model.model.layers:
        layer.__class__ = type("EditedLayer", (edit, type(layer)), {})
    fused = fusion_core.fuse(model, MERGED)
    assert not any(isinstance(layer, DecodeLayerMixin) for layer in fused.model.layers)
    assert reason in str(refusal(fused.model.layers[0]))


@pytest.mark.usefixtures("step_kernels")
def test_calls_the_step_cannot_take_as_the_original_would_run_the_original(steps: list[nn.Module]) -> None:
    fused = fusion_core.fuse(_model("llama"), MERGED)
    steps.clear()  # the verification's
    reference = _modules_only(fused)
    token = IDS[:, :1]
    with torch.no_grad():
        got, expected = fused(token).logits, reference(token).logits
    assert _close(got, expected) and len(steps) == 2
    steps.clear()
    assert _close(fused(token).logits.detach(), reference(token).logits.detach())  # grad mode on
    fused.train()
    with torch.no_grad():
        fused(token)
    fused.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused(token)
    assert not steps
    seen: list[nn.Module] = []
    handle = fused.model.layers[0].mlp.register_forward_hook(lambda module, args, out: seen.append(module))
    with torch.no_grad():
        fused(token)
    handle.remove()
    assert seen == [fused.model.layers[0].mlp] and steps == [fused.model.layers[1]]
    steps.clear()
    with torch.no_grad():
        fused(torch.arange(9)[None])  # more rows than the kernel takes
    assert not steps


@pytest.mark.usefixtures("step_kernels")
def test_an_adapter_on_the_mlp_turns_the_step_off(steps: list[nn.Module]) -> None:
    peft = pytest.importorskip("peft")
    fused = fusion_core.fuse(_model("llama"), MERGED)
    steps.clear()  # the verification's
    torch.manual_seed(0)
    adapted = peft.get_peft_model(fused, peft.LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    with torch.no_grad():
        adapted(input_ids=IDS[:, :1])
    assert not steps


@pytest.mark.usefixtures("step_kernels")
def test_exact_mode_switches_no_layer() -> None:
    fused = fusion_core.fuse(_model("llama"), {"qkv": True, "gate_up": True, "linear_kernels": {"exact": True}})
    assert not any(isinstance(layer, DecodeLayerMixin) for layer in fused.model.layers)


@pytest.mark.usefixtures("step_kernels")
def test_switched_layers_unfuse_and_pickle(steps: list[nn.Module]) -> None:
    plain = _model("llama")
    fused = fusion_core.fuse(copy.deepcopy(plain), MERGED)
    steps.clear()  # the verification's
    original = type(plain.model.layers[0])
    loaded = pickle.loads(pickle.dumps(fused))
    assert all(isinstance(layer, DecodeLayerMixin) for layer in loaded.model.layers)
    expected = _generate(fused).sequences  # the first call of each kind runs the modules, which decide it
    steps.clear()
    assert torch.equal(_generate(loaded).sequences, expected)
    assert len(steps) == 2 * 6
    fusion_core.unfuse(fused)
    assert all(type(layer) is original and FORM_KEY not in layer.__dict__ for layer in fused.model.layers)
    assert fused.state_dict().keys() == plain.state_dict().keys()


def test_the_kernel_is_not_built_for_dtypes_the_gemv_does_not_take() -> None:
    assert layer_kernel.kernel(torch.float64) is None


@pytest.mark.usefixtures("step_kernels")
def test_a_layer_kernel_that_cannot_be_built_leaves_the_modules_and_says_so_once(
        fresh_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    without_the_kernel_of(monkeypatch, "rms_norm")
    plain = _model("llama")
    with pytest.warns(RowDotUnavailableWarning, match="decode layer kernel") as caught:
        fused = fusion_core.fuse(copy.deepcopy(plain), MERGED)
        fusion_core.fuse(copy.deepcopy(plain), ALONE)  # tried again: not built, not said again
    assert len([w for w in caught if "decode layer kernel" in str(w.message)]) == 1
    # the norms and MLP as modules: only the attention's step (its own kernel) is left to the layers
    assert all(isinstance(layer.__dict__.get(FORM_KEY), ModulesForm) for layer in fused.model.layers)
    assert "no decode layer kernel" in str(refusal(fused.model.layers[0]))
    assert torch.equal(_generate(fused).sequences, _generate(_modules_only(fused)).sequences)


@pytest.mark.usefixtures("step_kernels")
def test_reset_state_forgets_the_built_layer_kernels(fresh_kernels: None) -> None:
    fusion_core.fuse(_model("llama"), MERGED)
    assert len(layer_kernel._KERNELS)  # fresh_kernels checks they are gone after fusion_core.reset_state()


@pytest.mark.usefixtures("step_kernels")
def test_the_steps_kernel_calls_are_labelled_for_the_profiler(steps: list[nn.Module]) -> None:
    """The step's kernel is no operator of torch's: without its labels the profiler books the MLP's GEMVs as time
    outside operators (what ``benchmarks/decode_split.py`` groups by these names)."""
    fused = fusion_core.fuse(_model("qwen2"), MERGED)
    _generate(fused, 2)  # the kinds decided
    steps.clear()
    with torch.profiler.profile() as recorded:
        _generate(fused, 2)
    names = [event.name for event in recorded.events()]
    assert steps and names.count(f"{layer_kernel.PROFILER_LABEL} input norm") == len(steps)
    assert names.count(f"{layer_kernel.PROFILER_LABEL} MLP 512x1536") == len(steps)
