"""``linear_kernels`` on transformers 5.x's experts modules: at decode the experts implementation measured fastest
(transformers' own: the class's loop, ``grouped_mm``, ``batched_mm``), outputs within the bound of the configured
one (bit-identical in exact mode), no tensor moved, and the configured implementation wherever the choice does not
apply (prefill, training, ``torch.compile``).

The timer is replaced by one that reports the configured implementation slowest, so another one runs wherever it
is admitted: the tests see what the choice may take, not only what this machine measured.
"""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fusion_linear_kernels import choice, experts, kernels, packed_experts, packing
from fusion_linear_kernels.family import ExpertsKernelsMixin
from onednn_packing import BF16_PACKS
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.testing.decisions import original_fastest, original_slowest
from fusion_core.testing.kit import TOLERANCES
from fusion_core.testing.tiny_models import MOE_MODELS, save_tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(experts._interface() is None, reason="transformers 4.57 has no experts modules: its experts "
                       "are per-expert nn.Linear layers, which the linear layers' tests cover"),
]

IDS = torch.tensor([[5, 17, 42, 9]])


@pytest.fixture(autouse=True)
def _configured_is_slowest(fake_times: Any) -> None:
    """The configured implementation measures slowest; packing measures slower (weights stay dense) unless a test
    asks for :func:`_packing_wins`. Every decision is forgotten before and after (``fake_times``)."""
    fake_times(experts, original_slowest)
    fake_times(packing, original_fastest)


@pytest.fixture
def _packing_wins(fake_times: Any, _configured_is_slowest: None) -> None:
    fake_times(packing, original_slowest)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experts")
    for name in MOE_MODELS:
        save_tiny_model(MOE_MODELS[name], root / name)
    return {name: root / name for name in MOE_MODELS}


def _load(directory: Path, fusion_config: dict[str, Any] | None) -> Any:
    if fusion_config is None:
        return AutoModelForCausalLM.from_pretrained(directory).eval()
    return fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config=fusion_config).eval()


