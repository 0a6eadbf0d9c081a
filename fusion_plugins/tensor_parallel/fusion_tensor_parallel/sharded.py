"""Fused modules in a model that transformers loaded under a tensor-parallel plan.

transformers applies its plan to the *original* modules (``q_proj`` colwise, ...) while it loads
them, so when its ``from_pretrained`` returns, a fused instance holds each rank's DTensor shards
of its original tensors (plain local shards on 5.1-5.15). The integration's
``fusion_convert_loaded`` wrapper (:mod:`fusion_tensor_parallel.plugin`) runs around fusion-core's
conversion of the loaded instances:

1. before it, :func:`localize_built` executes each instance's family rule
   (:class:`fusion_core.plugin.TensorParallelRule`, :mod:`fusion_tensor_parallel.execution`): it checks the plan
   entries of its original tensors, replaces the shards by this rank's local tensors and gives a
   rank-local plan, so the ordinary conversion builds ``[q_r; k_r; v_r]`` from them;
2. after it, :func:`finish` turns the local fused tensors back into DTensors of the model's mesh
   (``Shard(0)`` of a rank-major layout), so optimizers, gradient clipping and
   ``state_dict`` see a tensor-parallel model like the unfused one; the merged projection
   computes on the local rows and all-reduces its input gradient, as the ``colwise`` style does.

``state_dict()`` presents the original tensors as the DTensor shards transformers itself made
(``q_proj.weight``: ``Shard(0)`` of the full shape), so a save writes the full original-layout
checkpoint exactly like a tensor-parallel load of the unfused model does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fusion_core import Concat, FusionLoadError, ModuleFusionSpec, ModulePlan, TransformOp
from fusion_core.plugin import (
    MergedLinear,
    MergedProjectionsMixin,
    Replicated,
    Shape,
    TensorParallelRule,
    attach_plan,
    attached_plan,
    is_dtensor,
    plan_style,
    spec_member,
    tensor_parallel_mesh,
    tensor_parallel_size,
)
from fusion_tensor_parallel.execution import (
    PlanStyles,
    ShardedModule,
    StyleLookup,
    TensorParallelRefusal,
    UnevenRows,
    leaf_tensor,
    localize,
    set_leaf,
)

DEFAULT_RULE = Replicated()

logger = logging.getLogger(__name__)


def style_lookup(model: nn.Module) -> StyleLookup | None:
    """The plan style of a parameter path in ``model``'s tensor-parallel plan; None when no plan is applied.

    transformers' own matching rule (wildcards for layer numbers, module entries covering their
    ``weight`` and ``bias``; :func:`fusion_core.plugin.plan_style`).
    """
    plan = getattr(model, "tp_plan", None) or {}
    if tensor_parallel_size(model) <= 1 or not plan:
        return None
    return PlanStyles(lambda name: plan_style(name, plan), tensor_parallel_mesh(model))


def family_rule(spec: ModuleFusionSpec[Any] | None) -> TensorParallelRule:
    """The family's declared ``tensor_parallel`` rule; families that declare none run unsharded."""
    rule = spec_member(spec, "tensor_parallel") if spec is not None else None
    return DEFAULT_RULE if rule is None else rule


def localize_built(
    model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]], families: Mapping[str, Any]
) -> list[tuple[nn.Module, ModulePlan, ShardedModule]]:
    """Before the conversion: replace each sharded module's plan in ``built`` by its rank-local plan.

    Returns what :func:`finish` must complete after the conversion; empty for a model that
    transformers did not load under a tensor-parallel plan. A module whose parts' rows do not split
    evenly over the ranks (:class:`~fusion_tensor_parallel.execution.UnevenRows`) is taken out of ``built``,
    with a warning: the load leaves it unfused, running transformers' uneven shards as plain does. Raises
    :class:`FusionLoadError` naming the family, module and reason for any other module that cannot be sharded
    exactly.
    """
    styles = style_lookup(model)
    if styles is None:
        return []
    pending: list[tuple[nn.Module, ModulePlan, ShardedModule]] = []
    kept: list[tuple[nn.Module, ModulePlan]] = []
    for module, plan in built:
        spec = families.get(plan.family)
        try:
            sharded = localize(family_rule(spec), module, plan, styles)
        except UnevenRows as exc:  # plain runs transformers' uneven shards: the module stays as it loaded them
            logger.warning("fusion family %r, module %r: left unfused under the tensor-parallel plan: %s",
                           plan.family, plan.path, exc)
            continue
        except TensorParallelRefusal as exc:
            declared = "" if spec_member(spec, "tensor_parallel") is not None else " (the family declares no rule)"
            raise FusionLoadError(
                f"family {plan.family!r}, module {plan.path!r}: cannot run under the tensor-parallel plan{declared}: "
                f"{exc}"
            ) from None
        kept.append((module, plan if sharded is None else sharded.local_plan))
        if sharded is not None:
            pending.append((module, plan, sharded))
    built[:] = kept  # a module left out of ``built`` is left unfused by the load (see the hookspec)
    return pending


