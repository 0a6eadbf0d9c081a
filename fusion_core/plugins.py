"""The family registry: plugins found through entry points, each isolated from the others.

Every family, the shipped ones included, arrives the same way: a plugin module named by an
entry point implements :func:`~fusion_core.hookspecs.register_fusion_families`. A load pays only for the
families it uses: an entry point in the ``fusion_core.families`` group is named after the one family it
registers and is imported the first time that name is asked for (a fused load imports the plugins of its
enabled families, not the others); an entry point in the ``fusion_core`` group (integrations, whose hooks
act on every load, and any plugin registering several names) is imported when the registry is created.
A plugin that fails (its import, its hook, what it registers, a hook name no hookspec declares) is
recorded as a :class:`PluginFailure` naming its distribution and version; the others keep working.

The core knows no family by name. One rule settles name clashes, whatever the load order: a
family name claimed by two plugins is usable from neither, and each claimant is reported naming
the others, until one is uninstalled or left out with ``FUSION_CORE_ALLOWED_PLUGINS``. A family
that is not installed is hinted from installed metadata (a distribution declaring that entry
point) or from the naming convention ``fusion-<name>`` (what ``fusion new-family`` creates).

Integrations (:mod:`fusion_core.integration`) arrive the same way, through
:func:`~fusion_core.hookspecs.register_fusion_integrations`, under the same isolation and clash
rules; their lifecycle hooks are called through :attr:`FamilyRegistry.hook`. A plugin whose
registration failed, or whose integration name clashes, has its lifecycle hooks taken out too:
half a plugin never runs.

Environment:

- ``FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point at all;
- ``FUSION_CORE_STRICT_PLUGINS=1``: raise :class:`~fusion_core.errors.PluginError` on the first failure;
- ``FUSION_CORE_ALLOWED_PLUGINS=dist-a,dist-b``: load entry points of these distributions only.
"""

from __future__ import annotations

import difflib
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, cast

import pluggy
from pydantic import BaseModel

from fusion_core import hookspecs, spec as spec_module
from fusion_core.errors import MissingIntegrationError, PluginError, UnknownFamilyError
from fusion_core.integration import Integration, validate_integration
from fusion_core.patterns import compile_pattern
from fusion_core.spec import FamilyOptions, ModuleFusionSpec

ENTRY_POINT_GROUP = "fusion_core"
#: Entry points named after the one family each registers, imported when that family is first asked for.
FAMILY_ENTRY_POINT_GROUP = "fusion_core.families"
DISABLE_AUTOLOAD_ENV = "FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD"
STRICT_ENV = "FUSION_CORE_STRICT_PLUGINS"
ALLOWED_ENV = "FUSION_CORE_ALLOWED_PLUGINS"

