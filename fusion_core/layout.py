"""Moving one fused instance's tensors between the original and the fused layout.

:func:`fuse_instance` is the one way an instance becomes fused (discovery's rehearsal on the
meta device, a fused load, :func:`fusion_core.fuse` and the test kit all call it), and
:func:`unfuse_instance` its inverse (:func:`fusion_core.unfuse`). Underneath,
:func:`convert_to_fused` applies a module plan's forward transforms in place (a reshape stays a
view of the loaded storage). :func:`attach_original_layout` installs the state-dict hooks that
make a fused module *present* the original layout: ``state_dict()`` (and so transformers'
``save_pretrained``) yields the original names, shapes and bytes, and ``load_state_dict`` accepts
them. Inside :func:`fused_layout` the fused tensors are presented as they are.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fusion_core import streaming
from fusion_core.aliases import split_views
from fusion_core.compat import torch as torch_compat
from fusion_core.errors import FusionError, FusionLoadError, SaveError
from fusion_core.mapped_files import MappedFiles
from fusion_core.plugins import get_registry
from fusion_core.spec import FusedModule
from fusion_core.transforms import BoundTransform, ModulePlan, PackedPart, attach_plan, attached_plan, detach_plan
from fusion_core.wrapped import same_bits

_PRESENT_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("fusion_core_present_fused", default=False)


@contextmanager
def fused_layout() -> Iterator[None]:
    """Inside this block, fused models' ``state_dict()`` returns the fused runtime layout."""
    token = _PRESENT_FUSED.set(True)
    try:
        yield
    finally:
        _PRESENT_FUSED.reset(token)


def presenting_fused() -> bool:
    """Whether ``state_dict()`` runs inside :func:`fused_layout` now: a plugin's hook that presents more of the
    original layout (a quantizer's module over fused tensors) stands aside then, as the core's does."""
    return _PRESENT_FUSED.get()


def take_own_block(state_dict: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Pop a module's own entries (``prefix``-relative names, in order) off the end of ``state_dict``.

    When a module's ``state_dict`` post-hook runs, its own block of keys is the end of the dict: a
    hook that rewrites the block takes it off with this and writes it back in the order it wants.
    """
    keys: list[str] = []
    for key in reversed(state_dict):
        if not key.startswith(prefix):
            break
        keys.append(key)
    return {key[len(prefix):]: state_dict.pop(key) for key in reversed(keys)}


def module_plan(module: nn.Module) -> ModulePlan | None:
    """The plan a fused instance was built from, or None for a module fusion did not touch."""
    return attached_plan(module, ModulePlan)


def _owner(module: nn.Module, leaf: str, create: bool = False) -> tuple[nn.Module, str]:
    path, _, name = leaf.rpartition(".")
    if not path:
        return module, name
    owner = module
    for part in path.split("."):
        child = owner._modules.get(part)
        if child is None:
            if not create:
                raise AttributeError(f"no sub-module {part!r} on the way to {leaf!r}")
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    return owner, name


def _pop_leaf(module: nn.Module, leaf: str) -> tuple[torch.Tensor, bool, bool, dict[str, Any]]:
    """Remove a tensor; return it, whether it was a parameter, its requires_grad and its :func:`_marks`."""
    owner, name = _owner(module, leaf)
    param = owner._parameters.get(name)
    if param is not None:
        # Leave the attribute as None (the ``bias=None`` convention), not absent: a sub-module that
        # gave its tensors away (q_proj -> qkv_proj) stays readable for code that inspects
        # ``module.bias`` while the model is still being loaded (transformers 5.x initialisation).
        owner._parameters[name] = None
        return param.detach(), True, param.requires_grad, _marks(param)
    buffer = owner._buffers.get(name)
    if buffer is not None:
        del owner._buffers[name]
        return buffer, False, False, {}
    raise AttributeError(f"{leaf!r} is neither a parameter nor a buffer")


_MARK_TYPES = (bool, int, float, str, type(None))


def _marks(param: torch.Tensor) -> dict[str, Any]:
    """The plain values a library set as attributes of a parameter (transformers 5.x marks each loaded one
    ``_is_hf_initialized``, and its ``_init_weights`` leaves a marked parameter alone). Only torch's own
    ``nn.Parameter``: a subclass's attributes (bitsandbytes' ``quant_type``, ``bnb_quantized``) are its class's
    state, which another tensor must not appear to have."""
    if type(param) is not nn.Parameter:
        return {}
    return {key: value for key, value in vars(param).items() if isinstance(value, _MARK_TYPES)}


def standing_for(held: torch.Tensor, tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as the parameter that replaces ``held`` (a layout change of the same values): ``held``'s
    ``requires_grad`` and the plain values libraries set as its attributes (:func:`_marks`), so code that reads them
    sees the parameter as it saw the one before."""
    param = nn.Parameter(tensor, requires_grad=bool(held.requires_grad))
    param.__dict__.update(_marks(held))
    return param


