"""Compare a fused model with the plain one: per fused module, whole model, round trip, time.

This is the engine behind ``fusion check`` (and the conformance kit's end-to-end assertions).
It needs no knowledge of the architecture or of any family:

- **whole model**: random inputs are built from the model's ``forward`` signature and its config
  (``input_ids`` avoiding special token ids, or ``pixel_values`` / ``pixel_values_videos`` of the
  configured size); when that is not possible the whole-model comparison is reported as not run;
- **sub-models** the whole-model inputs do not reach (the vision tower of a vision-language
  model, fed only when an image is in the prompt) are driven on their own when their ``forward``
  takes rows of flattened patches (``hidden_states``, ``grid_thw``: Qwen2-VL, Qwen2.5-VL,
  Qwen3-VL, GLM-4V), with rows built from the sub-model's own config;
- **per fused module**: each fused module is a drop-in for its original class, so it is fed
  exactly what the plain model's module at the same path received during those runs (captured
  by a forward hook) and, for standard torch layers (``Linear``, ``Conv1d/2d/3d``), random inputs
  of the right shape as well. A family adds its own with the optional member
  :meth:`fusion_core.ModuleFusionSpec.sample_inputs`;
- **round trip**: the fused model saved with ``save_original_format=True`` is compared tensor by
  tensor (names, dtypes, shapes, bytes) with the source checkpoint.

"Not run" means the *plain* model (or sub-model) could not run the generic inputs. Once it has,
a fused side that raises or returns differently shaped outputs on the same inputs is a failure
(``ok`` False), with the exception's type and message in the report's ``note``.

Tolerances (:data:`TOLERANCES`) bound :func:`relative_error` per dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion_core.spec import Inputs, spec_member
from fusion_core.transforms import class_name

__all__ = [
    "TOLERANCES", "Comparison", "Inputs", "ModuleReport", "RoundTripReport", "WholeModelReport",
    "checkpoint_tensors", "compare_checkpoints", "compare_models", "compare_outputs", "iter_checkpoint_tensors",
    "median_seconds", "model_inputs", "relative_error", "round_trip", "synthetic_inputs", "tensors_of",
    "tower_inputs",
]


#: Documented numerical tolerances (max abs difference, relative to max |reference| + 1) per dtype.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}


def relative_error(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Max abs difference relative to ``max |reference| + 1``: the metric :data:`TOLERANCES` bounds."""
    return float((reference.float() - candidate.float()).abs().max()) / (float(reference.float().abs().max()) + 1.0)


