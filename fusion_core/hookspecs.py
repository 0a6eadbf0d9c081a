"""The plugin hooks of fusion-core: the whole surface a plugin distribution implements.

A plugin is a module named by an entry point in the ``fusion_core`` group::

    [project.entry-points.fusion_core]
    my_family = "my_package.plugin"

whose module-level functions are marked with :data:`hookimpl`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from fusion_core.spec import ModuleFusionSpec

PROJECT_NAME = "fusion_core"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for a plugin's hook implementations: ``@fusion_core.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


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
