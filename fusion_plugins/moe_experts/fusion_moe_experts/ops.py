"""The transform ops of the family: the shipped ``Stack`` and ``Concat`` composed.

``[gate_0 .. gate_{E-1}, up_0 .. up_{E-1}]`` (each ``[I, H]``) -> one ``[E, 2I, H]`` tensor whose
expert ``e`` holds ``[gate_e; up_e]``: the gate experts stacked, the up experts stacked, and the two
stacks concatenated along the rows (:class:`StackPairs`). The down projections need only the stack
(:class:`StackExperts`).

:class:`StackExperts` is the shipped ``Stack`` with one addition to its inverse, for FSDP2:
``fully_shard`` shards the stacked ``[E, ...]`` parameter along dim 0, the experts, and the
shipped inverse (``unbind`` along that same dim) is refused by DTensor ("Attempted to unbind along
the sharded dimension 0"). There the stack is first redistributed to shard the next dimension (an
all-to-all; ``Replicate`` for a 1-D stack), so each expert's tensor comes out as a ``Shard(0)``
DTensor of its original shape: what ``fully_shard`` makes of the unfused model's per-expert
parameters. Plain tensors take the shipped path unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusion_core import Concat, Stack, TransformOp
from fusion_core.plugin import Shape


def _unshard_dim(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """A DTensor sharded along ``dim`` redistributed to shard ``dim + 1`` instead (``Replicate`` when there
    is none); any other tensor as it is."""
    from fusion_core.plugin import is_dtensor

    if not is_dtensor(tensor) or not any(p.is_shard(dim) for p in tensor.placements):
        return tensor
    from torch.distributed.tensor import Replicate, Shard

    moved = Shard(dim + 1) if tensor.ndim > dim + 1 else Replicate()
    return tensor.redistribute(placements=[moved if p.is_shard(dim) else p for p in tensor.placements])


@dataclass(frozen=True)
class StackExperts(Stack):
    """``Stack(n)`` whose inverse also takes a stack that FSDP2 sharded along the stacked dimension."""

    def inverse(self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]) -> tuple[torch.Tensor, ...]:
        return super().inverse([_unshard_dim(tensors[0], self.dim)], source_shapes)


@dataclass(frozen=True)
class StackPairs(TransformOp):
    """``2n`` sources (n gates, then n ups) -> ``Concat(2, dim=1)`` of ``StackExperts(n)`` of each half."""

    n: int = 2

    def __post_init__(self) -> None:
        Stack(self.n)  # the same check Stack makes (n >= 1)

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (2 * self.n, 1)

    @property
    def _stack(self) -> Stack:
        return StackExperts(self.n, dim=0)

    _concat = Concat(2, dim=1)

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        if len(shapes) != 2 * self.n:
            raise ValueError(f"StackPairs(n={self.n}) takes {2 * self.n} tensors, got {len(shapes)}")
        halves = [self._stack.forward_shapes(shapes[: self.n])[0], self._stack.forward_shapes(shapes[self.n :])[0]]
        return self._concat.forward_shapes(halves)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        halves = [self._stack.forward(tensors[: self.n])[0], self._stack.forward(tensors[self.n :])[0]]
        return self._concat.forward(halves)

    def flat_offsets(self, shapes: Sequence[Shape]) -> tuple[int, ...] | None:
        # Expert e's block of the target is [gate_e; up_e]: gate_e at the block's start, up_e after it.
        size = math.prod(shapes[0])
        return tuple(2 * e * size for e in range(self.n)) + tuple((2 * e + 1) * size for e in range(self.n))

    def inverse(self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]) -> tuple[torch.Tensor, ...]:
        halves = [self._stack.forward_shapes(source_shapes[: self.n])[0],
                  self._stack.forward_shapes(source_shapes[self.n :])[0]]
        gates, ups = self._concat.inverse(tensors, halves)
        return (*self._stack.inverse([gates], source_shapes[: self.n]),
                *self._stack.inverse([ups], source_shapes[self.n :]))