def _decode(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, out.logits[-1]


def _one_ulp_up(forward: Any) -> Any:
    def nudged(module: Any, *args: Any) -> torch.Tensor:
        out = forward(module, *args)
        return torch.nextafter(out, torch.full_like(out, float("inf")))
    return nudged


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_decode_takes_another_implementation_within_the_bound(checkpoints, name):
    plain, fused = _load(checkpoints[name], None), _load(checkpoints[name], {"linear_kernels": True})
    fused_experts = [m for m in fused.modules() if isinstance(m, ExpertsKernelsMixin)]
    assert len(fused_experts) == plain.config.num_hidden_layers
    tokens, logits = _decode(fused)
    expected_tokens, expected_logits = _decode(plain)
    assert torch.equal(tokens, expected_tokens)
    assert float((logits - expected_logits).abs().max()) <= TOLERANCES[torch.float32] * (
        float(expected_logits.abs().max()) + 1)
    # rows -> (configured, chosen); the configured implementation may differ by call (5.0 decodes with batched_mm)
    chosen = {kind[3]: (kind[5], implementation) for kind, implementation in experts.decisions().items()}
    assert chosen and max(chosen) <= 4  # the prompt's rows (4) and the decode steps' (1); nothing at more rows
    assert chosen[1][1] != chosen[1][0]  # another implementation really ran
    want, got = plain.state_dict(), fused.state_dict()  # no tensor moved
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_exact_mode_takes_only_bit_identical_implementations(checkpoints, monkeypatch):
    original = experts.implementation
    monkeypatch.setattr(experts, "implementation", lambda module, name: _one_ulp_up(original(module, name))
                        if name != module.config._experts_implementation else original(module, name))
    directory = checkpoints["olmoe"]
    plain = _load(directory, None)
    expected_tokens, expected_logits = _decode(plain)
    tokens, logits = _decode(_load(directory, {"linear_kernels": {"exact": True}}))
    assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)
    assert all(name == kind[5] for kind, name in experts.decisions().items())  # the configured one, every kind
    # the default mode takes the nudged implementations, whose logits then differ: the check above can fail
    experts.clear_decisions()
    _, within = _decode(_load(directory, {"linear_kernels": True}))
    assert any(name != kind[5] for kind, name in experts.decisions().items())
    assert not torch.equal(within, expected_logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_choice_runs_the_kernel_chosen_for_each_expert_matrix_within_the_bound(checkpoints, monkeypatch,
                                                                                      fake_times, dtype):
    """At one row each routed expert's products run the kernel choice's decision for the expert matrix's kind
    (row-dot here: the tiny matrices taken as large enough, and the last admitted candidate measured fastest),
    within the bound of the configured implementation."""
    from fusion_linear_kernels import choice, row_dot

    monkeypatch.setattr(row_dot, "MIN_BYTES", 0)
    fake_times(choice, lambda ways: [1.0] * (ways - 1) + [0.1])
    # row-dot the last admitted candidate: blocked-rows, which applies at every width, left out
    monkeypatch.setattr(kernels, "CANDIDATES", tuple(c for c in kernels.CANDIDATES if c is not kernels.BLOCKED_ROWS))
    ran: list[tuple[int, ...]] = []
    gemv = row_dot.gemv  # what row-dot's run calls, with the weight it reads
    monkeypatch.setattr(row_dot, "gemv", lambda i, w, b, block: ran.append(tuple(w.shape)) or gemv(i, w, b, block))
    model = _load(checkpoints["olmoe"], None).to(dtype)
    module = next(m for m in model.modules() if experts.is_experts(m))
    if row_dot.kernel(dtype, False) is None:
        pytest.skip("the row-dot kernel cannot be built here (no C++ compiler)")
    top_k = model.config.num_experts_per_tok
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, model.config.hidden_size, generator=generator).to(dtype)
    index = torch.randperm(model.config.num_experts, generator=generator)[:top_k].view(1, top_k)
    weights = torch.softmax(torch.randn(1, top_k, generator=generator), -1).to(dtype)
    with torch.no_grad():
        reference = module(hidden, index, weights)
        experts.routed_choice(module, hidden, index, weights)  # the kernel choice measures each matrix's kind
        ran.clear()
        got = experts.routed_choice(module, hidden, index, weights)
    shapes = {tuple(module.gate_up_proj.shape[1:]), tuple(module.down_proj.shape[1:])}
    assert len(ran) == 2 * top_k and set(ran) == shapes  # gate/up and down of each routed expert
    assert {"x".join(map(str, kind[2])) for kind, name in choice.decisions().items() if name == "row-dot"} \
        >= {"x".join(map(str, shape)) for shape in shapes}
    assert float((got.float() - reference.float()).abs().max()) <= experts.admission_bound(reference, top_k)


def test_exact_mode_never_tries_routed_choice(checkpoints, monkeypatch):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("routed_choice tried in exact mode")

    monkeypatch.setattr(experts, "_OWN", {**experts._OWN, "routed_choice": refuse})
    model = _load(checkpoints["olmoe"], None)
    module = next(m for m in model.modules() if experts.is_experts(m))
    hidden = torch.randn(1, model.config.hidden_size)
    index = torch.arange(model.config.num_experts_per_tok).view(1, -1)
    weights = torch.full(index.shape, 1 / index.shape[1])
    assert "routed_choice" in experts.available()
    with torch.no_grad():
        assert experts.choose(module, hidden, index, weights, exact=True) != "routed_choice"
        with pytest.raises(AssertionError, match="exact mode"):  # the check bites: the default mode tries it
            experts.choose(module, hidden, index, weights, exact=False)


def test_prefill_and_training_run_the_configured_implementation(checkpoints, monkeypatch):
    directory = checkpoints["qwen2_moe"]
    plain, fused = _load(directory, None), _load(directory, {"linear_kernels": True})

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an implementation was chosen")

    monkeypatch.setattr(experts, "choose", refuse)
    long = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fused(long).logits, plain(long).logits)
    for model in (plain.train(), fused.train()):
        model(input_ids=IDS[:, :1], labels=IDS[:, :1]).loss.backward()
    for (key, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), key


