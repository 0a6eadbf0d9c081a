"""``linear_kernels``: every plain ``nn.Linear`` (the LM head included, tied or not) holds its weight in the
runtime layout, and runs the kernel, measured fastest for its kind on this machine; transformers 5.x's experts
modules hold their expert weights prepacked per expert where that measured faster
(:mod:`fusion_linear_kernels.packed_experts`), and otherwise run, at decode, the experts implementation measured
fastest (:mod:`fusion_linear_kernels.experts`).

Decode is bound by reading weights, and how close a GEMV gets to the memory's bandwidth depends
on the layout the kernel reads and on the kernel: ``F.linear`` on a dense bfloat16 weight has oneDNN
reorder the whole weight on every call. Two mechanisms, both measured, both within the documented
numerical bound of ``F.linear`` (:mod:`fusion_linear_kernels.tolerance`), or bit-identical in exact mode:

- **the layout** (:mod:`fusion_linear_kernels.packing`): the family's one transform,
  :class:`~fusion_linear_kernels.packing.PrepackLinearWeight` from ``weight`` to ``weight`` (bound by
  :func:`packing_plan` when a load converts, see :mod:`fusion_linear_kernels.plugin`), holds the
  weight in oneDNN's prepacked layout *instead of* the dense tensor where that measured faster (memory
  stays the plain model's; ``state_dict``, saves and ``unfuse`` present the dense weight, byte for byte),
  and the forward calls the packed kernel at every row count;
- **the kernel** (:func:`fusion_linear_kernels.choice.linear`), for a weight left dense: chosen once
  per kind of call on the real input at few rows; prefill, training, other devices and quantized
  weights run ``F.linear``; under ``torch.compile`` the same choice is one custom operator in the graph
  (:func:`fusion_linear_kernels.choice.traced_linear`).

Where a load left a weight these run as a view of the checkpoint's file mapping (transformers does, for a
checkpoint loaded in its stored dtype), the plugin reads it into the process's own memory after the conversion:
GEMVs read it faster there (:mod:`fusion_linear_kernels.residence`).

The merged projections of ``qkv`` and ``gate_up`` (:class:`fusion_core.plugin.MergedLinear`) get the
same two mechanisms, set by this plugin's ``fusion_convert_loaded`` hook when both families are enabled
(:mod:`fusion_linear_kernels.plugin`): where the merged weight packs, its container (``qkv_proj``, a
:class:`~fusion_core.plugin.MergedProjection`) is fused by this family as a layer of its own
(:func:`merged_packing_plan`), nested in the merging family's module, and runs the merged GEMM packed;
elsewhere the ``kernel`` extension point gets the kernel choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import nn

from fusion_core import FamilyOptions, FusedModule, FusionFamily, ModulePlan, WeightTransform
from fusion_core.plugin import (
    BoundTransform,
    MergedProjection,
    attached_plan,
    bind_transforms,
    fused_subclass,
    is_plain_linear,
    standing_for,
)
from fusion_linear_kernels import data_parallel, experts, packed_experts, packing
from fusion_linear_kernels.choice import Caller, autocast_dtype, traced_linear
from fusion_linear_kernels.dense_view import DenseView
from fusion_linear_kernels.packed_experts import PrepackExperts, is_packed_experts
from fusion_linear_kernels.packing import PrepackLinearWeight, ineligible, is_packed, packs, unpack

#: Set in a pickled (or deep-copied) fused module's state: the parameters it holds packed, pickled dense.
_PACKED_STATE = "_fusion_linear_kernels_packed"
#: In a fused layer's ``__dict__``: whether its weight is packed, for traced code (see ``LinearKernelsMixin.forward``).
PACKED_FLAG = "_fusion_linear_kernels_weight_packed"
#: In a packed experts module's ``__dict__``: the key its traced operator finds it by (see ``ExpertsKernelsMixin``).
OPERATOR_KEY = "_fusion_linear_kernels_operator_key"
#: Set on a layer whose weight is dense: its :class:`~fusion_linear_kernels.choice.Caller` (made at its first call).
CALLER_KEY = "_fusion_linear_kernels_caller"


class LinearKernelsOptions(FamilyOptions):
    """Options of ``linear_kernels``."""

    exact: bool = Field(
        default=False,
        description="True: take only kernels whose output is bit-identical to F.linear's on the real input, and "
        "pack only weights whose probes were bit-identical (never a layer with a bias); "
        "False: kernels and packed weights within the documented bound (fusion_linear_kernels.tolerance).",
    )


class PackedParametersMixin(FusedModule):
    """Copies, pickles and ``.to()`` of a fused module holding parameters in a packed runtime layout: a packed
    tensor has no storage Python can see, so they go through the dense tensors and pack again.

    Subclasses say which tensors are packed (:meth:`_is_packed`), how to unpack one (:meth:`_dense`) and how to
    pack a dense parameter again where it still may be (:meth:`_repack`).
    """

    exact: ClassVar[bool] = False

    @staticmethod
    def _is_packed(tensor: torch.Tensor | None) -> bool:
        raise NotImplementedError

    @staticmethod
    def _dense(tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _repack(self, name: str) -> None:
        raise NotImplementedError

    @property
    def fusion_path(self) -> str:
        """The module's path in its model (from its fusion plan), for messages."""
        plan = attached_plan(self, ModulePlan)
        return getattr(plan, "path", "") or ""

    def fusion_mark_layout(self) -> None:
        """Record what traced code needs to know of the layout (a fake tensor shows none)."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        packed = [name for name, p in self._parameters.items() if self._is_packed(p)]
        if packed:
            parameters = dict(self._parameters)
            for name in packed:
                held = parameters[name]
                parameters[name] = standing_for(held, self._dense(held))
            state["_parameters"], state[_PACKED_STATE] = parameters, tuple(packed)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        packed = state.pop(_PACKED_STATE, ())
        super().__setstate__(state)
        for name in packed:
            self._repack(name)
        if PACKED_FLAG in self.__dict__:
            self.fusion_mark_layout()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # A packed tensor that fn leaves as it is (``.to("cpu")`` on the CPU) is kept as it is; any other is
        # unpacked, converted by nn.Module, and packed again where it still may be (on an accelerator it stays dense).
        parameters = self._parameters
        kept: dict[str, nn.Parameter] = {}
        unpacked: list[str] = []
        for name, held in list(parameters.items()):
            if held is None or not self._is_packed(held):
                continue
            try:
                unchanged = fn(held) is held
            except (RuntimeError, NotImplementedError, TypeError):
                unchanged = False
            if unchanged:
                kept[name], parameters[name] = held, None
            else:
                unpacked.append(name)
                parameters[name] = standing_for(held, self._dense(held))
        try:
            result = super()._apply(fn, recurse)
        finally:
            parameters.update(kept)  # the keys stayed in place (set to None), so the order is the original one
        for name in unpacked:
            self._repack(name)
        self.fusion_mark_layout()
        return result


class LinearKernelsMixin(PackedParametersMixin):
    """The fused behaviour mixed into an ``nn.Linear`` subclass: the packed kernel for a prepacked weight, the chosen
    kernel at few rows for a dense one."""

    bias: torch.Tensor | None
    exact: ClassVar[bool] = False
    """Take only kernels bit-identical to ``F.linear`` (the family's ``exact`` option picks the subclass)."""

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The weight parameter; for a packed one, read from outside the layer, a view that reads and writes it as
        the dense tensor (:mod:`fusion_linear_kernels.dense_view`). Traced code gets the parameter."""
        parameters = self._parameters
        if "weight" not in parameters:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'weight'")
        held = parameters["weight"]
        if is_packed(held) and not torch.compiler.is_compiling():
            return DenseView(self)
        return held  # type: ignore[return-value]  # None for a layer built without one, as nn.Linear allows

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        # ``layer.weight = nn.Parameter(...)`` (torchao's ``quantize_``, a user) comes here: traced code reads the
        # recorded layout, which must follow the new weight.
        super().register_parameter(name, param)
        if name == "weight" and PACKED_FLAG in self.__dict__:
            self.fusion_mark_layout()

    def store_dense_weight(self, dense: torch.Tensor) -> None:
        """Hold ``dense`` (written through :attr:`weight`) as the weight, packed again where the layer's kind packs."""
        self._parameters["weight"] = standing_for(self._parameters["weight"], dense)
        self._repack("weight")
        self.fusion_mark_layout()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        if torch.compiler.is_compiling():
            # Traced code cannot see the layout (a fake tensor is strided): the flag set whenever the weight is
            # packed or unpacked decides, and the custom operator checks the layout again when it runs.
            if self.__dict__.get(PACKED_FLAG):
                return packing.linear(input, weight, self.bias, self.fusion_path)
            return traced_linear(input, weight, self.bias, self.exact)
        if is_packed(weight):
            return packing.linear(input, weight, self.bias, self.fusion_path)
        caller = self.__dict__.get(CALLER_KEY)
        if caller is None:
            caller = self.__dict__[CALLER_KEY] = Caller(self.exact)
        return caller(input, weight, self.bias)

    @property
    def packed(self) -> bool:
        """Whether the weight is held in oneDNN's prepacked layout (:mod:`fusion_linear_kernels.packing`)."""
        return is_packed(self._parameters.get("weight"))

    def fusion_mark_layout(self) -> None:
        """Record whether the weight is packed where ``torch.compile`` reads it (see ``forward``), and on a packed
        weight its module's path (what a data-parallel wrapper's refusal names)."""
        self.__dict__[PACKED_FLAG] = self.packed
        if self.packed:
            data_parallel.label(self._parameters["weight"], self.fusion_path)

    def extra_repr(self) -> str:
        layout = ", weight=prepacked" if self.packed else ""
        return f"{super().extra_repr()}, kernels={'exact' if self.exact else 'within bound'}{layout}"

    _is_packed = staticmethod(is_packed)
    _dense = staticmethod(unpack)

    def _repack(self, name: str) -> None:
        dense = self._parameters[name]
        if dense is None:
            return
        (out,) = PrepackLinearWeight(self.exact).forward([dense.detach()])
        if is_packed(out):
            self._parameters[name] = standing_for(dense, out)


class ExactLinearKernelsMixin(LinearKernelsMixin):
    """:class:`LinearKernelsMixin` taking only kernels bit-identical to ``F.linear``."""

    exact: ClassVar[bool] = True


class ExpertsKernelsMixin(PackedParametersMixin):
    """The fused behaviour mixed into a transformers 5.x experts module: expert weights held prepacked per expert
    where that measured faster (:mod:`fusion_linear_kernels.packed_experts`), which then run the routed experts'
    packed GEMMs at every row count; otherwise, at decode, the experts implementation measured fastest for the kind
    of call (:mod:`fusion_linear_kernels.experts`)."""

    exact: ClassVar[bool] = False
    """Take only implementations bit-identical to the configured one (the family's ``exact`` option)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get(PACKED_FLAG):  # transformers' implementations cannot read packed stacks
            hidden_states, top_k_index, top_k_weights = \
                args if len(args) == 3 and not kwargs else _experts_arguments(args, kwargs)
            trained = torch.is_grad_enabled() and self._trained()
            if not trained and not torch.compiler.is_compiling() and self._autocast_casts(hidden_states):
                with self._dense_stacks():  # transformers' implementation, whose GEMMs autocast casts
                    return super().forward(*args, **kwargs)
            recording = trained or (torch.is_grad_enabled() and (hidden_states.requires_grad
                                                                 or top_k_weights.requires_grad))
            if torch.compiler.is_compiling() or recording:  # one operator: traced opaquely, differentiated by it
                return packed_experts.packed_experts_op(
                    hidden_states, top_k_index, top_k_weights,
                    packed_experts.TRAINED if trained else packed_experts.FROZEN,
                    self.__dict__[OPERATOR_KEY], self.fusion_path)
            return packed_experts.routed(self, hidden_states, top_k_index, top_k_weights, self.fusion_path)
        if torch.compiler.is_compiling() or kwargs or len(args) != 3:
            return super().forward(*args, **kwargs)
        hidden_states, top_k_index, top_k_weights = args
        return experts.run(self, hidden_states, top_k_index, top_k_weights, self.exact, super().forward)

    def _trained(self) -> bool:
        return any(p.requires_grad for p in self._parameters.values() if is_packed_experts(p))

    def _autocast_casts(self, hidden_states: torch.Tensor) -> bool:
        """Whether autocast would cast an operand of the experts' GEMMs (the packed GEMMs are not operators it casts
        for: they would compute in the stacks' dtype where the original computes in autocast's)."""
        return any(autocast_dtype(hidden_states, p, None) is not None
                   for p in self._parameters.values() if is_packed_experts(p))

    @contextmanager
    def _dense_stacks(self) -> Iterator[None]:
        """The packed stacks as dense, frozen parameters for the block (a temporary copy: autograd keeps autocast's
        casts of them until the backward), then the packed ones again."""
        parameters = self._parameters
        held = {name: p for name, p in parameters.items() if is_packed_experts(p)}
        try:
            for name, stack in held.items():
                parameters[name] = nn.Parameter(stack.dense(), requires_grad=False)
            yield
        finally:
            parameters.update(held)

    @property
    def packed(self) -> bool:
        """Whether the expert weights are held prepacked per expert."""
        return any(is_packed_experts(p) for p in self._parameters.values())

    def fusion_mark_layout(self) -> None:
        """Record whether the stacks are packed where ``torch.compile`` reads it (see ``forward``), register the
        module for the traced operator, and label each packed stack with its path (what a refusal names)."""
        self.__dict__[PACKED_FLAG] = self.packed
        if self.packed:
            self.__dict__[OPERATOR_KEY] = packed_experts.register(self)
            for name, stack in self._parameters.items():
                if is_packed_experts(stack):
                    data_parallel.label(stack, f"{self.fusion_path}.{name}")

    _is_packed = staticmethod(is_packed_experts)

    @staticmethod
    def _dense(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.dense()  # type: ignore[attr-defined, no-any-return]

    def _repack(self, name: str) -> None:
        dense = self._parameters[name]
        if dense is None or not packed_experts.packs_module(self, self.exact):
            return
        transposed = bool(getattr(self, "is_transposed", False))
        self._parameters[name] = standing_for(dense, packed_experts.pack(dense.detach(), transposed))

    def extra_repr(self) -> str:
        mode = "exact" if self.exact else "within bound"
        layout = "expert weights prepacked" if self.packed else "experts implementation at decode: measured"
        return f"{super().extra_repr()}, {layout} ({mode})".lstrip(", ")


def _experts_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """(hidden_states, top_k_index, top_k_weights) of an experts call, given by position or by name."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    missing = [name for name in names if name not in values]
    if missing or len(args) + len(kwargs) != 3:
        raise TypeError(f"an experts module takes (hidden_states, top_k_index, top_k_weights); got {len(args)} "
                        f"positional and {sorted(kwargs)} keyword arguments")
    return tuple(values[name] for name in names)


