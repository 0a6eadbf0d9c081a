"""Invertible weight transforms and the plans built from them.

A family describes how the tensors of one original module become the tensors of its fused
replacement as :class:`WeightTransform` s over *module-relative* leaf names (``"weight"``,
``"q_proj.bias"``). Prefixes that transformers renames between checkpoint and model never
reach a family. Binding the transforms to one module instance (:func:`bind_transforms`) infers
every output shape from the input shapes, so a whole :class:`FusionPlan` is checked before a
single weight is read.

Every operation is invertible given the source shapes the plan recorded: that is what lets a
fused model save its original checkpoint layout byte for byte.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from fusion_core.errors import PlanError
from fusion_core.wrapped import concat

Shape = tuple[int, ...]


class TransformOp(ABC):
    """One invertible operation from ``arity[0]`` source tensors to ``arity[1]`` target tensors.

    Families may define their own ops (subclass this; a frozen dataclass is the easy way). The
    pipeline relies on this contract, and :func:`fusion_core.testing.kit.assert_transform_op`
    checks it:

    - **arity**: ``(sources, targets)``, both >= 1; a property when it depends on a field
      (``Concat.n``). :class:`WeightTransform` refuses a transform whose names do not match it.
    - **forward_shapes** is a pure function of the source shapes (no tensor is read: plans are
      checked before loading). It returns exactly ``arity[1]`` shapes, the ones ``forward``
      will produce, and raises ``ValueError`` for shapes it does not accept; the plan turns that
      into a :class:`~fusion_core.errors.PlanError` naming the family, module and shapes. Any other
      exception is a bug in the op and propagates as is.
    - **forward** and **inverse** keep the dtype, are exact inverses bit for bit (a fused model
      saves the checkpoint it loaded, byte for byte; every load verifies this once per op), and
      work on ``meta`` tensors (discovery rehearses the plan without data): no ``.item()``, no
      data-dependent shapes.
    - **Views**: a result may be a view of an input when it covers that input's whole storage
      (a reshape: no copy at load). Results that would share one storage with each other
      (slices of one tensor) must be copies, because checkpoints refuse tensors that share memory.
    - **Identity**: ops are immutable and compared by ``repr`` (the inverse check is cached per
      ``repr(op)``, and ``fusion plan`` prints it), so ``repr`` must show every parameter: a
      frozen dataclass does.
    """

    arity: tuple[int, int] = (1, 1)

    @abstractmethod
    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        """Target shapes for the given source shapes; raise ``ValueError`` when they do not fit."""

    @abstractmethod
    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Original layout -> fused layout."""

    @abstractmethod
    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        """Fused layout -> original layout, given the source shapes recorded in the plan."""

    def flat_offsets(self, shapes: Sequence[Shape]) -> tuple[int, ...] | None:
        """Where each source lies whole in the one target, when the target is only its sources back to back.

        The element offset, in the target's row-major order, at which each (contiguous) source's
        elements start, when ``forward`` places every source whole in a single target
        (``Concat`` along dim 0, ``Stack``); None when it does not (the default). A load then writes
        each source straight into the target, or finds it already in place
        (:mod:`fusion_core.streaming`), instead of calling ``forward``; what it builds must be
        ``forward``'s output bit for bit, which :func:`fusion_core.testing.kit.assert_transform_op` checks.
        """
        return None

    def slices(self, shapes: Sequence[Shape]) -> tuple[tuple[int, int, int], ...] | None:
        """Where each source lies in the one target as a slice: ``(dim, start, length)`` per source, or None.

        The one description of "which original tensor lives in which rows of the fused one" that every
        reader uses (:meth:`ModulePlan.packed_parts`: tensor parallelism, PEFT, quantizers, users reaching a
        merged parameter's parts by their original names). None (the default) for an op whose target holds
        its sources in another form (transposed, stacked, packed).
        """
        return None


@dataclass(frozen=True)
class Identity(TransformOp):
    """Moves a tensor unchanged; with different source and target names it is a rename."""

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        return (tuple(shapes[0]),)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (tensors[0],)

    def slices(self, shapes: Sequence[Shape]) -> tuple[tuple[int, int, int], ...] | None:
        return ((0, 0, shapes[0][0]),) if shapes[0] else None

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        return (tensors[0],)