def relative_l2(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """``||candidate - reference|| / ||reference||`` in float32 (a zero reference counts as 1e-30): the metric the
    training comparisons bound, where a gradient's elements may be tiny and a max-abs metric says little."""
    reference, candidate = reference.detach().float(), candidate.detach().float()
    return float((candidate - reference).norm() / reference.norm().clamp_min(1e-30))


@dataclass
class ModuleReport:
    """How one fused module compares with the plain model's module at the same path."""

    family: str
    module: str
    original_class: str
    fused_class: str
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    tolerance: float | None = None
    input_sets: int = 0
    ok: bool = False
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class WholeModelReport:
    ran: bool
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    tolerance: float | None = None
    ok: bool = True
    inputs: dict[str, list[int]] = field(default_factory=dict)
    note: str = ""
    towers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Sub-models driven on their own (a VL model's vision tower): path -> errors and verdict."""

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class TrainingReport:
    """One training step compared (:func:`compare_training`): the loss's relative error, the worst gradient's
    relative L2 error, and what differs (``note``) where ``ok`` is False."""

    ok: bool
    loss: float | None = None
    gradients: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class RoundTripReport:
    ok: bool
    tensors: int = 0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


# -- inputs ------------------------------------------------------------------------------------
def _float_dtype(model: nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _special_token_ids(value: Any) -> set[int]:
    found: set[int] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            named = isinstance(key, str) and key.endswith("token_id")
            if named and isinstance(item, int):
                found.add(item)
            elif named and isinstance(item, list):
                found.update(i for i in item if isinstance(i, int))
            else:
                found.update(_special_token_ids(item))
    return found


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value[0] if isinstance(value, (list, tuple)) else value
    return default


def model_inputs(model: nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor] | None:
    """Random inputs for ``model.forward`` built from its signature and config, or None."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    config = getattr(model, "config", None)
    if config is None:
        return None
    dtype = _float_dtype(model)
    if "input_ids" in params:
        text = getattr(config, "text_config", None) or config
        vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
        if not vocab:
            return None
        special = _special_token_ids(config.to_dict())
        allowed = torch.tensor([i for i in range(int(vocab)) if i not in special])
        if not len(allowed):
            return None
        picks = torch.randint(0, len(allowed), (1, 8), generator=generator)
        return {"input_ids": allowed[picks]}
    for name in ("pixel_values", "pixel_values_videos"):
        if name not in params:
            continue
        size = int(_first(config, "image_size", "crop_size", default=224))
        channels = int(_first(config, "num_channels", "in_chans", "in_channels", default=3))
        frames = _first(config, "num_frames", "frames_per_clip")
        shape = (1, int(frames), channels, size, size) if frames else (1, channels, size, size)
        return {name: torch.randn(*shape, generator=generator).to(dtype)}
    return None


def tower_inputs(model: nn.Module, generator: torch.Generator) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Inputs for sub-models the whole-model inputs do not reach: patch-row vision towers.

    A sub-model whose ``forward`` takes ``hidden_states`` and ``grid_thw`` (the Qwen-VL and GLM-4V
    vision towers) is fed one image of ``2 * merge`` x ``2 * merge`` patches, built from its own
    config, so it fits real checkpoints too. Found by signature, not by architecture name.
    """
    found: list[tuple[str, dict[str, torch.Tensor]]] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(f"{p}.") for p, _ in found):
            continue
        config = getattr(module, "config", None)
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if config is None or "hidden_states" not in params or "grid_thw" not in params:
            continue
        try:
            patch, merge = int(config.patch_size), int(config.spatial_merge_size)
            temporal = int(getattr(config, "temporal_patch_size", 1) or 1)
            channels = int(_first(config, "in_channels", "in_chans", "num_channels", default=3))
        except (AttributeError, TypeError, ValueError):  # a tower of another kind
            continue
        grid = torch.tensor([[1, 2 * merge, 2 * merge]])
        rows = torch.randn(int(grid.prod()), channels * temporal * patch * patch, generator=generator)
        found.append((path, {"hidden_states": rows.to(_float_dtype(module)), "grid_thw": grid}))
    return found


def synthetic_inputs(module: nn.Module, generator: torch.Generator, spec: Any = None) -> list[Inputs]:
    """Random inputs of the right shape for standard torch layers (and whatever ``spec`` adds)."""
    dtype = _float_dtype(module)
    result: list[Inputs] = []
    if spec is not None:
        result.extend(spec_member(spec, "sample_inputs")(module, generator))
    if isinstance(module, nn.Linear):
        result.append(((torch.randn(5, module.in_features, generator=generator).to(dtype),), {}))
    elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and module.groups == 1:
        kernel = tuple(module.kernel_size)
        reach = tuple(d * (k - 1) + 1 for d, k in zip(module.dilation, kernel, strict=True))
        rows = (7, module.in_channels, *reach)
        larger = (2, module.in_channels, *(2 * s + r for s, r in zip(module.stride, reach, strict=True)))
        for shape in (rows, larger):
            result.append(((torch.randn(*shape, generator=generator).to(dtype),), {}))
    return result


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value) if not hasattr(value, "_fields") else value
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a (possibly nested) model output, in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict) or hasattr(value, "to_tuple"):
        items = value.to_tuple() if hasattr(value, "to_tuple") else tuple(value.values())
        return [t for item in items for t in tensors_of(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_of(getattr(value, f.name))]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_of(item)]
    return []


def compare_outputs(expected: Any, got: Any) -> tuple[float, float]:
    """(max abs error, max error relative to max |expected| + 1) over every output tensor."""
    want, have = tensors_of(expected), tensors_of(got)
    if len(want) != len(have):
        raise AssertionError(f"the fused output has {len(have)} tensors, the original {len(want)}")
    worst_abs, worst_rel = 0.0, 0.0
    for a, b in zip(want, have, strict=True):
        if a.shape != b.shape:
            raise AssertionError(f"output shape {tuple(b.shape)} differs from the original {tuple(a.shape)}")
        if not a.numel():
            continue
        worst_abs = max(worst_abs, float((a.float() - b.float()).abs().max()))
        worst_rel = max(worst_rel, relative_error(a, b))
    return worst_abs, worst_rel


