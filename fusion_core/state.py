"""Every piece of process-wide state fusion-core keeps, and :func:`reset_state` to clear what may be cleared.

What is global, and why it must be:

====================================  ===========================================================  ================
state                                 why process-wide                                              reset_state()
====================================  ===========================================================  ================
plugin registry                       entry points are imported once (``fusion_core.plugins``)      rebuilt on next use
discovery cache                       a meta model per (class, config, families) is built once      cleared
safetensors header cache              shard headers are parsed once per file version                cleared
merge policy                          ``FUSION_CORE_MERGE``, or :func:`set_merge_policy`            re-read
measured decisions                    one measurement per kind serves every layer (core, plugins)   cleared (in memory)
transformers routing                  ``integrate_transformers()`` replaces a class method          switched off
missing-integration warnings          each library without its integration is named once           forgotten
fused-class cache                     ``isinstance`` and pickling need one class per pair           kept (identity)
``__init__`` wrappers, load lock      only while a fused load runs (``fusion_core.patching``)       none to reset
environment variables                 read when the registry or the merge policy is (re)built       re-read
plugins' own state                    each plugin's (its caches, import finders)                    its hook clears
====================================  ===========================================================  ================

The environment variables: ``FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD``, ``FUSION_CORE_STRICT_PLUGINS``,
``FUSION_CORE_ALLOWED_PLUGINS`` (the registry), ``FUSION_CORE_MERGE`` (the merge policy), and
``FUSION_CORE_DECISIONS`` and ``FUSION_CORE_CACHE_DIR`` (the decision store, read whenever it is).
Measured decisions ("which way is faster here", the merge policy's and the plugins', such as
``linear_kernels``') live in :mod:`fusion_core.decisions`: :func:`reset_state` forgets them in memory, and
the store on disk (per machine and software) is kept, so the next call of each kind reads it as a fresh
process would (``fusion tune`` forgets the stored ones). State that belongs to a plugin is the plugin's (the
PEFT integration's import hook): :func:`reset_state` asks every loaded plugin to clear it (the
``fusion_reset_state`` hook).
"""

from __future__ import annotations

from fusion_core import checkpoint, decisions, discovery, integration_needs, merge_policy, plugins, routing


def reset_state() -> None:
    """Clear every resettable piece of process-wide state in one call (tests, notebooks).

    Afterwards the next call reloads the plugins and re-reads the environment variables, as in a
    fresh process. Not to be called while a load runs in another thread.
    """
    routing.reset_integration()
    registry = plugins.loaded_registry()
    if registry is not None:
        registry.hook.fusion_reset_state()
    plugins.reset_registry()
    discovery.clear_cache()
    checkpoint.clear_header_cache()
    merge_policy.reset_merge_policy()
    decisions.reset()
    integration_needs.forget_warnings()