@dataclass(frozen=True)
class Flatten(TransformOp):
    """Flattens dimensions ``start_dim`` to the last one; a view for a contiguous tensor."""

    start_dim: int = 1

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        shape = tuple(shapes[0])
        if not 0 <= self.start_dim < len(shape):
            raise ValueError(f"cannot flatten from dim {self.start_dim} a tensor of shape {shape}")
        return ((*shape[:self.start_dim], math.prod(shape[self.start_dim:])),)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        (tensor,) = tensors
        return (tensor.reshape(self.forward_shapes([tuple(tensor.shape)])[0]),)

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        return (tensors[0].reshape(source_shapes[0]),)


@dataclass(frozen=True)
class Transpose(TransformOp):
    """Swaps two dimensions; the result is made contiguous so it can be saved and multiplied."""

    dim0: int = 0
    dim1: int = 1

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        shape = list(shapes[0])
        try:
            shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        except IndexError:
            raise ValueError(f"cannot transpose dims {self.dim0},{self.dim1} of shape {tuple(shapes[0])}") from None
        return (tuple(shape),)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (tensors[0].transpose(self.dim0, self.dim1).contiguous(),)

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        return (tensors[0].transpose(self.dim0, self.dim1).contiguous(),)


@dataclass(frozen=True)
class Concat(TransformOp):
    """Many-to-one: concatenates ``n`` sources along ``dim`` (q/k/v -> qkv). Inverse: split."""

    n: int = 2
    dim: int = 0

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (self.n, 1)

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        first = tuple(shapes[0])
        if not 0 <= self.dim < len(first):
            raise ValueError(f"cannot concatenate along dim {self.dim} tensors of shape {first}")
        for shape in shapes[1:]:
            rest = tuple(s for i, s in enumerate(shape) if i != self.dim)
            if len(shape) != len(first) or rest != tuple(s for i, s in enumerate(first) if i != self.dim):
                raise ValueError(f"shapes {[tuple(s) for s in shapes]} differ outside dim {self.dim}")
        total = sum(shape[self.dim] for shape in shapes)
        return ((*first[:self.dim], total, *first[self.dim + 1:]),)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # concat: a quantizer's per-row weights (tensor subclasses) too, exactly or refused.
        return (concat(tensors, self.dim),)

    def flat_offsets(self, shapes: Sequence[Shape]) -> tuple[int, ...] | None:
        if any(size != 1 for size in shapes[0][:self.dim]):  # rows of parts interleave
            return None
        return _back_to_back(shapes)

    def slices(self, shapes: Sequence[Shape]) -> tuple[tuple[int, int, int], ...] | None:
        starts = [0]
        for shape in shapes[:-1]:
            starts.append(starts[-1] + shape[self.dim])
        return tuple((self.dim, start, shape[self.dim]) for start, shape in zip(starts, shapes, strict=True))

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        # narrow, not split: tensor subclasses (a quantizer's weight) implement slicing more often.
        # Clones: slices of one storage would be saved as shared tensors, which checkpoints refuse.
        parts, start = [], 0
        for shape in source_shapes:
            parts.append(tensors[0].narrow(self.dim, start, shape[self.dim]).clone())
            start += shape[self.dim]
        return tuple(parts)


@dataclass(frozen=True)
class Split(TransformOp):
    """One-to-many: splits one source along ``dim`` into parts of ``sizes``. Inverse: concat."""

    sizes: tuple[int, ...] = ()
    dim: int = 0

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (1, len(self.sizes))

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        shape = tuple(shapes[0])
        if not 0 <= self.dim < len(shape) or sum(self.sizes) != shape[self.dim]:
            raise ValueError(f"cannot split shape {shape} along dim {self.dim} into {self.sizes}")
        return tuple((*shape[:self.dim], size, *shape[self.dim + 1:]) for size in self.sizes)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(part.clone() for part in torch.split(tensors[0], list(self.sizes), dim=self.dim))

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        return (concat(tensors, self.dim),)


def _back_to_back(shapes: Sequence[Shape]) -> tuple[int, ...]:
    """The element offset of each of ``shapes`` placed one after the other."""
    offsets, start = [], 0
    for shape in shapes:
        offsets.append(start)
        start += math.prod(shape)
    return tuple(offsets)


def _require_parts(op: Stack | Unstack) -> None:
    if op.n < 1:  # an empty stack has no shape to restore on save
        raise ValueError(f"{type(op).__name__}(n={op.n}): n must be at least 1")


