"""Entry point of the ``fusion-linear-kernels`` distribution (group ``fusion_core``).

Besides the family, one lifecycle hook, a wrapper around the conversion of a load (or ``fuse``):

- before it, each ``linear_kernels`` layer's plan gets the packing transform bound
  (:func:`fusion_linear_kernels.family.packing_plan`). Discovery planned the layers without it, so that
  the core leaves a layer whose weight an enclosing family merges (``q_proj`` under ``qkv``) to that
  family, as it does for plans that move no tensor (``FusionPlan.nested``); the ones that remain are
  the ones this family fuses. A layer whose weight is shared with another module (a tied LM head,
  which *is* the embedding table) gets no transform: packing it would give the head a second copy
  of the table and untie it; it keeps the dense, shared weight and the measured kernel choice. Nor
  does a layer whose weight the model's code reads directly (``self.dt_proj.weight @ x`` in Mamba:
  :mod:`fusion_linear_kernels.direct_reads`). The wrapper replaces plans, so it declares ``tryfirst=True``;
- after it, the merged projections of the other families (``qkv``, ``gate_up``:
  :class:`fusion_core.plugin.MergedLinear`) get what the plain layers get, in the mode the
  ``linear_kernels`` modules of that load were fused with: a merged container whose weight packs is
  fused as a ``linear_kernels`` layer of its own, nested in the merging family's module
  (:func:`pack_merged`), and runs the merged GEMM packed; the others get the kernel choice through
  their ``kernel`` extension point (a :class:`~fusion_linear_kernels.choice.Caller` each).

Then the dense weights all of these run that lie in the checkpoint's file mapping are read into the process's own
memory (:mod:`fusion_linear_kernels.residence`). Last, outside exact mode, each decoder layer whose form verifies gets
the decode step (:mod:`fusion_linear_kernels.decode_layer`: its class switched through a plan of this family, which
``fusion_core.unfuse`` undoes; ``fusion_module_unfused`` drops the form it kept).

Without ``linear_kernels`` in the load nothing is touched. Two more hooks: ``fusion_module_fused`` records in
each fused layer whether its weight is packed (traced code reads that flag: a fake tensor shows no layout), and
``fusion_module_unfused`` drops it and puts an unfused layer's parameters back in their original order
(``fusion_core.unfuse`` registers a restored tensor anew, after the bias, when its fused name is its original name,
as ``weight`` is here). ``fusion_save_kwargs`` refuses a fused-layout save (``save_original_format=False``) of a
model holding packed weights, by name. The measured decisions (kernel, packing, experts) live in fusion-core's
decisions facility (:class:`fusion_core.plugin.Decisions`), which ``fusion_core.reset_state()`` resets: no hook of this
plugin's is needed for them. ``fusion_reset_state`` forgets the kernels built in this process (the GEMV's,
:func:`fusion_linear_kernels.row_dot.clear`, and the decode step's, :func:`fusion_linear_kernels.layer_kernel.clear`
and :func:`fusion_linear_kernels.attention_kernel.clear`: each is built again at its next call) and whether a failed
build was already reported.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Generator, Mapping, MutableSequence
from typing import Any

from torch import nn

from fusion_core import ModulePlan, SaveError, hookimpl
from fusion_core.plugin import MergedLinear, fuse_instance, merged_projection, presenting_fused
from fusion_linear_kernels import (
    attention_kernel,
    cache_growth,
    layer_kernel,
    projection_kernel,
    row_dot,
    step_kernel,
)
from fusion_linear_kernels.choice import Caller, traced_linear
from fusion_linear_kernels.decode_layer import ATTENTION_KEY, FORM_KEY, ONE_CALL_KEY, read_by_steps, switch_layers
from fusion_linear_kernels.direct_reads import read_directly
from fusion_linear_kernels.experts import is_experts
from fusion_linear_kernels.family import (
    CALLER_KEY,
    OPERATOR_KEY,
    PACKED_FLAG,
    LinearKernelsFamily,
    LinearKernelsMixin,
    PackedParametersMixin,
    experts_packing_plan,
    merged_packing_plan,
    packing_plan,
)
from fusion_linear_kernels.packed_experts import stacks
from fusion_linear_kernels.residence import move_into_process_memory


@hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register(LinearKernelsFamily())


@hookimpl
def fusion_reset_state() -> None:
    row_dot.clear()
    layer_kernel.clear()
    attention_kernel.clear()
    cache_growth.clear()
    projection_kernel.clear()
    step_kernel.clear()


@hookimpl(wrapper=True, tryfirst=True)
def fusion_convert_loaded(
    model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]], families: Mapping[str, Any]
) -> Generator[None, None, None]:
    if LinearKernelsFamily.name in families:
        bind_packing(model, built)
    result = yield
    if LinearKernelsFamily.name not in families:
        return result
    modes = {module.exact for module, _ in built if isinstance(module, LinearKernelsMixin)}
    if len(modes) == 1:
        (exact,) = modes
        shared = _shared_parameters(model)
        verified: set[tuple[object, ...]] = set()
        read = set() if exact else read_by_steps(model)
        for module, plan in built:
            merged = merged_projection(module)
            if merged is not None:
                merged.kernel = Caller(exact)  # each its own: a Caller remembers its last call
                merged.traced_kernel = functools.partial(traced_linear, exact=exact)
                pack_merged(module, plan, merged, exact, shared | read_by_a_step(merged.owner, read), verified)
    if not any(isinstance(module, PackedParametersMixin) and module.exact for module, _ in built):
        # Exact mode keeps each weight where the load put it: a GEMM's bits can depend on the weight's address (on
        # an AMD EPYC, F.linear of a float32 32x32 weight 24 bytes past a 64-byte boundary differs from the same
        # weight 64-byte aligned), and the copy would be aligned where plain's file view is not.
        move_into_process_memory(model, decode_weights(built))
    if modes == {False}:
        switch_layers(model, LinearKernelsFamily.name)
    return result


def decode_weights(built: MutableSequence[tuple[nn.Module, ModulePlan]]) -> list[nn.Parameter]:
    """The parameters the layers this family fused, and the merged projections it set a kernel on, read at decode
    (a packed one is skipped later: it has no storage to move)."""
    layers = [module for module, _ in built if isinstance(module, PackedParametersMixin)]
    layers += [merged.owner for module, _ in built if (merged := merged_projection(module)) is not None]
    return [p for layer in layers for p in layer.parameters(recurse=False)]


def pack_merged(parent: nn.Module, plan: ModulePlan, merged: MergedLinear, exact: bool, shared: set[int],
                verified: set[tuple[object, ...]]) -> None:
    """Fuse the merged container of ``parent`` as a packed ``linear_kernels`` layer where its weight packs
    (:func:`fusion_linear_kernels.family.merged_packing_plan`) and is not among ``shared`` (the ids of weights never
    packed: tied ones, and those a decode step reads); the merged projection then calls the container, which runs the
    merged GEMM packed, and slices its output."""
    owner = merged.owner
    name = next((child for child, module in parent._modules.items() if module is owner), None)
    weight = owner._parameters.get("weight")
    if name is None or weight is None or id(weight) in shared:
        return
    container_plan = merged_packing_plan(plan, name, owner, exact)
    if container_plan is not None:
        fuse_instance(owner, container_plan, verified)


def read_by_a_step(module: nn.Module, read: set[int]) -> set[int]:
    """The ids of ``module``'s parameters where a decoder layer's decode step would read its weight (``module`` among
    ``read``, what :func:`~fusion_linear_kernels.decode_layer.read_by_steps` found; a weight the GEMV kernel reads,
    :func:`~fusion_linear_kernels.row_dot.gemv_weight`; the step's kernel built for its dtype): such weights are never
    packed (see there). Else none: a smaller weight, say, packs where measured faster, as the step cannot read it."""
    weight = module._parameters.get("weight")
    if (id(module) not in read or not isinstance(weight, nn.Parameter) or not row_dot.gemv_weight(weight)
            or layer_kernel.kernel(weight.dtype) is None):
        return set()
    return {id(parameter) for parameter in module._parameters.values() if parameter is not None}


def _shared_parameters(model: nn.Module) -> set[int]:
    """The ids of parameters that more than one module holds (tied weights): never packed."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {key for key, count in uses.items() if count > 1}


def bind_packing(model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]]) -> None:
    """Bind the packing transform to the plan of each ``linear_kernels`` layer whose weight no other module shares
    (a tied LM head keeps its plan without it), no model code reads directly
    (:mod:`fusion_linear_kernels.direct_reads`) and, outside exact mode, no decoder layer's decode step would read
    (:func:`~fusion_linear_kernels.decode_layer.read_by_steps`): see the module docs."""
    shared = _shared_parameters(model)
    read = read_by_steps(model)
    for index, (module, plan) in enumerate(built):
        if plan.family != LinearKernelsFamily.name:
            continue
        kept = shared if getattr(plan.fused_class, "exact", False) else shared | read_by_a_step(module, read)
        packable = stacks(module) if is_experts(module) else {"weight": module._parameters.get("weight")}
        if (packable and all(p is not None and id(p) not in kept for p in packable.values())
                and read_directly(model, plan.path, tuple(packable)) is None):
            bind = experts_packing_plan if is_experts(module) else packing_plan
            built[index] = (module, bind(module, plan))