class ExactExpertsKernelsMixin(ExpertsKernelsMixin):
    """:class:`ExpertsKernelsMixin` taking only implementations bit-identical to the configured one."""

    exact: ClassVar[bool] = True


def refusal(module: nn.Module) -> str | None:
    """Why an ``nn.Linear`` is left alone; None for a plain one (and for modules that are not ``nn.Linear``)."""
    if not isinstance(module, nn.Linear):
        return None
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__qualname__} overrides nn.Linear.forward"
    if not is_plain_linear(module):
        return "its weight is not a 2-D nn.Parameter"
    return None


class LinearKernelsFamily(FusionFamily[LinearKernelsOptions]):
    """Each nn.Linear holds its weight prepacked where that measured faster, or runs the fastest kernel measured."""

    name = "linear_kernels"
    options_model = LinearKernelsOptions
    target_modules_patterns = ()

    def is_fusable(self, module: nn.Module, options: LinearKernelsOptions) -> bool:
        return (isinstance(module, nn.Linear) and is_plain_linear(module)) or experts.is_experts(module)

    def refusal(self, module: nn.Module, options: LinearKernelsOptions) -> str | None:
        return refusal(module)

    def make_fused_class(self, original_cls: type[nn.Module], options: LinearKernelsOptions) -> type[nn.Module]:
        return fused_class(original_cls, options.exact)

    # No make_transforms: discovery plans these layers without moving a tensor, so a layer whose weight an
    # enclosing family merges (q_proj under qkv) is left to that family (FusionPlan.nested); the packing
    # transform is bound to each remaining layer's plan when the load converts (see fusion_linear_kernels.plugin).


