"""Entry point of the ``fusion-linear-kernels`` distribution (group ``fusion_core``).

Besides the family, one lifecycle hook, a wrapper around the conversion of a load (or ``fuse``):

- before it, each ``linear_kernels`` layer's plan gets the packing transform bound
  (:func:`fusion_linear_kernels.family.packing_plan`). Discovery planned the layers without it, so that
  the core leaves a layer whose weight an enclosing family merges (``q_proj`` under ``qkv``) to that
  family, as it does for plans that move no tensor (``FusionPlan.nested``); the ones that remain are
  the ones this family fuses. A layer whose weight is shared with another module (a tied LM head,
  which *is* the embedding table) gets no transform: packing it would give the head a second copy
  of the table and untie it; it keeps the dense, shared weight and the measured kernel choice. The
  wrapper replaces plans, so it declares ``tryfirst=True``;
- after it, the merged projections of the other families (``qkv``, ``gate_up``:
  :class:`fusion_core.merged.MergedLinear`) get the same kernel choice as the plain layers, through
  their ``kernel`` extension point, in the mode the ``linear_kernels`` modules of that load were
  fused with (their merged weight stays dense: it belongs to the merging family's plan).

Without ``linear_kernels`` in the load nothing is touched. Two more hooks: ``fusion_module_fused`` records in
each fused layer whether its weight is packed (traced code reads that flag: a fake tensor shows no layout), and
``fusion_module_unfused`` drops it and puts an unfused layer's parameters back in their original order
(``fusion_core.unfuse`` registers a restored tensor anew, after the bias, when its fused name is its original name,
as ``weight`` is here). ``fusion_save_kwargs`` refuses a fused-layout save (``save_original_format=False``) of a
model holding packed weights, by name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Mapping, MutableSequence
from typing import Any

from torch import nn

from fusion_core.errors import SaveError
from fusion_core.hookspecs import hookimpl
from fusion_core.layout import presenting_fused
from fusion_core.merged import MergedLinear
from fusion_core.transforms import ModulePlan
from fusion_linear_kernels.family import PACKED_FLAG, LinearKernelsFamily, LinearKernelsMixin, kernel, packing_plan


@hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register(LinearKernelsFamily())


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
        chosen = kernel(modes.pop())
        for module, _ in built:
            merged = module.__dict__.get("_fusion_merged")
            if isinstance(merged, MergedLinear):
                merged.kernel = chosen
    return result


def bind_packing(model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]]) -> None:
    """Bind the packing transform to the plan of each ``linear_kernels`` layer whose weight no other module shares
    (a tied LM head keeps its plan without it): see the module docs."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for index, (module, plan) in enumerate(built):
        weight = module._parameters.get("weight") if plan.family == LinearKernelsFamily.name else None
        if weight is not None and uses[id(weight)] == 1:
            built[index] = (module, packing_plan(module, plan))


@hookimpl
def fusion_module_fused(module: nn.Module, plan: ModulePlan) -> None:
    if isinstance(module, LinearKernelsMixin):
        module.fusion_mark_layout()


@hookimpl
def fusion_module_unfused(module: nn.Module, plan: ModulePlan) -> None:
    if plan.family != LinearKernelsFamily.name:
        return
    module.__dict__.pop(PACKED_FLAG, None)
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
