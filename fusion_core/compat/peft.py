"""Every private name of PEFT that fusion-core relies on (LoRA on fused modules).

Checked on peft 0.21.2 (:data:`CHECKED_RELEASES`; peft 0.17.1 itself does not import next to
transformers 5.x: it imports ``transformers.HybridCache``, which 5.x removed). On a release that
lacks one of them, :func:`wrap_lora_factories` raises ImportError naming it, the installed
release and the ones checked, instead of LoRA silently skipping fused modules.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import metadata
from types import ModuleType
from typing import Any

LORA_MODULE = "peft.tuners.lora.model"
"""The module whose import installs the wrappers (the one defining ``LoraModel``)."""

CHECKED_RELEASES = ("0.21.2",)

Factory = Callable[..., Any]


def _missing(name: str) -> ImportError:
    return ImportError(
        f"peft {metadata.version('peft')} has no {name}, which LoRA on fused modules wraps; fusion-core was "
        f"checked on peft {', '.join(CHECKED_RELEASES)}: install one of those, or load the model unfused"
    )


def wrap_lora_factories(
    lora_model_module: ModuleType,
    create: Callable[[Factory], Factory],
    all_linear: Callable[[Factory], Factory],
) -> None:
    """Replace PEFT's LoRA module factory and its ``"all-linear"`` expansion by ``create(original)`` and
    ``all_linear(original)``.

    - ``LoraModel._create_new_module`` (a staticmethod ``(lora_config, adapter_name, target,
      **kwargs) -> module``): every LoRA layer PEFT builds comes from it;
    - ``peft.tuners.tuners_utils._maybe_include_all_linear_layers`` (``(peft_config, model) ->
      peft_config``): what ``target_modules="all-linear"`` expands to.
    """
    lora_model = getattr(lora_model_module, "LoraModel", None)
    raw = None if lora_model is None else lora_model.__dict__.get("_create_new_module")
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    expand = getattr(tuners_utils, "_maybe_include_all_linear_layers", None)
    if raw is None or not hasattr(raw, "__func__"):
        raise _missing("LoraModel._create_new_module (a staticmethod)")
    if expand is None:
        raise _missing("peft.tuners.tuners_utils._maybe_include_all_linear_layers")
    lora_model._create_new_module = staticmethod(create(raw.__func__))  # type: ignore[union-attr]
    tuners_utils._maybe_include_all_linear_layers = all_linear(expand)  # type: ignore[union-attr]
