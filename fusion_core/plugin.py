"""The plugin surface: every name a family or an integration may use beyond the top-level package.

A plugin imports from fusion-core only :mod:`fusion_core` (the user API, the protocol, the weight
transform ops, the errors) and this module; the shipped plugins do exactly that, and
``tests/test_plugin_surface.py`` fails on any other import. Everything here is public and
documented in ``docs/api.md``; whatever a plugin needs that is missing here is a gap in this
surface, to be filled here, never a reason to import a private module.

The names, by what they serve:

- **plans** (plain immutable data, :mod:`fusion_core.transforms`): :class:`ModulePlan` (what fusion
  does to one module; its ``packed_parts()``, :class:`PackedPart`, say which original tensors live in
  which slices of a fused one: the one source of that fact), :class:`FusionPlan` (one load),
  :class:`BoundTransform` / :class:`LeafSpec` (a transform bound to one instance's tensor shapes),
  ``Shape``, :func:`bind_transforms`, and the plans attached to models and modules:
  :func:`module_plan`, :func:`attached_plan`, :func:`attach_plan`, :func:`detach_plan`.
- **fused instances** (:mod:`fusion_core.layout`, :mod:`fusion_core.spec`): :func:`fuse_instance`
  (convert one built instance to its plan's fused layout), :func:`presenting_fused` (is a save
  writing the fused layout right now), :func:`take_own_block` (a state-dict post-hook's own keys),
  :func:`standing_for` (a tensor as the parameter replacing another: its ``requires_grad`` and library marks),
  :func:`fused_subclass` (one fused class per mixin and original class, picklable),
  :func:`spec_member` (an optional spec member or its default).
- **merged projections** (:mod:`fusion_core.merged`), for families that merge sibling ``nn.Linear``
  layers (``qkv``, ``gate_up``): :class:`MergingFamily` (the family side: finding, refusing, transforms)
  and :class:`MergedProjectionsMixin` (the fused class), :func:`merged_transforms`, :class:`MergedLinear`,
  :class:`MergedProjection`, :class:`MergedSlice`, :class:`LinearKernel`, :func:`container_parts`,
  :func:`merge_children`, :func:`merge_refusal`, :func:`is_plain_linear`, :func:`merged_projection`
  (a fused module's shared projection, or None).
- **reading a forward's source** (:mod:`fusion_core.forward_source`), for an exact ``is_fusable``:
  :func:`forwards`, :func:`aliases`, :class:`Aliases`, :func:`alternatives`, :func:`calls`,
  :func:`self_call`, :func:`value_of`.
- **tensors** (:mod:`fusion_core.wrapped`, :mod:`fusion_core.streaming`): :func:`concat` (merging parts, tensor
  subclasses included), :func:`is_torch_tensor`, :func:`same_bits`, :func:`process_memory_copies` (a loaded
  weight's bytes read from its checkpoint file into memory the process owns, where transformers left it mapped;
  on transparent huge pages if asked).
- **measured decisions** (:mod:`fusion_core.decisions`), for a choice of the faster way per kind of call:
  :class:`Decisions` (one topic's table: measured once per kind, stored per machine and software, forgotten
  by ``reset_state``), :func:`best_times` (the timer), :func:`faster` (the one tie rule), :func:`device_key`
  (a kind's device, an accelerator's model included), and for a pass that reads weights from memory as decode
  does, :func:`distinct_copies` and :func:`pass_size`.
- **tensor parallelism** (:mod:`fusion_core.parallel.rules`): :class:`TensorParallelRule`,
  :class:`Replicated`, :class:`PackedColwise`, :func:`is_dtensor`.
- **integrations**: :func:`load_quantization` (the quantization config a load asked for),
  :func:`compile_pattern` (RE2 patterns, as ``target_modules`` uses them), :func:`discover` (the plan
  a load would use, without reading a weight), :class:`FamilyRegistry` and :class:`PluginSource`
  (a registry of one's own and a plugin's name in it, to test hooks the way the core calls them).
- **facts about other libraries' releases** (the compat modules, where their private names live):
  :data:`LORA_MODULE`, :func:`wrap_lora_factories` (PEFT), :func:`native_bf16_gemms`,
  :func:`remove_state_dict_post_hooks` (torch), :func:`plan_style`, :func:`tensor_parallel_mesh`,
  :func:`tensor_parallel_size`, and for 5.x experts modules :func:`experts_implementation`,
  :func:`is_expert_parallel`, :func:`apply_gate` (transformers).

The names are imported on first use, like the top-level package's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusion_core.lazy import resolve as _resolve

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "BoundTransform": "fusion_core.transforms",
    "FusionPlan": "fusion_core.transforms",
    "LeafSpec": "fusion_core.transforms",
    "ModulePlan": "fusion_core.transforms",
    "Shape": "fusion_core.transforms",
    "attach_plan": "fusion_core.transforms",
    "attached_plan": "fusion_core.transforms",
    "bind_transforms": "fusion_core.transforms",
    "detach_plan": "fusion_core.transforms",
    "fuse_instance": "fusion_core.layout",
    "module_plan": "fusion_core.layout",
    "presenting_fused": "fusion_core.layout",
    "standing_for": "fusion_core.layout",
    "take_own_block": "fusion_core.layout",
    "fused_subclass": "fusion_core.spec",
    "spec_member": "fusion_core.spec",
    "LinearKernel": "fusion_core.merged",
    "MergedLinear": "fusion_core.merged",
    "MergedProjection": "fusion_core.merged",
    "MergedProjectionsMixin": "fusion_core.merged",
    "MergedSlice": "fusion_core.merged",
    "MergingFamily": "fusion_core.merged",
    "merged_transforms": "fusion_core.merged",
    "merged_projection": "fusion_core.merged",
    "PackedPart": "fusion_core.transforms",
    "container_parts": "fusion_core.merged",
    "is_plain_linear": "fusion_core.merged",
    "merge_children": "fusion_core.merged",
    "merge_refusal": "fusion_core.merged",
    "Aliases": "fusion_core.forward_source",
    "aliases": "fusion_core.forward_source",
    "alternatives": "fusion_core.forward_source",
    "calls": "fusion_core.forward_source",
    "forwards": "fusion_core.forward_source",
    "self_call": "fusion_core.forward_source",
    "value_of": "fusion_core.forward_source",
    "concat": "fusion_core.wrapped",
    "is_torch_tensor": "fusion_core.wrapped",
    "same_bits": "fusion_core.wrapped",
    "process_memory_copies": "fusion_core.streaming",
    "Decisions": "fusion_core.decisions",
    "best_times": "fusion_core.decisions",
    "device_key": "fusion_core.decisions",
    "distinct_copies": "fusion_core.decisions",
    "faster": "fusion_core.decisions",
    "pass_size": "fusion_core.decisions",
    "PackedColwise": "fusion_core.parallel.rules",
    "Replicated": "fusion_core.parallel.rules",
    "TensorParallelRule": "fusion_core.parallel.rules",
    "is_dtensor": "fusion_core.parallel.rules",
    "load_quantization": "fusion_core.integration_needs",
    "compile_pattern": "fusion_core.patterns",
    "discover": "fusion_core.discovery",
    "FamilyRegistry": "fusion_core.plugins",
    "PluginSource": "fusion_core.plugins",
    "LORA_MODULE": "fusion_core.compat.peft",
    "wrap_lora_factories": "fusion_core.compat.peft",
    "native_bf16_gemms": "fusion_core.compat.torch",
    "remove_state_dict_post_hooks": "fusion_core.compat.torch",
    "plan_style": "fusion_core.compat.transformers",
    "tensor_parallel_mesh": "fusion_core.compat.transformers",
    "tensor_parallel_size": "fusion_core.compat.transformers",
    "experts_implementation": "fusion_core.compat.transformers",
    "is_expert_parallel": "fusion_core.compat.transformers",
    "apply_gate": "fusion_core.compat.transformers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _resolve(globals(), _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from fusion_core.compat.peft import (
        LORA_MODULE as LORA_MODULE,
        wrap_lora_factories as wrap_lora_factories,
    )
    from fusion_core.compat.torch import (
        native_bf16_gemms as native_bf16_gemms,
        remove_state_dict_post_hooks as remove_state_dict_post_hooks,
    )
    from fusion_core.compat.transformers import (
        apply_gate as apply_gate,
        experts_implementation as experts_implementation,
        is_expert_parallel as is_expert_parallel,
        plan_style as plan_style,
        tensor_parallel_mesh as tensor_parallel_mesh,
        tensor_parallel_size as tensor_parallel_size,
    )
    from fusion_core.decisions import (
        Decisions as Decisions,
        best_times as best_times,
        device_key as device_key,
        distinct_copies as distinct_copies,
        faster as faster,
        pass_size as pass_size,
    )
    from fusion_core.discovery import discover as discover
    from fusion_core.forward_source import (
        Aliases as Aliases,
        aliases as aliases,
        alternatives as alternatives,
        calls as calls,
        forwards as forwards,
        self_call as self_call,
        value_of as value_of,
    )
    from fusion_core.integration_needs import load_quantization as load_quantization
    from fusion_core.layout import (
        fuse_instance as fuse_instance,
        module_plan as module_plan,
        presenting_fused as presenting_fused,
        standing_for as standing_for,
        take_own_block as take_own_block,
    )
    from fusion_core.merged import (
        LinearKernel as LinearKernel,
        MergedLinear as MergedLinear,
        MergedProjection as MergedProjection,
        MergedProjectionsMixin as MergedProjectionsMixin,
        MergedSlice as MergedSlice,
        MergingFamily as MergingFamily,
        container_parts as container_parts,
        is_plain_linear as is_plain_linear,
        merge_children as merge_children,
        merge_refusal as merge_refusal,
        merged_projection as merged_projection,
        merged_transforms as merged_transforms,
    )
    from fusion_core.parallel.rules import (
        PackedColwise as PackedColwise,
        Replicated as Replicated,
        TensorParallelRule as TensorParallelRule,
        is_dtensor as is_dtensor,
    )
    from fusion_core.patterns import compile_pattern as compile_pattern
    from fusion_core.plugins import FamilyRegistry as FamilyRegistry, PluginSource as PluginSource
    from fusion_core.spec import (
        fused_subclass as fused_subclass,
        spec_member as spec_member,
    )
    from fusion_core.streaming import process_memory_copies as process_memory_copies
    from fusion_core.transforms import (
        BoundTransform as BoundTransform,
        FusionPlan as FusionPlan,
        LeafSpec as LeafSpec,
        ModulePlan as ModulePlan,
        PackedPart as PackedPart,
        Shape as Shape,
        attach_plan as attach_plan,
        attached_plan as attached_plan,
        bind_transforms as bind_transforms,
        detach_plan as detach_plan,
    )
    from fusion_core.wrapped import (
        concat as concat,
        is_torch_tensor as is_torch_tensor,
        same_bits as same_bits,
    )
