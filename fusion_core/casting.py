"""A dtype cast done by the merge: merged parts are loaded as stored and cast while the merged tensor is built.

A load with ``dtype=torch.float32`` from a bf16 checkpoint makes transformers cast every tensor as it
reads it: for a part that fusion-core then merges (``q_proj.weight``, ``gate_proj.weight``) that is a
new float32 tensor, written once, and then copied into the merged tensor, written again: the fused
load allocated and wrote its merged projections twice (at Qwen2.5-1.5B shapes 3.3 GB more, a fused
float32 load took 1.6x as long as plain's). Both release lines cast each tensor to the dtype of the
model's (meta) parameter it loads into, unless a ``keep_in_fp32`` rule says float32. So before
transformers' load reads any weight, :func:`hold_stored_dtypes` gives the meta parameters of the
parts that a merge will build the dtype the checkpoint stores them in: transformers then loads them
as stored (memory-mapped, nothing written), and the merge writes each merged byte once, cast to the
dtype the part would have had (:func:`fusion_core.streaming.merge` with ``dtype``).

Only parts that are floating on both sides, on the meta device (nothing loaded yet), of a merge
:mod:`fusion_core.streaming` can build, in a CPU load from a local safetensors checkpoint without a
quantizer (the caller decides) are held; any other part is cast by transformers as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fusion_core.checkpoint import KeyMatcher, TensorInfo
from fusion_core.compat.transformers import LoadedNames
from fusion_core.transforms import FusionPlan, ModulePlan

#: safetensors dtype name -> torch dtype, for the dtypes a merge casts between
_CASTABLE = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

#: module-relative part name -> the dtype the merge casts it to
Casts = dict[str, torch.dtype]


def stored_dtypes(
    tensors: Mapping[str, TensorInfo], plan: FusionPlan, names: LoadedNames | None,
    key_mapping: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, torch.dtype]]:
    """Model key -> (its checkpoint key, the dtype stored there), for every part a streamed merge of ``plan`` reads."""
    matcher = KeyMatcher(tensors, names, key_mapping)
    stored: dict[str, tuple[str, torch.dtype]] = {}
    for module in plan.modules:
        for bound in module.transforms:
            if bound.op.flat_offsets([s.shape for s in bound.sources]) is None:
                continue
            for spec in bound.sources:
                key = module.full_key(spec.name)
                ckpt_key = matcher.lookup(key)
                dtype = _CASTABLE.get(tensors[ckpt_key].dtype) if ckpt_key is not None else None
                if ckpt_key is not None and dtype is not None:
                    stored[key] = (ckpt_key, dtype)
    return stored


def hold_stored_dtypes(
    built: list[tuple[nn.Module, ModulePlan]], stored: Mapping[str, tuple[str, torch.dtype]]
) -> dict[int, Casts]:
    """Give the still-meta parts of ``built`` their stored dtype; per module (by ``id``), what each part is cast to.

    Called on the model transformers built, before it loads any weight (``stored``: :func:`stored_dtypes`).
    """
    casts: dict[int, Casts] = {}
    for module, plan in built:
        held: Casts = {}
        for bound in plan.transforms:
            for spec in bound.sources:
                dtype = stored[key][1] if (key := plan.full_key(spec.name)) in stored else None
                owner, _, leaf = spec.name.rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                param = holder._parameters.get(leaf)
                if (dtype is None or param is None or not param.is_meta or param.dtype == dtype
                        or param.dtype not in _CASTABLE.values()):
                    continue
                holder._parameters[leaf] = nn.Parameter(torch.empty_like(param, dtype=dtype),
                                                        requires_grad=param.requires_grad)
                held[spec.name] = param.dtype
        if held:
            casts[id(module)] = held
    return casts


def cast_back(module: nn.Module, held: Casts) -> None:
    """Give the parts :func:`hold_stored_dtypes` held their dtype back, in a module that is left unfused
    (built elsewhere than planned): it must hold what plain transformers would have loaded."""
    for name, dtype in held.items():
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        param = holder._parameters[leaf]
        if param is not None and param.dtype != dtype:
            holder._parameters[leaf] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)


__all__ = ["Casts", "cast_back", "hold_stored_dtypes", "stored_dtypes"]
