"""``linear_kernels`` on tiny real decoders: the same tokens and logits within the bound, exact mode bit-identical,
the checkpoint saved byte for byte, and a fused model that trains, compiles, pickles and unfuses like the plain one.

The timer is replaced by one that reports every candidate but ``F.linear`` fastest, so the layers run another
kernel wherever one is admitted: the tests see the kernels the choice may take, not only the original one. The
packing timer reports the packed layout slower, so every weight stays dense here: the prepacked layout has its own
tests (``test_packing.py``).
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from fusion_linear_kernels import LinearKernelsMixin, choice, kernels
from fusion_linear_kernels.choice import Caller
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.plugin import MergedLinear
from fusion_core.testing.kit import TOLERANCES
from fusion_core.testing.tiny_models import TEXT_MODELS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("other_kernels_dense_weights")]

IDS = torch.tensor([[5, 17, 42, 9]])
MERGED = {"qkv": True, "gate_up": True}


def _save(name: str, directory: Path, tied: bool, dtype: torch.dtype) -> Path:
    config = TEXT_MODELS[name].make_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, torch.dtype], Path]:
    root = tmp_path_factory.mktemp("linear-kernels")
    return {(name, tied, dtype): _save(name, root / f"{name}-{tied}-{str(dtype)[6:]}", tied, dtype)
            for name, tied in (("llama", False), ("qwen2", True)) for dtype in (torch.float32, torch.bfloat16)}


CASES = [(name, tied, dtype) for name, tied in (("llama", False), ("qwen2", True))
         for dtype in (torch.float32, torch.bfloat16)]


def _load(directory: Path, fusion_config: dict[str, Any] | None) -> Any:
    """The checkpoint in its own dtype (transformers 4.57 would load bfloat16 tensors as float32)."""
    if fusion_config is None:
        return AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    return fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=fusion_config,
                                       dtype="auto").eval()


def _decode(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of 6 steps (one row per step after the prompt), and the last step's logits."""
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, out.logits[-1]


@pytest.mark.parametrize(("name", "tied", "dtype"), CASES)
@pytest.mark.parametrize("others", [{}, MERGED], ids=["alone", "with-qkv-gate_up"])
def test_decode_matches_the_model_without_it(checkpoints, name, tied, dtype, others):
    directory = checkpoints[(name, tied, dtype)]
    reference = _load(directory, others or None)
    fused = _load(directory, {**others, "linear_kernels": True})
    assert isinstance(fused.lm_head, LinearKernelsMixin) and isinstance(fused.lm_head, nn.Linear)
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == tied
    if others:
        merged = fused.model.layers[0].self_attn.fused_projection
        assert isinstance(merged, MergedLinear) and isinstance(merged.kernel, Caller) and not merged.kernel.exact
    tokens, logits = _decode(fused)
    expected_tokens, expected_logits = _decode(reference)
    assert torch.equal(tokens, expected_tokens)
    scale = float(expected_logits.abs().max()) + 1
    assert float((logits.float() - expected_logits.float()).abs().max()) <= TOLERANCES[dtype] * scale
    assert choice.decisions()  # the one-row calls chose a kernel
    if dtype == torch.float32 and not others:
        assert "mv" in choice.decisions().values()  # another kernel really ran


def _one_ulp_up(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A candidate within the bound but never bit-identical: ``F.linear``'s output, one unit in the last place up."""
    out = torch.nn.functional.linear(input, weight, bias)
    return torch.nextafter(out, torch.full_like(out, float("inf")))


@pytest.mark.parametrize(("name", "tied", "dtype"), CASES)
@pytest.mark.parametrize("others", [{}, MERGED], ids=["alone", "with-qkv-gate_up"])
def test_exact_mode_is_bit_identical(checkpoints, monkeypatch, name, tied, dtype, others):
    nudged = kernels.Candidate("one ulp up", _one_ulp_up, kernels._always)
    monkeypatch.setattr(kernels, "CANDIDATES", (*kernels.CANDIDATES, nudged))
    directory = checkpoints[(name, tied, dtype)]
    reference = _load(directory, others or None)
    expected_tokens, expected_logits = _decode(reference)
    fused = _load(directory, {**others, "linear_kernels": {"exact": True}})
    tokens, logits = _decode(fused)
    assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)
    assert "one ulp up" not in choice.decisions().values()
    # the same candidate is taken by the default mode, whose logits then differ: the check above can fail
    choice.clear_decisions()
    _, within = _decode(_load(directory, {**others, "linear_kernels": True}))
    assert "one ulp up" in choice.decisions().values() and not torch.equal(within, expected_logits)


