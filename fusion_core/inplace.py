"""In-memory verbs: fuse an already built model in place, and return a fused model to its original form.

``fusion_core.fuse(model, fusion_config)`` is for models that did not come from
:func:`fusion_core.from_pretrained`: built with ``from_config``, handed over by a pipeline or a
training script. It runs the same discovery (so :func:`fusion_core.get_fusion_plan` gives the same
plan as a fused load of that model) and fuses each planned instance with the same function a
fused load uses (:func:`fusion_core.layout.fuse_instance`). ``fusion_core.unfuse(model)`` is its
inverse for any fused model: afterwards the model holds its original classes and ``state_dict()``
is bit-identical to the unfused model's.

Both check every instance before changing any, and refuse what they cannot do exactly with a
:class:`~fusion_core.errors.FusionError` naming the module: a module that differs from what
discovery planned, tensors on the meta device, and whatever a plugin refuses through the
:func:`~fusion_core.hookspecs.fusion_fuse_refusal` / :func:`~fusion_core.hookspecs.fusion_unfuse_refusal`
hooks (the PEFT integration: a model that already carries adapters; attach adapters after fusing,
and merge or unload them before unfusing). What only fails on real data (a family's op or
``fusion_finalize``, a plugin's hook) fails ``fuse`` as a whole: the model is put back as it was
before the call, so a caller never holds a half-fused model.
"""

from __future__ import annotations

import copy
import itertools
import sys
from typing import Any, TypeVar

from torch import nn

from fusion_core.config import parse_fusion_config
from fusion_core.discovery import discover
from fusion_core.errors import FusionError, FusionLoadError
from fusion_core.hf import convert_with_hooks, get_fusion_plan, mark_fused, mark_unfused
from fusion_core.layout import fuse_instance, module_plan, unfuse_instance, unfuse_refusal
from fusion_core.patching import LOAD_LOCK
from fusion_core.plugins import get_registry
from fusion_core.random_state import kept_random_state
from fusion_core.record import LEGACY_KEY, RECORD_KEY, pop_stored_fusion_config
from fusion_core.transforms import ModulePlan

ModelT = TypeVar("ModelT", bound=nn.Module)

__all__ = ["fuse", "unfuse"]


def fuse(model: ModelT, fusion_config: Any) -> ModelT:
    """Fuse ``model`` in place with the families of ``fusion_config``; return it (for chaining).

    ``model`` is a built transformers model (anything with a ``config``), unfused, with its
    weights on a real device. ``fusion_config`` is what :func:`fusion_core.from_pretrained`
    takes (a mapping or a :class:`~fusion_core.FusionConfig`); with no family enabled the model
    is returned untouched. Afterwards the model computes what it computed before,
    :func:`fusion_core.get_fusion_plan` returns the plan a fused load would have used, and
    :func:`fusion_core.save_pretrained` writes the original checkpoint layout.

    Raises ``pydantic.ValidationError`` for a bad ``fusion_config``, the discovery errors a fused
    load raises, and :class:`~fusion_core.errors.FusionError` (before changing anything) for a
    model that is already fused or carries adapters, or whose planned modules are not what the
    plan expects. All or nothing past those checks: when converting fails (a
    :class:`~fusion_core.errors.FusionLoadError` naming the family and module, from the family's
    own error) or a plugin's hook raises, the model gets back its classes, tensors, hooks and
    config attributes as they were before the call, and the error propagates with a note saying so.
    The process's random generators are left where they were (:mod:`fusion_core.random_state`).
    """
    with kept_random_state():
        return _fused(model, fusion_config)


def _fused(model: ModelT, fusion_config: Any) -> ModelT:
    """:func:`fuse`'s work, with the generators kept around it."""
    fusion = parse_fusion_config(fusion_config, get_registry())
    if not fusion.enabled_names():
        return model
    config = getattr(model, "config", None)
    if config is None:
        raise FusionError(f"{type(model).__name__} has no config: fuse() needs a transformers model")
    if get_fusion_plan(model) is not None or any(module_plan(m) is not None for m in model.modules()):
        raise FusionError(f"{type(model).__name__} is already fused; unfuse() it first to fuse it differently")
    refusal = get_registry().hook.fusion_fuse_refusal(model=model)
    if refusal is not None:
        raise FusionError(f"{type(model).__name__}: {refusal}")
    plain_config = _config_without_record(config)
    discovery = discover(type(model), plain_config, fusion)
    targets = [(_checked_instance(model, plan), plan) for plan in discovery.plan.modules]
    verified: set[tuple[object, ...]] = set()
    sources = discovery.sources()

    def convert() -> None:
        for module, plan in targets:
            try:
                fuse_instance(module, plan, verified)
            except Exception as exc:  # the family's op or fusion_finalize, on real data (discovery rehearsed the rest)
                raise FusionLoadError(
                    f"family {plan.family!r} ({sources[plan.family]}), module {plan.path!r}: fusing the "
                    f"{plan.original_class.__qualname__} failed: {type(exc).__name__}: {exc}"
                ) from exc

    snapshot = _Snapshot(model)
    try:
        plan = convert_with_hooks(model, targets, discovery, convert, discovery.plan)  # under the load lock
        mark_fused(model, discovery, plan)
    except BaseException as exc:  # KeyboardInterrupt too: never hand back a half-fused model
        snapshot.restore()
        _add_note(exc, f"fusion_core.fuse: {type(model).__name__} was restored to its state before the call "
                       "(classes, tensors, hooks and config as they were; nothing is fused)")
        raise
    return model