def fused_class(original_cls: type[nn.Module], exact: bool) -> type[nn.Module]:
    """The family's fused class for ``original_cls`` (an ``nn.Linear`` or a 5.x experts module) in a mode."""
    if issubclass(original_cls, nn.Linear):
        mixin: type = ExactLinearKernelsMixin if exact else LinearKernelsMixin
    else:
        mixin = ExactExpertsKernelsMixin if exact else ExpertsKernelsMixin
    return fused_subclass(mixin, original_cls)


def _packing_transforms(module: nn.Module, path: str, exact: bool) -> tuple[BoundTransform, ...] | None:
    """The packing transform (``weight`` -> ``weight`` in oneDNN's prepacked layout) bound to ``module``, or None
    where it could never pack: no weight, a weight :func:`~fusion_linear_kernels.packing.ineligible` refuses (a
    DTensor shard, a quantizer's tensor: nothing to run or verify), or in exact mode a layer with a bias (see
    :mod:`fusion_linear_kernels.packing`)."""
    weight = module._parameters.get("weight")
    if weight is None or ineligible(weight) is not None or (exact and module._parameters.get("bias") is not None):
        return None
    shapes = {name: tuple(t.shape) for name, t in module._parameters.items() if t is not None}
    return bind_transforms(LinearKernelsFamily.name, path, shapes,
                           [WeightTransform(("weight",), ("weight",), PrepackLinearWeight(exact=exact))])