@pytest.mark.parametrize(("name", "tied", "dtype"), CASES)
def test_saved_checkpoint_is_the_source_byte_for_byte(checkpoints, tmp_path, name, tied, dtype):
    directory = checkpoints[(name, tied, dtype)]
    fused = _load(directory, {**MERGED, "linear_kernels": True})
    _decode(fused)  # decisions made: nothing about the tensors changes
    fusion_core.save_pretrained(fused, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()


def test_training_runs_the_original_kernel_and_gradients_match(checkpoints, monkeypatch):
    directory = checkpoints[("llama", False, torch.float32)]
    plain, fused = _load(directory, None).train(), _load(directory, {"linear_kernels": True}).train()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a kernel was measured under autograd")

    monkeypatch.setattr(choice, "choose", refuse)
    ids = IDS[:, :1]  # one row: the size that chooses a kernel at inference
    for model in (plain, fused):
        model(input_ids=ids, labels=ids).loss.backward()
    for (key, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), key


#: How a traced graph names the chosen kernel's operator (``fusion_linear_kernels.choice.chosen_linear_op``).
CHOSEN_OPERATOR = "fusion_linear_kernels.chosen_linear.default"


def _graph_recorder(graphs: list[torch.fx.GraphModule]) -> Any:
    """A ``torch.compile`` backend that keeps each graph dynamo traced and runs it as traced."""
    def backend(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward
    return backend


def _operators(graphs: list[torch.fx.GraphModule]) -> list[str]:
    return [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("others", [{}, MERGED], ids=["alone", "with-qkv-gate_up"])
def test_compiles_with_fullgraph_through_the_chosen_kernels(checkpoints, others, dtype):
    """Compiled decode runs the kernel chosen for each layer, as eager decode does: every linear call of a decode step
    (a merged projection once for its parts, the tied head) is the chosen kernel's operator in the graph, with no
    break, and the compiled logits are eager's, bit for bit (the same kernels on the same rows)."""
    directory = checkpoints[("qwen2", True, dtype)]
    fused = _load(directory, {**others, "linear_kernels": True})
    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=_graph_recorder(graphs))  # a graph break raises here
    with torch.no_grad():
        expected = fused(input_ids=IDS[:, :1]).logits
        got = compiled(input_ids=IDS[:, :1]).logits
    linears = sum(isinstance(m, nn.Linear) for m in _load(directory, None).modules())
    merged = [m.fused_projection for m in fused.modules() if isinstance(getattr(m, "fused_projection", None),
                                                                     MergedLinear)]
    assert bool(merged) == bool(others)
    calls = linears - sum(len(projection.sizes) - 1 for projection in merged)  # one call per merged projection
    operators = _operators(graphs)
    assert operators.count(CHOSEN_OPERATOR) == calls and "<built-in function linear>" not in operators
    assert torch.equal(got, expected)


def test_compiled_steps_remember_each_weights_kind(checkpoints, monkeypatch):
    """The operator keeps a Caller per weight, as an eager layer does: after a compiled step has chosen, a step like it
    works no kind out again, and its logits are the first step's."""
    fused = _load(checkpoints[("qwen2", True, torch.float32)], {**MERGED, "linear_kernels": True})
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=_graph_recorder([]))
    with torch.no_grad():
        first = compiled(input_ids=IDS[:, :1]).logits
        worked_out: list[tuple[int, ...]] = []
        real_chosen = choice.chosen
        monkeypatch.setattr(choice, "chosen", lambda rows, weight, *rest: (
            worked_out.append(tuple(weight.shape)), real_chosen(rows, weight, *rest))[1])
        again = compiled(input_ids=IDS[:, :1]).logits
    assert worked_out == [] and torch.equal(again, first)


def test_compiled_prefill_training_and_export_keep_f_linear(checkpoints):
    """Where eager runs ``F.linear`` without choosing, so does the graph: more rows than a decision covers (prefill),
    autograd (training: the gradients are plain's), and ``torch.export``, whose programs other runtimes read."""
    directory = checkpoints[("qwen2", True, torch.float32)]
    plain, fused = _load(directory, None), _load(directory, {"linear_kernels": True})
    long_ids = torch.arange(choice.MAX_ROWS + 1).unsqueeze(0) + 3
    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend=_graph_recorder(graphs))
    with torch.no_grad():
        compiled(input_ids=long_ids)
    compiled(input_ids=IDS, labels=IDS).loss.backward()
    plain(input_ids=IDS, labels=IDS).loss.backward()
    assert len(graphs) == 2 and CHOSEN_OPERATOR not in _operators(graphs)
    for (key, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), key
    with torch.no_grad():  # as an inference program is exported: eager would choose here
        exported = torch.export.export(fused, (), {"input_ids": IDS[:, :1], "use_cache": False}, strict=True)
    assert not any("chosen_linear" in str(node.target) for node in exported.graph.nodes)