def test_compiles_pickles_saves_and_unfuses(checkpoints, tmp_path):
    directory = checkpoints["mixtral"]
    plain, fused = _load(directory, None), _load(directory, {"linear_kernels": {"exact": True}})
    # Compiled (a graph break raises with fullgraph) as the plain model compiles: the traced code is the release's
    # own (transformers 5.0's grouped_mm does not trace in float32, the plain model's neither).
    def compiled_logits(model: Any) -> torch.Tensor:
        torch._dynamo.reset()
        with torch.no_grad():
            return torch.compile(model, fullgraph=True, backend="eager")(input_ids=IDS[:, :1]).logits

    try:
        expected = compiled_logits(plain)
    except Exception as exc:  # whatever the release raises, the fused model must raise too
        with pytest.raises(type(exc)):
            compiled_logits(fused)
    else:
        assert torch.equal(compiled_logits(fused), expected)
    expected_tokens, _ = _decode(plain)
    for other in (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused)):
        assert isinstance(other.model.layers[0].mlp.experts, ExpertsKernelsMixin)
        assert torch.equal(_decode(other)[0], expected_tokens)
    fusion_core.save_pretrained(fused, tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()
    fusion_core.unfuse(fused)
    assert not any(isinstance(m, ExpertsKernelsMixin) for m in fused.modules())
    assert type(fused.model.layers[0].mlp.experts) is type(plain.model.layers[0].mlp.experts)


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_candidate_computes_the_configured_output(checkpoints, name, dtype):
    """Each implementation the choice may take (fusion's own ``routed_gemv`` included) computes what the
    configured one does on these experts, within the admission bound, at every row count it applies to."""
    model = _load(checkpoints[name], None).to(dtype)
    module = next(m for m in model.modules() if experts.is_experts(m))
    top_k = model.config.num_experts_per_tok
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in range(1, choice.MAX_ROWS + 1):
            hidden = torch.randn(rows, model.config.hidden_size, generator=generator).to(dtype)
            index = torch.stack([torch.randperm(model.config.num_experts, generator=generator)[:top_k]
                                 for _ in range(rows)])
            weights = torch.softmax(torch.randn(rows, top_k, generator=generator), -1).to(dtype)
            reference = module(hidden, index, weights)
            bound = experts.admission_bound(reference, top_k)
            for candidate in experts.available():
                got = experts.implementation(module, candidate)(module, hidden, index, weights)
                assert got.shape == reference.shape and got.dtype == reference.dtype, candidate
                assert float((got.float() - reference.float()).abs().max()) <= bound, (candidate, rows)


def test_experts_whose_class_does_more_around_the_dispatcher_are_left_to_their_own_forward(checkpoints, monkeypatch):
    """A subclass of a dispatching experts class with a forward of its own (transformers 5.25's Ergo: one row per
    route and a learned norm after each) is not the dispatcher: an implementation chosen for it would skip what its
    forward adds, so the family leaves it alone; the dispatching class itself is still fused, also once fused."""
    dispatching = _load(checkpoints["olmoe"], {"linear_kernels": True})
    fused_experts = [m for m in dispatching.modules() if isinstance(m, ExpertsKernelsMixin)]
    assert fused_experts and all(experts.is_experts(m) for m in fused_experts)
    experts_class = type(next(m for m in _load(checkpoints["olmoe"], None).modules() if experts.is_experts(m)))

    class ScaledExperts(experts_class):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states, top_k_index, top_k_weights) * 2

    monkeypatch.setattr(sys.modules[experts_class.__module__], experts_class.__name__, ScaledExperts)
    fusion_core.reset_state()  # the model class is unchanged: its cached plan holds the dispatching experts
    try:
        plain, fused = _load(checkpoints["olmoe"], None), _load(checkpoints["olmoe"], {"linear_kernels": True})
        assert any(type(m) is ScaledExperts for m in plain.modules())
        assert not any(experts.is_experts(m) or isinstance(m, ExpertsKernelsMixin) for m in fused.modules())
        tokens, logits = _decode(fused)  # the configured implementation measures slowest: any other would be taken
        expected_tokens, expected_logits = _decode(plain)
    finally:
        fusion_core.reset_state()
    assert torch.equal(tokens, expected_tokens)
    _close(logits, expected_logits)


