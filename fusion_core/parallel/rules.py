"""How a family declares that its fused tensors shard under a transformers tensor-parallel plan.

transformers' tensor-parallel plans are keyed by module name (``model.layers.*.self_attn.q_proj:
colwise``) and applied while the *original* modules are loaded, so a fused module first receives
each rank's shards of its original tensors. A family declares, as its ``tensor_parallel`` member
(:attr:`fusion_core.ModuleFusionSpec.tensor_parallel`), a :class:`TensorParallelRule` saying how
its fused tensors are built from those shards:

- :class:`PackedColwise` (``qkv``, ``gate_up``): the fused container concatenates colwise
  projections along their rows. When every projection is planned ``colwise``, each rank's
  merged weight is ``[q_r; k_r; v_r]``: its own rows of every part (grouped-query shapes
  included), which is exactly what the unfused model runs on that rank. When every projection
  gathers its output (``colwise_gather_output`` on 5.x, ``colwise_rep`` on 4.57: OLMo-2 style
  plans), the rows are the same and each part's output is gathered to its full width.
- :class:`Replicated` (``patch_embeddings``, and every family that declares nothing): the fused
  module runs unsharded; a plan entry on any of its tensors is refused.

These are declarations only: the core never shards anything. The tensor-parallel integration
(the ``fusion-tensor-parallel`` distribution) executes them at load, and refuses, naming the
family and module, any combination it cannot shard exactly. :meth:`TensorParallelRule.check` lets
the conformance kit hold a declaration against the family's transforms without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from fusion_core.transforms import Concat

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """A DTensor (never, where torch.distributed is not available: nothing can be sharded then)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


class TensorParallelRule(ABC):
    """How a family's fused tensors shard; set an instance as the family's ``tensor_parallel``."""

    @abstractmethod
    def check(self, transforms: tuple[Any, ...]) -> None:
        """Raise ``AssertionError`` when the family's transforms contradict the rule (conformance kit)."""


@dataclass(frozen=True)
class Replicated(TensorParallelRule):
    """The fused module runs unsharded (every rank holds all of it); refused when the plan shards it."""

    def check(self, transforms: tuple[Any, ...]) -> None:
        """Any transforms run unsharded."""


@dataclass(frozen=True)
class PackedColwise(TensorParallelRule):
    """``container`` concatenates ``projections`` (colwise ``nn.Linear`` s) along their rows.

    ``unit`` names an attribute of the fused module (``head_dim``) that every rank's rows of
    every projection must be a multiple of: a shard that splits an attention head is refused.
    """

    projections: tuple[str, ...]
    container: str
    unit: str | None = None

    def owns(self, sources: tuple[str, ...]) -> bool:
        """Whether a transform reading ``sources`` (module-relative names) merges this rule's projections."""
        return all(name.split(".", 1)[0] in self.projections for name in sources)

    def check(self, transforms: tuple[Any, ...]) -> None:
        owned = [t for t in transforms if self.owns(tuple(t.sources))]
        assert owned, f"PackedColwise{self.projections}: no transform reads the projections"
        for transform in owned:
            assert isinstance(transform.op, Concat) and transform.op.dim == 0, (
                f"PackedColwise needs Concat(dim=0) transforms (the rows of each projection in order), "
                f"not {transform.op!r}"
            )
            parts = [s.split(".", 1)[0] for s in transform.sources]
            assert tuple(parts) == self.projections, f"sources {transform.sources} are not {self.projections} in order"
            leaves = {s.split(".", 1)[1] for s in transform.sources}
            assert len(leaves) == 1 and leaves <= {"weight", "bias"}, f"sources {transform.sources}: weight or bias"
            assert transform.targets == (f"{self.container}.{leaves.pop()}",), (
                f"targets {transform.targets} are not in {self.container!r}"
            )
