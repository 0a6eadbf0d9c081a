"""``fusion check``: load plain and fused, compare on the same random inputs, round trip, time.

See :mod:`fusion_core.compare` for how inputs are chosen. The check fails (``ok`` is
False) when a fused module or the whole model differs beyond the documented tolerance of the
dtype, when the fused model, a fused sub-model or a fused module raises (or returns differently
shaped outputs) on inputs the plain one ran (the report's note gives the exception's type and
message), when a fused module could not be exercised at all, or when saving the fused model does
not reproduce the source checkpoint exactly. Only inputs the *plain* model cannot run are
reported as "not run".

A family that declares ``preserves = "training_loss"`` (``linear_cross_entropy``) promises less in one
mode and more in another: in training mode with labels, the loss and every gradient (not the logits);
everywhere else, the original forward bit for bit. For such a family the check also runs one training
step on both models (:func:`fusion_core.compare.compare_training`) and reports it as
``training``; a mismatch fails the check.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from fusion_core.commands._common import UsageError, fusion_config_from_args, resolve_checkpoint
from fusion_core.compare import compare_models, compare_training, round_trip
from fusion_core.hf import LOAD_LOCK, from_pretrained, get_fusion_plan
from fusion_core.plugins import get_registry
from fusion_core.spec import spec_member

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_check(
    model_dir: str,
    families: str | None = None,
    options: str | None = None,
    config_file: str | None = None,
    model_class: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    repeats: int = 5,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    checkpoint = resolve_checkpoint(model_dir, model_class)
    if checkpoint.fused_layout:
        raise UsageError(
            f"{model_dir} is a fused-layout checkpoint, which plain transformers cannot load for comparison; "
            "run `fusion convert --to original` first and check that"
        )
    fusion = fusion_config_from_args(families, options, config_file, checkpoint)
    step = on_step or (lambda _: None)
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype] if dtype else "auto"}
    step("plain load")
    with LOAD_LOCK:
        plain = checkpoint.model_cls.from_pretrained(
            checkpoint.directory, config=copy.deepcopy(checkpoint.config), **kwargs
        )
    step("fused load")
    fused = from_pretrained(checkpoint.model_cls, checkpoint.directory, fusion_config=fusion, **kwargs)
    plan = get_fusion_plan(fused)
    if plan is None:  # from_pretrained always records one; a None here is a pipeline bug
        raise RuntimeError(f"the fused load of {checkpoint.directory} recorded no fusion plan")
    registry = get_registry()
    specs = {name: registry.get(name).spec for name in plan.families}
    comparison = compare_models(plain, fused, plan, specs=specs, seed=seed, repeats=repeats, on_step=step)
    step("round trip")
    if dtype is not None:  # bytes are compared with the source: reload in the checkpoint's own dtype
        fused = from_pretrained(checkpoint.model_cls, checkpoint.directory, fusion_config=fusion, dtype="auto")
    comparison.round_trip = round_trip(fused, checkpoint.directory)
    result = comparison.as_dict()
    training = [name for name in plan.families if spec_member(specs[name], "preserves") == "training_loss"]
    if training:
        step("training step")
        result["training"] = _training_check(plain, fused, training, seed)
        result["ok"] = result["ok"] and result["training"]["ok"]
    result.update(
        command="check",
        model_dir=str(checkpoint.directory),
        model_class=checkpoint.model_cls.__name__,
        fusion_config=fusion.model_dump(),
        dtype=str(next(p.dtype for p in plain.parameters())).removeprefix("torch."),
    )
    return result


def _training_check(plain: Any, fused: Any, families: list[str], seed: int) -> dict[str, Any]:
    """One training step with labels on both models: the loss and every gradient, for ``families`` that declare it."""
    try:
        report = compare_training(plain, fused, seed=seed)
    except Exception as exc:  # the plain model cannot train on the kit's inputs (not a causal LM)
        return {"families": families, "ok": True, "note": f"not run: {type(exc).__name__}: {exc}"}
    return {"families": families, **report.as_dict()}