def _shared(marks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The marks every part carries alike: what the tensor made of them carries. Without them a fused parameter
    read as unmarked, and ``model.apply(model._init_weights)``, which leaves plain's loaded weights alone,
    initialised the merged q/k/v anew."""
    if not marks:
        return {}
    first, *others = marks
    return {key: value for key, value in first.items()
            if all(key in other and type(other[key]) is type(value) and other[key] == value for other in others)}


def convert_to_fused(
    module: nn.Module, plan: ModulePlan, verified: set[tuple[object, ...]] | None = None,
    files: MappedFiles | None = None, casts: Mapping[str, torch.dtype] | None = None,
) -> None:
    """Apply ``plan``'s forward transforms to ``module``'s tensors in place (meta tensors too).

    A transform whose target is its sources back to back is built by :func:`fusion_core.streaming.merge`
    (each byte written once; read from the checkpoint file where ``files``, the load's snapshot of
    mapped files, shows a source is a clean view of one), any other by the op's ``forward``.
    With ``verified`` (a set kept for one load), the first conversion of each (family, op, shapes,
    dtype) is run backwards and compared bit for bit with the loaded tensors: an op whose inverse
    loses data fails the load instead of a later save silently writing other bytes. ``casts`` names
    the parts loaded in their stored dtype, with the dtype each is cast to as it is merged
    (:mod:`fusion_core.casting`); the check compares with the cast parts.
    """
    for bound in plan.transforms:
        tensors = []
        kinds = []
        marks = []
        for spec in bound.sources:
            key = plan.full_key(spec.name)
            try:
                tensor, is_param, requires_grad, mark = _pop_leaf(module, spec.name)
            except AttributeError as exc:
                raise FusionLoadError(
                    f"family {plan.family!r}, module {plan.path!r}: tensor {key!r} is missing ({exc})"
                ) from None
            if tuple(tensor.shape) != spec.shape:
                raise FusionLoadError(
                    f"family {plan.family!r}, module {plan.path!r}: tensor {key!r} has shape "
                    f"{tuple(tensor.shape)}, the plan expects {spec.shape}"
                )
            tensors.append(tensor)
            kinds.append((is_param, requires_grad))
            marks.append(mark)
        wanted = [casts.get(spec.name) if casts else None for spec in bound.sources]
        with torch.no_grad():
            merged = streaming.merge(bound.op, tensors, files, _one_dtype(tensors, wanted))
            if merged is None and any(wanted):  # the op runs on the parts as transformers would have cast them
                tensors, wanted = _cast(tensors, wanted), [None] * len(wanted)
            outputs = (merged,) if merged is not None else bound.op.forward(tensors)
            if verified is not None:
                _verify_inverse(plan, bound, tensors, wanted, outputs, verified)
        is_param = kinds[0][0]
        requires_grad = any(rg for _, rg in kinds)
        shared = _shared(marks)
        for spec, output in zip(bound.targets, outputs, strict=True):
            owner, name = _owner(module, spec.name, create=True)
            if is_param:
                param = nn.Parameter(output, requires_grad=requires_grad)
                param.__dict__.update(shared)
                owner.register_parameter(name, param)
            else:
                owner.register_buffer(name, output)


def _one_dtype(tensors: list[torch.Tensor], wanted: list[torch.dtype | None]) -> torch.dtype | None:
    """The dtype every part has once cast as ``wanted`` says; None with no cast, or when they would differ."""
    if not any(wanted):
        return None
    dtypes = {want or t.dtype for t, want in zip(tensors, wanted, strict=True)}
    return dtypes.pop() if len(dtypes) == 1 else None


def _cast(tensors: list[torch.Tensor], wanted: list[torch.dtype | None]) -> list[torch.Tensor]:
    return [t if want is None else t.to(want) for t, want in zip(tensors, wanted, strict=True)]


def _verify_inverse(
    plan: ModulePlan, bound: Any, tensors: list[torch.Tensor], wanted: list[torch.dtype | None], outputs: Any,
    verified: set[tuple[object, ...]],
) -> None:
    dtypes = tuple(want or t.dtype for t, want in zip(tensors, wanted, strict=True))
    key = (plan.family, repr(bound.op), tuple(s.shape for s in bound.sources), dtypes)
    if key in verified:
        return
    tensors = _cast(tensors, wanted)  # the loaded parts, cast as the merge cast them
    shapes = [s.shape for s in bound.sources]
    # What a save presents: aliases of the merged bytes where the op allows them, else the op's inverse.
    back = split_views(bound.op, list(outputs), shapes) or bound.op.inverse(list(outputs), shapes)
    for spec, original, restored in zip(bound.sources, tensors, back, strict=True):
        if not same_bits(original, restored):
            raise FusionLoadError(
                f"family {plan.family!r}, module {plan.path!r}: {bound.op!r} is not invertible: its inverse does not "
                f"restore tensor {plan.full_key(spec.name)!r} bit for bit, so saving would not reproduce the checkpoint"
            )
    verified.add(key)


def _present_original(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any = None
) -> None:
    if _PRESENT_FUSED.get():
        return
    plan = module_plan(module)
    if plan is None:
        return
    # Transform the module's own block of keys and put it back in the original order, so sharding
    # stays what it was.
    block = take_own_block(state_dict, prefix)
    order = {name: i for i, name in enumerate(plan.original_leaves)}
    with torch.no_grad():
        for bound in plan.transforms:
            if not all(t.name in block for t in bound.targets):
                _refuse_stray_fused(module, plan, bound, block, prefix)
                continue
            fused = [block.pop(t.name) for t in bound.targets]
            shapes = [s.shape for s in bound.sources]
            # No copy where the parts can be aliases of the merged tensor's bytes: a save holds no second copy.
            originals = split_views(bound.op, fused, shapes) or bound.op.inverse(fused, shapes)
            for spec, tensor in zip(bound.sources, originals, strict=True):
                presented = _presented(module, spec.name)
                order[presented] = order[spec.name]
                block[presented] = tensor
    children = {name: i for i, name in enumerate(module._modules)}

    def position(leaf: str) -> tuple[int, int]:
        # Own tensors first, then each child's in module order (as nn.Module.state_dict goes); in a
        # child, the original tensors before anything a wrapper added (an adapter's lora_A, ...).
        child = leaf.partition(".")[0] if "." in leaf else None
        return (-1 if child is None else children.get(child, len(children)), order.get(leaf, len(order)))

    for leaf in sorted(block, key=position):
        state_dict[prefix + leaf] = block[leaf]


def _refuse_stray_fused(module: nn.Module, plan: ModulePlan, bound: BoundTransform, block: dict[str, Any],
                        prefix: str) -> None:
    """Raise when a transform's fused tensors are no longer held where the plan put them, but are in the block.

    Something replaced or wrapped the fused module after the load (a wrapper holding it as ``.inner``, PEFT's
    ``base_layer``): the inverse cannot run, and writing what is there would put fused-layout tensors in a save
    that claims the original layout. A fused tensor still held by its module under its name, in a form that
    writes other keys (a quantizer's tensor: ``weight._data``), is its integration's to present; a transform
    none of whose tensors are in the block (a partial state dict) has nothing to convert.
    """
    moved = []
    for target in bound.targets:
        path, _, leaf = target.name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        if leaf not in owner._parameters and leaf not in owner._buffers:
            moved.append(target.name)
    stray = sorted(key for key in block for name in moved
                   if key == name or (name.rpartition(".")[0] and key.startswith(name.rpartition(".")[0] + ".")))
    if stray:
        raise SaveError(
            f"family {plan.family!r}, module {plan.path or '<root>'!r}: cannot write the original layout: the "
            f"fused tensor(s) {[t.name for t in bound.targets]} are not all where the plan put them "
            f"(found {[prefix + key for key in stray]}); was the fused module replaced or wrapped after the load? "
            f"{_WRAPPER_HINT if any('base_layer' in key for key in stray) else ''}"
            "Unwrap it, or save with save_original_format=False"
        )


_WRAPPER_HINT = ("An adapter layer (PEFT's base_layer) wraps it: PEFT on fused modules needs fusion-core's 'peft' "
                 "integration (pip install fusion-peft), which targets and saves adapters under the original names. ")


def _presented(module: nn.Module, leaf: str) -> str:
    """The name the unfused model gives ``leaf`` now: through wrappers that hold the original module as
    ``base_layer`` (PEFT's tuner layers: ``q_proj.weight`` is ``q_proj.base_layer.weight`` there)."""
    path, _, name = leaf.rpartition(".")
    if not path:
        return leaf
    parts: list[str] = []
    owner = module
    for part in path.split("."):
        child = owner._modules.get(part)
        if child is None:
            return leaf
        owner = child
        parts.append(part)
    while name not in owner._parameters and name not in owner._buffers:
        wrapped = owner._modules.get("base_layer")
        if wrapped is None:
            break
        owner = wrapped
        parts.append("base_layer")
    return ".".join([*parts, name])


def _accept_original(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    plan = module_plan(module)
    if plan is None or _PRESENT_FUSED.get():
        return
    with torch.no_grad():
        for bound in plan.transforms:
            keys = [prefix + _presented(module, s.name) for s in bound.sources]
            if not all(k in state_dict for k in keys):
                continue
            outputs = bound.op.forward([state_dict.pop(k) for k in keys])
            for spec, tensor in zip(bound.targets, outputs, strict=True):
                state_dict[prefix + spec.name] = tensor


def attach_original_layout(module: nn.Module, plan: ModulePlan) -> None:
    """Make ``module`` present the original layout in ``state_dict``/``load_state_dict``."""
    if module_plan(module) is not None:
        return
    attach_plan(module, plan)
    module.register_state_dict_post_hook(_present_original)  # type: ignore[no-untyped-call]
    module.register_load_state_dict_pre_hook(_accept_original)  # type: ignore[no-untyped-call]


def detach_original_layout(module: nn.Module) -> None:
    """Remove what :func:`attach_original_layout` installed.

    The hooks are found by the functions they call, not by handles: a handle of a deep-copied or
    unpickled module would still point at the original module's hook table.
    """
    detach_plan(module, ModulePlan)
    torch_compat.remove_layout_hooks(module, _present_original, _accept_original)


def finalize(module: nn.Module, plan: ModulePlan) -> None:
    """Attach the layout hooks and let the fused class set itself up."""
    attach_original_layout(module, plan)
    hook = getattr(module, "fusion_finalize", None)
    if callable(hook):
        hook()


def fuse_instance(
    module: nn.Module, plan: ModulePlan, verified: set[tuple[object, ...]] | None = None, *, convert: bool = True,
    files: MappedFiles | None = None, casts: Mapping[str, torch.dtype] | None = None,
) -> None:
    """Fuse one built instance in place, as ``plan`` says: the one code path for "fuse one module".

    Switches ``module`` to ``plan.fused_class`` (a routed build already did), moves its tensors
    into the fused layout (``convert=False`` when they were loaded in that layout already; see
    :func:`convert_to_fused` for ``verified``, ``files`` and ``casts``), attaches the hooks that present the original
    layout, calls the fused class's ``fusion_finalize``, and then the
    :func:`~fusion_core.hookspecs.fusion_module_fused` hook of every plugin. Raises
    :class:`~fusion_core.errors.FusionLoadError` for an instance of another class or with
    missing or mis-shaped tensors; the family's own errors propagate as they are.
    """
    if type(module) is not plan.fused_class:
        if type(module) is not plan.original_class:
            raise FusionLoadError(
                f"family {plan.family!r}, module {plan.path!r}: is a {type(module).__qualname__}, the plan fuses "
                f"{plan.original_class.__qualname__}"
            )
        module.__class__ = plan.fused_class
    if convert:
        convert_to_fused(module, plan, verified, files, casts)
    finalize(module, plan)
    get_registry().hook.fusion_module_fused(module=module, plan=plan)


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name, None) not in (None, getattr(FusedModule, name))


def unfuse_refusal(module: nn.Module) -> str | None:
    """Why :func:`unfuse_instance` cannot return ``module`` to its original form exactly; None when it can.

    The fused class's own reason first, then the first plugin's (:func:`~fusion_core.hookspecs.fusion_unfuse_refusal`).
    """
    plan = module_plan(module)
    if plan is None or type(module) is not plan.fused_class:
        return f"{type(module).__qualname__} is not a module fusion-core fused (no plan attached)"
    cls = type(module)
    if _overrides(cls, "fusion_finalize") and not _overrides(cls, "fusion_unfinalize"):
        return (
            f"family {plan.family!r}, module {plan.path!r}: its fused class sets itself up in fusion_finalize but "
            "has no fusion_unfinalize, so it cannot be returned to its original class exactly"
        )
    reason: str | None = get_registry().ensure(plan.family).hook.fusion_unfuse_refusal(module=module, plan=plan)
    return None if reason is None else f"family {plan.family!r}, module {plan.path!r}: {reason}"


def unfuse_instance(module: nn.Module) -> None:
    """Return one fused instance to its original class and tensor layout, in place.

    The inverse of :func:`fuse_instance`: the fused tensors go back through the plan's inverse
    transforms into the original names and shapes (each one a fresh, contiguous tensor of its
    own, as the original module held them), ``fusion_unfinalize`` undoes ``fusion_finalize``,
    containers that fusion created are removed, and the class is switched back. Raises
    :class:`~fusion_core.errors.FusionError` before changing anything when the module is not
    fused or its fused class cannot undo its ``fusion_finalize``.
    """
    reason = unfuse_refusal(module)
    if reason is not None:
        raise FusionError(reason)
    plan = module_plan(module)
    if plan is None:  # unfuse_refusal said so already; for type checkers
        raise FusionError(f"{type(module).__qualname__} is not a module fusion-core fused")
    restored: list[tuple[str, torch.Tensor, bool, bool, dict[str, Any]]] = []
    with torch.no_grad():
        for bound in plan.transforms:
            fused: list[tuple[torch.Tensor, bool, bool]] = []
            for spec in bound.targets:
                owner, name = _owner(module, spec.name)
                param = owner._parameters.get(name)
                tensor = param if param is not None else owner._buffers.get(name)
                is_param = param is not None
                if tensor is None:
                    raise FusionError(
                        f"family {plan.family!r}, module {plan.path!r}: fused tensor {plan.full_key(spec.name)!r} "
                        "is missing"
                    )
                fused.append((tensor, is_param, tensor.requires_grad))
            originals = bound.op.inverse([t for t, _, _ in fused], [s.shape for s in bound.sources])
            is_param, requires_grad = fused[0][1], any(rg for _, _, rg in fused)
            shared = _shared([_marks(t) for t, param, _ in fused if param])
            for spec, tensor in zip(bound.sources, originals, strict=True):
                restored.append((spec.name, tensor.detach().clone(memory_format=torch.contiguous_format),
                                 is_param, requires_grad, shared))
    undo = getattr(module, "fusion_unfinalize", None)
    if callable(undo):
        undo()
    for bound in plan.transforms:
        for spec in bound.targets:
            owner, name = _owner(module, spec.name)
            owner._parameters.pop(name, None)
            owner._buffers.pop(name, None)
    _drop_created_containers(module, plan)
    for name, tensor, is_param, requires_grad, marks in restored:
        owner, leaf = _owner(module, name)
        if is_param:
            param = nn.Parameter(tensor, requires_grad=requires_grad)
            param.__dict__.update(marks)
            owner.register_parameter(leaf, param)
        else:
            owner.register_buffer(leaf, tensor)
    detach_original_layout(module)
    module.__class__ = plan.original_class
    get_registry().ensure(plan.family).hook.fusion_module_unfused(module=module, plan=plan)


def _drop_created_containers(module: nn.Module, plan: ModulePlan) -> None:
    """Remove the empty sub-modules that :func:`convert_to_fused` created to hold fused tensors."""
    kept = {leaf.rpartition(".")[0] for leaf in plan.original_leaves}
    kept |= {prefix for path in kept for prefix in _prefixes(path)}
    for bound in plan.transforms:
        for spec in bound.targets:
            for path in reversed(_prefixes(spec.name.rpartition(".")[0])):
                if path in kept:
                    continue
                parent, name = _owner(module, path)
                child = parent._modules.get(name)
                if child is not None and not (child._parameters or child._buffers or child._modules):
                    del parent._modules[name]


def _prefixes(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``; ``""`` -> ``[]``."""
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


# -- the original names of a fused model's tensors ----------------------------------------------------
def original_named_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` under the original checkpoint names: a merged parameter gives each part.

    A fused model's ``named_parameters()`` lists what it holds (``qkv_proj.weight``), while its
    ``state_dict()`` and every save use the original names (``q_proj.weight``, ...). This yields the
    parameters as the unfused model named them: each part of a merged parameter is a view of its rows
    (:meth:`~fusion_core.transforms.ModulePlan.packed_parts`), so reading, initialising or copying into
    it writes through, and its gradient is those rows of the merged one. ``requires_grad`` belongs to the
    merged parameter: a part cannot be frozen alone (freeze the merged parameter, or load without the
    family). A fused tensor held in a form with no slice per part (transposed, packed) is yielded under
    its fused name.
    """
    parts_of: dict[str, list[tuple[str, PackedPart]]] = {}
    position: dict[str, int] = {}
    for prefix, module in model.named_modules():
        position[prefix] = len(position)
        plan = module_plan(module)
        for part in plan.packed_parts() if plan is not None else ():
            full = f"{prefix}.{part.fused}" if prefix else part.fused
            parts_of.setdefault(full, []).append((f"{prefix}.{part.original}" if prefix else part.original, part))
    named: list[tuple[str, torch.Tensor]] = []
    for name, parameter in model.named_parameters():
        parts = parts_of.get(name)
        if not parts or any(parameter.shape[p.dim] < p.start + p.length for _, p in parts):
            named.append((name, parameter))
            continue
        named += [(original, parameter.narrow(part.dim, part.start, part.length)) for original, part in parts]
    # In the unfused model's order: by owning module (the parts' modules keep their places in the tree).
    yield from sorted(named, key=lambda item: position.get(item[0].rpartition(".")[0], len(position)))


def original_parameter(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter the unfused model calls ``name`` (``model.layers.0.self_attn.q_proj.weight``): a view of its
    rows of the merged parameter where fusion merged it; ``AttributeError`` naming it otherwise."""
    for original, tensor in original_named_parameters(model):
        if original == name:
            return tensor
    raise AttributeError(f"{type(model).__name__} has no parameter {name!r} under its original names "
                         "(fusion_core.original_named_parameters lists them)")
