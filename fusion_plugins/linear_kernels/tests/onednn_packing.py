"""Whether this CPU's oneDNN packs linear weights of a dtype, for the tests that need a weight packed.

oneDNN's bfloat16 and float16 repacks need AVX-512 (bw, vl and dq) or AVX-NE-CONVERT; on a CPU with AVX2 alone
they raise, and the family keeps every weight of that dtype dense (``test_where_plain_runs`` checks that on every
machine, with the repack made to raise). float32 packs on any x86 CPU torch runs on.
"""

from __future__ import annotations

import functools

import pytest
import torch
from fusion_linear_kernels import compat


@functools.cache
def refusal(dtype: torch.dtype) -> str | None:
    """Why oneDNN does not pack a ``dtype`` weight here (its error's first line), or None where it does."""
    if not compat.available():
        return "this torch build has no oneDNN prepacked linear"
    try:
        compat.pack(torch.zeros(64, 32, dtype=dtype))
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def needs_packing(dtype: torch.dtype) -> pytest.MarkDecorator:
    """A mark skipping the test where oneDNN does not pack ``dtype`` on this CPU, with oneDNN's reason."""
    reason = refusal(dtype)
    return pytest.mark.skipif(reason is not None, reason=f"oneDNN does not pack {dtype} on this CPU: {reason}")


BF16_PACKS = needs_packing(torch.bfloat16)
"""The mark of the tests that need a bfloat16 weight packed."""
