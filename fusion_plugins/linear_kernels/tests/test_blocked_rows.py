"""The blocked-rows GEMV: within the bound of F.linear on wide rows (row and width tails included) for one input row
and on rows of any width for two to eight (few-rows, one weight row at a time or four side by side), never tried in
exact mode, and a failed build leaves the other candidates (and a stored decision naming it runs F.linear)."""

from __future__ import annotations

import warnings

import pytest
import torch
from fusion_linear_kernels import blocked_rows, choice, compat, kernels, row_dot
from fusion_linear_kernels.kernels import Candidate
from fusion_linear_kernels.tolerance import admission_bound, admitted
from one_row_gemv import fresh_kernels_of, one_row_layer, skip_unless_built, without_a_compiler
from torch.nn import functional as F

from fusion_core.testing.decisions import original_slowest

pytestmark = pytest.mark.usefixtures("fake_times")
GEN = torch.Generator().manual_seed(0)
#: Over row_dot.MIN_BYTES in bfloat16; rows not a multiple of blocked_rows.ROWS, a width no vector width divides.
SHAPE = (row_dot.MIN_BYTES // 2 // 4100 + 3, 4100)


def _layer(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    return one_row_layer(SHAPE, dtype, bias, GEN)


@pytest.fixture
def buildable():
    skip_unless_built(lambda: row_dot.kernel(torch.bfloat16, False), "the GEMV kernel")


@pytest.fixture
def fresh_kernels():
    yield from fresh_kernels_of(row_dot)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", ["wide", "narrow"])
def test_the_blocked_rows_gemv_is_within_the_bound_of_f_linear(buildable, dtype, bias, shape):
    size = SHAPE if shape == "wide" else NARROW
    weight, b, x = one_row_layer(size, dtype, bias, GEN)
    assert size[0] % blocked_rows.ROWS and size[1] % 64  # the kernel's row and width tails run
    with torch.no_grad():
        assert blocked_rows.applies(x, weight, b)
        got = blocked_rows.run(x, weight, b)
    reference = F.linear(x, weight, b)
    assert got.shape == reference.shape and got.dtype == reference.dtype
    assert admitted(got, reference, admission_bound(x, weight, reference), exact=False)
    assert not admitted(got.flip(-1), reference, admission_bound(x, weight, reference), exact=False)  # the check bites


def test_it_applies_to_one_row_of_a_large_dense_weight_of_any_width(buildable):
    weight, _, x = _layer(torch.bfloat16, False)
    assert not blocked_rows.applies(torch.randn(1, 2, SHAPE[1]).to(torch.bfloat16), weight, None)  # two rows
    assert not blocked_rows.applies(x, weight[:8].contiguous(), None)  # served from the caches
    narrow = torch.randn(*NARROW, generator=GEN).to(torch.bfloat16)  # rows of 1000: measured against the others
    assert blocked_rows.applies(torch.randn(1, NARROW[1], generator=GEN).to(torch.bfloat16), narrow, None)
    assert not blocked_rows.applies(x.float(), weight, None)  # an input of another dtype
    assert not blocked_rows.applies(x, weight.t().contiguous().t(), None)  # not row-major


#: A narrow weight (rows of 1000 elements: a width tail for every vector width), the other row tail.
NARROW = (row_dot.MIN_BYTES // 2 // 1000 + 5, 1000)
FEW_ROWS = [kernels.FEW_ROWS, kernels.FEW_ROWS_BLOCKED]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [SHAPE, NARROW], ids=["wide", "narrow"])
@pytest.mark.parametrize("rows", [2, 3, 5, 8])
@pytest.mark.parametrize("candidate", FEW_ROWS, ids=lambda c: c.name)
def test_few_rows_are_within_the_bound_of_f_linear(buildable, dtype, bias, shape, rows, candidate):
    weight, b, _ = one_row_layer(shape, dtype, bias, GEN)
    x = torch.randn(rows, 1, shape[1], generator=GEN).to(dtype)  # a batch of `rows` sequences at one token each
    assert shape[0] % blocked_rows.FEW_ROWS_BLOCK  # the blocked candidate's row tail runs
    with torch.no_grad():
        assert candidate.applies(x, weight, b) and not blocked_rows.applies(x, weight, b)
        got = candidate.run(x, weight, b)
    reference = F.linear(x, weight, b)
    assert got.shape == reference.shape and got.dtype == reference.dtype
    bound = admission_bound(x, weight, reference)
    assert admitted(got, reference, bound, exact=False)
    assert not admitted(got.flip(0), reference, bound, exact=False)  # the check bites: rows swapped


#: The bfloat16 paths only some CPUs run (row_dot.source's switches), and C++ that only that path holds.
CPU_PATHS = {"paired": "_mm512_dpbf16_ps", "even_odd": "_mm256_slli_epi32"}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("path", sorted(CPU_PATHS))
def test_bfloat16_without_a_path_of_some_cpus_is_within_the_bound_too(buildable, bias, path):
    """Which bfloat16 path runs depends on the CPU: AVX512-BF16's paired dot products, AVX2's even and odd lanes (where
    there is no AVX512-BF16), else widening in order. Built here without one of those paths, the kernel stays within the
    bound at every block and row count, as the default build does (whichever path this CPU runs)."""
    without = row_dot.source(torch.bfloat16, bias, **{path: False})
    assert CPU_PATHS[path] not in without and CPU_PATHS[path] in row_dot.source(torch.bfloat16, bias)
    builds = (compat.cpp_kernel(row_dot.argument_types(torch.bfloat16, bias), without),
              row_dot.kernel(torch.bfloat16, bias))
    for shape in (SHAPE, NARROW):
        weight, b, _ = one_row_layer(shape, torch.bfloat16, bias, GEN)
        for inputs, block in row_dot.BUILT:
            x = torch.randn(inputs, shape[1], generator=GEN).to(torch.bfloat16)
            reference = F.linear(x, weight, b)
            bound = admission_bound(x, weight, reference)
            for built in builds:
                out = torch.empty(inputs, shape[0], dtype=torch.bfloat16)
                built(weight, x, *((b,) if bias else ()), out, *shape, inputs, block)
                assert admitted(out, reference, bound, exact=False), (shape, inputs, block)


def test_every_block_it_reads_is_one_the_kernel_is_built_for():
    """A pair the kernel lacks would run F.linear (row_dot.gemv's guard), silently losing the kernel."""
    used = {(1, 1), (1, blocked_rows.ROWS)} | {(inputs, block) for inputs in range(2, row_dot.MAX_INPUTS + 1)
                                                for block in (1, blocked_rows.FEW_ROWS_BLOCK)}
    assert used == set(row_dot.BUILT)
    assert row_dot.MAX_INPUTS == choice.MAX_ROWS  # every row count a layer chooses for has a kernel


def test_few_rows_apply_to_two_to_eight_rows_of_a_large_dense_weight(buildable):
    weight, _, _ = one_row_layer(NARROW, torch.bfloat16, False, GEN)
    most = row_dot.MAX_INPUTS
    rows = torch.randn(1, most + 1, NARROW[1]).to(torch.bfloat16)
    assert [blocked_rows.applies_to_few_rows(rows[:, :n], weight, None) for n in range(1, most + 2)] == [
        False] + [True] * (most - 1) + [False]
    assert not blocked_rows.applies_to_few_rows(rows[:, :2], weight[:8].contiguous(), None)  # served from the caches
    assert not blocked_rows.applies_to_few_rows(rows[:, :2].float(), weight, None)  # an input of another dtype
    assert not blocked_rows.applies_to_few_rows(rows[:, :2], weight, torch.zeros(NARROW[0]))  # a bias of another
    with torch.no_grad():  # more rows than it takes, asked directly: F.linear, not a kernel it was not built for
        for candidate in FEW_ROWS:
            assert torch.equal(candidate.run(rows, weight, None), F.linear(rows, weight))


@pytest.mark.parametrize("candidate", FEW_ROWS, ids=lambda c: c.name)
def test_a_layer_runs_few_rows_where_it_measured_fastest_and_never_in_exact_mode(buildable, fake_times, candidate):
    weight, b, _ = one_row_layer(SHAPE, torch.bfloat16, True, GEN)
    x = torch.randn(2, 1, SHAPE[1], generator=GEN).to(torch.bfloat16)
    with torch.no_grad():
        taken = [c for c in kernels.CANDIDATES if c.applies(x, weight, b)]
        fake_times(choice, lambda ways: [0.1 if c is candidate else 1.0 for c in taken][:ways])
        assert choice.chosen(x, weight, b, exact=False) is candidate
        assert choice.chosen(x, weight, b, exact=True) not in FEW_ROWS
        got = choice.Caller()(x, weight, b)
    reference = F.linear(x, weight, b)
    assert got.shape == reference.shape and admitted(got, reference, admission_bound(x, weight, reference), False)


def test_within_the_bound_the_choice_measures_it_and_exact_mode_never_tries_it(buildable, fake_times, monkeypatch):
    fake_times(choice, lambda ways: [1.0] * (ways - 1) + [0.1])  # the last candidate measured fastest
    weight, _, x = _layer(torch.bfloat16, False)
    with torch.no_grad():
        assert choice.choose(x, weight, None, exact=False) is kernels.BLOCKED_ROWS
        tried = Candidate("blocked-rows", blocked_rows.run,
                          lambda *args: pytest.fail("blocked-rows tried in exact mode"), exact=False)
        monkeypatch.setattr(kernels, "CANDIDATES",
                            tuple(tried if c is kernels.BLOCKED_ROWS else c for c in kernels.CANDIDATES))
        assert choice.choose(x, weight, None, exact=True) is not tried


def test_a_failed_build_leaves_the_other_candidates_and_says_so_once(fresh_kernels, fake_times, monkeypatch):
    without_a_compiler(monkeypatch)
    fake_times(choice, original_slowest)
    weight, _, x = _layer(torch.bfloat16, False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert choice.choose(x, weight, None, exact=False) is not kernels.BLOCKED_ROWS
        assert not blocked_rows.applies(x.float(), weight.float(), None)  # another dtype: no second warning
        # a stored decision naming blocked-rows, on a machine where it cannot be built, runs F.linear
        assert torch.equal(kernels.BLOCKED_ROWS.run(x, weight, None), F.linear(x, weight))
    said = [w for w in caught if issubclass(w.category, row_dot.RowDotUnavailableWarning)
            and "GEMV kernel" in str(w.message)]
    assert len(said) == 1 and "no C++ compiler found" in str(said[0].message)


def test_reset_state_forgets_the_built_kernels(buildable, fresh_kernels):
    weight, _, x = _layer(torch.bfloat16, False)
    with torch.no_grad():
        blocked_rows.run(x, weight, None)
    assert len(row_dot._KERNELS)  # fresh_kernels checks they are gone after fusion_core.reset_state()


def test_its_calls_are_labelled_for_the_profiler(buildable):
    """No operator of torch's runs it: the profiler sees its calls only by their label (what decode_split groups)."""
    weight, _, x = _layer(torch.bfloat16, False)
    with torch.no_grad(), torch.profiler.profile() as recorded:
        blocked_rows.run(x, weight, None)
    assert f"{row_dot.PROFILER_LABEL} {SHAPE[0]}x{SHAPE[1]}" in [event.name for event in recorded.events()]
