"""Discovery: which module instances each enabled family fuses, decided on a meta-device model.

The model class is instantiated once on the meta device (no memory, no weights). For every
enabled family, in ``fusion_config`` order, each module whose path passes the family's name
patterns and options is offered to ``is_fusable``; each selected instance gets a
:class:`~fusion_core.transforms.ModulePlan` binding the family's transforms to its shapes. The
selected instances are then converted on the meta device, which runs the family's transforms
and its fused class end to end before a single weight is read.

Families decide instance by instance: an instance that is not fusable keeps its original class
even when others of its class are fused. Results are cached per model class, config content,
fusion config and family objects.
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion_core.compat.transformers import LoadedNames, loaded_names
from fusion_core.config import FusionConfig
from fusion_core.errors import DiscoveryError, PlanError
from fusion_core.layout import fuse_instance
from fusion_core.patching import LOAD_LOCK, ClassRoute, construction_order, context_scoped_patch, no_routing
from fusion_core.patterns import search_any
from fusion_core.plugins import PluginSource, RegisteredFamily
from fusion_core.spec import FamilyOptions, ModuleFusionSpec, spec_member
from fusion_core.transforms import FusionPlan, ModulePlan, WeightTransform, bind_transforms, declined


@dataclass(frozen=True)
class Discovery:
    """The plan of one load, immutable: what the load, ``fuse()``, the kit and the CLI read after discovery.

    The validated ``fusion_config`` is read once, by :func:`discover`: its enabled families (each as
    registered, with its options, hence its source and ``required`` flag) and its record, the JSON written
    into a saved checkpoint's config. Nothing after discovery goes back to the config.
    """

    model_class: type[nn.Module]
    """The class the load builds, as transformers builds it (the original class, also where a family fuses the root)."""
    plan: FusionPlan
    routes: Mapping[type[nn.Module], ClassRoute]
    scanned_modules: int
    names: LoadedNames
    """How transformers names the checkpoint keys it loads into this model (matches checkpoint keys exactly)."""
    families: tuple[tuple[RegisteredFamily, FamilyOptions], ...]
    """The enabled families, in ``fusion_config`` order, each with its options."""
    fusion_config: str
    """The validated ``fusion_config`` as JSON (disabled families included): the record a save writes."""

    def specs(self) -> dict[str, ModuleFusionSpec[Any]]:
        """Each enabled family's spec, by name (what the lifecycle hooks receive as ``families``)."""
        return {family.name: family.spec for family, _ in self.families}

    def sources(self) -> dict[str, PluginSource]:
        """Where each enabled family came from, by name: what every error about a family names."""
        return {family.name: family.source for family, _ in self.families}

    def required(self, name: str) -> bool:
        """Whether the enabled family ``name`` must fuse something (its ``required`` option)."""
        return next(options.required for family, options in self.families if family.name == name)

    def record(self) -> dict[str, Any]:
        """The ``fusion_config`` to record on the loaded model's config (a fresh copy)."""
        return dict(json.loads(self.fusion_config))


def build_meta_model(model_cls: Any, config: Any, constructed: list[nn.Module] | None = None) -> nn.Module:
    """Instantiate ``model_cls`` (an Auto class or a concrete model class) without real weights.

    Everything is built on the meta device. A model whose ``__init__`` reads a tensor's value
    (Apertus' xIELU activation calls ``.item()``) cannot be built there; it is built again with
    only its parameters on the meta device, the way transformers' own empty-weights init does.
    ``constructed``, when given, receives every module the build constructed, in construction
    order (:func:`~fusion_core.patching.construction_order`; the failed first build's are dropped).
    """
    model: nn.Module | None = None
    try:
        with torch.device("meta"), no_routing(), construction_order() as order:
            model = _instantiate(model_cls, config)
    except (NotImplementedError, RuntimeError) as exc:
        if "meta" not in str(exc):
            raise
    if model is None:
        with _parameters_on_meta(), no_routing(), construction_order() as order:
            model = _instantiate(model_cls, config)
    if constructed is not None:
        constructed[:] = order
    return model