@dataclass(frozen=True)
class Stack(TransformOp):
    """Many-to-one: stacks ``n`` same-shaped sources along a new dimension ``dim``.

    E expert weights ``[out, in]`` -> one ``[E, out, in]`` tensor for a batched (grouped) forward;
    ``Concat`` would give ``[E * out, in]`` instead. Inverse: :class:`Unstack` (copies).
    """

    n: int = 2
    dim: int = 0

    def __post_init__(self) -> None:
        _require_parts(self)

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (self.n, 1)

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        first = tuple(shapes[0])
        if not 0 <= self.dim <= len(first):
            raise ValueError(f"cannot stack along dim {self.dim} tensors of shape {first}")
        if any(tuple(shape) != first for shape in shapes[1:]):
            raise ValueError(f"stacked tensors must have one shape; got {[tuple(s) for s in shapes]}")
        return ((*first[:self.dim], len(shapes), *first[self.dim:]),)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (torch.stack(list(tensors), dim=self.dim),)

    def flat_offsets(self, shapes: Sequence[Shape]) -> tuple[int, ...] | None:
        if any(size != 1 for size in shapes[0][:self.dim]):
            return None
        return _back_to_back(shapes)

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        # Clones: views of one storage would be saved as shared tensors, which checkpoints refuse.
        return tuple(part.clone() for part in torch.unbind(tensors[0], dim=self.dim))


@dataclass(frozen=True)
class Unstack(TransformOp):
    """One-to-many: one source with ``n`` entries along ``dim`` -> ``n`` tensors without that dimension.

    The inverse of :class:`Stack`: a checkpoint holding ``[E, out, in]`` run as E separate
    modules. Inverse: stack.
    """

    n: int = 2
    dim: int = 0

    def __post_init__(self) -> None:
        _require_parts(self)

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (1, self.n)

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        shape = tuple(shapes[0])
        if not 0 <= self.dim < len(shape) or shape[self.dim] != self.n:
            raise ValueError(f"cannot unstack shape {shape} along dim {self.dim} into {self.n} tensors")
        rest = (*shape[:self.dim], *shape[self.dim + 1:])
        return tuple(rest for _ in range(self.n))

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(part.clone() for part in torch.unbind(tensors[0], dim=self.dim))

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]
    ) -> tuple[torch.Tensor, ...]:
        return (torch.stack(list(tensors), dim=self.dim),)


