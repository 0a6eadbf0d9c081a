"""Workflows on a fused model that only an integration plugin serves, as the core can see them.

The core calls integrations only through hooks, so without an integration installed nothing would
serve its workflow: a tensor-parallel load would convert each rank's shards as if they were whole
tensors. What the core *can* see of such a workflow (a load keyword, a model transformers loaded
sharded) is listed here, with the integration it needs; the load is then refused by
:meth:`fusion_core.plugins.FamilyRegistry.require_integration`, naming the distribution to
install (``fusion-<name>`` by convention, as for a missing family). Nothing here runs an integration.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from fusion_core.compat import transformers as compat
from fusion_core.plugins import conventional_distribution


@dataclass(frozen=True)
class Need:
    """``workflow`` (a phrase for the error message) needs the integration called ``integration``."""

    integration: str
    workflow: str


TENSOR_PARALLEL = "tensor_parallel"
QUANTIZATION = "quantization"


def load_needs(load_kwargs: Mapping[str, Any], config: Any = None) -> list[Need]:
    """What a fused load needs, from its keyword arguments and the checkpoint's config, before anything is read."""
    needs = []
    if load_kwargs.get("tp_plan") is not None:
        needs.append(Need(TENSOR_PARALLEL, f"a fused load with tp_plan={load_kwargs['tp_plan']!r}"))
    quantization = load_quantization(load_kwargs, config)
    if quantization is not None:
        needs.append(Need(QUANTIZATION, f"a fused load that quantizes ({type(quantization).__name__})"))
    return needs


def load_quantization(load_kwargs: Mapping[str, Any], config: Any) -> Any:
    """The quantization a load applies: its ``quantization_config`` keyword, else the checkpoint's own; or None."""
    explicit = load_kwargs.get("quantization_config")
    return explicit if explicit is not None else getattr(config, "quantization_config", None)


def loaded_needs(model: nn.Module) -> list[Need]:
    """What a model transformers has just loaded needs (a tensor-parallel plan set by its config)."""
    if compat.tensor_parallel_size(model) > 1:
        return [Need(TENSOR_PARALLEL, "a fused model that transformers loaded under a tensor-parallel plan")]
    return []


#: Libraries whose use on a fused model needs an integration, by import name.
LIBRARY_NEEDS = {
    "peft": Need("peft", "PEFT adapters (LoRA) on fused modules"),
    "torchao": Need(QUANTIZATION, "torchao quantization of a fused model"),
    "bitsandbytes": Need(QUANTIZATION, "bitsandbytes quantization of a fused model"),
    "optimum.quanto": Need(QUANTIZATION, "quanto quantization of a fused model"),
}


def warn_unserved_libraries(integrations: Collection[str]) -> None:
    """Warn, once per library and process, about a library whose integration is not installed, when it is in use.

    The core cannot see a PEFT call (it happens after the load, inside PEFT). A library already
    imported when a model is fused is the sign it is about to be used: the warning comes now. One
    imported later (``import peft`` after the load, as most scripts do) gets it when it is imported,
    through a finder on ``sys.meta_path`` that imports nothing itself. An original-format save of a
    fused module an adapter wrapped is refused in any case (:mod:`fusion_core.layout`).
    """
    for library, need in LIBRARY_NEEDS.items():
        if need.integration in integrations or library in _WARNED:
            continue
        if library in sys.modules:
            _warn(library, need, stacklevel=4)
        else:
            _WATCH.missing[library] = need
    if _WATCH.missing and _WATCH not in sys.meta_path:
        sys.meta_path.insert(0, _WATCH)


def _warn(library: str, need: Need, stacklevel: int) -> None:
    _WARNED.add(library)
    warnings.warn(
        f"{library} is imported, but fusion-core's {need.integration!r} integration is not installed: "
        f"{need.workflow} needs it (pip install {conventional_distribution(need.integration)})",
        MissingIntegrationWarning, stacklevel=stacklevel,
    )


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Warns when a library of :data:`LIBRARY_NEEDS` without its integration is first imported; finds nothing."""

    def __init__(self) -> None:
        self.missing: dict[str, Need] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        need = self.missing.pop(fullname, None)
        if need is not None and fullname not in _WARNED:
            _warn(fullname, need, stacklevel=2)
        if not self.missing and self in sys.meta_path:
            sys.meta_path.remove(self)


class MissingIntegrationWarning(UserWarning):
    """A library in use on a fused model has no integration installed (see :func:`warn_unserved_libraries`)."""


_WARNED: set[str] = set()
_WATCH = _ImportWatch()


def forget_warnings() -> None:
    """Warn again about every library (see :func:`warn_unserved_libraries`); the import finder is removed."""
    _WARNED.clear()
    _WATCH.missing.clear()
    if _WATCH in sys.meta_path:
        sys.meta_path.remove(_WATCH)