def packing_plan(module: nn.Module, plan: ModulePlan) -> ModulePlan:
    """``plan`` (a ``linear_kernels`` layer's) with the packing transform bound (:func:`_packing_transforms`); the
    transform packs where :func:`fusion_linear_kernels.packing.packs` says so, at conversion."""
    exact = bool(getattr(plan.fused_class, "exact", False))
    bound = None if plan.transforms else _packing_transforms(module, plan.path, exact)
    return plan if bound is None else dataclasses.replace(plan, transforms=bound)


def experts_packing_plan(module: nn.Module, plan: ModulePlan) -> ModulePlan:
    """``plan`` (a 5.x experts module's) with :class:`~fusion_linear_kernels.packed_experts.PrepackExperts` bound to
    each 3-D expert weight where :func:`fusion_linear_kernels.packed_experts.packs_module` says so; else ``plan``."""
    exact = bool(getattr(plan.fused_class, "exact", False))
    if plan.transforms or not packed_experts.packs_module(module, exact):
        return plan
    transposed = bool(getattr(module, "is_transposed", False))
    shapes = {name: tuple(t.shape) for name, t in module._parameters.items() if t is not None}
    return dataclasses.replace(plan, transforms=bind_transforms(
        LinearKernelsFamily.name, plan.path, shapes,
        [WeightTransform((name,), (name,), PrepackExperts(transposed)) for name in packed_experts.stacks(module)]))


