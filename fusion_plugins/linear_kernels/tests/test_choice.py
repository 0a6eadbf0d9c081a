"""The kernel choice on its own: the admission bound, exact mode, and where the original kernel runs."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from fusion_linear_kernels import choice, kernels, row_dot
from fusion_linear_kernels.kernels import LINEAR, Candidate
from fusion_linear_kernels.tolerance import admission_bound, admitted
from torch.nn import functional as F

from fusion_core.testing.decisions import original_slowest

GEN = torch.Generator().manual_seed(0)
SHAPES = [(96, 64), (40, 200), (256, 24)]


#: Every decision forgotten before and after (``fake_times``); the clock unless a test replaces it.
pytestmark = pytest.mark.usefixtures("fake_times")


def _layer(out: int, inn: int, dtype: torch.dtype, bias: bool = True):
    weight = (torch.randn(out, inn, generator=GEN) / inn**0.5).to(dtype)
    return weight, (torch.randn(out, generator=GEN).to(dtype) if bias else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("out", "inn"), SHAPES)
def test_mv_is_within_the_bound_of_f_linear(dtype, out, inn):
    weight, bias = _layer(out, inn, dtype)
    for b in (None, bias):
        x = torch.randn(1, inn, generator=GEN).to(dtype)
        reference = F.linear(x, weight, b)
        bound = admission_bound(x, weight, reference)
        got = kernels.CANDIDATES[1].run(x, weight, b)
        assert admitted(got, reference, bound, exact=False)
        # the bound is about the dtype's rounding, not the output's scale: a few units in the last place at most
        assert bound < 8 * torch.finfo(dtype).eps * float(reference.abs().max()) + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_refuses_what_exceeds_it_and_exact_mode_refuses_any_difference(dtype):
    weight, bias = _layer(64, 128, dtype)
    x = torch.randn(1, 128, generator=GEN).to(dtype)
    reference = F.linear(x, weight, bias)
    bound = admission_bound(x, weight, reference)
    off = reference.clone()
    off[0, 3] = (off[0, 3].double() + 1.5 * bound).to(dtype)
    assert not admitted(off, reference, bound, exact=False)
    near = reference.clone()
    near[0, 3] = torch.nextafter(near[0, 3].float(), torch.tensor(float("inf"))).to(dtype)
    if not torch.equal(near, reference):
        assert admitted(near, reference, bound, exact=False)
        assert not admitted(near, reference, bound, exact=True)
    assert admitted(reference.clone(), reference, bound, exact=True)
    nan = reference.clone()
    nan[0, 0] = float("nan")
    assert not admitted(nan, reference, bound, exact=False)


def _wrong(input, weight, bias):
    out = F.linear(input, weight, bias)
    return out + out.abs().max() * 0.1


def _one_ulp_off(input, weight, bias):
    out = F.linear(input, weight, bias)
    return torch.nextafter(out, torch.full_like(out, float("inf")))


def test_a_wrong_candidate_is_never_taken_however_fast(fake_times):
    fake_times(choice, lambda ways: [1.0] + [1e-9] * (ways - 1))
    weight, bias = _layer(96, 64, torch.float32)
    x = torch.randn(1, 64, generator=GEN)
    wrong = Candidate("wrong", _wrong, kernels._always)
    assert choice.choose(x, weight, bias, exact=False, candidates=(LINEAR, wrong)) is LINEAR
    off = Candidate("off", _one_ulp_off, kernels._always)
    assert choice.choose(x, weight, bias, exact=True, candidates=(LINEAR, off)) is LINEAR
    assert choice.choose(x, weight, bias, exact=False, candidates=(LINEAR, off)) is off


def test_a_kept_candidate_other_than_f_linear_must_be_admitted_too(fake_times):
    fake_times(choice, lambda ways: [1.0] + [1e-9] * (ways - 1))  # every way after the kept one measures fastest
    weight, bias = _layer(96, 64, torch.float32)
    x = torch.randn(1, 64, generator=GEN)
    wrong = Candidate("wrong", _wrong, kernels._always)
    off = Candidate("off", _one_ulp_off, kernels._always)
    mv = kernels.CANDIDATES[1]
    assert choice.choose(x, weight, bias, exact=False, candidates=(wrong,), keep=wrong) is LINEAR
    assert choice.choose(x, weight, bias, exact=False, candidates=(wrong, off), keep=wrong) is off
    assert choice.choose(x, weight, bias, exact=False, candidates=(off, mv), keep=off) is mv
    fake_times(choice, lambda ways: [1.0, 0.99])  # a tie keeps the kept one
    assert choice.choose(x, weight, bias, exact=False, candidates=(off, mv), keep=off) is off


def test_the_fastest_admitted_candidate_is_kept_per_kind(fake_times):
    mv = kernels.CANDIDATES[1]
    fake_times(choice, original_slowest)
    weight, bias = _layer(96, 64, torch.float32)
    x = torch.randn(1, 1, 64, generator=GEN)
    with torch.no_grad():
        got = choice.linear(x, weight, bias)
    assert choice.decisions() == {("cpu", torch.float32, (96, 64), (64, 1), True, 1, False, "torch"): "mv"}
    reference = F.linear(x, weight, bias)
    assert got.shape == reference.shape and admitted(got, reference, admission_bound(x, weight, reference), False)
    # a tie (within 2%) keeps F.linear
    choice.clear_decisions()
    fake_times(choice, lambda ways: [1.0, 0.99])
    assert choice.choose(x, weight, bias, exact=False, candidates=(LINEAR, mv)) is LINEAR


def test_the_original_kernel_runs_for_prefill_training_and_other_tensors():
    weight, bias = _layer(96, 64, torch.float32)
    one = torch.randn(1, 64)
    assert not choice.runs_original(one, weight, bias)
    assert not choice.runs_original(torch.randn(2, 2, 64), weight, None)
    assert choice.runs_original(torch.randn(1, choice.MAX_ROWS + 1, 64), weight, bias)  # prefill
    trained = weight.clone().requires_grad_()
    assert choice.runs_original(one, trained, bias)  # autograd
    with torch.no_grad():
        assert not choice.runs_original(one, trained, bias)  # the same layer at inference
    assert choice.runs_original(one.requires_grad_(), weight, bias)
    assert choice.runs_original(torch.randn(1, 64, dtype=torch.float64), weight, bias)  # a dtype mix
    assert choice.runs_original(torch.randn(1, 64, device="meta"), weight.to("meta"), None)
    assert choice.runs_original(one.detach(), weight, bias.to(torch.bfloat16))


def test_a_training_step_measures_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured under autograd")

    monkeypatch.setattr(choice, "choose", refuse)
    weight, bias = _layer(96, 64, torch.float32)
    weight.requires_grad_()
    x = torch.randn(1, 64)
    choice.linear(x, weight, bias).sum().backward()
    expected = weight.detach().clone().requires_grad_()
    F.linear(x, expected, bias).sum().backward()
    assert torch.equal(weight.grad, expected.grad)


def test_a_quantizers_weight_is_another_kind_than_a_dense_one():
    """A tensor subclass (a quantizer's int8 weight) of the same shape, dtype and strides as a dense weight is filed
    under another kind: a kernel chosen for the dense weight (torch.mv) is never run on it."""

    class Quantized(torch.Tensor):
        pass

    weight = torch.randn(8, 4)
    x = torch.randn(1, 1, 4)
    dense, subclass = choice.kind_of(x, weight, None, False), choice.kind_of(x, weight.as_subclass(Quantized), None,
                                                                               False)
    assert dense[-1] == "torch" and dense != subclass and subclass[-1].endswith("Quantized")


def _caller_counting_kinds(fake_times, monkeypatch):
    """A caller, a layer and a one-row input, with ``mv`` measured fastest and every kind worked out from here on
    recorded."""
    fake_times(choice, original_slowest)
    kinds: list[object] = []
    real = choice.kind_of
    monkeypatch.setattr(choice, "kind_of", lambda *args: kinds.append(real(*args)) or kinds[-1])
    weight, bias = _layer(96, 64, torch.float32)
    return kinds, choice.Caller(), weight, bias, torch.randn(1, 1, 64, generator=GEN)


def test_a_caller_runs_its_last_kind_again_without_working_it_out(fake_times, monkeypatch):
    kinds, caller, weight, bias, x = _caller_counting_kinds(fake_times, monkeypatch)
    with torch.no_grad():
        outputs = [caller(x, weight, bias) for _ in range(3)]
    assert len(kinds) == 1 and choice.decisions() == {kinds[0]: "mv"}
    expected = kernels.CANDIDATES[1].run(x, weight, bias)
    assert all(torch.equal(out, expected) for out in outputs)


def test_a_caller_works_the_kind_out_again_when_anything_it_reads_changes(fake_times, monkeypatch):
    kinds, caller, weight, bias, x = _caller_counting_kinds(fake_times, monkeypatch)
    with torch.no_grad():
        caller(x, weight, bias)
        calls = [
            lambda: caller(torch.randn(1, 2, 64), weight, bias),  # another row count
            lambda: caller(x, weight, None),  # another bias
            lambda: caller(x, weight.clone(), bias),  # another weight object
        ]
        for call in calls:
            before = len(kinds)
            call()
            assert len(kinds) == before + 1
        # the same weight object, its data replaced (``param.data = ...``, what module.to(dtype) does)
        caller(x, weight, bias)  # remembered: this weight, torch.mv
        weight.data = weight.data.double()
        before, mv, vectors = len(kinds), torch.mv, []
        monkeypatch.setattr(torch, "mv", lambda *args: vectors.append(args) or mv(*args))
        with pytest.raises(RuntimeError) as got:  # the dtype mix: F.linear raises, as it would for plain
            caller(x, weight, bias)
        with pytest.raises(RuntimeError) as want:
            F.linear(x, weight, bias)
        assert str(got.value) == str(want.value) and not vectors and len(kinds) == before
        monkeypatch.setattr(torch, "mv", mv)
        weight.data = weight.data.float().t().contiguous().t()  # other strides
        caller(x, weight, bias)
        assert kinds[-1][3] == (1, 96)
    choice.clear_decisions()  # forgetting the decisions forgets what the caller remembers
    weight, bias = _layer(96, 64, torch.float32)
    with torch.no_grad():
        caller(x, weight, bias)
        before = len(kinds)
        choice.clear_decisions()
        caller(x, weight, bias)
    assert len(kinds) == before + 1 and choice.decisions()


def test_a_caller_under_autograd_runs_the_original_and_keeps_no_weight_alive(fake_times, monkeypatch):
    _, caller, weight, bias, x = _caller_counting_kinds(fake_times, monkeypatch)
    with torch.no_grad():
        caller(x, weight, bias)
    trained = weight.requires_grad_()
    caller(x, trained, bias).sum().backward()  # the same weight, now trained: F.linear with autograd
    expected = weight.detach().clone().requires_grad_()
    F.linear(x, expected, bias).sum().backward()
    assert torch.equal(trained.grad, expected.grad)
    held = weakref.ref(weight)
    del weight, trained
    gc.collect()
    assert held() is None
    copied = copy.deepcopy(caller), pickle.loads(pickle.dumps(caller))
    assert all(c._last is None and c.exact is caller.exact for c in copied)


def _aten_ops(call) -> tuple[torch.Tensor, set[str]]:
    """``call()``'s output and the names of the operators it ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = call()
    return out, {event.name for event in prof.events()}


def test_a_slice_of_the_last_position_runs_as_the_rows_decode_runs(fake_times):
    """``hidden[:, -1:, :]``, what transformers hands the LM head at prefill, keeps the whole sequence's strides, and
    on a weight that does not require grad (as here, and as the copies a measurement times) torch's ``F.linear`` runs
    it as a batched GEMM over a transposed copy of the whole weight (80x slower for a 128256x2048 bfloat16 head).
    Within the bound the layer runs the slice's rows, measured as the kind decode runs; exact mode runs ``F.linear``
    on it as it is and measures nothing there."""
    fake_times(choice, lambda ways: [1e-9] + [1.0] * (ways - 1))  # F.linear measured fastest
    weight, _ = _layer(96, 64, torch.bfloat16, bias=False)
    sliced = torch.randn(1, 5, 64, generator=GEN).to(torch.bfloat16)[:, -1:, :]
    decode = torch.empty(1, 1, 64, dtype=torch.bfloat16).copy_(sliced)
    assert not choice.folds(sliced) and choice.folds(decode) and sliced.is_contiguous()
    reference = F.linear(sliced, weight)
    with torch.no_grad():
        caller = choice.Caller()
        for _ in range(2):  # the first call chooses, the second runs what the caller remembers
            got, ops = _aten_ops(lambda: caller(sliced, weight, None))
            assert "aten::bmm" not in ops and "aten::mm" in ops
            assert got.shape == reference.shape and torch.equal(got, reference)
        assert list(choice.decisions().values()) == ["linear"]
        assert torch.equal(choice.linear(decode, weight, None), reference) and len(choice.decisions()) == 1
        choice.clear_decisions()
        exact, ops = _aten_ops(lambda: choice.Caller(exact=True)(sliced, weight, None))
        assert torch.equal(exact, reference) and not choice.decisions()
        batch = torch.randn(2, 5, 64, generator=GEN).to(torch.bfloat16)[:, -1:, :]  # not contiguous: rows copied
        got = choice.linear(batch, weight, None)
        want = F.linear(batch, weight)
        assert got.shape == want.shape and admitted(got, want, admission_bound(batch, weight, want), exact=False)


def test_a_decision_is_stored_per_build_of_the_gemv_kernel():
    """Which way is fastest depends on the kernel's code (the even/odd split made row-dot, not blocked-rows, the
    faster at 896-wide rows on an AVX2 CPU): no table whose measurements run the kernel reuses a decision an earlier
    build's timings took."""
    from fusion_linear_kernels import experts, packed_experts, packing, step_blocks

    for table in (choice._DECISIONS, step_blocks._DECISIONS, experts._DECISIONS, packed_experts._DECISIONS,
                  packing._DECISIONS):
        assert table.code == row_dot.CODE_DIGEST, table.topic
