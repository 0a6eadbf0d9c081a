"""``fusion plan``: what a fused load would do to a checkpoint, decided on the meta device.

No weight is read: the model is instantiated on the meta device (discovery), and the checkpoint
is known from its safetensors headers only. The plan lists every module that would be replaced
and every checkpoint tensor that would be transformed, with its shapes before and after, and
checks the checkpoint against the plan the way a fused load does before reading data.
"""

from __future__ import annotations

from typing import Any

from fusion_core.checkpoint import KeyMatcher, TensorInfo, check_checkpoint, read_checkpoint_index
from fusion_core.commands._common import Checkpoint, fusion_config_from_args, resolve_checkpoint
from fusion_core.discovery import discover
from fusion_core.errors import CheckpointError, DiscoveryError, PlanError
from fusion_core.transforms import FusionPlan, class_name


def run_plan(
    model_dir: str,
    families: str | None = None,
    options: str | None = None,
    config_file: str | None = None,
    model_class: str | None = None,
) -> dict[str, Any]:
    """The plan as plain data; ``ok`` is False (with ``error``) when nothing can be fused."""
    checkpoint = resolve_checkpoint(model_dir, model_class)
    fusion = fusion_config_from_args(families, options, config_file, checkpoint)
    result: dict[str, Any] = {
        "command": "plan",
        "model_dir": str(checkpoint.directory),
        "model_class": checkpoint.model_cls.__name__,
        "layout": checkpoint.layout,
        "fusion_config": fusion.model_dump(),
        "ok": False,
        "error": None,
        "error_type": None,
        "modules": [],
        "skipped": [],
        "nested": [],
        "refused": [],
        "transforms": [],
        "checkpoint": {"checked": False, "error": None},
    }
    try:
        discovery = discover(checkpoint.model_cls, checkpoint.config, fusion)
    except (DiscoveryError, PlanError) as exc:
        result["error"], result["error_type"] = str(exc), type(exc).__name__
        return result
    plan = discovery.plan
    result["ok"] = True
    result["scanned_modules"] = discovery.scanned_modules
    result["skipped"] = list(plan.skipped)
    result["nested"] = [
        {"family": family, "module": path, "left_to": outer_family, "inside": outer_path}
        for family, path, outer_family, outer_path in plan.nested
    ]
    result["refused"] = [{"family": family, "module": path, "reason": reason}
                         for family, path, reason in plan.refused]
    result["modules"] = [
        {
            "family": m.family,
            "module": m.path,
            "original_class": class_name(m.original_class),
            "fused_class": class_name(m.fused_class),
        }
        for m in plan.modules
    ]
    try:
        index = read_checkpoint_index(checkpoint.directory)
    except CheckpointError as exc:
        result["checkpoint"] = {"checked": False, "error": str(exc)}
        result["transforms"] = plan.describe()
        return result
    result["transforms"] = describe_with_checkpoint(plan, index, checkpoint, KeyMatcher(index, discovery.names))
    try:
        check_checkpoint(checkpoint.directory, index, plan, checkpoint.fused_layout, names=discovery.names)
    except CheckpointError as exc:
        result["checkpoint"] = {"checked": True, "error": str(exc)}
        result["ok"] = False
        result["error"], result["error_type"] = str(exc), type(exc).__name__
    else:
        result["checkpoint"] = {"checked": True, "error": None}
    return result


def describe_with_checkpoint(
    plan: FusionPlan, index: dict[str, TensorInfo], checkpoint: Checkpoint, matcher: KeyMatcher
) -> list[dict[str, object]]:
    """:meth:`FusionPlan.describe` rows, each with the checkpoint keys, files and dtypes involved.

    ``checkpoint_keys`` maps every model key of the row (original and fused) to its key in a
    checkpoint of that layout: the source checkpoint's own key for the layout it is in, the same
    prefix with the other layout's leaf name for the other.
    """
    rows = plan.describe()
    for row, (module, bound) in zip(rows, [(m, b) for m in plan.modules for b in m.transforms], strict=True):
        present = bound.targets if checkpoint.fused_layout else bound.sources
        prefix = matcher.module_prefix(module, [s.name for s in present])
        ckpt_keys: dict[str, str | None] = {}
        for spec in (*bound.sources, *bound.targets):
            ckpt_keys[module.full_key(spec.name)] = None if prefix is None else prefix + spec.name
        info = index.get(f"{prefix}{present[0].name}") if prefix is not None else None
        row["checkpoint_keys"] = ckpt_keys
        row["dtype"] = info.dtype if info else None
        row["file"] = info.file if info else None
    return rows