@dataclass(frozen=True)
class WeightTransform:
    """What a family declares: module-relative ``sources`` become ``targets`` through ``op``.

    ``optional`` transforms are skipped when none of their sources exist on an instance (a bias
    some checkpoints have and others do not); partly present sources are always an error.
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    op: TransformOp = field(default_factory=Identity)
    optional: bool = False

    def __post_init__(self) -> None:
        # A runtime guard for untyped callers: ("weight") is a string, not a one-tuple.
        if isinstance(self.sources, str) or isinstance(self.targets, str):  # type: ignore[unreachable]
            raise TypeError("WeightTransform sources and targets are tuples of leaf names, not strings")
        if (len(self.sources), len(self.targets)) != tuple(self.op.arity):
            raise ValueError(
                f"{type(self.op).__name__} takes {self.op.arity[0]} source(s) and gives {self.op.arity[1]} "
                f"target(s); got sources={self.sources} targets={self.targets}"
            )


@dataclass(frozen=True)
class LeafSpec:
    """A module-relative tensor name with its shape."""

    name: str
    shape: Shape


@dataclass(frozen=True)
class BoundTransform:
    """A :class:`WeightTransform` bound to one module instance, with every shape known."""

    sources: tuple[LeafSpec, ...]
    targets: tuple[LeafSpec, ...]
    op: TransformOp


@dataclass(frozen=True)
class ModulePlan:
    """Everything fusion does to one module instance: which class it becomes, which tensors move."""

    family: str
    path: str
    original_class: type
    fused_class: type
    transforms: tuple[BoundTransform, ...]
    original_leaves: tuple[str, ...] = ()
    """Every tensor of the original module, in its state-dict order (kept on save)."""
    moved_linears: tuple[str, ...] = ()
    """Module-relative paths (``""``: the module itself) of the original ``nn.Linear`` modules whose
    tensors the plan moves: what a quantizer matching ``isinstance(m, nn.Linear)`` would have
    quantized there, and a fused model does not present as ``nn.Linear``."""

    def full_key(self, leaf: str) -> str:
        return f"{self.path}.{leaf}" if self.path else leaf

    @property
    def original_keys(self) -> tuple[str, ...]:
        return tuple(self.full_key(s.name) for t in self.transforms for s in t.sources)

    @property
    def fused_keys(self) -> tuple[str, ...]:
        return tuple(self.full_key(s.name) for t in self.transforms for s in t.targets)

    def packed_parts(self) -> tuple[PackedPart, ...]:
        """Which original tensors live in which slices of which fused tensors (module-relative names).

        The one source of that fact, derived from the transforms' :meth:`TransformOp.slices`; tensors a
        transform holds in another form (transposed, stacked, packed) have no part here.
        """
        parts: list[PackedPart] = []
        for bound in self.transforms:
            where = bound.op.slices([s.shape for s in bound.sources]) if len(bound.targets) == 1 else None
            if where is None:
                continue
            target = bound.targets[0]
            parts += [PackedPart(source.name, target.name, dim, start, length)
                      for source, (dim, start, length) in zip(bound.sources, where, strict=True)]
        return tuple(parts)


@dataclass(frozen=True)
class PackedPart:
    """One original tensor inside a fused one: ``fused.narrow(dim, start, length)`` is ``original``."""

    original: str
    fused: str
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class FusionPlan:
    """All module plans of one load, in model order; checked for overlapping claims on creation.

    ``skipped`` names the families that found nothing to fuse and were left out (``required=False``).
    ``nested`` lists ``(family, path, outer family, outer path)`` for each module a family would
    have fused that lies inside a module fused whole by a family with ``owns_submodules``, claiming
    its tensors: the outer fusion owns them (a MoE block's expert MLPs, fused by ``moe_experts``,
    not ``gate_up``).
    ``refused`` lists ``(family, path, reason)`` for each module a family's patterns selected and
    its ``is_fusable`` declined, where its optional ``refusal`` member said why.
    """

    modules: tuple[ModulePlan, ...] = ()
    skipped: tuple[str, ...] = ()
    nested: tuple[tuple[str, str, str, str], ...] = ()
    refused: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        check_conflicts(self.modules)

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.family for m in self.modules))

    def by_path(self) -> dict[str, ModulePlan]:
        return {m.path: m for m in self.modules}

    def describe(self) -> list[dict[str, object]]:
        """Plain data for printing, JSON and tests: one row per transformed tensor group."""
        rows: list[dict[str, object]] = []
        for module in self.modules:
            for bound in module.transforms:
                rows.append(
                    {
                        "family": module.family,
                        "module": module.path,
                        "original_class": class_name(module.original_class),
                        "fused_class": class_name(module.fused_class),
                        "op": repr(bound.op),
                        "original": {module.full_key(s.name): list(s.shape) for s in bound.sources},
                        "fused": {module.full_key(s.name): list(s.shape) for s in bound.targets},
                    }
                )
        return rows


def declined(refused: Iterable[tuple[str, str, str]], family: str) -> list[str]:
    """``"path: reason"`` for each of ``family``'s entries in :attr:`FusionPlan.refused` (the root module as
    ``(the model)``): what errors and warnings quote."""
    return [f"{path or '(the model)'}: {reason}" for name, path, reason in refused if name == family]


#: The class attribute holding the name :func:`class_name` shows for a class whose ``__qualname__`` is there for
#: pickle to find it, not for people to read (the fused classes of :func:`fusion_core.spec.fused_subclass`).
DISPLAY_NAME_ATTRIBUTE = "__fusion_display_name__"


def class_name(cls: type) -> str:
    """How plans, the CLI and reports name ``cls``: ``module.qualname``, or the readable name it carries.

    A fused class made by :func:`fusion_core.spec.fused_subclass` is shown as its mixin applied to
    its original class (``fusion_qkv.family.QkvMixin[LlamaAttention]``). Only the class's own
    attribute counts: a subclass of a fused class is shown by its own qualified name.
    """
    shown = vars(cls).get(DISPLAY_NAME_ATTRIBUTE)
    return shown if isinstance(shown, str) else f"{cls.__module__}.{cls.__qualname__}"


def check_conflicts(modules: Iterable[ModulePlan]) -> None:
    """Raise :class:`PlanError` when two module plans claim the same tensor or module."""
    claims: dict[str, tuple[str, str]] = {}
    module_owner: dict[str, str] = {}
    for plan in modules:
        if plan.path in module_owner and module_owner[plan.path] != plan.family:
            raise PlanError(
                f"families {module_owner[plan.path]!r} and {plan.family!r} both replace module {plan.path!r}"
            )
        if plan.path in module_owner:
            raise PlanError(f"family {plan.family!r} plans module {plan.path!r} twice")
        module_owner[plan.path] = plan.family
        for key in plan.original_keys:
            if key in claims:
                other_family, other_path = claims[key]
                raise PlanError(
                    f"checkpoint key {key!r} is claimed by family {other_family!r} (module {other_path!r}) "
                    f"and by family {plan.family!r} (module {plan.path!r})"
                )
            claims[key] = (plan.family, plan.path)


def bind_transforms(
    family: str,
    path: str,
    leaf_shapes: Mapping[str, Shape],
    transforms: Sequence[WeightTransform],
) -> tuple[BoundTransform, ...]:
    """Bind ``transforms`` to one instance whose original tensors have ``leaf_shapes``.

    Checks, naming family, module and leaf: every required source exists, no leaf is consumed
    twice, every op accepts its shapes, and no target overwrites a tensor that stays.
    """
    where = f"family {family!r}, module {path or '<root>'!r}"
    bound: list[BoundTransform] = []
    consumed: set[str] = set()
    produced: set[str] = set()
    for transform in transforms:
        present = [name for name in transform.sources if name in leaf_shapes]
        if not present and transform.optional:
            continue
        missing = [name for name in transform.sources if name not in leaf_shapes]
        if missing:
            raise PlanError(
                f"{where}: transform {transform.sources} -> {transform.targets} needs tensor(s) {missing}, "
                f"which the module does not have (it has {sorted(leaf_shapes)})"
            )
        twice = consumed.intersection(transform.sources)
        if twice:
            raise PlanError(f"{where}: tensor(s) {sorted(twice)} are consumed by two transforms")
        consumed.update(transform.sources)
        shapes = [tuple(leaf_shapes[name]) for name in transform.sources]
        try:
            target_shapes = transform.op.forward_shapes(shapes)
        except ValueError as exc:
            raise PlanError(f"{where}: {type(transform.op).__name__} rejects shapes {shapes}: {exc}") from None
        if len(target_shapes) != len(transform.targets):
            raise PlanError(f"{where}: {transform.op!r} gave {len(target_shapes)} shapes for {transform.targets}")
        dup = produced.intersection(transform.targets)
        if dup:
            raise PlanError(f"{where}: tensor(s) {sorted(dup)} are produced by two transforms")
        produced.update(transform.targets)
        bound.append(
            BoundTransform(
                sources=tuple(LeafSpec(n, s) for n, s in zip(transform.sources, shapes, strict=True)),
                targets=tuple(LeafSpec(n, s) for n, s in zip(transform.targets, target_shapes, strict=True)),
                op=transform.op,
            )
        )
    clobbered = produced.intersection(set(leaf_shapes) - consumed)
    if clobbered:
        raise PlanError(f"{where}: target(s) {sorted(clobbered)} would overwrite tensors that are not transformed")
    return tuple(bound)


# -- the plan attached to a model or module --------------------------------------------------------
PLAN_ATTRIBUTES: dict[type, str] = {FusionPlan: "_fusion_plan", ModulePlan: "_fusion_module_plan"}
"""Instance attribute holding each kind of plan: a :class:`FusionPlan` on a fused model, a :class:`ModulePlan`
on each fused module. A model fused at its root by a family (``linear_cross_entropy``) carries both, so
they live under two names. Read them with :func:`attached_plan`, write them with :func:`attach_plan`."""

PlanT = TypeVar("PlanT", FusionPlan, ModulePlan)


def attached_plan(obj: object, kind: type[PlanT]) -> PlanT | None:
    """The plan of ``kind`` (:class:`FusionPlan` on a model, :class:`ModulePlan` on a fused module) on ``obj``."""
    plan: PlanT | None = getattr(obj, "__dict__", {}).get(PLAN_ATTRIBUTES[kind])
    return plan


def attach_plan(obj: object, plan: FusionPlan | ModulePlan) -> None:
    """Attach ``plan`` to ``obj``, replacing the plan of its kind there."""
    obj.__dict__[PLAN_ATTRIBUTES[type(plan)]] = plan


def detach_plan(obj: object, kind: type[FusionPlan] | type[ModulePlan]) -> None:
    """Remove the plan of ``kind`` from ``obj`` (nothing when there is none)."""
    obj.__dict__.pop(PLAN_ATTRIBUTES[kind], None)
