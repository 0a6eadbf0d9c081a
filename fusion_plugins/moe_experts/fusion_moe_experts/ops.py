"""The one transform op of the family: the shipped ``Stack`` and ``Concat`` composed.

``[gate_0 .. gate_{E-1}, up_0 .. up_{E-1}]`` (each ``[I, H]``) -> one ``[E, 2I, H]`` tensor whose
expert ``e`` holds ``[gate_e; up_e]``: the gate experts stacked, the up experts stacked, and the two
stacks concatenated along the rows. The down projections need only ``Stack`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusion_core import Concat, Stack, TransformOp
from fusion_core.transforms import Shape


@dataclass(frozen=True)
class StackPairs(TransformOp):
    """``2n`` sources (n gates, then n ups) -> ``Concat(2, dim=1)`` of ``Stack(n)`` of each half."""

    n: int = 2

    def __post_init__(self) -> None:
        Stack(self.n)  # the same check Stack makes (n >= 1)

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (2 * self.n, 1)

    @property
    def _stack(self) -> Stack:
        return Stack(self.n, dim=0)

    _concat = Concat(2, dim=1)

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        if len(shapes) != 2 * self.n:
            raise ValueError(f"StackPairs(n={self.n}) takes {2 * self.n} tensors, got {len(shapes)}")
        halves = [self._stack.forward_shapes(shapes[: self.n])[0], self._stack.forward_shapes(shapes[self.n :])[0]]
        return self._concat.forward_shapes(halves)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        halves = [self._stack.forward(tensors[: self.n])[0], self._stack.forward(tensors[self.n :])[0]]
        return self._concat.forward(halves)

    def inverse(self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]) -> tuple[torch.Tensor, ...]:
        halves = [self._stack.forward_shapes(source_shapes[: self.n])[0],
                  self._stack.forward_shapes(source_shapes[self.n :])[0]]
        gates, ups = self._concat.inverse(tensors, halves)
        return (*self._stack.inverse([gates], source_shapes[: self.n]),
                *self._stack.inverse([ups], source_shapes[self.n :]))
