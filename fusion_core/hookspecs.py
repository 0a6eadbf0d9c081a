"""The plugin hooks of fusion-core: the whole surface a plugin distribution implements.

A plugin is a module named by an entry point in the ``fusion_core`` group::

    [project.entry-points.fusion_core]
    my_family = "my_package.plugin"

whose module-level functions are marked with :data:`hookimpl`. Families and integrations are
plugins alike: a family package implements :func:`register_fusion_families`; an integration (the
code that makes a fused model work with a tool users bring: PEFT, tensor parallelism, a
quantizer) implements :func:`register_fusion_integrations` and the lifecycle hooks below. A
plugin implements any subset; pluggy lets an implementation take only the arguments it needs.

The lifecycle hooks, in the order a fused load calls them:

1. :func:`fusion_load_planned`: the plan is built, nothing is read yet; an integration may refuse.
2. transformers loads the checkpoint into the (fused-class) modules in their original layout.
3. :func:`fusion_convert_loaded` (a wrapper) runs around the conversion to the fused layout, during
   which :func:`fusion_module_fused` is called once per fused module.
4. The model is returned. :func:`fusion_save_kwargs` runs on every ``fusion_core.save_pretrained``;
   :func:`fusion_fuse_refusal` and :func:`fusion_unfuse_refusal` guard the in-place verbs
   (``fusion_core.fuse`` / ``fusion_core.unfuse``), and ``fusion_core.unfuse`` calls
   :func:`fusion_module_unfused` per module.

An exception raised by an implementation propagates to the caller of the fusion-core function
that called the hook, unchanged, except where a hook says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, MutableMapping, MutableSequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from torch import nn

    from fusion_core.integration import Integration
    from fusion_core.spec import ModuleFusionSpec
    from fusion_core.transforms import FusionPlan, ModulePlan

PROJECT_NAME = "fusion_core"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for a plugin's hook implementations: ``@fusion_core.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- registration ---------------------------------------------------------------------------------
@hookspec
def register_fusion_families(register: Callable[[ModuleFusionSpec[Any]], None]) -> None:
    """Register the fusion families this plugin provides.

    Called once per plugin when the registry loads. Call ``register(spec)`` once per family,
    with an object satisfying :class:`fusion_core.ModuleFusionSpec`. Return nothing.

    An exception raised here, or an object that is not a spec, is reported against this plugin's
    distribution; the other plugins' families stay usable. A family name another plugin also
    registers is usable from neither, whatever the load order, and both are reported naming each
    other (``FUSION_CORE_STRICT_PLUGINS=1`` turns any report into an error).

    Example::

        @fusion_core.hookimpl
        def register_fusion_families(register):
            register(PatchEmbeddingsFamily())
    """


@hookspec
def register_fusion_integrations(register: Callable[[Integration], None]) -> None:
    """Register the integrations this plugin provides: ``register(Integration(name, description))``.

    Called once per plugin when the registry loads, like :func:`register_fusion_families`, with
    the same isolation and clash rules. The name is what ``fusion list`` shows and what the core's
    refusals name when a workflow needs an integration that is not installed (``fusion-<name>`` by
    convention: ``tensor_parallel`` -> ``pip install fusion-tensor-parallel``).
    """


# -- a fused load ---------------------------------------------------------------------------------
@hookspec
def fusion_load_planned(
    plan: FusionPlan, model_class: type, config: Any, load_kwargs: Mapping[str, Any],
    families: Mapping[str, ModuleFusionSpec[Any]],
) -> None:
    """A fused load is planned; no weight has been read yet.

    ``plan`` is what will be fused, ``model_class`` the class (or Auto class) being loaded,
    ``config`` its ``PretrainedConfig``, ``load_kwargs`` the keyword arguments that go to
    transformers' ``from_pretrained`` (``quantization_config``, ``tp_plan``, ``device_map``, ...;
    read-only) and ``families`` the specs of the enabled families by name.

    Raise to refuse the load: :class:`fusion_core.errors.FusionLoadError` naming the family, the
    module and the way out; any other exception is wrapped in one that names the plugin.
    """


@hookspec
def fusion_convert_loaded(
    model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]],
    families: Mapping[str, ModuleFusionSpec[Any]],
) -> Generator[None, None, None] | None:
    """transformers has loaded ``model`` (or ``fusion_core.fuse`` was handed it); its fused modules are about to be
    converted to the fused layout.

    Implement it as a *wrapper* (``@hookimpl(wrapper=True)``, a generator that yields once): the
    code before ``yield`` runs before the conversion, the code after it once every module is
    fused (and :func:`fusion_module_fused` was called for each). ``built`` lists ``(module, its
    plan)`` for every fused module; a wrapper may replace an entry's plan before the conversion
    (tensor parallelism converts each rank's shard with a rank-local plan), or remove an entry to
    leave that module unfused, as plain transformers loaded it (the load puts its original class back
    and leaves it out of the model's plan; a ``required`` family left with nothing fused fails the
    load): tensor parallelism does for rows that do not split evenly over the ranks. Raise
    :class:`fusion_core.errors.FusionLoadError` to fail the load.

    Wrappers nest by what they declare, never by plugin names or load order: a wrapper that
    replaces plans in ``built`` declares ``tryfirst=True`` (it is the outermost, so every other
    wrapper sees the plans that will be converted and finishes before it); one that completes the
    conversion itself (a quantizer's state the conversion cannot carry) declares ``trylast=True``
    (the innermost, so every other wrapper's after-code sees the model as it will be returned).
    Wrappers that declare neither run between them, in no promised order.
    """


@hookspec
def fusion_module_fused(module: nn.Module, plan: ModulePlan) -> None:
    """``module`` has just been fused as ``plan`` says (its fused class finalized, its tensors fused).

    Called on every path that fuses: a fused load, ``fusion_core.fuse``, discovery's rehearsal on
    the meta device (tensors on ``meta``), the test kit. Keep it cheap and idempotent.
    """


@hookspec
def fusion_module_unfused(module: nn.Module, plan: ModulePlan) -> None:
    """``module`` is back in its original class and layout (``fusion_core.unfuse``); ``plan`` is what it had."""


# -- the in-place verbs and saving ------------------------------------------------------------------
@hookspec(firstresult=True)
def fusion_fuse_refusal(model: nn.Module) -> str | None:
    """May ``fusion_core.fuse`` fuse this built model in place? Return the reason it may not, or None.

    The first reason returned refuses the call with :class:`fusion_core.errors.FusionError`, before
    anything changes (PEFT: a model already carrying adapter layers).
    """


@hookspec(firstresult=True)
def fusion_unfuse_refusal(module: nn.Module, plan: ModulePlan) -> str | None:
    """May ``fusion_core.unfuse`` return this fused module to its original form? The reason it may not, or None.

    Asked for every fused module before any is changed; the first reason refuses the whole call
    with :class:`fusion_core.errors.FusionError` (PEFT: adapter layers attached inside it).
    """


@hookspec
def fusion_save_kwargs(model: nn.Module, save_kwargs: MutableMapping[str, Any]) -> None:
    """``fusion_core.save_pretrained`` is about to call ``model.save_pretrained(directory, **save_kwargs)``.

    Update ``save_kwargs`` in place (a gathered ``state_dict`` from a process group, a
    quantizer's serialization settings). Called on every rank of a process group, so collectives
    here match. Raise :class:`fusion_core.errors.SaveError` to refuse the save; nothing is written then.
    """


# -- process-wide state ---------------------------------------------------------------------------
@hookspec
def fusion_reset_state() -> None:
    """:func:`fusion_core.reset_state` is clearing fusion-core's process-wide state: clear the plugin's own.

    Caches, finders on ``sys.meta_path``: whatever a fresh process would not have. Measured decisions kept in a
    :class:`fusion_core.plugin.Decisions` are reset by the core (:func:`fusion_core.decisions.reset`).
    Called on the plugins of the registry in use, before it is discarded; not while a load runs.
    """
