"""What an integration plugin registers: its name and what it serves.

An integration makes fused models work with a tool users bring (PEFT, tensor parallelism, a
quantizer). It is a plugin like a family: a distribution with an entry point in the
``fusion_core`` group whose module implements
:func:`~fusion_core.hookspecs.register_fusion_integrations` and the lifecycle hooks of
:mod:`fusion_core.hookspecs`. The core never calls an integration by name; it calls hooks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Integration:
    """An integration's name (an identifier: ``tensor_parallel``) and a one-line description."""

    name: str
    description: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"integration name {self.name!r} is not an identifier")
        if not isinstance(self.description, str):
            raise TypeError(f"integration {self.name!r}: description must be a string")


def validate_integration(value: object) -> Integration:
    """``value`` if it is an :class:`Integration`; ``TypeError`` saying what it is otherwise."""
    if not isinstance(value, Integration):
        raise TypeError(f"{value!r} is not a fusion_core.Integration")
    return value