_FAMILY_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class PluginSource:
    """Where a family came from: the plugin (entry point) name and its distribution."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        if self.distribution is None:
            return f"plugin {self.plugin!r} (registered programmatically)"
        return f"plugin {self.plugin!r} from distribution {self.distribution} {self.version}"


PROGRAMMATIC = PluginSource("<programmatic>")


@dataclass(frozen=True)
class RegisteredFamily:
    spec: ModuleFusionSpec[Any]
    source: PluginSource

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class PluginFailure:
    """A plugin, or one family of it, that could not be used, and why."""

    source: PluginSource
    reason: str
    family: str | None = None

    def __str__(self) -> str:
        what = f"family {self.family!r} of {self.source}" if self.family else str(self.source)
        return f"{what}: {self.reason}"


#: How alike (``difflib`` ratio) an attribute's name must be to a member's to count as its misspelling.
MISSPELLING_CUTOFF = 0.8


def misspelt_members(spec: object) -> list[tuple[str, str]]:
    """``(attribute, member it probably meant)`` for each public attribute of ``spec`` that misspells a member.

    pluggy finds a misspelt hook (``check_pending``); this finds a misspelt spec member, which would otherwise
    be ignored while the member keeps its default (``module_transform`` for ``module_transforms``). The members
    are :data:`~fusion_core.spec.REQUIRED_MEMBERS` and :data:`~fusion_core.spec.OPTIONAL_MEMBERS`, read now.
    Only names ``spec`` defines itself count: its instance attributes and the attributes of its classes, but
    not fusion-core's base classes (:class:`~fusion_core.FusionFamily`). A name is left alone when it is
    private (``_``), a member, unlike every member (``difflib`` ratio below :data:`MISSPELLING_CUTOFF`), a
    compound of the member's name (``save_refusal``, ``tensor_parallel_mesh``), or a sibling of that member
    defined at the same level or a more derived one (``refusals`` beside the class's own ``refusal``): helpers.
    """
    members = [*spec_module.REQUIRED_MEMBERS, *spec_module.OPTIONAL_MEMBERS]
    levels: list[Any] = [getattr(spec, "__dict__", {})]  # the instance first, then its classes, most derived first
    levels += [vars(cls) for cls in type(spec).__mro__ if cls is not object and cls.__module__ != spec_module.__name__]
    depth: dict[str, int] = {}
    for level, names in enumerate(levels):
        for attribute in names:
            if isinstance(attribute, str):
                depth.setdefault(attribute, level)
    found = []
    for attribute, level in sorted(depth.items()):
        if attribute.startswith("_") or attribute in members:
            continue
        close = difflib.get_close_matches(attribute, members, n=1, cutoff=MISSPELLING_CUTOFF)
        if not close:
            continue
        meant = close[0]
        if attribute.startswith(f"{meant}_") or attribute.endswith(f"_{meant}"):
            continue
        if depth.get(meant, len(levels)) <= level:
            continue
        found.append((attribute, meant))
    return found


def validate_spec(spec: object) -> ModuleFusionSpec[Any]:
    """Check that ``spec`` satisfies :class:`ModuleFusionSpec`; raise ``TypeError``/``ValueError`` why not.

    A public attribute that misspells a member (:func:`misspelt_members`) is an error too.
    """
    if isinstance(spec, type):  # the class has every attribute, but its methods would be called unbound
        raise TypeError(f"register an instance of {spec.__qualname__}, not the class itself")
    missing = [attr for attr in spec_module.REQUIRED_MEMBERS if not hasattr(spec, attr)]
    if missing:
        raise TypeError(f"{spec!r} is not a ModuleFusionSpec (missing: {', '.join(missing)})")
    spec = cast("ModuleFusionSpec[Any]", spec)
    if not isinstance(spec.name, str) or not _FAMILY_NAME.match(spec.name):
        raise ValueError(f"family name {spec.name!r} is not an identifier")
    misspelt = misspelt_members(spec)
    if misspelt:
        raise TypeError(
            f"family {spec.name!r}: "
            + "; ".join(f"{attribute!r} is not a ModuleFusionSpec member (did you mean {meant!r}?)"
                        for attribute, meant in misspelt)
            + ". As written it would be ignored and the member left at its default; rename it, or give a helper "
            "a name that starts with '_'"
        )
    if not isinstance(spec.description, str):
        raise TypeError(f"family {spec.name!r}: description must be a string")
    preserves = spec_module.spec_member(spec, "preserves")
    if preserves not in spec_module.PRESERVES:
        raise ValueError(f"family {spec.name!r}: preserves must be one of {spec_module.PRESERVES}, got {preserves!r}")
    options_model = spec.options_model
    if not (isinstance(options_model, type) and issubclass(options_model, BaseModel)):
        raise TypeError(f"family {spec.name!r}: options_model must be a pydantic model class")
    if not issubclass(options_model, FamilyOptions) or options_model.model_config.get("extra") != "forbid":
        raise TypeError(
            f"family {spec.name!r}: options_model must subclass fusion_core.FamilyOptions and keep extra='forbid'"
        )
    patterns = spec.target_modules_patterns
    if isinstance(patterns, str):
        raise TypeError(f"family {spec.name!r}: target_modules_patterns must be a sequence of regexes, not a str")
    for pattern in patterns:
        try:
            compile_pattern(pattern)
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"family {spec.name!r}: invalid target_modules_patterns entry {pattern!r}: {exc}"
            ) from None
    return spec


@dataclass(frozen=True)
class RegisteredIntegration:
    integration: Integration
    source: PluginSource

    @property
    def name(self) -> str:
        return self.integration.name


_KINDS = {"register_fusion_families": "family", "register_fusion_integrations": "integration"}


class FamilyRegistry:
    """Installed fusion families and integrations by name, plus the failures met while collecting them."""

    def __init__(self) -> None:
        self._families: dict[str, RegisteredFamily] = {}
        self._integrations: dict[str, RegisteredIntegration] = {}
        self._failures: list[PluginFailure] = []
        # family name -> the fusion_core.families entry points of that name, not imported yet
        self._deferred: dict[str, list[tuple[metadata.EntryPoint, PluginSource]]] = {}
        self._deferred_lock = threading.RLock()
        # (kind, name) -> every plugin source that claimed it
        self._claims: dict[tuple[str, str], list[PluginSource]] = {}
        self._plugins: dict[PluginSource, object] = {}
        self.strict = _env_flag(STRICT_ENV)
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)

    # -- reading ---------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        if isinstance(name, str):
            self.ensure(name)
        return name in self._families

    def __iter__(self) -> Iterator[RegisteredFamily]:
        self._load_deferred(list(self._deferred))
        return iter(list(self._families.values()))

    def names(self) -> list[str]:
        self._load_deferred(list(self._deferred))
        return list(self._families)

    @property
    def failures(self) -> list[PluginFailure]:
        """Every plugin that could not be used, and why (every entry point is imported first)."""
        self._load_deferred(list(self._deferred))
        return list(self._failures)

    def ensure(self, *names: str) -> FamilyRegistry:
        """Import the plugins of the families ``names`` if not yet imported; returns the registry.

        Whoever calls a hook about modules of some families (a save, an unfuse) ensures their plugins first:
        a model unpickled in a fresh process has fused modules whose plugins nothing has imported yet.
        """
        # A name registered already may still be claimed by a deferred entry point: loading it reports the clash.
        self._load_deferred([name for name in names if name in self._deferred or name not in self._families])
        return self

    @property
    def hook(self) -> Any:
        """The lifecycle hooks of every registered plugin (:mod:`fusion_core.hookspecs`), called by keyword."""
        return self._pm.hook

    def integrations(self) -> list[RegisteredIntegration]:
        """The registered integrations, in registration order."""
        return list(self._integrations.values())

    def get(self, name: str) -> RegisteredFamily:
        """The family called ``name``, or :class:`UnknownFamilyError` saying what is installed."""
        self.ensure(name)
        try:
            return self._families[name]
        except KeyError:
            raise UnknownFamilyError(self.unknown_family_message(name)) from None

    def require_integration(self, name: str, workflow: str) -> RegisteredIntegration:
        """The integration called ``name``, or :class:`MissingIntegrationError`: ``workflow`` needs it."""
        registered = self._integrations.get(name)
        if registered is not None:
            return registered
        raise MissingIntegrationError(f"{workflow} needs fusion-core's {name!r} integration, which is not "
                                      f"installed{self._absence(name)}")

    def unknown_family_message(self, name: str) -> str:
        installed = ", ".join(sorted(self.names())) or "none"
        message = f"unknown fusion family {name!r}; installed families: {installed}"
        close = difflib.get_close_matches(name, list(self._families), n=1)
        if close:
            message += f". Did you mean {close[0]!r}?"
        return message + self._absence(name)

    def _absence(self, name: str) -> str:
        """Why the family or integration ``name`` is not here, and what to install."""
        # A plugin whose import failed names nothing; its entry point usually has the registered name.
        failed = [f for f in self.failures if name in (f.family, f.source.plugin)]
        if failed:
            return f". It failed to load: {failed[0]}"
        declared = next((ep for group in (ENTRY_POINT_GROUP, FAMILY_ENTRY_POINT_GROUP)
                         for ep in metadata.entry_points(group=group) if ep.name == name), None)
        if declared is not None and declared.dist is not None:
            why = f" ({DISABLE_AUTOLOAD_ENV}=1)" if _env_flag(DISABLE_AUTOLOAD_ENV) else ""
            return (f". The installed distribution {declared.dist.name} {declared.dist.version} declares "
                    f"the plugin {name!r}, which is not loaded{why}")
        distribution = conventional_distribution(name)
        return (f". By fusion-core's naming convention it is provided by the distribution "
                f"{distribution!r}: pip install {distribution}")

    # -- writing ---------------------------------------------------------------------------
    def register_family(self, spec: object, *, source: PluginSource = PROGRAMMATIC) -> RegisteredFamily:
        """Register one family; raises ``PluginError`` if invalid or its name is taken."""
        try:
            valid = validate_spec(spec)
        except (TypeError, ValueError) as exc:
            raise PluginError(f"{source}: {exc}") from exc
        self.ensure(valid.name)  # an installed family of that name is registered first, and wins
        existing = self._families.get(valid.name)
        if existing is not None:
            raise PluginError(
                f"{source}: family name {valid.name!r} is already registered by {existing.source}"
            )
        if len(self._claims.get(("family", valid.name), ())) > 1:
            raise PluginError(f"{source}: family name {valid.name!r} is disabled: "
                              f"{self._claimants(('family', valid.name))} all claim it")
        registered = RegisteredFamily(valid, source)
        self._families[valid.name] = registered
        return registered

    def unregister_family(self, name: str) -> RegisteredFamily:
        """Remove a family (tests, notebooks); raises :class:`UnknownFamilyError` if absent."""
        registered = self.get(name)
        del self._families[name]
        return registered

    def register_plugin(
        self, plugin: object, *, source: PluginSource | None = None, family: str | None = None
    ) -> list[str]:
        """Register a plugin object (a module or instance with hook implementations).

        Returns the family and integration names it registered. Failures are recorded (raised in
        strict mode); a plugin that fails has none of its hooks left registered. ``family``: the plugin
        must register that family and nothing else (a ``fusion_core.families`` entry point of that name).
        """
        source = source or PluginSource(getattr(plugin, "__name__", repr(plugin)))
        try:
            self._pm.register(plugin, name=f"{source.plugin}:{id(plugin)}")
        except Exception as exc:  # pluggy validation of the hook signatures
            self._fail(source, f"invalid hook implementation: {exc}")
            return []
        self._plugins[source] = plugin
        unknown = self._unknown_hooks(plugin)
        if unknown:
            self._drop(source)
            self._fail(source, f"implements hooks fusion_core does not define: {', '.join(unknown)}; none of its hooks "
                               "run")
            return []
        if not self._pm.get_hookcallers(plugin):
            self._drop(source)
            self._fail(source, "implements no fusion_core hook")
            return []
        added: list[str] = []
        failed = False
        for hook_name, kind in _KINDS.items():
            for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
                if impl.plugin is plugin:
                    failed |= not self._call_hook(impl.function, hook_name, kind, source, added, family)
        if failed:
            self._drop(source)
        return added

    def _unknown_hooks(self, plugin: object) -> list[str]:
        """The hooks ``plugin`` implements that no hookspec declares (a misspelling), each with the likely name.

        pluggy registers such an implementation and never calls it; :meth:`pluggy.PluginManager.check_pending`
        finds it. Every plugin registered before passed this check, so what it finds belongs to ``plugin``.
        """
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError:
            pass
        else:
            return []
        specs = [name for name, caller in vars(self._pm.hook).items() if caller.has_spec()]
        found = []
        for caller in self._pm.get_hookcallers(plugin) or []:
            if not caller.has_spec() and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls()):
                close = difflib.get_close_matches(caller.name, specs, n=1)
                found.append(f"{caller.name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return found

    def _drop(self, source: PluginSource) -> None:
        """Take a failed plugin's hooks out: its lifecycle hooks must not run without what it registers."""
        plugin = self._plugins.pop(source, None)
        if plugin is not None and self._pm.is_registered(plugin):
            self._pm.unregister(plugin)

    def _call_hook(
        self, function: Callable[..., Any], hook_name: str, kind: str, source: PluginSource, added: list[str],
        family: str | None,
    ) -> bool:
        """Run one registration hook; False when the plugin failed (its hooks are then taken out)."""
        pending: list[object] = []
        try:
            result = function(register=pending.append)
        except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() must not end the host
            self._fail(source, f"{hook_name} raised {type(exc).__name__}: {exc}")
            return False
        ok = True
        if result is not None:
            self._fail(source, f"{hook_name} must call register(...) and return None, got {result!r}")
            ok = False
        for value in pending:
            name = getattr(value, "name", None)
            try:
                registered: RegisteredFamily | RegisteredIntegration
                if kind == "family":
                    registered = RegisteredFamily(validate_spec(value), source)
                else:
                    registered = RegisteredIntegration(validate_integration(value), source)
            except (TypeError, ValueError) as exc:
                self._fail(source, str(exc), family=name if isinstance(name, str) and kind == "family" else None)
                ok = False
                continue
            if family is not None and (kind, registered.name) != ("family", family):
                self._fail(source, f"an entry point of the {FAMILY_ENTRY_POINT_GROUP!r} group registers the one family "
                           f"it is named after ({family!r}), not {kind} {registered.name!r}; declare a plugin that "
                           f"registers other names in the {ENTRY_POINT_GROUP!r} group", family=family)
                ok = False
                continue
            ok &= self._claim(kind, registered, source, added)
        return ok

    def _claim(
        self, kind: str, registered: RegisteredFamily | RegisteredIntegration, source: PluginSource, added: list[str]
    ) -> bool:
        table: dict[str, Any] = self._families if kind == "family" else self._integrations
        name = registered.name
        claims = self._claims.setdefault((kind, name), [])
        claims.append(source)
        if len(claims) == 1 and name not in table:
            table[name] = registered
            added.append(name)
            return True
        # A second claim, in either load order: which one runs must never depend on entry-point
        # order, so neither does. Every claimant is reported, each naming the others.
        first = table.pop(name, None)
        if first is not None and first.source not in claims:
            claims.insert(0, first.source)
        if first is not None and first.source is not source:
            self._report_clash(kind, name, first.source)
            if kind == "integration":
                self._drop(first.source)
        self._report_clash(kind, name, source)
        return kind == "family"  # a family clash disables the name only; an integration's hooks must go

    def _claimants(self, key: tuple[str, str]) -> str:
        return " and ".join(str(claim) for claim in self._claims.get(key, ()))

    def _report_clash(self, kind: str, name: str, source: PluginSource) -> None:
        others = " and ".join(str(claim) for claim in self._claims[(kind, name)] if claim is not source)
        family = name if kind == "family" else None
        if not others:
            self._fail(source, f"registers {kind} name {name!r} twice; the {kind} is disabled", family=family)
            return
        self._fail(source, f"{kind} name {name!r} is also registered by {others}; the {kind} is disabled until "
                   f"one is uninstalled or left out with {ALLOWED_ENV}", family=family)

    def _fail(self, source: PluginSource, reason: str, family: str | None = None) -> None:
        failure = PluginFailure(source, reason, family)
        if self.strict:
            raise PluginError(f"{failure} ({STRICT_ENV}=1)")
        self._failures.append(failure)

    def load_entry_points(self) -> None:
        """Import every ``fusion_core`` entry point and register what it registers, one by one; list the
        ``fusion_core.families`` ones, imported when their family is first asked for (:meth:`ensure`)."""
        allowed_raw = os.environ.get(ALLOWED_ENV, "").strip()
        allowed = {_normalize(d.strip()) for d in allowed_raw.split(",") if d.strip()} if allowed_raw else None
        for group in (ENTRY_POINT_GROUP, FAMILY_ENTRY_POINT_GROUP):
            for entry_point in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
                dist = entry_point.dist
                source = PluginSource(
                    entry_point.name,
                    dist.name if dist is not None else "<unknown distribution>",
                    dist.version if dist is not None else "?",
                )
                if allowed is not None and _normalize(source.distribution or "") not in allowed:
                    self._failures.append(PluginFailure(source, f"not loaded: distribution not in {ALLOWED_ENV}"))
                elif group == FAMILY_ENTRY_POINT_GROUP:
                    self._deferred.setdefault(entry_point.name, []).append((entry_point, source))
                else:
                    self._load(entry_point, source, None)

    def _load_deferred(self, names: list[str]) -> None:
        """Import the deferred ``fusion_core.families`` entry points named ``names`` (each plugin once)."""
        with self._deferred_lock:
            for name in names:
                for entry_point, source in self._deferred.pop(name, ()):
                    if self._load(entry_point, source, name) == []:
                        self._fail(source, f"registers no family {name!r}, the name of its "
                                   f"{FAMILY_ENTRY_POINT_GROUP!r} entry point", family=name)

    def _load(self, entry_point: metadata.EntryPoint, source: PluginSource, family: str | None) -> list[str] | None:
        """Import one entry point and register its plugin: the names it registered (None: its import failed)."""
        try:
            plugin = entry_point.load()
        except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() must not end the host
            self._fail(source, f"import of {entry_point.value!r} failed: {type(exc).__name__}: {exc}", family=family)
            return None
        return self.register_plugin(plugin, source=source, family=family)


def conventional_distribution(name: str) -> str:
    """The distribution fusion-core's convention gives a family or integration (``gate_up`` -> ``fusion-gate-up``)."""
    return "fusion-" + name.replace("_", "-")


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


_registry: FamilyRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> FamilyRegistry:
    """The process-wide registry, created (and entry points loaded) on first use."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                registry = FamilyRegistry()
                if not _env_flag(DISABLE_AUTOLOAD_ENV):
                    registry.load_entry_points()
                _registry = registry
    return _registry


def loaded_registry() -> FamilyRegistry | None:
    """The process-wide registry if one was built, without building one (None: no plugin was loaded)."""
    return _registry


def reset_registry() -> None:
    """Forget the process-wide registry; the next :func:`get_registry` reloads (tests use this)."""
    global _registry
    with _registry_lock:
        _registry = None


def register_family(spec: object) -> RegisteredFamily:
    """Register a family in the process-wide registry without packaging it (tests, notebooks)."""
    return get_registry().register_family(spec)


def unregister_family(name: str) -> RegisteredFamily:
    """Remove a family from the process-wide registry."""
    return get_registry().unregister_family(name)