def test_pickles_copies_and_unfuses(checkpoints):
    directory = checkpoints[("qwen2", True, torch.float32)]
    plain = _load(directory, None)
    fused = _load(directory, {**MERGED, "linear_kernels": True})
    expected_tokens, _ = _decode(plain)
    for other in (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused)):
        assert isinstance(other.lm_head, LinearKernelsMixin)
        assert other.lm_head.weight is other.model.embed_tokens.weight
        merged = other.model.layers[0].self_attn.fused_projection
        assert isinstance(merged.kernel, Caller) and not merged.kernel.exact
        assert torch.equal(_decode(other)[0], expected_tokens)
    fusion_core.unfuse(fused)
    assert not any(isinstance(m, LinearKernelsMixin) for m in fused.modules())
    assert type(fused.lm_head) is nn.Linear and type(fused.model.layers[0].self_attn.q_proj) is nn.Linear
    got, want = fused.state_dict(), plain.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(_decode(fused)[0], expected_tokens)


def test_the_plan_leaves_merged_projections_to_their_family(checkpoints):
    directory = checkpoints[("llama", False, torch.float32)]
    fused = _load(directory, {**MERGED, "linear_kernels": True})
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, LinearKernelsMixin)
    assert isinstance(layer.mlp.down_proj, LinearKernelsMixin)
    assert not isinstance(layer.self_attn.qkv_proj, LinearKernelsMixin)
    plan = fusion_core.get_fusion_plan(fused)
    owners = {m.path: m.family for m in plan.modules}
    assert owners["model.layers.0.self_attn"] == "qkv" and owners["lm_head"] == "linear_kernels"
    assert "model.layers.0.self_attn.q_proj" not in owners and "model.layers.0.mlp.up_proj" not in owners
    assert ("linear_kernels", "model.layers.0.self_attn.q_proj", "qkv", "model.layers.0.self_attn") in plan.nested
    assert ("linear_kernels", "model.layers.0.mlp.gate_proj", "gate_up", "model.layers.0.mlp") in plan.nested


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_with_moe_experts(tmp_path, name):
    """The experts a MoE family fuses whole are its own; the other linear layers (attention, router, LM head) and
    the merged projections choose kernels; greedy tokens are plain's."""
    from fusion_core.testing.tiny_models import MOE_MODELS, save_tiny_model

    plain = save_tiny_model(MOE_MODELS[name], tmp_path).eval()
    # moe_experts fuses per-expert ModuleLists (transformers 4.57); 5.x blocks hold their experts stacked already
    fused = _load(tmp_path, {"moe_experts": {"required": False}, "qkv": True, "gate_up": {"required": False},
                             "linear_kernels": True})
    assert isinstance(fused.lm_head, LinearKernelsMixin)
    assert not [path for path, m in fused.named_modules() if ".experts." in path and isinstance(m, LinearKernelsMixin)]
    assert torch.equal(_decode(fused)[0], _decode(plain)[0])


@pytest.mark.parametrize("others", [{}, MERGED], ids=["alone", "with-qkv-gate_up"])
def test_peft_lora_attaches_by_the_original_names(checkpoints, tmp_path, others, lora):
    directory = checkpoints[("llama", False, torch.float32)]

    plain, fused = lora(_load(directory, None)), lora(_load(directory, {**others, "linear_kernels": True}))
    assert isinstance(fused.base_model.model.model.layers[0].self_attn.o_proj.base_layer, LinearKernelsMixin)
    expected_tokens, expected_logits = _decode(plain)
    tokens, logits = _decode(fused)
    assert torch.equal(tokens, expected_tokens)
    assert float((logits - expected_logits).abs().max()) <= TOLERANCES[torch.float32] * (
        float(expected_logits.abs().max()) + 1)
    plain.save_pretrained(tmp_path / "plain")
    fused.save_pretrained(tmp_path / "fused")
    left, right = (load_file(tmp_path / side / "adapter_model.safetensors") for side in ("plain", "fused"))
    assert sorted(left) == sorted(right) and all(torch.equal(left[k], right[k]) for k in left)
