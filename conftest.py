"""Settings for every test directory (tests/ and each plugin's tests/).

The test suite counts GEMMs (a merged projection must run one where the originals ran several),
so it pins the merge policy to ``"always"`` instead of the default ``"measure"``, whose choice on
a busy machine could go either way; subprocesses the tests start inherit it through the
environment. The tests of the policy itself set the policy they need.

Measured decisions time passes of 64 KiB (``FUSION_CORE_PASS_BYTES``), not of the machine's last-level cache.
Measured decisions are stored (``fusion_core.decisions``) in a directory of this session's, never in the
user's cache: ``FUSION_CORE_CACHE_DIR`` points there, for the subprocesses the tests start too, and so does
``XDG_CACHE_HOME``, for those started as a user runs them, without any ``FUSION_CORE_*`` variable.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

os.environ["FUSION_CORE_MERGE"] = "always"
os.environ["FUSION_CORE_CACHE_DIR"] = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fusion-core-test-cache-")
# transformers 5.25 requires the `kernels` package at a release the package registry does not serve;
# without it, hub kernels must be off or a plain from_pretrained raises (see scripts/_env.sh).
os.environ.setdefault("USE_HUB_KERNELS", "NO")
# Decisions time a pass over copies of a weight larger than this machine's last-level cache (up to ~0.5 GB per kind
# on some VMs; at most 4096 copies): the suite's tiny models time 64 KiB passes (16 copies of a 4 KiB weight, as
# before), in its subprocesses too; tests/test_decisions.py covers the default and 64 MiB passes.
os.environ["FUSION_CORE_PASS_BYTES"] = str(2**16)

from fusion_core.merge_policy import set_merge_policy

set_merge_policy("always")
atexit.register(shutil.rmtree, os.environ["FUSION_CORE_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _transformers_release(record_testsuite_property: Callable[[str, object], None]) -> None:
    """The release under test, in the JUnit report: scripts/test_summary.py names it per run."""
    import transformers

    record_testsuite_property("transformers", transformers.__version__)


@pytest.fixture(autouse=True)
def _transformers_load_patches_undone() -> Iterator[None]:
    """Undo what racing transformers loads can leave behind, after every test.

    transformers 5.x replaces ``PreTrainedModel.tie_weights`` / ``init_weights`` and torch's
    ``nn.init`` functions with no-ops for the duration of each load, process-wide and without a
    lock; plain loads racing in threads (tests/test_reliability_concurrency.py starts eight) can
    each save the other's no-op as "the original" and leave it installed. A later test's
    ``from_config`` then builds a model whose tied weights are not tied. fusion-core serializes its
    own loads (``LOAD_LOCK``); plain loads in threads are the user's, so the tests restore the state.
    """
    import torch
    from transformers import PreTrainedModel

    methods = {name: PreTrainedModel.__dict__[name] for name in ("tie_weights", "init_weights")}
    inits = dict(vars(torch.nn.init))
    yield
    for name, method in methods.items():
        setattr(PreTrainedModel, name, method)
    for name, function in inits.items():
        if vars(torch.nn.init).get(name) is not function:
            setattr(torch.nn.init, name, function)
