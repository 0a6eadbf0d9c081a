"""The transformers adapter: fused ``from_pretrained`` and original-format ``save_pretrained``.

Loading route: selected instances are built with their original ``__init__`` and switched to
their fused class, so transformers loads the *original* checkpoint into them with its own
machinery (dtype, device maps, sharding, memory mapping) and reports nothing missing. Right after
loading, each fused instance converts its tensors in place (a reshape is a view of the loaded
storage) and presents the original layout again to ``state_dict()``, which is what every
``save_pretrained`` writes. Converting a state dict before loading would instead copy every fused
tensor and bypass transformers' own key renaming, dtype and device handling.

What fusion-core applied is recorded in the checkpoint's config (:mod:`fusion_core.record`); the
header check lives with the checkpoint reader (:func:`fusion_core.checkpoint.check_checkpoint`),
the load lock with the process-wide patching (:data:`fusion_core.patching.LOAD_LOCK`).

transformers' loading report (missing, unexpected and mismatched keys) is taken from the model
transformers loads, not by passing ``output_loading_info=True``: some model classes' own
``from_pretrained`` (Qwen2.5-Omni's) call a method on what the base class returns, which that
argument turns into a tuple.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from fusion_core import streaming
from fusion_core.aliases import in_process_group
from fusion_core.casting import Casts, cast_back, hold_stored_dtypes, stored_dtypes
from fusion_core.checkpoint import check_checkpoint, planned_tensors, read_checkpoint_index
from fusion_core.compat import transformers as compat
from fusion_core.compat.accelerate import onloaded_state_dict, rebind_hooked_forward
from fusion_core.config import parse_fusion_config
from fusion_core.discovery import Discovery, discover
from fusion_core.errors import CheckpointError, FusionError, FusionLoadError, SaveError
from fusion_core.integration_needs import load_needs, loaded_needs, warn_unserved_libraries
from fusion_core.layout import convert_to_fused, fuse_instance, fused_layout, module_plan
from fusion_core.mapped_files import MappedFiles
from fusion_core.memory import check_memory, onto_cpu
from fusion_core.parallel.saving import gathered_save_kwargs, is_writer, rank_zero_directory
from fusion_core.patching import LOAD_LOCK, BuildScope, class_patch_scope
from fusion_core.plugins import PluginSource, get_registry
from fusion_core.random_state import RandomState, kept_random_state
from fusion_core.record import (
    CONFIG_NAME,
    RECORD_KEY,
    attach_record,
    is_fused_layout_dir,
    load_config,
    pop_stored_fusion_config,
    write_config,
)
from fusion_core.transforms import FusionPlan, ModulePlan, attach_plan, attached_plan, declined, detach_plan

logger = logging.getLogger(__name__)

__all__ = ["LOAD_LOCK", "from_pretrained", "get_fusion_plan", "save_pretrained"]


def get_fusion_plan(model: nn.Module) -> FusionPlan | None:
    """The :class:`FusionPlan` a model was loaded with, or None for a model fusion did not touch."""
    return attached_plan(model, FusionPlan)


def mark_fused(model: nn.Module, discovery: Discovery, plan: FusionPlan) -> None:
    """Record on a freshly fused model what was applied: the config's record and the plan."""
    attach_record(model.config, discovery.record())
    attach_plan(model, plan)


def mark_unfused(model: nn.Module) -> None:
    """Undo :func:`mark_fused`: no plan, and no record for a later save to write."""
    detach_plan(model, FusionPlan)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, RECORD_KEY):
        delattr(config, RECORD_KEY)


