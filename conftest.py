"""Settings for every test directory (tests/ and each plugin's tests/).

The test suite counts GEMMs (a merged projection must run one where the originals ran several),
so it pins the merge policy to ``"always"`` instead of the default ``"measure"``, whose choice on
a busy machine could go either way; subprocesses the tests start inherit it through the
environment. The tests of the policy itself set the policy they need.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

os.environ["FUSION_CORE_MERGE"] = "always"

from fusion_core.merge_policy import set_merge_policy

set_merge_policy("always")


@pytest.fixture(scope="session", autouse=True)
def _transformers_release(record_testsuite_property: Callable[[str, object], None]) -> None:
    """The release under test, in the JUnit report: scripts/test_summary.py names it per run."""
    import transformers

    record_testsuite_property("transformers", transformers.__version__)
