"""The row-dot candidate of the GEMV kernel built here: within the bound of F.linear, never tried in exact mode, and a
failed build leaves the other candidates (and a stored decision naming it runs F.linear)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from fusion_linear_kernels import choice, kernels, row_dot
from fusion_linear_kernels.kernels import Candidate
from fusion_linear_kernels.tolerance import admission_bound, admitted
from one_row_gemv import fresh_kernels_of, one_row_layer, skip_unless_built, without_a_compiler
from torch.nn import functional as F

from fusion_core.testing.decisions import original_slowest

pytestmark = pytest.mark.usefixtures("fake_times")
GEN = torch.Generator().manual_seed(0)
#: A weight just over row_dot.MIN_BYTES in bfloat16, 1000 wide (a width no vector width divides).
SHAPE = (row_dot.MIN_BYTES // 2 // 1000 + 3, 1000)


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
def test_the_row_dot_gemv_is_within_the_bound_of_f_linear(buildable, dtype, bias):
    weight, b, x = _layer(dtype, bias)
    with torch.no_grad():
        assert row_dot.applies(x, weight, b)
        got = row_dot.run(x, weight, b)
    reference = F.linear(x, weight, b)
    assert got.shape == reference.shape and got.dtype == reference.dtype
    assert admitted(got, reference, admission_bound(x, weight, reference), exact=False)
    assert not admitted(got.flip(-1), reference, admission_bound(x, weight, reference), exact=False)  # it bites


def test_it_applies_to_one_row_of_a_large_dense_weight_only(buildable):
    weight, _, x = _layer(torch.bfloat16, False)
    assert not row_dot.applies(torch.randn(1, 2, SHAPE[1]).to(torch.bfloat16), weight, None)  # two rows
    small = weight[:8].contiguous()  # served from the caches: F.linear
    assert not row_dot.applies(x, small, None)
    assert not row_dot.applies(x, weight.t().contiguous().t(), None)  # not row-major
    assert not row_dot.applies(x.double(), weight.double(), None)
    assert not row_dot.applies(x.float(), weight, None)  # an input of another dtype


def test_within_the_bound_the_choice_measures_it_and_exact_mode_never_tries_it(buildable, fake_times, monkeypatch):
    fake_times(choice, lambda ways: [1.0] * (ways - 1) + [0.1])  # the last candidate measured fastest: row-dot ...
    monkeypatch.setattr(kernels, "CANDIDATES", tuple(c for c in kernels.CANDIDATES if c is not kernels.BLOCKED_ROWS))
    weight, _, x = _layer(torch.bfloat16, False)  # ... once blocked-rows, which applies at every width, is left out
    with torch.no_grad():
        assert choice.choose(x, weight, None, exact=False) is kernels.ROW_DOT
        tried = Candidate("row-dot", row_dot.run, lambda *args: pytest.fail("row-dot tried in exact mode"),
                          exact=False)
        monkeypatch.setattr(kernels, "CANDIDATES",
                            tuple(tried if c is kernels.ROW_DOT else c for c in kernels.CANDIDATES))
        assert choice.choose(x, weight, None, exact=True) is not tried


def test_a_failed_build_leaves_the_other_candidates_and_says_so_once(fresh_kernels, fake_times, monkeypatch):
    without_a_compiler(monkeypatch)
    fake_times(choice, original_slowest)
    weight, _, x = _layer(torch.bfloat16, False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert choice.choose(x, weight, None, exact=False) is not kernels.ROW_DOT
        assert not row_dot.applies(x.float(), weight.float(), None)  # another dtype: no second warning
        # a stored decision naming row-dot, on a machine where it cannot be built, runs F.linear
        assert torch.equal(kernels.ROW_DOT.run(x, weight, None), F.linear(x, weight))
    said = [w for w in caught if issubclass(w.category, row_dot.RowDotUnavailableWarning)]
    assert len(said) == 1 and "no C++ compiler found" in str(said[0].message)


_LATER_PROCESS = """
import json, sys, torch
from torch.nn import functional as F
from fusion_linear_kernels import row_dot
weight, x = torch.randn(4096, 512).to(torch.bfloat16), torch.randn(3, 512).to(torch.bfloat16)
got, reference = row_dot.gemv(x, weight, None, 4).float(), F.linear(x, weight).float()
print(json.dumps({"inductor": "torch._inductor.codecache" in sys.modules,
                  "error": float((got - reference).abs().max()), "scale": float(reference.abs().max())}))
"""


def test_a_later_process_loads_the_built_kernel_from_its_file_without_inductor(buildable, tmp_path):
    """The first process builds through Inductor's toolchain and stores the file per machine; the next loads that
    file directly (Inductor's import and lookup took about 2.5 s of a first ``generate``)."""
    env = {**os.environ, "FUSION_CORE_CACHE_DIR": str(tmp_path), "FUSION_CORE_DECISIONS": "stored"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _LATER_PROCESS], env=env, check=True, text=True,
                                      capture_output=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["inductor"] and not runs[1]["inductor"]
    assert all(run["error"] <= 0.02 * run["scale"] for run in runs), runs  # the kernel ran: F.linear's output
    assert "linear_kernels.gemv_library" in (tmp_path / "decisions.json").read_text()


def test_a_stored_library_that_is_gone_or_does_not_load_is_built_again(buildable, fresh_kernels, tmp_path):
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a library")
    assert row_dot._existing(str(tmp_path / "gone.so")) is None and row_dot._existing(str(broken)) == str(broken)
    digest = hashlib.sha256(row_dot.source(torch.bfloat16, False).encode()).hexdigest()
    row_dot._LIBRARIES[(str(torch.bfloat16), digest)] = str(broken)  # as if a process had stored it
    weight, _, x = _layer(torch.bfloat16, False)
    with torch.no_grad():
        assert row_dot.applies(x, weight, None)  # built again, not left without a kernel
        got = row_dot.run(x, weight, None)
    reference = F.linear(x, weight)
    assert admitted(got, reference, admission_bound(x, weight, reference), exact=False)


def test_a_long_row_is_within_the_bound(buildable):
    weight = (torch.randn(160, 8192, generator=GEN) / 90).to(torch.bfloat16)
    x = torch.randn(1, 8192, generator=GEN).to(torch.bfloat16)
    with torch.no_grad():
        assert row_dot.applies(x, weight, None)
        got = row_dot.run(x, weight, None)
    reference = F.linear(x, weight)
    assert admitted(got, reference, admission_bound(x, weight, reference), exact=False)