class _Snapshot:
    """What :func:`fuse` may change on a model, taken before it changes anything, to put back on failure.

    Fusing rebinds attributes and edits containers; it does not write into the original tensors
    (a transform's op returns new tensors or views, and the originals are popped, not modified). So
    the snapshot holds, for every module and the model's config, the class, the attribute dict,
    and a copy of each dict-valued attribute (``_parameters``, ``_buffers``, ``_modules``, every
    hook table, ...): restoring rebinds the original objects and refills those dicts in place, so
    the same parameter and buffer objects are back and hook handles taken before still remove
    their hooks. Sub-modules fusion created are dropped with the containers that held them.
    """

    def __init__(self, model: nn.Module) -> None:
        self._objects = [
            (obj, type(obj), dict(vars(obj)), {name: dict(v) for name, v in vars(obj).items() if isinstance(v, dict)})
            for obj in (*model.modules(), model.config)
        ]

    def restore(self) -> None:
        for obj, cls, attributes, contents in self._objects:
            if type(obj) is not cls:
                obj.__class__ = cls
            state = vars(obj)
            state.clear()
            state.update(attributes)
            for name, content in contents.items():
                attributes[name].clear()
                attributes[name].update(content)


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10 the note is kept in ``__notes__`` (tools read it, tracebacks do not)."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        vars(exc).setdefault("__notes__", []).append(note)


def _config_without_record(config: Any) -> Any:
    """The model's config as discovery sees it on a load: without a stored fusion record."""
    if not (hasattr(config, RECORD_KEY) or hasattr(config, LEGACY_KEY)):
        return config
    plain = copy.deepcopy(config)
    pop_stored_fusion_config(plain)
    return plain


def _checked_instance(model: nn.Module, plan: ModulePlan) -> nn.Module:
    """The planned instance of ``model``, after checking it is what discovery saw on the meta model."""
    where = f"family {plan.family!r}, module {plan.path!r}"
    try:
        module = model.get_submodule(plan.path)
    except AttributeError:
        raise FusionError(f"{where}: the model has no such module (it differs from the one its class builds)") from None
    if type(module) is not plan.original_class:
        raise FusionError(
            f"{where}: is a {type(module).__qualname__}, discovery planned a {plan.original_class.__qualname__} "
            "(the model was changed after it was built?)"
        )
    leaves = module.state_dict(keep_vars=True)
    sources = {s.name: s.shape for t in plan.transforms for s in t.sources}
    if tuple(leaves) != plan.original_leaves or any(tuple(leaves[n].shape) != s for n, s in sources.items()):
        raise FusionError(
            f"{where}: its tensors {({k: tuple(v.shape) for k, v in leaves.items()})} differ from the planned "
            f"{sources} (the model was changed after it was built?)"
        )
    on_meta = [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta]
    if on_meta:
        raise FusionError(f"{where}: tensors {on_meta} are on the meta device; fuse a model whose weights are loaded")
    return module


def unfuse(model: ModelT) -> ModelT:
    """Return every fused module of ``model`` to its original class and layout, in place; return it.

    Afterwards no fused class is left, :func:`fusion_core.get_fusion_plan` returns None, the
    config no longer carries the fusion record, and ``state_dict()`` is bit-identical to the
    unfused model's (same names, order, shapes, dtypes and bytes). A model with nothing fused is
    returned untouched. Raises :class:`~fusion_core.errors.FusionError`, before changing
    anything, when adapter layers are attached inside a fused module (``merge_and_unload()`` or
    ``unload()`` them first) or a fused class cannot undo its set-up.
    """
    fused = [(name, m) for name, m in model.named_modules() if module_plan(m) is not None]
    for _, module in fused:
        reason = unfuse_refusal(module)
        if reason is not None:
            raise FusionError(reason)
    with LOAD_LOCK:
        # Innermost first: a fused module inside another (a merged container that linear_kernels packs, inside
        # the attention qkv fused) is back in its original layout before its parent reads its tensors.
        for _, module in reversed(fused):
            unfuse_instance(module)
    mark_unfused(model)
    return model