@hookimpl
def fusion_module_fused(module: nn.Module, plan: ModulePlan) -> None:
    if isinstance(module, PackedParametersMixin):
        module.fusion_mark_layout()


@hookimpl
def fusion_module_unfused(module: nn.Module, plan: ModulePlan) -> None:
    if plan.family != LinearKernelsFamily.name:
        return
    for derived in (PACKED_FLAG, OPERATOR_KEY, CALLER_KEY, FORM_KEY, ATTENTION_KEY, ONE_CALL_KEY):
        module.__dict__.pop(derived, None)
    order = {name: index for index, name in enumerate(plan.original_leaves)}
    parameters = module._parameters
    items = sorted(parameters.items(), key=lambda item: order.get(item[0], len(order)))
    parameters.clear()
    parameters.update(items)


@hookimpl
def fusion_save_kwargs(model: nn.Module, save_kwargs: dict[str, Any]) -> None:
    """Refuse a fused-layout save (``save_original_format=False``) of a model holding packed weights."""
    if not presenting_fused():
        return
    packed = next((path for path, m in model.named_modules() if isinstance(m, LinearKernelsMixin) and m.packed), None)
    if packed is not None:
        raise SaveError(
            f"family 'linear_kernels', module {packed!r}: its weight is held prepacked (oneDNN's opaque layout), "
            "which has no checkpoint form; save with save_original_format=True (the default: for this family the "
            "same tensors), or call fusion_core.unfuse(model) first"
        )