# -- expert weights held prepacked (fusion_linear_kernels.packed_experts) -----------------------------------------
def _packed_modules(model: Any) -> list[ExpertsKernelsMixin]:
    found = [m for m in model.modules() if isinstance(m, ExpertsKernelsMixin)]
    assert found and all(m.packed for m in found), [m.packed for m in found]  # a test cannot pass on dense stacks
    stacks = [p for m in found for p in packed_experts.stacks(m).values()]
    assert stacks and all(isinstance(p, packed_experts.PackedExperts) for p in stacks)
    return found


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """Within the tolerance of ``dtype`` (the computation's), relative to the largest expected value."""
    scale = float(want.abs().max()) + 1
    assert float((got - want).abs().max()) <= TOLERANCES[dtype] * scale, float((got - want).abs().max())


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=BF16_PACKS)])
def test_packed_experts_decode_and_prefill_like_the_configured_implementation(checkpoints, name, dtype,
                                                                             _packing_wins):
    plain = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=dtype).eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, checkpoints[name], fusion_config={"linear_kernels": True},
                                        dtype=dtype).eval()
    _packed_modules(fused)
    long = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))  # prefill: rows grouped
    with torch.no_grad():
        _close(fused(long).logits.float(), plain(long).logits.float(), dtype)
    tokens, logits = _decode(fused)
    expected_tokens, expected_logits = _decode(plain)
    assert torch.equal(tokens, expected_tokens)
    _close(logits.float(), expected_logits.float(), dtype)
    want, got = plain.state_dict(), fused.state_dict()  # the stacks as they were loaded, bit for bit
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_packed_experts_exact_mode_is_bit_identical_or_stays_dense(checkpoints, _packing_wins):
    """Exact mode packs a module's experts only where its probes were bit-identical to the configured
    implementation; the model then decodes bit-identically, packed or not."""
    directory = checkpoints["olmoe"]
    expected_tokens, expected_logits = _decode(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16))
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, directory, dtype=torch.bfloat16,
                                        fusion_config={"linear_kernels": {"exact": True}}).eval()
    tokens, logits = _decode(fused)
    assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)


@BF16_PACKS
def test_packed_experts_save_copy_pickle_convert_and_unfuse(checkpoints, tmp_path, _packing_wins):
    directory = checkpoints["qwen2_moe"]
    plain, fused = _load(directory, None), _load(directory, {"linear_kernels": True})
    _packed_modules(fused)
    fusion_core.save_pretrained(fused, tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()
    with torch.no_grad():
        expected = fused(IDS).logits
        for other in (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused)):
            _packed_modules(other)
            assert torch.equal(other(IDS).logits, expected)
        converted = copy.deepcopy(fused).to(torch.bfloat16)  # unpacked, converted, packed again
        assert all(p.dtype == torch.bfloat16 for m in _packed_modules(converted) for p in m.parameters())
        _close(converted(IDS).logits.float(), plain.to(torch.bfloat16)(IDS).logits.float())
    fusion_core.unfuse(fused)
    assert not any(isinstance(m, ExpertsKernelsMixin) for m in fused.modules())
    assert not any(key.startswith("_fusion_linear_kernels") for m in fused.modules() for key in m.__dict__)
    want = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert all(type(p) is torch.nn.Parameter for p in fused.parameters())
    assert all(torch.equal(fused.state_dict()[k], want[k]) for k in want)


