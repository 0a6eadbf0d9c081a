"""Executing the families' tensor-parallel declarations on the shards transformers loaded.

Each declaration of :class:`fusion_core.plugin.TensorParallelRule` has an execution here: :func:`localize`
checks the plan entries of a fused module's original tensors right after transformers loaded
them and, for a sharded module, replaces its sharded original tensors by this rank's local rows
and returns a :class:`ShardedModule` whose ``local_plan`` the fused layout is built from;
:func:`finish` then makes the fused module a sharded module of the model
(:mod:`fusion_tensor_parallel.sharded`). A combination a rule cannot shard exactly (a style other
than the ones it knows, parts planned differently, rows that do not split evenly or split a head)
raises :class:`TensorParallelRefusal` with the reason, and the load fails naming the family and
module. A rule of a kind this integration does not know is refused the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fusion_core import Concat, ModulePlan
from fusion_core.plugin import BoundTransform, LeafSpec, PackedColwise, Replicated, TensorParallelRule, is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

StyleLookup = Callable[[str], "str | None"]
"""Full parameter path (``model.layers.0.self_attn.q_proj.weight``) -> its plan style, or None."""


@dataclass(frozen=True)
class PlanStyles:
    """A model's tensor-parallel plan as a :data:`StyleLookup`, with the mesh transformers sharded it over.

    The mesh matters where transformers loads each rank's shard as a plain local tensor (5.1-5.15)
    rather than a DTensor that carries its mesh.
    """

    lookup: StyleLookup
    mesh: Any = None

    def __call__(self, name: str) -> str | None:
        return self.lookup(name)

COLWISE = "colwise"
GATHERED_COLWISE = frozenset({"colwise_gather_output", "colwise_rep"})
"""Colwise styles whose output is gathered to the full width on every rank (5.x and 4.57 names)."""


class TensorParallelRefusal(Exception):
    """A module cannot run exactly under the plan; the message is the reason."""


class UnevenRows(TensorParallelRefusal):
    """A part's rows do not split evenly over the ranks: transformers shards them unevenly, and a rank's merged
    rows would not be a regular shard of any merged tensor. The module runs unfused, as transformers sharded it."""


def leaf_tensor(module: nn.Module, leaf: str) -> torch.Tensor | None:
    """The parameter or buffer at module-relative ``leaf`` (``q_proj.weight``), or None."""
    owner: nn.Module | None = module
    path, _, name = leaf.rpartition(".")
    for part in path.split(".") if path else ():
        owner = owner._modules.get(part) if owner is not None else None
    if owner is None:
        return None
    tensor = owner._parameters.get(name)
    return tensor if tensor is not None else owner._buffers.get(name)


def set_leaf(module: nn.Module, leaf: str, tensor: torch.Tensor) -> None:
    """Replace the parameter at ``leaf`` by ``tensor`` (a parameter again, same requires_grad)."""
    path, _, name = leaf.rpartition(".")
    owner = module.get_submodule(path) if path else module
    old = owner._parameters[name]
    owner._parameters[name] = nn.Parameter(tensor, requires_grad=old is None or old.requires_grad)


@dataclass
class ShardedModule:
    """What a rule found for one sharded module: its rank-local plan and how to finish it."""

    rule: TensorParallelRule
    local_plan: ModulePlan
    mesh: Any
    sharded: tuple[int, ...]
    """Indexes (in the plan's transforms) of the transforms whose tensors are sharded."""
    gather_output: bool = False
    """Each part's output is gathered to its full width (``colwise_gather_output`` / ``colwise_rep``)."""
    local: bool = False
    """transformers loaded the shards as plain local tensors (5.1-5.15), not DTensors: the fused ones stay local."""


def refuse_sharded(module: nn.Module, plan: ModulePlan, styles: StyleLookup, why: str) -> None:
    """Refuse any planned or already-sharded original tensor of a module that must run unsharded."""
    for bound in plan.transforms:
        for spec in bound.sources:
            key = plan.full_key(spec.name)
            style = styles(key)
            if style is not None:
                raise TensorParallelRefusal(f"{key!r} is planned {style!r}, but {why}")
            tensor = leaf_tensor(module, spec.name)
            if is_dtensor(tensor):
                raise TensorParallelRefusal(
                    f"{key!r} was loaded sharded ({tuple(tensor.placements)}) with no plan entry naming it, "
                    f"but {why}"
                )


def _localize_replicated(module: nn.Module, plan: ModulePlan, styles: StyleLookup) -> ShardedModule | None:
    refuse_sharded(module, plan, styles, "this family's fused module runs unsharded only")
    return None


class _PackedColwiseExecution:
    """:class:`~fusion_core.plugin.PackedColwise` on one module's loaded shards."""

    def __init__(self, rule: PackedColwise) -> None:
        self.rule = rule
        self.container, self.unit = rule.container, rule.unit

    def _own(self, bound: BoundTransform) -> bool:
        """A transform that concatenates whole parts along their rows into the container: read from the plan
        (the op's slices), not from the parts' names, so a triple under any names the family merges shards."""
        where = bound.op.slices([s.shape for s in bound.sources]) if len(bound.targets) == 1 else None
        return (isinstance(bound.op, Concat) and where is not None and all(dim == 0 for dim, _, _ in where)
                and bound.targets[0].name.split(".", 1)[0] == self.container)

    def localize(self, module: nn.Module, plan: ModulePlan, styles: StyleLookup) -> ShardedModule | None:
        entries = {s.name: styles(plan.full_key(s.name)) for b in plan.transforms if self._own(b) for s in b.sources}
        self.projections = tuple(dict.fromkeys(name.rpartition(".")[0] for name in entries))
        if not any(entries.values()):
            refuse_sharded(module, plan, styles, "none of its parts is planned")
            return None
        others = replace(plan, transforms=tuple(b for b in plan.transforms if not self._own(b)))
        refuse_sharded(module, others, styles, f"only {list(self.projections)} of the module can be sharded")
        styles_used = set(entries.values())
        if not (styles_used == {COLWISE} or styles_used <= GATHERED_COLWISE):
            raise TensorParallelRefusal(
                f"plan styles {entries}: {self.container} merges {list(self.projections)} exactly only when every one "
                f"is {COLWISE!r} (each rank then holds its own rows of each), every one gathers its output "
                f"({' or '.join(sorted(GATHERED_COLWISE))}), or none is planned"
            )
        gather = styles_used <= GATHERED_COLWISE
        meshes: list[Any] = []
        rows: dict[str, int] = {}
        locals_: dict[str, torch.Tensor] = {}
        kinds: set[bool] = set()
        for leaf in entries:
            # A gathered output is whole again before any head is formed: the rows may split heads.
            locals_[leaf], mesh, rows[leaf], was_local = self._local_rows(
                module, plan, leaf, styles, check_unit=not gather
            )
            meshes.append(mesh)
            kinds.add(was_local)
        if len(kinds) > 1:
            raise TensorParallelRefusal(f"{list(entries)} were loaded partly as DTensors, partly as local tensors")
        if any(mesh != meshes[0] for mesh in meshes):
            raise TensorParallelRefusal(f"{list(entries)} are sharded over different device meshes")
        for leaf, local in locals_.items():
            set_leaf(module, leaf, local)
        for name in self.projections:  # the emptied originals give the merged projection its part sizes
            child = module._modules.get(name)
            if child is not None and hasattr(child, "out_features"):
                setattr(child, "out_features", rows[f"{name}.weight"])  # noqa: B010 (an nn.Module attribute)
        sharded = tuple(i for i, b in enumerate(plan.transforms) if self._own(b))
        transforms = list(plan.transforms)
        for index in sharded:
            bound = transforms[index]
            sources = tuple(LeafSpec(s.name, (rows[s.name], *s.shape[1:])) for s in bound.sources)
            targets = bound.op.forward_shapes([s.shape for s in sources])
            transforms[index] = BoundTransform(
                sources, tuple(LeafSpec(t.name, shape) for t, shape in zip(bound.targets, targets, strict=True)),
                bound.op,
            )
        return ShardedModule(self.rule, replace(plan, transforms=tuple(transforms)), meshes[0], sharded, gather,
                             kinds.pop())

    def _local_rows(
        self, module: nn.Module, plan: ModulePlan, leaf: str, styles: StyleLookup, check_unit: bool
    ) -> tuple[torch.Tensor, Any, int, bool]:
        """(this rank's rows of ``leaf``, the mesh, how many rows each rank holds, whether they were a local tensor)."""
        key = plan.full_key(leaf)
        tensor = leaf_tensor(module, leaf)
        if tensor is None:
            raise TensorParallelRefusal(
                f"{key!r} is planned colwise but the module holds no such tensor (a fused-layout checkpoint "
                "cannot be loaded under a tensor-parallel plan: load the original-layout checkpoint)"
            )
        if is_dtensor(tensor):
            mesh, total, local = self._dtensor_shard(key, tensor), int(tensor.shape[0]), False
        else:  # transformers 5.1-5.15: each rank's rows as a plain tensor; the plan knows the full shape
            mesh = getattr(styles, "mesh", None)
            planned = next((s.shape[0] for b in plan.transforms for s in b.sources if s.name == leaf), None)
            if mesh is None or planned is None:
                raise TensorParallelRefusal(
                    f"{key!r} is planned colwise but was loaded neither as a DTensor shard nor on a known mesh"
                )
            total, local = int(planned), True
        world = mesh.size()
        if total % world:
            raise UnevenRows(
                f"{key!r} has {total} rows, which do not split evenly over {world} ranks; the merged rows of a "
                "rank would not be a regular shard"
            )
        local_rows = total // world
        unit = getattr(module, self.unit, None) if self.unit and check_unit and leaf.endswith("weight") else None
        if isinstance(unit, int) and unit > 0 and local_rows % unit:
            raise TensorParallelRefusal(
                f"{key!r}: {world} ranks get {local_rows} rows each, which splits a {self.unit} of {unit}"
            )
        rows = tensor.to_local() if is_dtensor(tensor) else tensor
        if int(rows.shape[0]) != local_rows:
            raise TensorParallelRefusal(f"{key!r}: this rank holds {int(rows.shape[0])} rows, expected {local_rows}")
        return rows, mesh, local_rows, local

    @staticmethod
    def _dtensor_shard(key: str, tensor: DTensor) -> Any:
        """The 1-D mesh of a ``Shard(0)`` DTensor; refused for any other placement."""
        from torch.distributed.tensor import Shard

        mesh = tensor.device_mesh
        placements = tuple(tensor.placements)
        if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or (
            placements[0].dim % tensor.dim()
        ):
            raise TensorParallelRefusal(f"{key!r} has placements {placements} on a {mesh.ndim}-D mesh, not Shard(0)")
        return mesh


def localize(
    rule: TensorParallelRule, module: nn.Module, plan: ModulePlan, styles: StyleLookup
) -> ShardedModule | None:
    """Execute ``rule`` on ``module``'s loaded original tensors (see the module docs); None: not sharded."""
    if isinstance(rule, PackedColwise):
        return _PackedColwiseExecution(rule).localize(module, plan, styles)
    if isinstance(rule, Replicated):
        return _localize_replicated(module, plan, styles)
    raise TensorParallelRefusal(
        f"the tensor-parallel integration does not know the rule {type(rule).__qualname__} (it executes "
        f"{PackedColwise.__name__} and {Replicated.__name__})"
    )