def from_pretrained(
    model_cls: Any,
    name_or_path: str | Path | None,
    fusion_config: Any = None,
    **transformers_kwargs: Any,
) -> Any:
    """Load a model with the families of ``fusion_config`` fused, from its original checkpoint.

    ``model_cls`` is a transformers Auto class or a concrete ``PreTrainedModel`` subclass;
    ``transformers_kwargs`` go to its ``from_pretrained`` (``dtype``, ``device_map``, ...).
    ``fusion_config`` (a mapping or :class:`FusionConfig`) wins over the one stored in the
    checkpoint's config; with neither, or with no family enabled, this is a plain load.

    A load onto the CPU (no ``device_map``, or ``"cpu"``) from a local safetensors checkpoint is first checked
    against the memory available (``/proc/meminfo``, the cgroup limit): the merged copies the
    fused modules allocate plus the tensors cast to another dtype, from the plan and the
    safetensors headers; a load that would not fit raises
    :class:`~fusion_core.errors.InsufficientMemoryError` before any weight is read
    (``FUSION_CORE_SKIP_MEMORY_CHECK=1`` skips the check; see :mod:`fusion_core.memory`).

    Raises ``pydantic.ValidationError`` for a bad ``fusion_config``, and a
    :class:`~fusion_core.errors.FusionError` naming the key, module and family for anything
    that would leave a fused parameter not loaded from the checkpoint.
    """
    generators = RandomState.taken()  # put back before transformers loads (fusion_core.random_state)
    kwargs = dict(transformers_kwargs)
    want_info = bool(kwargs.pop("output_loading_info", False))
    registry = get_registry()
    # An explicit fusion_config is checked first, before any file is read.
    explicit = parse_fusion_config(fusion_config, registry) if fusion_config is not None else None
    local = Path(name_or_path) if name_or_path is not None else None  # None: the weights come as ``state_dict``
    fused_dir = local is not None and is_fused_layout_dir(local)
    config = load_config(model_cls, name_or_path, fused_dir, kwargs)
    stored = pop_stored_fusion_config(config)
    # A stored fusion_config is validated only when it is used: an explicit one replaces it, except in a
    # fused-layout checkpoint, whose tensors only the stored one can load.
    fusion = explicit if explicit is not None and not fused_dir else parse_fusion_config(stored or {}, registry)
    if fused_dir and explicit is not None and explicit.model_dump() != fusion.model_dump():
        raise CheckpointError(
            f"{name_or_path} holds a fused-layout checkpoint made with fusion_config={stored}; it can only be "
            f"loaded with that fusion_config, not {explicit.model_dump()} (convert it to the original layout first)"
        )
    if not fusion.enabled_names():
        generators.restore()
        with LOAD_LOCK:
            return model_cls.from_pretrained(name_or_path, config=config, output_loading_info=want_info, **kwargs)
    discovery = discover(model_cls, config, fusion)  # from here on, the load reads the plan, not the config
    for name in discovery.plan.skipped:
        reasons = declined(discovery.plan.refused, name)
        logger.warning("fusion family %r found nothing to fuse in %s and is left out (required=False)%s", name,
                       discovery.model_class.__name__, f"; it declined {reasons[0]}" if reasons else "")
    for need in load_needs(kwargs, config):
        registry.require_integration(need.integration, need.workflow)
    _call_plugins(registry.hook.fusion_load_planned, "fusion_load_planned", plan=discovery.plan,
                  model_class=model_cls, config=config, load_kwargs=MappingProxyType(kwargs),
                  families=discovery.specs())
    as_stored: dict[str, tuple[str, torch.dtype]] = {}  # parts a merge casts, loaded as stored (fusion_core.casting)
    # A GGUF file (``gguf_file=``) has no safetensors headers to check: transformers dequantizes its tensors and
    # renames them while it loads, so they are checked by the loading report alone, as every renamed key is.
    if local is not None and local.is_dir() and kwargs.get("gguf_file") is None:
        directory = local / kwargs.get("subfolder", "")
        pre_quantized = getattr(config, "quantization_config", None) is not None
        tensors = read_checkpoint_index(directory, kwargs.get("variant"))
        check_checkpoint(directory, tensors, discovery.plan, fused_dir, pre_quantized=pre_quantized,
                         names=discovery.names, key_mapping=kwargs.get("key_mapping"))
        if not pre_quantized:  # a quantizer stores and allocates in its own form
            if not fused_dir and _merges_may_cast(kwargs):
                as_stored = stored_dtypes(tensors, discovery.plan, discovery.names, kwargs.get("key_mapping"))
            check_memory(tensors, discovery.plan, fused_dir, kwargs, {key for key, _ in as_stored.values()})
    on_built = convert_to_fused if fused_dir else None
    casts: dict[int, Casts] = {}
    generators.restore()
    with (LOAD_LOCK, class_patch_scope(discovery.routes, on_built=on_built, root=discovery.model_class) as scope,
          _loading_reports(lambda: casts.update(hold_stored_dtypes(scope.built, as_stored)) if as_stored else None)
          as reports):
        model = model_cls.from_pretrained(name_or_path, config=config, **kwargs)
    info = _report_of(model, reports)
    built, plan = _reconcile_build(model, scope, discovery, fused_dir, casts)
    built, plan = _leave_offloaded_unfused(model, built, plan, discovery, fused_dir, casts)
    _verify_loading_info(info, plan, fused_dir)
    for need in loaded_needs(model):
        registry.require_integration(need.integration, need.workflow)

    convert = functools.partial(_convert_built, built, fused_dir, discovery.sources(), casts)
    plan = convert_with_hooks(model, built, discovery, convert, plan, casts)
    mark_fused(model, discovery, plan)
    return (model, info) if want_info else model


