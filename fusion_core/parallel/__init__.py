"""What the core knows of process groups (see ``docs/distributed.md``).

- :mod:`~fusion_core.parallel.rules`: how a family declares that its fused tensors shard
  (``tensor_parallel = PackedColwise(...)`` on the family class), and :func:`check_tensor_parallel_rule`
  for the conformance kit; the tensor-parallel integration (``fusion-tensor-parallel``) executes
  the declarations at load;
- :mod:`~fusion_core.parallel.saving`: gathered, single-writer saves from a process group (DDP,
  FSDP2, tensor parallelism alike).
"""

from __future__ import annotations

from typing import Any

from fusion_core.parallel.rules import PackedColwise, Replicated, TensorParallelRule, is_dtensor
from fusion_core.spec import spec_member

__all__ = ["PackedColwise", "Replicated", "TensorParallelRule", "check_tensor_parallel_rule", "is_dtensor"]


def check_tensor_parallel_rule(spec: Any, config: Any = None, options: Any = None) -> TensorParallelRule | None:
    """Check a family's ``tensor_parallel`` declaration against its transforms; return the rule.

    None when the family declares nothing (its fused modules then run unsharded, and a plan that
    shards their original tensors is refused at load). Raises ``AssertionError`` for a rule that
    is not a :class:`TensorParallelRule` or contradicts the family's transforms.
    """
    rule = spec_member(spec, "tensor_parallel")
    if rule is None:
        return None
    assert isinstance(rule, TensorParallelRule), (
        f"family {spec.name!r}: tensor_parallel must be a fusion_core.parallel.TensorParallelRule, got {rule!r}"
    )
    if options is None:
        options = spec.options_model()
    rule.check(tuple(spec.make_transforms(config, options)))
    return rule
