"""The pre-read memory check of a fused load onto the CPU: refuse a load that would not fit, before reading.

A fused load keeps the checkpoint's parts memory-mapped (page cache the kernel can drop) while it
writes merged tensors (a qkv or gate_up concatenation, a stack of experts) into new anonymous
memory (:mod:`fusion_core.streaming`). The plan knows every merged tensor's shape and the
safetensors headers every stored tensor's dtype and shape, so an upper bound of the bytes the load
will newly allocate is known before any weight is read. The estimate is deliberately simple and
conservative:

- **merged copies**: every tensor a transform produces, in the target dtype (a reshape that ends
  up a view of the loaded storage is counted too, and so is a merge whose parts lie back to back in
  the checkpoint, which becomes a view of them);
- **casts**: every stored floating-point tensor whose dtype differs from the target dtype, in the
  target dtype (a cast cannot stay mapped; a tensor kept in its stored dtype is assumed to), but
  for the parts a merge casts as it builds the merged tensor (:mod:`fusion_core.casting`): their
  cast is the merged copy, already counted.

The target dtype is the load's ``dtype`` (or ``torch_dtype``); ``"auto"``, and no dtype on
transformers 5 (whose default is ``"auto"``), keep each tensor's stored dtype, merged copies
counted at the widest stored floating dtype; no dtype on transformers 4 loads float32.
What is available is the smaller of ``MemAvailable`` in ``/proc/meminfo`` and the cgroup's
``memory.max`` minus ``memory.current``; where neither can be read the check is skipped.
``FUSION_CORE_SKIP_MEMORY_CHECK=1`` skips it too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusion_core.checkpoint import DTYPE_SIZES, FLOAT_DTYPES, TensorInfo
from fusion_core.compat.transformers import release
from fusion_core.errors import InsufficientMemoryError
from fusion_core.transforms import FusionPlan

SKIP_ENV = "FUSION_CORE_SKIP_MEMORY_CHECK"
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class LoadEstimate:
    """Bytes a fused load newly allocates: ``merged`` copies, and ``total`` with the casts."""

    merged: int
    total: int


def available_memory() -> tuple[int, str] | None:
    """Bytes this process may still allocate and where that number came from; None where nothing says."""
    found: list[tuple[int, str]] = []
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, f"MemAvailable in {_MEMINFO}"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            used = int((_CGROUP / "memory.current").read_text().strip())
            found.append((max(int(limit) - used, 0), f"cgroup limit {_CGROUP}/memory.max minus memory.current"))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _target_itemsize(load_dtype: Any) -> int | None:
    """Bytes per element the load converts floating-point tensors to; None keeps each stored dtype."""
    if load_dtype is None:
        return None if release() >= (5, 0) else torch.get_default_dtype().itemsize
    if isinstance(load_dtype, str):
        if load_dtype == "auto":
            return None
        load_dtype = getattr(torch, load_dtype, None)
    return load_dtype.itemsize if isinstance(load_dtype, torch.dtype) else None


def estimate_load(
    tensors: Mapping[str, TensorInfo], plan: FusionPlan, fused_layout: bool, load_dtype: Any,
    cast_in_merge: Collection[str] = (),
) -> LoadEstimate:
    """The bytes a fused load of ``tensors`` (a checkpoint's headers) will newly allocate; see the module docstring.

    ``cast_in_merge``: the checkpoint keys of the parts a merge casts (not cast on their own)."""
    itemsize = _target_itemsize(load_dtype)
    floats = [info for info in tensors.values() if info.dtype in FLOAT_DTYPES]
    widest = max((DTYPE_SIZES[info.dtype] for info in floats), default=4)
    merged = 0 if fused_layout else sum(
        math.prod(target.shape) * (itemsize or widest)
        for module in plan.modules for bound in module.transforms for target in bound.targets
    )
    casts = 0 if itemsize is None else sum(
        math.prod(info.shape) * itemsize for info in floats
        if DTYPE_SIZES[info.dtype] != itemsize and info.key not in cast_in_merge
    )
    return LoadEstimate(merged, merged + casts)


def onto_cpu(device_map: Any) -> bool:
    """Whether a load with this ``device_map`` puts every tensor in CPU memory (None: no map, the CPU)."""
    if isinstance(device_map, Mapping):
        return bool(device_map) and all(onto_cpu(device) for device in device_map.values())
    return device_map is None or str(device_map) == "cpu"


def check_memory(
    tensors: Mapping[str, TensorInfo], plan: FusionPlan, fused_layout: bool, load_kwargs: Mapping[str, Any],
    cast_in_merge: Collection[str] = (),
) -> None:
    """Raise :class:`InsufficientMemoryError` when a load onto the CPU would allocate more than is available.

    ``cast_in_merge``: as :func:`estimate_load` takes it."""
    if os.environ.get(SKIP_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return
    if not onto_cpu(load_kwargs.get("device_map")):
        return
    load_dtype = load_kwargs.get("dtype", load_kwargs.get("torch_dtype"))
    estimate = estimate_load(tensors, plan, fused_layout, load_dtype, cast_in_merge)
    available = available_memory()
    if available is None or estimate.total <= available[0]:
        return
    families = sorted({module.family for module in plan.modules})
    raise InsufficientMemoryError(
        f"the fused load would newly allocate about {estimate.total} bytes ({estimate.merged} bytes of merged "
        f"copies of families {families}, the rest dtype casts) but only {available[0]} bytes are "
        f"available ({available[1]}); no weight was read. Fuse fewer families, load with a device_map onto an "
        f"accelerator, choose a smaller dtype, or set {SKIP_ENV}=1 to skip this check"
    )