def _instantiate(model_cls: Any, config: Any) -> nn.Module:
    config = copy.deepcopy(config)
    if isinstance(model_cls, type) and issubclass(model_cls, nn.Module):
        return model_cls(config)
    model: nn.Module = model_cls.from_config(config)
    return model


_META_PARAMETERS: contextvars.ContextVar[bool] = contextvars.ContextVar("fusion_core_meta_parameters", default=False)


def _meta_register_parameter(original: Callable[..., None]) -> Callable[..., None]:
    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if _META_PARAMETERS.get() and param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    return register_parameter


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Register every new parameter on the meta device, in this context only (other threads build as usual)."""
    context_scoped_patch(nn.Module, "register_parameter", _meta_register_parameter)
    token = _META_PARAMETERS.set(True)
    try:
        yield
    finally:
        _META_PARAMETERS.reset(token)


def config_fingerprint(config: Any) -> str | None:
    """A digest of the config's content, or None when it cannot be written out whole (then nothing is cached).

    Only the JSON the config writes names every value; a ``repr`` fallback would shorten large
    values (``tensor([...])``) and let two different configs share one cached plan.
    """
    try:
        text = config.to_json_string(use_diff=False)
    except Exception:  # an exotic config attribute that JSON cannot hold
        return None
    return hashlib.sha256(text.encode()).hexdigest()


class _Identity:
    """A spec in a cache key, by identity: holding it keeps its ``id`` from being reused by another object."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


_cache: dict[tuple[Any, ...], Discovery] = {}
_cache_lock = threading.Lock()


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def discover(model_cls: Any, config: Any, fusion_config: FusionConfig) -> Discovery:
    """The plan for ``model_cls`` built from ``config`` with ``fusion_config``'s families (cached).

    The families are the ones ``fusion_config`` was validated against (see :meth:`FusionConfig.families`).
    """
    families = tuple(fusion_config.families())
    recorded = fusion_config.to_json()
    fingerprint = config_fingerprint(config)
    key = (model_cls, fingerprint, recorded, tuple(_Identity(f.spec) for f, _ in families))
    with _cache_lock:
        hit = _cache.get(key) if fingerprint is not None else None
    if hit is not None:
        return hit
    with LOAD_LOCK:  # building the meta model may patch nn.Module.register_parameter process-wide
        result = _discover(model_cls, config, families, recorded)
    if fingerprint is not None:
        with _cache_lock:
            _cache[key] = result
    return result


def _module_selected(path: str, patterns: Sequence[str], options: FamilyOptions) -> bool:
    # Linear-time matching: options can come from a downloaded config.json (see fusion_core.patterns).
    if patterns and not search_any(patterns, path):
        return False
    if options.target_modules is not None and not search_any(options.target_modules, path):
        return False
    return not search_any(options.exclude_modules, path)