def finish(module: nn.Module, plan: ModulePlan, sharded: ShardedModule) -> None:
    """After the module was fused from its local tensors: make it a sharded module of the model."""
    if isinstance(sharded.rule, Replicated):
        raise AssertionError("a replicated module is never sharded")
    shard_merged_module(module, plan, sharded)


@dataclass(frozen=True)
class RankMajorConcat(TransformOp):
    """:class:`Concat` along rows where every part is sharded ``Shard(0)`` over ``mesh``.

    The fused tensor is ``Shard(0)`` of the rank-major layout ``[a_0; b_0; a_1; b_1; ...]``, so
    each rank's local rows are ``[a_r; b_r]``. ``inverse`` gives every part back as the DTensor
    shard transformers loaded (``Shard(0)`` of its full shape), without any communication;
    ``forward`` accepts those shards or full tensors (a full ``load_state_dict``).
    """

    n: int
    mesh: Any

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (self.n, 1)

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        return Concat(n=self.n, dim=0).forward_shapes(shapes)

    def _rank(self) -> tuple[int, int]:
        return self.mesh.get_local_rank(), self.mesh.size()

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        rank, world = self._rank()
        parts = []
        for tensor in tensors:
            if is_dtensor(tensor):
                parts.append(tensor.redistribute(self.mesh, [_shard0()]).to_local())
            else:
                parts.append(tensor.chunk(world, dim=0)[rank])
        shape = self.forward_shapes([tuple(t.shape) for t in tensors])[0]
        return (_from_local(torch.cat(parts, dim=0), self.mesh, shape),)

    def inverse(self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]) -> tuple[torch.Tensor, ...]:
        fused = tensors[0]
        local = fused.to_local() if is_dtensor(fused) else fused
        world = self.mesh.size()
        sizes = [shape[0] // world for shape in source_shapes]
        parts = torch.split(local, sizes, dim=0)
        # Clones: slices of one storage would be saved as shared tensors, which checkpoints refuse.
        return tuple(
            _from_local(part.clone(), self.mesh, tuple(shape)) for part, shape in zip(parts, source_shapes, strict=True)
        )


def _shard0() -> Any:
    from torch.distributed.tensor import Shard

    return Shard(0)


def _from_local(local: torch.Tensor, mesh: Any, shape: Shape) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [_shard0()], run_check=False, shape=torch.Size(shape), stride=stride)


