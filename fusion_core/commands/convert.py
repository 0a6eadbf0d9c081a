"""``fusion convert``: rewrite a checkpoint in the other layout, shard by shard, atomically.

The fused layout is what ``fusion_core.save_pretrained(model, dir, save_original_format=False)``
writes: the same shards with the fused tensors, and ``fused_config.json`` (the config plus
``"fusion_core": {"fusion_config": ..., "layout": "fused"}``) instead of ``config.json``.

Only one shard's tensors are in memory at a time (plus the few tensors of a transform whose
sources straddle two shards). The plan comes from discovery on the meta device and is checked
against the checkpoint headers before any data is read; the new directory appears only when
every shard is written (:func:`fusion_core.checkpoint.atomic_directory`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusion_core.checkpoint import (
    SAFE_WEIGHTS_INDEX_NAME,
    KeyMatcher,
    atomic_directory,
    check_checkpoint,
    match_keys,
    read_checkpoint_index,
)
from fusion_core.commands._common import UsageError, fusion_config_from_args, progress, resolve_checkpoint
from fusion_core.compat.transformers import LoadedNames, loaded_names
from fusion_core.discovery import discover
from fusion_core.errors import CheckpointError
from fusion_core.record import CONFIG_NAME, FUSED_CONFIG_NAME, write_config
from fusion_core.transforms import BoundTransform, FusionPlan
from fusion_core.wrapped import same_bits

#: Index metadata a fused-layout conversion leaves so the way back restores the original shards.
ORIGINAL_SHARDS_KEY = "fusion_core_original_shards"


@dataclass(frozen=True)
class _Group:
    """One bound transform in checkpoint keys: ``inputs`` (present in the source) -> ``outputs``."""

    bound: BoundTransform
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    to_fused: bool

    def apply(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            if self.to_fused:
                return self.bound.op.forward(tensors)
            return self.bound.op.inverse(tensors, [s.shape for s in self.bound.sources])


def _groups(plan: FusionPlan, checkpoint_keys: list[str], to_fused: bool, names: LoadedNames) -> list[_Group]:
    groups = []
    matcher = KeyMatcher(checkpoint_keys, names)  # once: one lookup per key, not an index per group
    for module in plan.modules:
        for bound in module.transforms:
            present, produced = (bound.sources, bound.targets) if to_fused else (bound.targets, bound.sources)
            inputs = []
            for key in (module.full_key(s.name) for s in present):
                ckpt_key = matcher.lookup(key)
                if ckpt_key is None:
                    raise CheckpointError(f"family {module.family!r}, module {module.path!r}: no checkpoint key "
                                          f"for {key!r}")
                inputs.append(ckpt_key)
            prefix = inputs[0][: len(inputs[0]) - len(present[0].name)]
            groups.append(_Group(bound, tuple(inputs), tuple(prefix + s.name for s in produced), to_fused))
    return groups


def run_convert(
    src: str,
    dst: str,
    to: str = "fused",
    families: str | None = None,
    options: str | None = None,
    config_file: str | None = None,
    model_class: str | None = None,
    overwrite: bool = False,
    show_progress: bool | None = None,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    if to not in ("fused", "original"):
        raise UsageError(f"--to must be 'fused' or 'original', not {to!r}")
    checkpoint = resolve_checkpoint(src, model_class)
    to_fused = to == "fused"
    if checkpoint.fused_layout == to_fused:
        raise UsageError(f"{src} is already in the {checkpoint.layout} layout")
    target = Path(dst)
    if target.resolve() == checkpoint.directory.resolve():
        raise UsageError("the destination must differ from the source")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise UsageError(f"{dst} exists and is not empty; pass --overwrite to replace it")
    fusion = fusion_config_from_args(families, options, config_file, checkpoint)
    if checkpoint.fused_layout and fusion.model_dump() != (checkpoint.stored_fusion_config or {}):
        stored = checkpoint.stored_fusion_config
        raise UsageError(f"{src} was fused with fusion_config={stored}; convert it back with that one")
    discovery = discover(checkpoint.model_cls, checkpoint.config, fusion)
    plan = discovery.plan
    # headers only: fail before writing
    index = read_checkpoint_index(checkpoint.directory)
    check_checkpoint(checkpoint.directory, index, plan, checkpoint.fused_layout, names=discovery.names)
    groups = _groups(plan, list(index), to_fused, discovery.names)
    shards: dict[str, list[str]] = {}
    for key, info in index.items():
        shards.setdefault(info.file, []).append(key)
    index_path = checkpoint.directory / SAFE_WEIGHTS_INDEX_NAME
    source_index = json.loads(index_path.read_text()) if index_path.is_file() else None
    recorded = dict(((source_index or {}).get("metadata") or {}).get(ORIGINAL_SHARDS_KEY) or {})
    # Where each output tensor goes: back to the shard it came from when this checkpoint was
    # converted by fusion-core before (exact round trip), else the shard of the group's first input.
    destination: dict[str, str] = {}
    moved: dict[str, str] = {}
    for group in groups:
        for key in group.inputs:
            moved[key] = index[key].file
        for key in group.outputs:
            destination[key] = recorded.get(key) or index[group.inputs[0]].file
    grouped = {key for group in groups for key in group.inputs}
    weight_map: dict[str, str] = {}
    total_size = 0
    from safetensors import safe_open
    from safetensors.torch import save_file

    with atomic_directory(target) as staging, ExitStack() as stack:
        for item in sorted(checkpoint.directory.iterdir()):
            if item.name in (CONFIG_NAME, FUSED_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME) or item.suffix == ".safetensors":
                continue
            if item.is_file():
                shutil.copy2(item, staging / item.name)
            elif item.is_dir() and not item.name.startswith("."):
                shutil.copytree(item, staging / item.name)
        handles: dict[str, Any] = {}

        def handle(shard: str) -> Any:
            if shard not in handles:
                handles[shard] = stack.enter_context(safe_open(str(checkpoint.directory / shard), "pt"))
            return handles[shard]

        ready: dict[str, torch.Tensor] = {}  # computed outputs waiting for their shard
        done: set[int] = set()
        bar = progress(sorted(shards), total=len(shards), desc=f"convert to {to}", enabled=show_progress,
                       unit="shard")
        for shard in bar:
            if on_step:
                on_step(shard)
            out = {key: handle(shard).get_tensor(key) for key in shards[shard] if key not in grouped}
            for number, group in enumerate(groups):
                if number in done or not any(destination[k] == shard for k in group.outputs):
                    continue
                tensors = [handle(index[k].file).get_tensor(k) for k in group.inputs]
                ready.update(zip(group.outputs, (t.contiguous() for t in group.apply(tensors)), strict=True))
                done.add(number)
            for key in [k for k in ready if destination[k] == shard]:
                out[key] = ready.pop(key)
            save_file(out, str(staging / shard), metadata=handle(shard).metadata())
            for key, tensor in out.items():
                weight_map[key] = shard
                total_size += tensor.numel() * tensor.element_size()
        if ready or len(done) != len(groups):
            raise CheckpointError(f"internal error: tensors {sorted(ready)} were never written")
        if source_index is not None:
            metadata = dict(source_index.get("metadata") or {})
            metadata["total_size"] = total_size
            metadata.pop(ORIGINAL_SHARDS_KEY, None)
            if to_fused:
                metadata[ORIGINAL_SHARDS_KEY] = dict(sorted(moved.items()))
            source_index["metadata"] = metadata
            source_index["weight_map"] = dict(sorted(weight_map.items()))
            (staging / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(source_index, indent=2, sort_keys=True) + "\n")
        write_config(staging, checkpoint.raw_config, discovery.record(), fused=to_fused)
    return {
        "command": "convert",
        "source": str(checkpoint.directory),
        "destination": str(target),
        "from": checkpoint.layout,
        "to": to,
        "fusion_config": discovery.record(),
        "shards": len(shards),
        "tensors": len(weight_map),
        "transformed_groups": len(groups),
        "total_size": total_size,
    }


def verify_conversion(result: dict[str, Any], model_class: str | None = None) -> dict[str, Any]:
    """Load the fused-layout side with :func:`fusion_core.from_pretrained` and compare it with the other.

    The fused model's ``state_dict()`` presents the original layout, so it must equal the
    original-layout checkpoint tensor for tensor (this loads the whole model, unlike convert).
    """
    from safetensors import safe_open

    from fusion_core.hf import from_pretrained

    pair = (result["destination"], result["source"])
    fused_dir, original_dir = pair if result["to"] == "fused" else pair[::-1]
    checkpoint = resolve_checkpoint(original_dir, model_class)
    model = from_pretrained(checkpoint.model_cls, fused_dir, dtype="auto")
    state = model.state_dict()
    index = read_checkpoint_index(Path(original_dir))
    mapping = match_keys(list(state), list(index), loaded_names(model))
    problems = [f"no checkpoint tensor for model key {k!r}" for k in state if k not in mapping]
    problems += [f"checkpoint tensor {k!r} is not in the model" for k in sorted(set(index) - set(mapping.values()))]
    handles: dict[str, Any] = {}
    with ExitStack() as stack:
        for key, ckpt_key in mapping.items():
            file = index[ckpt_key].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(Path(original_dir) / file), "pt"))
            if not same_bits(state[key], handles[file].get_tensor(ckpt_key)):
                problems.append(f"{ckpt_key!r} differs from the loaded model's {key!r}")
    return {"ok": not problems, "tensors": len(mapping), "problems": problems}