def convert_with_hooks(
    model: nn.Module, built: list[tuple[nn.Module, ModulePlan]], discovery: Discovery, convert: Callable[[], None],
    plan: FusionPlan, casts: dict[int, Casts] | None = None,
) -> FusionPlan:
    """Run ``convert`` (fusing ``built``) as the innermost call of ``fusion_convert_loaded``: wrappers run around it.
    Returns ``plan`` without the modules a wrapper took out of ``built`` (left unfused: :func:`_leave_unfused`).

    The one way a load and ``fusion_core.fuse`` convert, under the load lock: while another load
    runs, 4.57's init_empty_weights sends every parameter registered in *any* thread to the meta
    device, the fused ones created here included.
    """
    registry = get_registry()
    planned = list(built)
    with LOAD_LOCK, kept_random_state():
        registry.hook.fusion_convert_loaded.call_extra(
            [convert], {"model": model, "built": built, "families": discovery.specs()}
        )
    warn_unserved_libraries({entry.name for entry in registry.integrations()})
    converted = {id(module) for module, _ in built}
    removed = [(m, p) for m, p in planned if id(m) not in converted]
    if not removed:
        return plan
    _, plan = _leave_unfused(planned, plan, removed, discovery, casts if casts is not None else {},
                             "a plugin's fusion_convert_loaded left them out of the conversion")
    return plan


def _merges_may_cast(load_kwargs: dict[str, Any]) -> bool:
    """Whether merges may cast parts loaded as stored (:mod:`fusion_core.casting`): a plain load onto the CPU.

    A quantizer (it picks each tensor's dtype itself), tensor parallelism (its shards are cast as they
    are cut) and an accelerator or offloading ``device_map`` keep transformers' own cast.
    """
    if any(load_kwargs.get(name) is not None for name in ("quantization_config", "tp_plan", "device_mesh")):
        return False
    return onto_cpu(load_kwargs.get("device_map")) and not in_process_group()


def _call_plugins(hook: Any, name: str, **kwargs: Any) -> None:
    """Call a refusing hook: a FusionError passes as it is, anything else is wrapped naming the plugin."""
    for impl in reversed(hook.get_hookimpls()):
        if impl.wrapper or impl.hookwrapper:
            raise FusionLoadError(f"plugin {impl.plugin_name.partition(':')[0]!r} implements {name} as a wrapper; "
                                  "it takes a plain implementation (raise to refuse)")
        try:
            impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
        except FusionError:
            raise
        except Exception as exc:
            raise FusionLoadError(f"plugin {impl.plugin_name.partition(':')[0]!r} refused the load in {name}: "
                                  f"{type(exc).__name__}: {exc}") from exc