def test_packed_experts_under_autocast_give_what_the_original_gives(checkpoints, _packing_wins):
    """CPU autocast runs a float32 model's experts GEMMs in bfloat16; the packed GEMMs are not operators it casts
    for, so the packed experts computed in float32 (other numbers) where the original computed in bfloat16: under
    autocast they run the original implementation on their dense stacks, in inference and through frozen experts."""
    directory = checkpoints["olmoe"]
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config={"linear_kernels": True},
                                        dtype=torch.float32).eval()
    _packed_modules(fused)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for ids in (IDS[:, :1], IDS):
            assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    grads = []
    for model in (plain, fused):
        model.train().requires_grad_(False)
        model.model.embed_tokens.weight.requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=IDS, labels=IDS).loss.backward()
        grads.append(model.model.embed_tokens.weight.grad)
    assert torch.equal(*grads)
    assert _packed_modules(fused)  # the packed stacks are back after each call


@BF16_PACKS
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_packed_experts_compile_and_train_through_frozen_experts(checkpoints, backend, _packing_wins):
    """Compiled with fullgraph (the packed experts are one operator), and gradients reach the layers before a
    frozen experts layer (LoRA's case) as in the plain model, eager and compiled; an expert weight that requires grad
    is refused by name at backward."""
    directory = checkpoints["olmoe"]
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, directory, fusion_config={"linear_kernels": True},
                                        dtype=torch.bfloat16)
    _packed_modules(fused)
    for model in (plain, fused):
        model.requires_grad_(False)
        model.model.embed_tokens.weight.requires_grad_(True)
    plain(input_ids=IDS, labels=IDS).loss.backward()
    torch._dynamo.reset()
    compiled = torch.compile(fused.forward, fullgraph=True, backend=backend)
    for run in (fused, compiled):
        fused.model.embed_tokens.weight.grad = None
        loss = run(input_ids=IDS, labels=IDS).loss
        loss.backward()
        # bf16 gradients: the routed sums round where transformers' implementation of this release rounds elsewhere
        _close(fused.model.embed_tokens.weight.grad.float(), plain.model.embed_tokens.weight.grad.float(),
               torch.bfloat16)
    fused.model.layers[1].mlp.experts.gate_up_proj.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"linear_kernels holds the weight of the experts of "
                                           r"model\.layers\.1\.mlp\.experts prepacked .* cannot be trained"):
        fused(input_ids=IDS, labels=IDS).loss.backward()


def test_fsdp2_over_packed_experts_is_refused_by_name(checkpoints, _packing_wins):
    from torch.distributed.fsdp import fully_shard

    fused = _load(checkpoints["mixtral"], {"linear_kernels": True})
    _packed_modules(fused)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(NotImplementedError, match=r"linear_kernels holds the weight of "
                                                      r"'model\.layers\.0\.mlp\.experts\.\w+' prepacked per expert"):
            fully_shard(fused.model.layers[0].mlp.experts)
    finally:
        torch.distributed.destroy_process_group()


def test_packed_experts_take_arguments_by_name_and_calls_with_no_rows(checkpoints, _packing_wins):
    fused = _load(checkpoints["olmoe"], {"linear_kernels": True})
    module = _packed_modules(fused)[0]
    top_k = fused.config.num_experts_per_tok
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, fused.config.hidden_size, generator=generator)
    index = torch.stack([torch.randperm(fused.config.num_experts, generator=generator)[:top_k] for _ in range(2)])
    weights = torch.softmax(torch.randn(2, top_k, generator=generator), -1)
    with torch.no_grad():
        by_position = module(hidden, index, weights)
        assert torch.equal(module(hidden, top_k_index=index, top_k_weights=weights), by_position)
        assert torch.equal(module(top_k_weights=weights, hidden_states=hidden, top_k_index=index), by_position)
        with pytest.raises(TypeError, match=r"an experts module takes \(hidden_states, top_k_index, top_k_weights\)"):
            module(hidden, index, top_k_weights=weights, extra=1)
        empty = torch.randn(0, fused.config.hidden_size)
        out = module(empty, torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k))
    assert out.shape == empty.shape
