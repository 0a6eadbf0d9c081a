"""The process's random generators, left where the user put them by everything fusion-core adds to a load.

Users seed once, then load and build what they train: ``torch.manual_seed(3)``, a load, then a LoRA adapter
initialised from that generator. A fused load that draws where a plain load does not (a plugin's check on sample
tensors, a timing on random inputs, a rehearsal of a transform) gives the adapter other weights than on the plain
model, and the two runs no longer compare. A family's author cannot be expected to know which of their calls draw, so
the core keeps the generators itself:

- what a fused load runs before transformers' ``from_pretrained`` (the plugins' import and checks, discovery, the
  ``fusion_load_planned`` hooks) runs from a :class:`RandomState` taken first and put back before transformers loads;
- the conversion after it (the ``fusion_convert_loaded`` hooks and every family's transforms and finalisers, in a load
  and in :func:`fusion_core.fuse`) runs inside :func:`kept_random_state`.

transformers' own load runs between the two on the state the user left, and advances it as a plain load does (it draws
to initialise a weight the checkpoint lacks; the modules it builds, a family's fused classes among them, draw what
their constructors draw). The generators kept are torch's CPU generator, each CUDA device's where CUDA is already
initialised (taking them would initialise it), and Python's ``random``. A fused class whose constructor or forward
draws where the original does not is the family's to avoid: the conformance kit's load check
(:func:`fusion_core.testing.kit.assert_fused_load`) compares the generators after a plain and a fused load and after
their first forward.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["RandomState", "kept_random_state"]


class RandomState:
    """The process's generators as they were when :meth:`taken`: :meth:`restore` puts them back."""

    __slots__ = ("_cpu", "_cuda", "_python")

    def __init__(self, python: Any, cpu: torch.Tensor, cuda: list[torch.Tensor] | None) -> None:
        self._python, self._cpu, self._cuda = python, cpu, cuda

    @classmethod
    def taken(cls) -> RandomState:
        """The generators now."""
        initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all() if initialised else None
        return cls(random.getstate(), torch.random.get_rng_state(), cuda)

    def restore(self) -> None:
        """Put every generator back where it was when taken."""
        random.setstate(self._python)
        torch.random.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)


@contextmanager
def kept_random_state() -> Iterator[None]:
    """Run the block with the generators put back afterwards, where it raises too."""
    state = RandomState.taken()
    try:
        yield
    finally:
        state.restore()
