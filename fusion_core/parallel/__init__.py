"""Fused models under transformers' tensor parallelism, DDP and FSDP2 (see ``docs/distributed.md``).

- :mod:`~fusion_core.parallel.rules`: how a family declares that its fused tensors shard
  (``tensor_parallel = PackedColwise(...)`` on the family class), and :func:`check_tensor_parallel_rule`
  for the conformance kit;
- :mod:`~fusion_core.parallel.tensor_parallel`: the load step that turns each rank's shards of the
  original tensors into its shard of the fused tensors;
- :mod:`~fusion_core.parallel.saving`: gathered, single-writer saves from a process group.
"""

from __future__ import annotations

from typing import Any

from fusion_core.parallel.rules import (
    PackedColwise,
    Replicated,
    ShardedModule,
    TensorParallelRefusal,
    TensorParallelRule,
)

__all__ = [
    "PackedColwise", "Replicated", "ShardedModule", "TensorParallelRefusal", "TensorParallelRule",
    "check_tensor_parallel_rule",
]


def check_tensor_parallel_rule(spec: Any, config: Any = None, options: Any = None) -> TensorParallelRule | None:
    """Check a family's ``tensor_parallel`` declaration against its transforms; return the rule.

    None when the family declares nothing (its fused modules then run unsharded, and a plan that
    shards their original tensors is refused at load). Raises ``AssertionError`` for a rule that
    is not a :class:`TensorParallelRule` or contradicts the family's transforms.
    """
    rule = getattr(spec, "tensor_parallel", None)
    if rule is None:
        return None
    assert isinstance(rule, TensorParallelRule), (
        f"family {spec.name!r}: tensor_parallel must be a fusion_core.parallel.TensorParallelRule, got {rule!r}"
    )
    if options is None:
        options = spec.options_model()
    rule.check(tuple(spec.make_transforms(config, options)))
    return rule