# -- transformers' loading report ----------------------------------------------------------------
# (model, its loading report) for each load in the current context.
_REPORTS: contextvars.ContextVar[list[tuple[Any, compat.Report]] | None] = contextvars.ContextVar(
    "fusion_core_loading_reports", default=None
)
# What to do before transformers loads weights into a model it built, in the current context.
_BEFORE_LOAD: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "fusion_core_before_load", default=None
)


def _record_reports(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def _load_pretrained_model(*args: Any, **kwargs: Any) -> Any:
        before = _BEFORE_LOAD.get()
        if before is not None:
            before()
        result = function(*args, **kwargs)
        reports = _REPORTS.get()
        if reports is not None:
            reports.append(compat.loading_report(result, args, kwargs))
        return result

    _load_pretrained_model.__fusion_core_wrapper__ = True  # type: ignore[attr-defined]
    return _load_pretrained_model


@contextmanager
def _loading_reports(before: Callable[[], None] | None = None) -> Iterator[list[tuple[Any, compat.Report]]]:
    """Collect transformers' loading report of every model loaded in this block (callers hold LOAD_LOCK).

    ``before`` runs when transformers is about to load weights into a model it built (the load method is
    called), before it reads any.

    transformers' load method (:data:`fusion_core.compat.transformers.LOAD_METHOD`), which every
    ``from_pretrained`` calls, is wrapped for the duration of the block; the wrapper only records
    inside this context, so a load in another thread passes through untouched.
    """
    install = not getattr(compat.raw_load_method().__func__, "__fusion_core_wrapper__", False)
    reports: list[tuple[Any, compat.Report]] = []
    token = _REPORTS.set(reports)
    before_token = _BEFORE_LOAD.set(before)
    try:
        with compat.wrapped_load_method(_record_reports) if install else nullcontext():
            yield reports
    finally:
        _BEFORE_LOAD.reset(before_token)
        _REPORTS.reset(token)


def _report_of(model: nn.Module, reports: list[tuple[Any, compat.Report]]) -> dict[str, Any]:
    """The loading report of ``model`` as ``output_loading_info=True`` would return it."""
    for loaded, report in reports:
        if loaded is model:
            return report()
    raise FusionLoadError(
        f"{type(model).__name__}.from_pretrained returned a model whose loading report fusion-core could not see "
        f"(transformers loaded it without PreTrainedModel.{compat.LOAD_METHOD}); a fused load cannot prove "
        "that every fused weight was loaded"
    )


def _keys(info: dict[str, Any], name: str) -> list[str]:
    return [k[0] if isinstance(k, tuple) else str(k) for k in info.get(name) or ()]


def _verify_loading_info(info: dict[str, Any], plan: FusionPlan, fused_dir: bool) -> None:
    """No silent weights: any missing, unexpected or mismatched key of a fused module's moved tensors raises.

    transformers reports model keys (a checkpoint key under the name it was renamed to), so each
    reported key is looked up exactly among the fused modules' keys: never by a shared suffix,
    which would pair a key of one tower with a module of another.
    """
    owners: dict[str, ModulePlan] = {}
    for module in plan.modules:
        for key in planned_tensors(module, fused_dir):
            owners[key] = module
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        for key in _keys(info, kind):
            owner = owners.get(key)
            if (owner is not None and kind != "unexpected_keys" and not owner.transforms
                    and all("." not in leaf for leaf in owner.original_leaves)):
                # A layer fused by class only (its own tensors move nowhere: linear_kernels' layers at discovery)
                # that the checkpoint does not hold, or holds in another shape with ignore_mismatched_sizes:
                # transformers initialised it and reported it, as it does for the plain model (a new
                # classification head). A module with children (a model's root) is held to every key below it.
                continue
            if owner is not None:
                raise FusionLoadError(
                    f"family {owner.family!r}, module {owner.path!r}: transformers reported "
                    f"{kind.replace('_', ' ')[:-1]} {key!r}; a fused module never keeps an unloaded weight"
                )


# -- after transformers' load ---------------------------------------------------------------------
def _convert_built(
    built: list[tuple[nn.Module, ModulePlan]], fused_dir: bool, sources: dict[str, PluginSource],
    casts: dict[int, Casts],
) -> None:
    """Bring every loaded fused instance into its fused layout and let it finalize; errors name the family.

    ``casts``: per module (by ``id``), the parts loaded as stored that the merge casts (:mod:`fusion_core.casting`).
    """
    verified: set[tuple[object, ...]] = set()
    files = MappedFiles.snapshot() if not fused_dir else None
    with streaming.readers():
        for module, plan in built:
            _convert_one(module, plan, sources[plan.family], fused_dir, verified, files, casts.get(id(module)))


def _convert_one(module: nn.Module, plan: ModulePlan, source: PluginSource, fused_dir: bool,
                 verified: set[tuple[object, ...]], files: MappedFiles | None, casts: Casts | None) -> None:
    """Fuse one loaded instance (see :func:`_convert_built`)."""
    try:
        if not fused_dir:
            unloaded = _meta_tensors(module)
            if unloaded:
                raise FusionLoadError(
                    f"family {plan.family!r}, module {plan.path!r}: tensors {unloaded} are on the meta device "
                    "after loading (offloaded to disk?); fused modules must be loaded onto a real device"
                )
        fuse_instance(module, plan, verified, convert=not fused_dir, files=files, casts=casts)
    except FusionLoadError as exc:
        raise FusionLoadError(f"{exc} [{source}]") from None
    except Exception as exc:  # the family's fusion_finalize or op, on real data
        raise FusionLoadError(
            f"family {plan.family!r} ({source}), module {plan.path!r}: fusing the loaded "
            f"{plan.original_class.__qualname__} failed: {type(exc).__name__}: {exc}"
        ) from exc
    on_meta = _meta_tensors(module)
    if on_meta:
        raise FusionLoadError(
            f"family {plan.family!r} ({source}), module {plan.path!r}: tensors {on_meta} are on the meta device "
            "after fusing (a transformers load in another thread patched parameter registration?)"
        )


def _reconcile_build(
    model: nn.Module, scope: BuildScope, discovery: Discovery, fused_dir: bool, casts: dict[int, Casts],
) -> tuple[list[tuple[nn.Module, ModulePlan]], FusionPlan]:
    """The fused instances that sit where discovery planned them, and the plan of this load.

    A model whose construction differs between discovery's meta build and transformers' build
    (an ``__init__`` that reads a global flag, the device or a random draw) can put a routed
    instance at another path than planned, build fewer, or build more. A family with
    ``required=False`` then leaves the planned modules it could not place unfused, with a
    warning: the instances built for them are still in their original layout (only a routed
    class switch happened, before any weight was read), so switching the class back leaves
    exactly what plain transformers loaded (parts loaded as stored for a merge, ``casts``, are cast
    back). A required family, or any family in a fused-layout checkpoint (whose tensors are stored fused
    and cannot load into an original module), raises.
    """
    paths = {id(m): name for name, m in model.named_modules()}
    built: list[tuple[nn.Module, ModulePlan]] = []
    strays: dict[str, tuple[nn.Module, ModulePlan, str | None]] = {}
    for module, plan in scope.built:
        actual = paths.get(id(module))
        if actual == plan.path:
            built.append((module, plan))
        else:
            strays[plan.path] = (module, plan, actual)
    placed = {plan.path for _, plan in built}
    problems: list[tuple[str, str]] = []  # (family, what went wrong)
    for plan in discovery.plan.modules:
        if plan.path in placed:
            continue
        stray = strays.get(plan.path)
        where = f"module planned at {plan.path!r} was built at {stray[2]!r}" if stray else (
            f"no instance was built for module {plan.path!r}")
        problems.append((plan.family, f"{where}; the model constructs {plan.original_class.__qualname__} instances "
                                      "differently from the model discovery planned"))
    for cls, count in scope.surplus.items():
        family = next(p.family for p in scope.routes[cls].instances if p is not None)
        problems.append((family, f"the model constructs {count} more {cls.__qualname__} instances than the model "
                                 "discovery planned"))
    for family, what in problems:
        required = discovery.required(family)
        if required or fused_dir:
            hint = "; a fused-layout checkpoint cannot leave it unfused" if fused_dir and not required else ""
            raise FusionLoadError(f"family {family!r}: {what}{hint}")
    for family, what in problems:
        logger.warning("fusion family %r: %s; left unfused (required=False)", family, what)
    for module, plan, _ in strays.values():
        _put_back(module, plan, casts)
    return built, _without(discovery.plan, built)


def _put_back(module: nn.Module, plan: ModulePlan, casts: dict[int, Casts]) -> None:
    """Return a module that only had its class switched (never converted) to exactly what plain transformers
    loaded: its original class, an accelerate hook's kept forward bound to it, the parts a merge would have cast
    cast back."""
    module.__class__ = plan.original_class
    rebind_hooked_forward(module)
    cast_back(module, casts.pop(id(module), {}))


def _without(plan: FusionPlan, kept: list[tuple[nn.Module, ModulePlan]]) -> FusionPlan:
    """``plan`` with only the modules of ``kept``; a family left with none is added to ``skipped``."""
    modules = tuple(p for _, p in kept)
    gone = tuple(name for name in plan.families if not any(p.family == name for p in modules))
    return replace(plan, modules=modules, skipped=plan.skipped + gone)


def _leave_offloaded_unfused(
    model: nn.Module, built: list[tuple[nn.Module, ModulePlan]], plan: FusionPlan, discovery: Discovery,
    fused_dir: bool, casts: dict[int, Casts],
) -> tuple[list[tuple[nn.Module, ModulePlan]], FusionPlan]:
    """Leave each module that the ``device_map`` offloaded in its original class and layout, as plain loaded it.

    accelerate keeps an offloaded module's tensors on the meta device and brings them from the offload
    folder (or CPU memory) for each forward, by their original names: there is nothing to fuse, and the
    original forward is what those hooks serve (see :func:`_leave_unfused`). An offloaded module of a
    fused-layout checkpoint (its tensors exist only fused) is refused.
    """
    if not getattr(model, "hf_device_map", None):
        return built, plan
    offloaded = [(m, p) for m, p in built if _meta_tensors(m)]
    if not offloaded:
        return built, plan
    if fused_dir:
        _, stored = offloaded[0]
        raise FusionLoadError(f"family {stored.family!r}, module {stored.path!r}: the device_map offloaded it, and a "
                              "fused-layout checkpoint cannot leave it unfused; load onto a real device")
    return _leave_unfused(built, plan, offloaded, discovery, casts, "the device_map offloaded them")


def _leave_unfused(
    built: list[tuple[nn.Module, ModulePlan]], plan: FusionPlan, left: list[tuple[nn.Module, ModulePlan]],
    discovery: Discovery, casts: dict[int, Casts], why: str,
) -> tuple[list[tuple[nn.Module, ModulePlan]], FusionPlan]:
    """Put each module of ``left`` (not yet converted) back in its original class; the rest of ``built``, and
    ``plan`` without them.

    Only a class switch happened to such a module before the conversion (:func:`_put_back`). A family left with
    nothing fused while ``required`` raises; otherwise a warning per family names the first module and ``why``.
    """
    for module, own in left:
        _put_back(module, own, casts)
    left_ids = {id(m) for m, _ in left}
    kept = [(m, p) for m, p in built if id(m) not in left_ids]
    paths: dict[str, list[str]] = {}
    for _, own in left:
        paths.setdefault(own.family, []).append(own.path)
    for family, family_paths in paths.items():
        first = repr(family_paths[0]) if family_paths[0] else "the model's root"
        if discovery.required(family) and not any(p.family == family for _, p in kept):
            raise FusionLoadError(
                f"family {family!r}: every module it would fuse is left unfused, as {why} ({first} first, "
                f"{len(family_paths)} in all); load the family with required=False, or keep some of its modules "
                "where it can fuse them"
            )
        logger.warning("fusion family %r: %d module(s) left unfused, as plain transformers loaded them, as %s "
                       "(%s first)", family, len(family_paths), why, first)
    return kept, _without(plan, kept)


def _meta_tensors(module: nn.Module) -> list[str]:
    """Names of the module's parameters and buffers that hold no data (meta device)."""
    return [name for name, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta]


# -- saving -------------------------------------------------------------------------------------
def _refuse_replaced_fused_modules(model: nn.Module) -> None:
    """Refuse, before anything is written, a save that would drop the tensors of a fused module the model replaced.

    Some models swap one of their own modules after loading (BigBird rebuilds its attention from the
    q/k/v children when a short input switches it to full attention): the replacement holds the
    fused module's slices but presents no tensors in any layout, so the save would silently lack them.
    """
    plan = get_fusion_plan(model)
    if plan is None:
        return
    present = {own.path for m in model.modules() if (own := module_plan(m)) is not None}
    gone = [m for m in plan.modules if m.path not in present]
    if gone:
        named = "; ".join(f"family {m.family!r}, module {m.path!r}" for m in gone[:3])
        more = f" (and {len(gone) - 3} more)" if len(gone) > 3 else ""
        raise SaveError(
            f"{named}{more}: the model replaced the fused module after loading (it is no longer in the module "
            "tree), so its tensors cannot be written in any layout; save before running the model, or load it "
            f"without {gone[0].family!r}"
        )


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    save_original_format: bool = True,
    **transformers_kwargs: Any,
) -> None:
    """Save ``model`` atomically: in the original checkpoint layout by default.

    With ``save_original_format=True`` the directory is what the original model would have
    written (same tensor names, shapes, dtypes and bytes) plus a ``"fusion_core"`` record in
    ``config.json`` that only fusion-core reads. With ``False`` it keeps the fused layout and
    writes ``fused_config.json`` instead of ``config.json`` (see :mod:`fusion_core.record`).
    Either the whole new directory appears, or the old one stays as it was.
    """
    if transformers_kwargs.get("safe_serialization", True) is False:
        raise SaveError("fusion-core writes safetensors only; safe_serialization=False is not supported")
    families = {plan.family for m in model.modules() if (plan := module_plan(m)) is not None}
    fused = get_fusion_plan(model) is not None or bool(families)
    if not save_original_format and not fused:
        raise SaveError("save_original_format=False needs a fused model; this one has no fused module")
    _refuse_replaced_fused_modules(model)
    target = Path(directory)
    with rank_zero_directory(target) as staging:
        with nullcontext() if save_original_format else fused_layout():
            save_kwargs = dict(gathered_save_kwargs(model, transformers_kwargs))
            if "state_dict" not in save_kwargs and (onloaded := onloaded_state_dict(model)) is not None:
                save_kwargs["state_dict"] = onloaded
            get_registry().ensure(*families).hook.fusion_save_kwargs(model=model, save_kwargs=save_kwargs)
            model.save_pretrained(staging, **save_kwargs)  # type: ignore[operator]
        if not save_original_format and is_writer():  # other ranks of a process group wrote no config
            config_path = staging / CONFIG_NAME
            write_config(staging, json.loads(config_path.read_text()), None, fused=True)
            config_path.unlink()
