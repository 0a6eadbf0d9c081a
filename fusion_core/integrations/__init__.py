"""Integrations with libraries that wrap or rewrite a model's modules after it is fused.

Each one switches itself on when its library is importable: no user call. fusion-core calls
:func:`activate_integrations` whenever it fuses a model, which costs nothing when the library is
not installed and never imports it early (see :mod:`fusion_core.integrations.peft`).
"""

from __future__ import annotations

from torch import nn

from fusion_core.integrations import peft as _peft

__all__ = ["activate_integrations", "adapter_layers"]


def activate_integrations() -> None:
    """Switch on every integration whose library is installed (idempotent)."""
    _peft.activate()


def adapter_layers(model: nn.Module) -> list[str]:
    """Paths of adapter layers (PEFT tuner layers) inside ``model``; empty when there are none."""
    return _peft.tuner_layer_paths(model)