# -- the comparisons ---------------------------------------------------------------------------
def _capture(model: nn.Module, paths: Iterable[str]) -> tuple[dict[str, list[Inputs]], Callable[[], None]]:
    captured: dict[str, list[Inputs]] = {path: [] for path in paths}
    handles = []
    for path in captured:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
            if len(captured[path]) < 2:
                captured[path].append((_clone(args), _clone(kwargs)))

        handles.append(model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return captured, remove


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _describe(exc: BaseException, first_line: bool = False) -> str:
    """``Type: message`` of an exception (its first line only when ``first_line``)."""
    message = str(exc)
    if first_line and message:
        message = message.splitlines()[0]
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class _FusedFailed(Exception):
    """The fused side failed on inputs the plain side ran: a check failure; ``str`` is the report's note."""


def _compare_fused(expected: Any, run: Callable[[], Any], what: str) -> tuple[float, float]:
    """:func:`compare_outputs` of ``expected`` and ``run()``; :class:`_FusedFailed` when the fused side fails."""
    try:
        with torch.no_grad():
            got = run()
    except Exception as exc:
        raise _FusedFailed(f"the fused {what} raised {_describe(exc)} on inputs the plain {what} ran") from exc
    try:
        return compare_outputs(expected, got)
    except AssertionError as exc:
        raise _FusedFailed(f"the fused {what}'s output does not match the original's: {exc}") from exc


@dataclass
class Comparison:
    """Everything ``fusion check`` reports."""

    modules: list[ModuleReport]
    whole_model: WholeModelReport
    forward_time_ratio: float | None
    timed: str
    round_trip: RoundTripReport | None = None

    @property
    def ok(self) -> bool:
        return (
            all(m.ok for m in self.modules)
            and self.whole_model.ok
            and (self.round_trip is None or self.round_trip.ok)
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "modules": [m.as_dict() for m in self.modules],
            "whole_model": self.whole_model.as_dict(),
            "round_trip": self.round_trip.as_dict() if self.round_trip else None,
            "forward_time_ratio": self.forward_time_ratio,
            "timed": self.timed,
        }


def compare_models(
    plain: nn.Module,
    fused: nn.Module,
    plan: Any,
    specs: dict[str, Any] | None = None,
    seed: int = 0,
    repeats: int = 5,
    on_step: Callable[[str], None] | None = None,
) -> Comparison:
    """Compare ``fused`` (loaded with ``plan``) against ``plain`` on the same random inputs."""
    specs = specs or {}
    step = on_step or (lambda _: None)
    plain.eval()
    fused.eval()
    dtype = _float_dtype(fused)
    tolerance = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    generator = torch.Generator().manual_seed(seed)
    inputs = model_inputs(plain, generator)
    captured, remove = _capture(plain, [m.path for m in plan.modules])
    whole = WholeModelReport(ran=False, tolerance=tolerance)
    timing: tuple[float, float] | None = None
    step("whole model")
    if inputs is None:
        whole.note = "no generic inputs for this model's forward; compared module by module only"
    else:
        whole.inputs = {k: list(v.shape) for k, v in inputs.items()}
        try:
            with torch.no_grad():
                expected = plain(**inputs)
        except Exception as exc:  # an architecture that needs more than generic inputs: not run
            whole.note = f"not run: {_describe(exc, first_line=True)}"
        else:
            # The plain model ran these inputs, so from here on an exception is the fused model's
            # failure (its forward raised, or its outputs are shaped differently), never "not run".
            remove()
            try:
                whole.max_abs_error, whole.max_rel_error = _compare_fused(expected, lambda: fused(**inputs), "model")
                whole.ran = True
                whole.ok = whole.max_rel_error <= tolerance
                with torch.no_grad():
                    timing = (
                        median_seconds(lambda: plain(**inputs), repeats),
                        median_seconds(lambda: fused(**inputs), repeats),
                    )
            except Exception as exc:
                whole.ran, whole.ok, timing = False, False, None
                whole.max_abs_error = whole.max_rel_error = None
                whole.note = str(exc) if isinstance(exc, _FusedFailed) else f"timing run failed: {_describe(exc)}"
    remove()
    for path, kwargs in tower_inputs(plain, generator):
        step(path)
        captured_tower, remove_tower = _capture(plain, [m.path for m in plan.modules])
        shapes = {k: list(v.shape) for k, v in kwargs.items()}
        try:
            with torch.no_grad():
                expected = plain.get_submodule(path)(**kwargs)
        except Exception as exc:  # a tower these generic rows do not fit: not run
            whole.towers[path] = {"ok": None, "note": f"not run: {_describe(exc)}"}
        else:
            remove_tower()
            try:
                a, r = _compare_fused(expected, functools.partial(fused.get_submodule(path), **kwargs), "sub-model")
            except _FusedFailed as exc:  # the plain tower ran these rows: the fused one failed
                whole.towers[path] = {"max_abs_error": None, "max_rel_error": None, "ok": False,
                                      "inputs": shapes, "note": str(exc)}
                whole.ok = False
            else:
                whole.towers[path] = {"max_abs_error": a, "max_rel_error": r, "ok": r <= tolerance,
                                      "inputs": shapes}
                whole.ok = whole.ok and r <= tolerance
        finally:
            remove_tower()
        for key, sets in captured_tower.items():
            captured.setdefault(key, []).extend(sets)
    reports: list[ModuleReport] = []
    module_times = [0.0, 0.0]
    for module_plan in plan.modules:
        step(module_plan.path)
        original = plain.get_submodule(module_plan.path)
        replacement = fused.get_submodule(module_plan.path)
        report = ModuleReport(
            module_plan.family, module_plan.path, class_name(type(original)), class_name(type(replacement)),
            tolerance=tolerance,
        )
        sets = captured.get(module_plan.path, []) + synthetic_inputs(
            original, generator, specs.get(module_plan.family)
        )
        report.input_sets = len(sets)
        if not sets:
            report.note = "no input: not reached by the whole-model run and not a standard torch layer"
            reports.append(report)
            continue
        try:
            worst_abs, worst_rel = 0.0, 0.0
            for args, kwargs in sets:
                with torch.no_grad():
                    expected = original(*_clone(args), **_clone(kwargs))
                call = functools.partial(replacement, *_clone(args), **_clone(kwargs))
                a, r = _compare_fused(expected, call, "module")
                worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
            args, kwargs = sets[0]
            with torch.no_grad():
                for i, mod in enumerate((original, replacement)):
                    module_times[i] += median_seconds(functools.partial(mod, *args, **kwargs), repeats)
        except _FusedFailed as exc:
            report.note = str(exc)
            reports.append(report)
            continue
        except Exception as exc:
            report.note = _describe(exc)
            reports.append(report)
            continue
        report.max_abs_error, report.max_rel_error = worst_abs, worst_rel
        report.ok = worst_rel <= tolerance and not math.isnan(worst_rel)
        if not report.ok:
            report.note = f"error {worst_rel:.3g} exceeds the {dtype} tolerance {tolerance:.3g}"
        reports.append(report)
    if timing is not None and timing[0] > 0:
        ratio, timed = timing[1] / timing[0], "whole model"
    elif module_times[0] > 0:
        ratio, timed = module_times[1] / module_times[0], "fused modules"
    else:
        ratio, timed = None, "nothing"
    return Comparison(reports, whole, ratio, timed)


# -- round trip --------------------------------------------------------------------------------
def iter_checkpoint_tensors(directory: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, key, tensor) for every tensor of a safetensors checkpoint, one file at a time."""
    from safetensors import safe_open

    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                yield file.name, key, handle.get_tensor(key)


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint by key (tests and small checkpoints: all in memory)."""
    return {key: tensor for _, key, tensor in iter_checkpoint_tensors(directory)}


def compare_checkpoints(source: Path, saved: Path) -> RoundTripReport:
    """Same tensor names, dtypes, shapes and bytes in ``saved`` as in ``source``."""
    from fusion_core.checkpoint import read_checkpoint_index

    want = read_checkpoint_index(source)
    have = read_checkpoint_index(saved)
    problems = [f"missing {k!r}" for k in want if k not in have]
    problems += [f"unexpected {k!r}" for k in have if k not in want]
    for key, info in want.items():
        other = have.get(key)
        if other is not None and (other.dtype, other.shape) != (info.dtype, info.shape):
            problems.append(f"{key!r}: {other.dtype}{list(other.shape)} instead of {info.dtype}{list(info.shape)}")
    if not problems:
        from safetensors import safe_open

        from fusion_core.wrapped import same_bits

        handles: dict[str, Any] = {}
        with contextlib.ExitStack() as stack:
            for key, info in want.items():
                other = have[key]
                for directory, item in ((source, info), (saved, other)):
                    path = str(Path(directory) / item.file)
                    if path not in handles:
                        handles[path] = stack.enter_context(safe_open(path, "pt"))
                a = handles[str(Path(source) / info.file)].get_tensor(key)
                b = handles[str(Path(saved) / other.file)].get_tensor(key)
                if not same_bits(a, b):
                    problems.append(f"{key!r}: bytes differ")
    return RoundTripReport(ok=not problems, tensors=len(want), problems=problems)


def round_trip(fused: nn.Module, source: Path) -> RoundTripReport:
    """Save ``fused`` in the original layout to a temporary directory and compare with ``source``."""
    from fusion_core.hf import save_pretrained

    with tempfile.TemporaryDirectory(prefix="fusion-check-") as tmp:
        save_pretrained(fused, Path(tmp) / "saved")
        return compare_checkpoints(Path(source), Path(tmp) / "saved")


# -- a training step (families that declare preserves='training_loss') --------------------------------
def _training_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, seed: int) -> tuple[
        torch.Tensor, Any, dict[str, torch.Tensor]]:
    """One forward and backward in training mode with labels: the loss, the outputs and every gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks on both sides
    outputs = model(input_ids=input_ids, labels=labels)
    outputs.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    return outputs.loss.detach(), outputs, grads


def compare_training(plain: nn.Module, fused: nn.Module, seed: int = 0, tokens: int = 12) -> TrainingReport:
    """What a family declaring ``preserves = "training_loss"`` promises, checked on a causal LM (the kit's
    ``assert_training_loss`` asserts the report, ``fusion check`` prints it).

    In training mode, called with labels (a few of them ``-100``, ignored), the fused model's loss
    and the gradient of every parameter equal the plain model's within :data:`TOLERANCES` (the
    gradients by relative L2 norm); called without labels, or in eval mode, its outputs equal the
    plain model's bit for bit, since the fused forward is the original's there. A fused model that raises
    where the plain one trained is a failure of the report; the plain model's own exception (not a causal LM)
    propagates.
    """
    config: Any = plain.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    parameter = next(plain.parameters())
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, int(config.vocab_size), (2, tokens), generator=generator).to(parameter.device)
    labels = input_ids.clone()
    labels[0, : tokens // 3] = -100
    tolerance = TOLERANCES[parameter.dtype]
    expected_loss, _, expected_grads = _training_step(plain, input_ids, labels, seed)
    try:  # once the plain model trained on these inputs, a fused model that cannot is a failure, not "not run"
        got_loss, _, got_grads = _training_step(fused, input_ids, labels, seed)
    except Exception as exc:
        return TrainingReport(False, note=f"the fused model raised {type(exc).__name__} in the training step the "
                                          f"plain model ran: {exc}")
    loss_error = relative_error(expected_loss, got_loss)
    report = TrainingReport(True, loss=loss_error)
    names = [name for name, _ in fused.named_parameters()]
    if not loss_error <= tolerance:
        report.ok, report.note = False, (f"training loss {float(got_loss):.6g}, plain {float(expected_loss):.6g} "
                                         f"(relative error {loss_error:.3g}, tolerance {tolerance:.3g})")
    elif sorted(names) != sorted(expected_grads) or sorted(got_grads) != sorted(expected_grads):
        missing = sorted(set(expected_grads) - set(got_grads))
        report.ok, report.note = False, (f"gradients differ in which parameters get one: missing {missing[:5]}, "
                                         f"extra {sorted(set(got_grads) - set(expected_grads))[:5]}")
    else:
        errors = {name: relative_l2(expected, got_grads[name]) for name, expected in expected_grads.items()}
        worst = max(errors, key=errors.__getitem__, default=None)
        report.gradients = 0.0 if worst is None else errors[worst]
        if worst is not None and not errors[worst] <= tolerance:
            report.ok, report.note = False, (f"gradient of {worst} differs by {errors[worst]:.3g} relative L2 "
                                             f"(tolerance {tolerance:.3g})")
    if report.ok:
        report.note = _same_logits_without_labels(plain, fused, input_ids, seed)
        report.ok = not report.note
    plain.eval(), fused.eval()
    return report


def _same_logits_without_labels(plain: nn.Module, fused: nn.Module, input_ids: torch.Tensor, seed: int) -> str:
    """What differs when both models are called without labels, in eval and in training mode ("" when nothing)."""
    with torch.no_grad():
        for mode in ("eval", "train"):
            getattr(plain, mode)(), getattr(fused, mode)()
            torch.manual_seed(seed)
            expected_logits = plain(input_ids=input_ids).logits
            torch.manual_seed(seed)
            got_logits = fused(input_ids=input_ids).logits
            if not torch.equal(expected_logits, got_logits):
                return f"without labels, in {mode} mode, the fused logits are not the plain ones"
    return ""