class _AllReduceInputGrad(torch.autograd.Function):
    """Identity forward; all-reduces the gradient: the input-gradient sum a ``colwise`` style does."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return input.view_as(input)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gathers a last-dim shard to the full width; backward keeps this rank's columns of the gradient.

    What a gathered colwise style (``colwise_gather_output``) does to its output: the gradient
    of a replicated output is the same on every rank, so no reduction is needed.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.world)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.world, dim=-1)[ctx.rank].contiguous(), None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _parameter(owner: nn.Module, name: str) -> torch.Tensor | None:
    return owner._parameters.get(name)


class ShardedMergedLinear(MergedLinear):
    """A merged projection holding this rank's rows of every part (``sizes`` are the local sizes).

    It computes on the local tensors of the container's DTensor parameters (their gradients flow
    back as ``Shard(0)`` gradients), or on its plain local parameters where transformers loaded
    local shards (5.1-5.15), and its input's gradient is all-reduced over the mesh: each
    rank's rows give only a partial input gradient, exactly as under the ``colwise`` style. One
    input is wrapped once, so sibling projections still share one merged GEMM. Under a gathered
    colwise style each part's output is then all-gathered to its full width.
    """

    @property
    def weight(self) -> torch.Tensor:
        weight = _parameter(self.owner, "weight")
        if weight is None:
            raise RuntimeError(f"the merged projection's {type(self.owner).__name__} has no weight")
        return _local(weight)

    @property
    def bias(self) -> torch.Tensor | None:
        bias = _parameter(self.owner, "bias")
        return None if bias is None else _local(bias)

    def __call__(self, index: int, input: torch.Tensor) -> torch.Tensor:
        weight = _parameter(self.owner, "weight")
        group = weight.device_mesh.get_group() if is_dtensor(weight) else self.__dict__.get("_tp_group")
        if group is None:
            return super().__call__(index, input)
        if torch.is_grad_enabled() and input.requires_grad:
            memo = self.__dict__.get("_tp_input")
            if memo is not None and memo[0] is input:
                wrapped = memo[1]
            else:
                wrapped = _AllReduceInputGrad.apply(input, group)  # type: ignore[no-untyped-call]
            output = super().__call__(index, wrapped)
            # Keep the wrapped input only while siblings may still take their part of a merged output.
            self.__dict__["_tp_input"] = (input, wrapped) if self._cache is not None else None
        else:
            output = super().__call__(index, input)
        if self.__dict__.get("_tp_gather"):
            output = _GatherLastDim.apply(output, group)  # type: ignore[no-untyped-call]
        return output


def _present_fused_in_order(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Inside ``fused_layout()``: present each rank-major merged tensor gathered, in the plain ``[a; b]`` order.

    A fused-layout checkpoint holds the merged tensor of a single-process load; the rank-major
    order would load there as wrong rows. Gathering is a collective: every rank must ask.
    """
    for bound in _plan(module).transforms:
        if not isinstance(bound.op, RankMajorConcat):
            continue
        for target in bound.targets:
            value = state_dict.get(prefix + target.name)
            if not is_dtensor(value):
                continue  # already presented in the original layout
            world = bound.op.mesh.size()
            sizes = [spec.shape[0] // world for spec in bound.sources]
            ranks = [torch.split(block, sizes) for block in torch.split(value.full_tensor(), sum(sizes))]
            state_dict[prefix + target.name] = torch.cat([ranks[r][i] for i in range(len(sizes)) for r in range(world)])


def _gather_fused_local(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Inside ``fused_layout()``, for local shards: present each merged tensor gathered, in the plain ``[a; b]`` order.

    transformers 5.1-5.15 gather a state dict for saving by the plan's names, which know no merged
    tensor; this gathers it instead (a collective: every rank must ask).
    """
    group, world = module.__dict__[_LOCAL_SHARDS]
    for bound in _plan(module).transforms:
        if not isinstance(bound.op, Concat) or bound.op.dim != 0:
            continue
        for target in bound.targets:
            value = state_dict.get(prefix + target.name)
            if value is None:
                continue  # presented in the original layout: transformers gathers those by name
            parts = [torch.empty_like(value) for _ in range(world)]
            torch.distributed.all_gather(parts, value.contiguous(), group=group)
            sizes = [spec.shape[0] for spec in bound.sources]  # this rank's rows of each part
            ranks = [torch.split(block, sizes) for block in parts]
            state_dict[prefix + target.name] = torch.cat([ranks[r][i] for i in range(len(sizes)) for r in range(world)])


_LOCAL_SHARDS = "_fusion_tp_local"
"""Module attribute: (process group, world size) of a module fused from plain local shards."""


def _keep_local(module: nn.Module, plan: ModulePlan, sharded: ShardedModule) -> None:
    """Finish a module fused from plain local shards (5.1-5.15): its tensors stay local, like the unfused ones."""
    group = sharded.mesh.get_group()
    module.__dict__[_LOCAL_SHARDS] = (group, sharded.mesh.size())
    module.register_state_dict_post_hook(_gather_fused_local)  # type: ignore[no-untyped-call]
    merged = _merged_projection(module, plan)
    merged.__class__ = ShardedMergedLinear
    merged.__dict__["_tp_gather"] = sharded.gather_output
    merged.__dict__["_tp_group"] = group


def _plan(module: nn.Module) -> ModulePlan:
    plan = attached_plan(module, ModulePlan)
    if plan is None:
        raise TypeError(f"{type(module).__name__} is not a module fusion-core fused")
    return plan


def _merged_projection(module: nn.Module, plan: ModulePlan) -> MergedLinear:
    merged = module.fused_projection if isinstance(module, MergedProjectionsMixin) else None
    if not isinstance(merged, MergedLinear):
        raise FusionLoadError(
            f"family {plan.family!r}, module {plan.path!r}: PackedColwise needs a merged projection "
            "(fusion_core.plugin.MergedProjectionsMixin) to run on this rank's rows"
        )
    return merged


def shard_merged_module(module: nn.Module, plan: ModulePlan, sharded: ShardedModule) -> None:
    """Make a module fused from its local rows a sharded module: DTensor parameters, rank-major layout.

    Where transformers loaded plain local shards, the fused tensors stay plain local ones instead.
    """
    if sharded.local:
        _keep_local(module, plan, sharded)
        return
    transforms = list(plan.transforms)
    for index in sharded.sharded:
        bound = transforms[index]
        if not isinstance(bound.op, Concat) or bound.op.dim != 0:
            raise FusionLoadError(
                f"family {plan.family!r}, module {plan.path!r}: a sharded merge needs Concat(dim=0), not {bound.op!r}"
            )
        for target in bound.targets:
            local = leaf_tensor(module, target.name)
            if local is None:
                raise FusionLoadError(f"family {plan.family!r}, module {plan.path!r}: no fused {target.name!r}")
            set_leaf(module, target.name, _from_local(local.detach(), sharded.mesh, target.shape))
        transforms[index] = replace(bound, op=RankMajorConcat(n=bound.op.n, mesh=sharded.mesh))
    attach_plan(module, replace(plan, transforms=tuple(transforms)))
    module.register_state_dict_post_hook(_present_fused_in_order)  # type: ignore[no-untyped-call]
    merged = _merged_projection(module, plan)
    merged.__class__ = ShardedMergedLinear
    merged.__dict__["_tp_gather"] = sharded.gather_output