def _fused_class(family: RegisteredFamily, original: type[nn.Module], options: FamilyOptions) -> type[nn.Module]:
    """The family's fused class for ``original``, checked against the fused class contract.

    Not cached here: one discovery asks once per (family, class), discoveries are cached, and
    classes made with :func:`~fusion_core.spec.fused_subclass` are cached there by class pair.
    """
    where = f"family {family.name!r} ({family.source})"
    try:
        fused = family.spec.make_fused_class(original, options)
    except Exception as exc:
        raise DiscoveryError(
            f"{where}: make_fused_class({original.__name__}) raised {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(fused, type) and issubclass(fused, original)):
        raise DiscoveryError(
            f"{where}: make_fused_class({original.__name__}) must return a subclass of it, got {fused!r}"
        )
    if "__init__" in fused.__dict__:
        raise DiscoveryError(
            f"{where}: fused class {fused.__qualname__} defines __init__; fused classes are built by the "
            "original __init__ and set themselves up in fusion_finalize()"
        )
    return fused


def _transforms(family: RegisteredFamily, config: Any, options: FamilyOptions) -> tuple[WeightTransform, ...]:
    where = f"family {family.name!r} ({family.source})"
    try:
        transforms = tuple(family.spec.make_transforms(config, options))
    except Exception as exc:
        raise DiscoveryError(f"{where}: make_transforms raised {type(exc).__name__}: {exc}") from exc
    for transform in transforms:
        if not isinstance(transform, WeightTransform):
            raise DiscoveryError(f"{where}: make_transforms returned {transform!r}, not a WeightTransform")
    return transforms


def _module_transforms(family: RegisteredFamily, where: str, path: str, module: nn.Module, config: Any,
                       options: FamilyOptions) -> tuple[WeightTransform, ...] | None:
    """The family's transforms for this one module (its optional ``module_transforms`` member), checked."""
    try:
        own = spec_member(family.spec, "module_transforms")(module, config, options)
    except Exception as exc:
        raise DiscoveryError(
            f"{where}: module_transforms raised {type(exc).__name__} on module {path!r} "
            f"({type(module).__name__}): {exc}"
        ) from exc
    if own is None:
        return None
    own = tuple(own)
    for transform in own:
        if not isinstance(transform, WeightTransform):
            raise DiscoveryError(
                f"{where}: module_transforms returned {transform!r} for {path!r}, not a WeightTransform"
            )
    return own


def _discover(
    model_cls: Any, config: Any, families: tuple[tuple[RegisteredFamily, FamilyOptions], ...], recorded: str
) -> Discovery:
    constructed: list[nn.Module] = []
    meta_model = build_meta_model(model_cls, config, constructed)
    names = loaded_names(meta_model)
    modules = list(meta_model.named_modules())
    plans: list[ModulePlan] = []
    skipped: list[str] = []
    refused: list[tuple[str, str, str]] = []
    class_owner: dict[type[nn.Module], tuple[str, type[nn.Module]]] = {}
    for family, options in families:
        where = f"family {family.name!r} ({family.source})"
        transforms = _transforms(family, config, options)
        considered = 0
        chosen: list[tuple[str, nn.Module]] = []
        for path, module in modules:
            if not _module_selected(path, family.spec.target_modules_patterns, options):
                continue
            considered += 1
            try:
                fusable = family.spec.is_fusable(module, options)
            except Exception as exc:
                raise DiscoveryError(
                    f"{where}: is_fusable raised {type(exc).__name__} on module {path!r} "
                    f"({type(module).__name__}): {exc}"
                ) from exc
            if fusable is True:
                chosen.append((path, module))
                continue
            if fusable is not False:
                raise DiscoveryError(f"{where}: is_fusable must return a bool, got {fusable!r} for {path!r}")
            reason = _refusal(family, where, path, module, options)
            if reason is not None:
                refused.append((family.name, path, reason))
        if not chosen and not options.required:
            skipped.append(family.name)
            continue
        if not chosen:
            reasons = declined(refused, family.name)
            said = f"; {len(reasons)} declined, e.g. " + "; ".join(reasons[:3]) if reasons else ""
            raise DiscoveryError(
                f"{where} found nothing to fuse in {type(meta_model).__name__}: {len(modules)} modules, "
                f"{considered} passed the name patterns, none is fusable{said}"
            )
        fused_classes: dict[type[nn.Module], type[nn.Module]] = {}
        for path, module in chosen:
            original = type(module)
            if original not in fused_classes:
                fused_classes[original] = _fused_class(family, original, options)
            fused = fused_classes[original]
            owner = class_owner.setdefault(original, (family.name, fused))
            if owner[0] != family.name:
                raise PlanError(
                    f"families {owner[0]!r} and {family.name!r} both replace instances of class "
                    f"{original.__qualname__} (module {path!r})"
                )
            leaves = module.state_dict(keep_vars=True)
            own = _module_transforms(family, where, path, module, config, options)
            try:
                bound = bind_transforms(family.name, path, {k: tuple(v.shape) for k, v in leaves.items()},
                                        transforms if own is None else own)
            except PlanError as exc:
                raise PlanError(f"{exc} [{family.source}]") from None
            plans.append(ModulePlan(family.name, path, original, fused, bound, tuple(leaves),
                                    _moved_linears(module, bound)))
    owners = {family.name for family, _ in families if spec_member(family.spec, "owns_submodules") is True}
    plans, nested = _leave_nested_to_outer(plans, owners)
    for family, options in families:
        inside = [outer for inner, outer in nested if inner.family == family.name]
        if options.required and inside and not any(p.family == family.name for p in plans):
            raise DiscoveryError(
                f"family {family.name!r} ({family.source}) found nothing to fuse in {type(meta_model).__name__} "
                f"outside modules other families fuse whole: {[f'{o.path} ({o.family})' for o in inside][:4]}"
            )
    skipped += [f.name for f, _ in families if f.name not in skipped and not any(p.family == f.name for p in plans)]
    order = {path: i for i, (path, _) in enumerate(modules)}
    plan = FusionPlan(tuple(sorted(plans, key=lambda p: order[p.path])), skipped=tuple(skipped),
                      nested=tuple((inner.family, inner.path, outer.family, outer.path)
                                   for inner, outer in sorted(nested, key=lambda pair: order[pair[0].path])),
                      refused=tuple(refused))
    routes = _routes(plan, class_owner, constructed, modules)
    model_class = type(meta_model)  # before the rehearsal, which switches a fused root to its fused class
    _rehearse(meta_model, plan, {family.name: family.source for family, _ in families})
    return Discovery(model_class, plan, routes, len(modules), names, families, recorded)


def _routes(
    plan: FusionPlan,
    class_owner: Mapping[type[nn.Module], tuple[str, type[nn.Module]]],
    constructed: list[nn.Module],
    modules: list[tuple[str, nn.Module]],
) -> dict[type[nn.Module], ClassRoute]:
    """Per routed class, the plan of each instance in construction order (None: left alone).

    Construction order, not model order: a model whose ``__init__`` builds a module and then
    replaces it (MiniMax's decoder layer builds an attention module, then the one its layer type
    needs) constructs instances that never reach the model. Those get no plan; the instance that
    ends up at a planned path gets that path's plan.
    """
    by_path = plan.by_path()
    plan_of = {id(module): by_path.get(path) for path, module in modules}
    order = list({id(module): module for module in constructed}.values())
    routes: dict[type[nn.Module], ClassRoute] = {}
    for original, (_, fused) in class_owner.items():
        instances = tuple(plan_of.get(id(module)) for module in order if type(module) is original)
        if any(instances):
            routes[original] = ClassRoute(original, fused, instances)
    return routes


def _refusal(family: RegisteredFamily, where: str, path: str, module: nn.Module, options: FamilyOptions) -> str | None:
    """The family's reason for declining ``module`` (its optional ``refusal`` member), checked."""
    try:
        reason = spec_member(family.spec, "refusal")(module, options)
    except Exception as exc:
        raise DiscoveryError(
            f"{where}: refusal raised {type(exc).__name__} on module {path!r} ({type(module).__name__}): {exc}"
        ) from exc
    if reason is not None and not isinstance(reason, str):
        raise DiscoveryError(f"{where}: refusal must return a str or None, got {reason!r} for {path!r}")
    return reason or None


def _moved_linears(module: nn.Module, bound: tuple[Any, ...]) -> tuple[str, ...]:
    """Module-relative paths of the ``nn.Linear`` modules inside ``module`` whose tensors the plan moves."""
    moved = {s.name for b in bound for s in b.sources}
    return tuple(
        name for name, sub in module.named_modules() if isinstance(sub, nn.Linear)
        and any(leaf.startswith(f"{name}.") if name else "." not in leaf for leaf in moved)
    )


def _leave_nested_to_outer(
    plans: list[ModulePlan], owners: set[str]
) -> tuple[list[ModulePlan], list[tuple[ModulePlan, ModulePlan]]]:
    """Drop each module plan that lies inside a module fused by a family of ``owners`` and claims some of its tensors.

    A family that fuses a module whole declares ``owns_submodules = True`` (``moe_experts``: a
    mixture-of-experts block whose expert MLPs ``gate_up`` would merge too). Its fusion already owns
    the tensors beneath it, so another family's plan for a module inside it is left to it, whatever
    the order of ``fusion_config``. Any other two plans that claim the same tensor, nested or not,
    are still a conflict (:func:`~fusion_core.transforms.check_conflicts`). Returns the kept plans
    and (dropped plan, the plan that contains it) pairs.

    A plan that moves no tensor (it only changes the class: ``linear_kernels`` on an ``nn.Linear``)
    is likewise left to an enclosing plan of another family that moves that module's tensors (its
    :attr:`~fusion_core.transforms.ModulePlan.moved_linears`: ``qkv`` merging ``q_proj``), whatever
    that family declares: the module it would fuse is emptied and replaced by the enclosing fusion.
    """
    by_path: dict[str, list[ModulePlan]] = {}
    for plan in plans:
        by_path.setdefault(plan.path, []).append(plan)
    nested: list[tuple[ModulePlan, ModulePlan]] = []
    for inner in plans:
        keys = set(inner.original_keys)
        parts = inner.path.split(".")
        ancestors = (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1))  # innermost first; "" is the root
        outer = next((o for a in ancestors for o in by_path.get(a, ()) if o.family != inner.family and (
            (o.family in owners and keys & set(o.original_keys)) or (not keys and _moves(o, inner.path)))), None)
        if outer is not None:
            nested.append((inner, outer))
    dropped = {id(inner) for inner, _ in nested}
    return [p for p in plans if id(p) not in dropped], nested


