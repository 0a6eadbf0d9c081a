"""Names imported on first use (PEP 562), for the two facades: :mod:`fusion_core` and :mod:`fusion_core.plugin`.

A facade lists ``public name -> defining module``; touching a name imports its module then, not
when the facade is imported, so ``import fusion_core`` stays a few milliseconds and a plugin that
imports :mod:`fusion_core.plugin` pays only for the parts of the core it uses.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def resolve(namespace: dict[str, Any], exports: Mapping[str, str], name: str) -> Any:
    """Import ``name`` from its module in ``exports``, cache it in the facade's ``namespace`` and return it.

    Raises ``AttributeError`` (what ``__getattr__`` must raise) for a name the facade does not export.
    """
    if name not in exports:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(exports[name]), name)
    namespace[name] = value
    return value
