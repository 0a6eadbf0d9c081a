"""A replaced clock for measured decisions, so that no clock decides a test.

Every measured decision (:class:`fusion_core.plugin.Decisions`) times its ways through one seam,
``Decisions.times``. :func:`fake_clock` replaces it, per topic, by a function of the number of
ways: a family's tests (and the zoo census) can then make the alternative win, or the original, on any
machine. By convention every decision lists the original way first (``F.linear``, the dense weight,
transformers' own implementation), so :func:`original_slowest` makes every alternative win and
:func:`original_fastest` keeps the original.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fusion_core.decisions import Decisions

Times = Callable[[int], list[float]]
"""What a replaced clock reports for a number of ways (seconds, one per way)."""


def original_slowest(ways: int) -> list[float]:
    """The original way (listed first) slowest, every alternative equally fast."""
    return [1.0] + [0.5] * (ways - 1)


def original_fastest(ways: int) -> list[float]:
    """The original way (listed first) fastest."""
    return [0.5] + [1.0] * (ways - 1)


def fake_clock(fakes: Mapping[str, Times]) -> Callable[[Decisions[Any, Any], Sequence[Any], torch.device], list[float]]:
    """A replacement for ``Decisions.times`` (set it with ``monkeypatch.setattr(Decisions, "times", ...)``): a
    decision whose topic is a key of ``fakes``, or starts with a key and a dot, is timed by that fake, without
    running its ways; every other keeps the clock that was in place. ``fakes`` is read at each timing, so a test
    may add topics later."""
    clock = Decisions.times

    def times(table: Decisions[Any, Any], ways: Sequence[Any], device: torch.device) -> list[float]:
        fake = next((fakes[key] for key in fakes if table.topic == key or table.topic.startswith(key + ".")), None)
        return clock(table, ways, device) if fake is None else fake(len(ways))

    return times