def _moves(plan: ModulePlan, path: str) -> bool:
    """Whether ``plan`` moves the tensors of the ``nn.Linear`` at ``path`` (a module inside its own)."""
    return any(plan.full_key(linear) == path for linear in plan.moved_linears if linear)


def _rehearse(meta_model: nn.Module, plan: FusionPlan, sources: Mapping[str, PluginSource]) -> None:
    """Run every conversion on the meta model, so a broken family fails before any data is read.

    Each op also runs backwards there: an op whose output shapes differ from what it declared, or
    whose inverse does not give the source shapes back, could not save the original layout.
    """
    for module_plan in plan.modules:
        module = meta_model.get_submodule(module_plan.path)
        where = f"family {module_plan.family!r} ({sources[module_plan.family]})"
        try:
            _rehearse_inverse(module, module_plan)
            fuse_instance(module, module_plan)
        except Exception as exc:
            raise DiscoveryError(
                f"{where}: fusing module {module_plan.path!r} ({module_plan.original_class.__qualname__}) "
                f"failed on the meta device: {type(exc).__name__}: {exc}"
            ) from exc


def _rehearse_inverse(module: nn.Module, module_plan: ModulePlan) -> None:
    leaves = module.state_dict(keep_vars=True)
    for bound in module_plan.transforms:
        sources = [leaves[s.name].detach() for s in bound.sources]
        with torch.no_grad():
            outputs = bound.op.forward(sources)
            got = [tuple(t.shape) for t in outputs]
            if got != [t.shape for t in bound.targets]:
                raise PlanError(f"{bound.op!r} produced shapes {got}, it declared {[t.shape for t in bound.targets]}")
            back = [tuple(t.shape) for t in bound.op.inverse(outputs, [s.shape for s in bound.sources])]
        if back != [s.shape for s in bound.sources]:
            raise PlanError(
                f"{bound.op!r} is not invertible: its inverse gives shapes {back}, the sources have "
                f"{[s.shape for s in bound.sources]}"
            )