def merged_packing_plan(parent: ModulePlan, name: str, container: nn.Module, exact: bool) -> ModulePlan | None:
    """The plan that holds a merged container's weight packed (``parent``'s ``name`` child, a
    :class:`~fusion_core.plugin.MergedProjection` that ``qkv`` or ``gate_up`` built), or None where it stays as it is.

    Fusing it with this plan makes the container a ``linear_kernels`` layer nested in the merging family's module:
    its weight ``->`` the packed weight (the same transform as every other layer's), so ``state_dict``, saves and
    ``unfuse`` see the dense merged weight first and the merging family then splits it into the original parts.
    Left alone: a container that is not fusion-core's own (a quantizer replaced it), a weight that does not pack
    (:func:`~fusion_linear_kernels.packing.packs`: ineligible, not measured faster, not within the bound), and in
    exact mode a container with a bias.
    """
    weight = container._parameters.get("weight")
    if type(container) is not MergedProjection or not isinstance(weight, nn.Parameter):
        return None
    path = f"{parent.path}.{name}" if parent.path else name
    transforms = _packing_transforms(container, path, exact)
    # Only where the weight packs: otherwise the class switch would change nothing but the container's type.
    if transforms is None or not packs(weight.detach(), exact):
        return None
    leaves = tuple(leaf for leaf, tensor in container._parameters.items() if tensor is not None)
    return ModulePlan(family=LinearKernelsFamily.name, path=path, original_class=MergedProjection,
                      fused_class=fused_class(MergedProjection, exact), transforms=transforms,
                      original_leaves=leaves)
