"""Conformance checks for fusion families, usable from any test suite.

Each check runs the real thing on real modules: a family's fused class against the original
module, its transforms forward and back, the state-dict round trip, discovery on a model, a
fused load of a checkpoint. A failed check raises ``AssertionError`` with what differed.

Where a check needs a model, ``model`` is any :data:`ModelSource`: the name of a tiny model
(:data:`fusion_core.testing.tiny_models.ALL_TINY_MODELS`, listed in ``docs/tiny-models.md``),
a ``(model_class, config)`` pair, or a local checkpoint directory. Where a family's transforms
are built, ``config`` is what ``make_transforms(config, options)`` receives in a real load: the
model's top-level ``PretrainedConfig``. Module-level checks pass ``None`` unless given one, so a
family whose transforms read the config needs ``config=`` there (:func:`model_config` gives it).
"""

from __future__ import annotations

import copy
import itertools
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion_core.compare import (
    TOLERANCES,
    Comparison,
    TrainingReport,
    compare_checkpoints,
    compare_outputs,
    compare_training,
    model_inputs,
    relative_error,
    relative_l2,
)
from fusion_core.compat import transformers as compat
from fusion_core.layout import fuse_instance
from fusion_core.plugins import validate_spec
from fusion_core.random_state import kept_random_state
from fusion_core.spec import FamilyOptions, ModuleFusionSpec, spec_member
from fusion_core.transforms import BoundTransform, FusionPlan, ModulePlan, Shape, TransformOp, bind_transforms
from fusion_core.wrapped import is_torch_tensor, same_bits

__all__ = [
    "TOLERANCES", "ModelSource", "ModelUnderTest", "assert_discovers", "assert_fused_load",
    "assert_numerically_equivalent", "assert_options_schema", "assert_quantizers_see_the_same_weights",
    "assert_state_dict_round_trip",
    "assert_tensor_parallel_rule", "assert_training_loss",
    "assert_transform_op", "assert_transform_round_trip", "build_model", "compare_checkpoints", "fuse_module",
    "model_config",
    "module_factory",
    "registered", "relative_error", "relative_l2", "resolve_model",
]

def assert_training_loss(plain: nn.Module, fused: nn.Module, seed: int = 0, tokens: int = 12,
                         label: str = "the fused model") -> TrainingReport:
    """One training step with labels on both models (:func:`fusion_core.compare.compare_training`): fails with what
    differs, else returns the report (the loss's and the worst gradient's relative errors)."""
    report = compare_training(plain, fused, seed=seed, tokens=tokens)
    if not report.ok:
        raise AssertionError(f"{label}: {report.note}")
    return report


ModelSource = str | os.PathLike[str] | tuple[Any, Any]
"""A tiny-model name, a ``(model_class, config)`` pair, or a checkpoint directory."""

Inputs = Sequence[Any] | Mapping[str, Any] | tuple[Sequence[Any], Mapping[str, Any]]
"""What an ``inputs_factory(dtype)`` returns: positional args, keyword args, or ``(args, kwargs)``."""


# -- models ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelUnderTest:
    """A :data:`ModelSource` resolved: the class that loads it, its config, its checkpoint if any."""

    label: str
    model_cls: Any
    config: Any
    directory: Path | None = None


def resolve_model(model: ModelSource, config: Any = None) -> ModelUnderTest:
    """Resolve ``model`` (see :data:`ModelSource`); ``config`` replaces the model's own config.

    Raises ``KeyError`` (listing the names) for an unknown tiny model, ``LookupError`` for one the
    installed transformers lacks, ``TypeError`` for anything else.
    """
    if isinstance(model, tuple):
        if len(model) != 2 or not isinstance(model[0], type):
            raise TypeError(f"a model pair is (model_class, config), got {model!r}")
        config = config if config is not None else model[1]
        return ModelUnderTest(getattr(config, "model_type", None) or model[0].__name__, model[0], config)
    if isinstance(model, os.PathLike) or (isinstance(model, str) and Path(model).is_dir()):
        from fusion_core.commands._common import resolve_checkpoint

        checkpoint = resolve_checkpoint(Path(model))
        return ModelUnderTest(str(model), checkpoint.model_cls, config if config is not None else checkpoint.config,
                              checkpoint.directory)
    if not isinstance(model, str):
        raise TypeError(f"model must be a tiny-model name, a (model_class, config) pair or a directory, got {model!r}")
    from fusion_core.testing.tiny_models import auto_class, tiny_model

    tiny = tiny_model(model)
    made = tiny.make_config()
    if made is None:
        import transformers

        raise LookupError(f"transformers {transformers.__version__} has no {model}")
    return ModelUnderTest(model, auto_class(tiny), config if config is not None else made)


def model_config(model: ModelSource) -> Any:
    """The config a real load of ``model`` hands to ``make_transforms``."""
    return resolve_model(model).config


def build_model(resolved: ModelUnderTest, seed: int = 0) -> Any:
    """The plain ``PreTrainedModel`` with random weights (seeded), or loaded from its checkpoint directory."""
    if resolved.directory is not None:
        return resolved.model_cls.from_pretrained(resolved.directory, config=copy.deepcopy(resolved.config)).eval()
    torch.manual_seed(seed)
    return compat.build_from_config(resolved.model_cls, copy.deepcopy(resolved.config)).eval()


def module_factory(model: ModelSource, path: str, seed: int = 0, config: Any = None) -> Callable[[], nn.Module]:
    """A ``module_factory`` for the checks: copies of the module at ``path`` of ``model`` (built once).

    Tests a family on the exact class and configuration of a real architecture, MoE blocks and
    attention layers included, without writing the module by hand.
    """
    resolved = resolve_model(model, config)
    built: list[nn.Module] = []

    def make() -> nn.Module:
        if not built:
            built.append(build_model(resolved, seed))
        return copy.deepcopy(built[0].get_submodule(path))

    return make


# -- one module --------------------------------------------------------------------------------
def _transforms(spec: ModuleFusionSpec[Any], config: Any, options: FamilyOptions, module: nn.Module) -> list[Any]:
    """What discovery binds to ``module``: the family's ``module_transforms`` for it, else ``make_transforms``."""
    own = spec_member(spec, "module_transforms")
    for method, build in (("module_transforms", lambda: own(module, config, options)),
                          ("make_transforms", lambda: spec.make_transforms(config, options))):
        try:
            transforms = build()
        except Exception as exc:
            hint = (" With config=None: if the family reads the model config, pass config= to the kit "
                    "(kit.model_config(model) gives the one a real load uses)") if config is None else ""
            message = f"family {spec.name!r}: {method} raised {type(exc).__name__}: {exc}.{hint}"
            raise AssertionError(message) from exc
        if transforms is not None:
            return list(transforms)
    return []


def fuse_module(
    module: nn.Module, spec: ModuleFusionSpec[Any], options: FamilyOptions | None = None, config: Any = None,
    path: str = "",
) -> nn.Module:
    """A fused deep copy of one loaded ``module``, as a fused load would produce it."""
    validate_spec(spec)
    options = options if options is not None else spec.options_model()
    if not spec.is_fusable(module, options):
        raise AssertionError(f"family {spec.name!r}: is_fusable refused {type(module).__qualname__}")
    fused = copy.deepcopy(module)
    leaves = fused.state_dict(keep_vars=True)
    bound = bind_transforms(spec.name, path, {k: tuple(v.shape) for k, v in leaves.items()},
                            _transforms(spec, config, options, module))
    fused_cls = spec.make_fused_class(type(module), options)
    fuse_instance(fused, ModulePlan(spec.name, path, type(module), fused_cls, bound, tuple(leaves)))
    return fused


def _call(module: nn.Module, inputs: Inputs) -> Any:
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], Mapping)
            and isinstance(inputs[0], (list, tuple))):
        return module(*inputs[0], **inputs[1])
    return module(*inputs)


def assert_numerically_equivalent(
    module_factory: Callable[[], nn.Module],
    inputs_factory: Callable[[torch.dtype], Inputs],
    spec: ModuleFusionSpec[Any],
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    options: FamilyOptions | None = None,
    config: Any = None,
) -> dict[torch.dtype, float]:
    """Fused vs original forward, per dtype, within :data:`TOLERANCES`; returns the errors.

    Outputs are compared whatever their structure (a tensor, tuples such as an MoE block's
    ``(hidden, router_logits)``, dicts, dataclasses, transformers ``ModelOutput``): every
    floating-point tensor in them, in order. ``inputs_factory(dtype)`` returns positional
    arguments, keyword arguments, or an ``(args, kwargs)`` pair.
    """
    errors: dict[torch.dtype, float] = {}
    for dtype in dtypes:
        torch.manual_seed(0)
        original = module_factory().to(dtype).eval()
        fused = fuse_module(original, spec, options, config)
        inputs = inputs_factory(dtype)
        with torch.no_grad():
            expected = _call(original, copy.deepcopy(inputs))
            try:
                got = _call(fused, copy.deepcopy(inputs))
            except Exception as exc:
                hint = (" (config=None was passed to make_transforms: if the family reads the model config, pass "
                        "config= to the kit)") if config is None else ""
                raise AssertionError(
                    f"family {spec.name!r}: the fused {type(original).__qualname__} raised "
                    f"{type(exc).__name__}: {exc}{hint}"
                ) from exc
        try:
            _, error = compare_outputs(expected, got)
        except AssertionError as exc:
            raise AssertionError(f"{dtype}: family {spec.name!r}: {exc}") from None
        if not error <= TOLERANCES[dtype]:
            raise AssertionError(f"{dtype}: fused output differs by {error:.3g} (tolerance {TOLERANCES[dtype]:.3g})")
        errors[dtype] = error
    return errors


def assert_state_dict_round_trip(
    module: nn.Module, spec: ModuleFusionSpec[Any], options: FamilyOptions | None = None, config: Any = None
) -> None:
    """The fused module presents the original state dict bit for bit and accepts it back."""
    original_state = module.state_dict()
    fused = fuse_module(module, spec, options, config)
    presented = fused.state_dict()
    if list(presented) != list(original_state):
        raise AssertionError(f"state-dict keys differ: {list(presented)} vs {list(original_state)}")
    for key, tensor in original_state.items():
        if not same_bits(presented[key], tensor):
            raise AssertionError(f"tensor {key!r} differs after the fused round trip")
    reloaded = fuse_module(module, spec, options, config)
    reloaded.load_state_dict(presented)
    for key, tensor in reloaded.state_dict().items():
        if not same_bits(tensor, original_state[key]):
            raise AssertionError(f"tensor {key!r} differs after load_state_dict of the original layout")


def assert_transform_round_trip(
    module: nn.Module, spec: ModuleFusionSpec[Any], options: FamilyOptions | None = None, config: Any = None
) -> list[BoundTransform]:
    """Every transform of ``spec``, bound to ``module``, goes forward and back bit for bit.

    Each op is first held to the :class:`~fusion_core.TransformOp` contract
    (:func:`assert_transform_op`, on the shapes and dtypes of ``module``), so a custom op is
    checked as thoroughly as the shipped ones.
    """
    validate_spec(spec)
    options = options if options is not None else spec.options_model()
    state = module.state_dict()
    bound = bind_transforms(spec.name, "", {k: tuple(v.shape) for k, v in state.items()},
                            _transforms(spec, config, options, module))
    for transform in bound:
        sources = [state[s.name] for s in transform.sources]
        assert_transform_op(transform.op, [s.shape for s in transform.sources], dtypes=[sources[0].dtype],
                            sources=sources)
    return list(bound)


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _check_views(op: TransformOp, what: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Results share no storage with each other; a view of an input covers that whole input."""
    seen: dict[int, int] = {}
    for i, out in enumerate(outputs):
        ptr = _storage(out)
        if ptr in seen:
            raise AssertionError(
                f"{op!r}: {what} results {seen[ptr]} and {i} share one storage; copy them (checkpoints refuse "
                "tensors that share memory)"
            )
        seen[ptr] = i
        for tensor in inputs:
            whole = out.data_ptr() == tensor.data_ptr() and out.numel() == tensor.numel()
            if _storage(tensor) == ptr and not whole:
                raise AssertionError(
                    f"{op!r}: {what} result {i} is a view of part of an input; return a copy (clone) instead"
                )


def _check_flat_offsets(op: TransformOp, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """What :meth:`~fusion_core.TransformOp.flat_offsets` claims is what ``forward`` does: a load builds the
    target from it (:func:`fusion_core.streaming.merge`) instead of calling ``forward``."""
    offsets = op.flat_offsets([tuple(t.shape) for t in inputs])
    if offsets is None:
        return
    if len(offsets) != len(inputs) or len(outputs) != 1:
        raise AssertionError(f"{op!r}: flat_offsets gave {len(offsets)} offset(s) for {len(inputs)} source(s) and "
                             f"{len(outputs)} target(s); it places every source in one target")
    flat = outputs[0].reshape(-1)
    covered = sorted((offset, offset + t.numel()) for offset, t in zip(offsets, inputs, strict=True))
    if covered[0][0] != 0 or covered[-1][1] != flat.numel() or any(
        a[1] != b[0] for a, b in itertools.pairwise(covered)
    ):
        raise AssertionError(f"{op!r}: flat_offsets {offsets} do not tile the target of {flat.numel()} elements")
    for i, (offset, source) in enumerate(zip(offsets, inputs, strict=True)):
        if not same_bits(flat.narrow(0, offset, source.numel()), source.reshape(-1)):
            raise AssertionError(f"{op!r}: flat_offsets places source {i} at element {offset}, but forward put "
                                 "other values there")


def assert_transform_op(
    op: TransformOp,
    shapes: Sequence[Shape],
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    bad_shapes: Sequence[Shape] | None = None,
    sources: Sequence[torch.Tensor] | None = None,
) -> None:
    """``op`` honours the :class:`~fusion_core.TransformOp` contract on source ``shapes``.

    Checks: ``arity`` matches ``shapes`` and the results; ``forward_shapes`` gives what
    ``forward`` produces, on real and on ``meta`` tensors; ``inverse`` restores every source bit
    for bit with its dtype; results share no storage with each other and are views of an input
    only when they cover all of it; ``repr`` shows the op's parameters and equal ops compare and
    hash equal; with ``bad_shapes``, ``forward_shapes`` rejects them with ``ValueError``.
    ``sources`` replaces the random source tensors (one dtype).
    """
    arity = tuple(op.arity)
    if len(arity) != 2 or not all(isinstance(n, int) and n >= 1 for n in arity):
        raise AssertionError(f"{op!r}: arity must be (sources, targets), both >= 1; got {op.arity!r}")
    if len(shapes) != arity[0]:
        raise AssertionError(f"{op!r}: arity {arity} takes {arity[0]} source(s); the check was given {len(shapes)}")
    if " at 0x" in repr(op):
        raise AssertionError(f"{type(op).__name__}: repr {op!r} must show the op's parameters (a frozen dataclass)")
    twin = copy.deepcopy(op)
    try:
        same = twin == op and hash(twin) == hash(op) and repr(twin) == repr(op)
    except TypeError as exc:
        raise AssertionError(f"{op!r}: ops must be immutable and hashable (a frozen dataclass): {exc}") from None
    if not same:
        raise AssertionError(f"{op!r}: a copy of the op must compare, hash and print equal")
    targets = tuple(tuple(s) for s in op.forward_shapes([tuple(s) for s in shapes]))
    if len(targets) != arity[1] or not all(all(isinstance(d, int) for d in s) for s in targets):
        raise AssertionError(f"{op!r}: forward_shapes gave {targets}, not {arity[1]} shape(s) of ints")
    meta = op.forward([torch.empty(s, device="meta") for s in shapes])
    if [tuple(t.shape) for t in meta] != list(targets):
        raise AssertionError(f"{op!r}: on meta tensors forward gave {[tuple(t.shape) for t in meta]}, "
                             f"forward_shapes {list(targets)} (discovery rehearses ops on the meta device)")
    for dtype in dtypes:
        generator = torch.Generator().manual_seed(0)
        inputs = list(sources) if sources is not None else [
            (torch.randn(s, generator=generator) * 100).to(dtype) for s in shapes
        ]
        originals = [t.clone() for t in inputs]
        with torch.no_grad():
            outputs = op.forward(inputs)
            if len(outputs) != arity[1] or [tuple(o.shape) for o in outputs] != list(targets):
                raise AssertionError(f"{op!r}: forward gave shapes {[tuple(o.shape) for o in outputs]}, "
                                     f"forward_shapes inferred {list(targets)}")
            if any(o.dtype != dtype for o in outputs):
                raise AssertionError(f"{op!r}: forward changed the dtype {dtype} to {[o.dtype for o in outputs]}")
            _check_views(op, "forward", inputs, outputs)
            back = op.inverse(list(outputs), [tuple(s) for s in shapes])
        if len(back) != arity[0]:
            raise AssertionError(f"{op!r}: inverse gave {len(back)} tensor(s) for {arity[0]} source(s)")
        _check_views(op, "inverse", outputs, back)
        for i, (original, restored) in enumerate(zip(originals, back, strict=True)):
            if not same_bits(original, restored):
                raise AssertionError(f"{op!r}: source {i} ({dtype}) is not restored bit for bit by the inverse")
        _check_flat_offsets(op, inputs, outputs)
    if bad_shapes is not None:
        try:
            op.forward_shapes([tuple(s) for s in bad_shapes])
        except ValueError:
            pass
        except Exception as exc:
            raise AssertionError(f"{op!r}: forward_shapes({list(bad_shapes)}) raised {type(exc).__name__}, "
                                 "not ValueError (the plan reports only ValueError as a shape mismatch)") from None
        else:
            raise AssertionError(f"{op!r}: forward_shapes accepted shapes {list(bad_shapes)} it should reject")


# -- tensor parallelism ----------------------------------------------------------------------
def assert_tensor_parallel_rule(spec: ModuleFusionSpec[Any], config: Any = None, options: Any = None) -> Any:
    """The family's ``tensor_parallel`` rule agrees with its transforms (see ``docs/distributed.md``).

    Returns the rule, or None for a family that declares none (it then runs unsharded, and a
    plan entry on its original tensors is refused at load).
    """
    from fusion_core.parallel import check_tensor_parallel_rule

    return check_tensor_parallel_rule(spec, config, options)


# -- options ---------------------------------------------------------------------------------
def assert_options_schema(spec: ModuleFusionSpec[Any]) -> dict[str, Any]:
    """The options model is valid, strict, frozen, JSON-describable and accepted by ``FusionConfig``.

    Returns the JSON schema (what ``fusion list --json`` shows users).
    """
    import pydantic

    from fusion_core.config import parse_fusion_config
    from fusion_core.plugins import FamilyRegistry

    validate_spec(spec)
    model = spec.options_model
    defaults = model()
    schema: dict[str, Any] = model.model_json_schema()
    if schema.get("additionalProperties") is not False:
        raise AssertionError(f"{model.__name__}: the JSON schema must forbid unknown options")
    if model.model_validate(defaults.model_dump(mode="json")) != defaults:
        raise AssertionError(f"{model.__name__}: options do not survive a JSON dump and validation")
    try:
        model.model_validate({"__surely_not_an_option__": 1})
    except pydantic.ValidationError:
        pass
    else:
        raise AssertionError(f"{model.__name__} accepts unknown options")
    field = next(iter(model.model_fields))
    try:
        setattr(defaults, field, getattr(defaults, field))
    except (pydantic.ValidationError, TypeError, AttributeError):
        pass
    else:
        raise AssertionError(f"{model.__name__}: options must be frozen (they key caches)")
    registry = FamilyRegistry()
    registry.register_family(spec)
    settings: list[Any] = [True, False, {}, defaults.model_dump(mode="json", exclude_defaults=True)]
    for setting in settings:
        parse_fusion_config({spec.name: setting}, registry)
    try:
        parse_fusion_config({spec.name: {"__surely_not_an_option__": 1}}, registry)
    except pydantic.ValidationError as exc:
        if spec.name not in str(exc):
            raise AssertionError(f"an invalid option error does not name the family: {exc}") from None
    else:
        raise AssertionError("FusionConfig accepted an unknown option")
    return schema


# -- whole models ------------------------------------------------------------------------------
def _setting(options: FamilyOptions | Mapping[str, Any] | None) -> Any:
    if isinstance(options, FamilyOptions):
        return options.model_dump(mode="json", exclude_unset=True)
    return dict(options) if options is not None else True


def assert_discovers(
    spec: ModuleFusionSpec[Any],
    model: ModelSource,
    options: FamilyOptions | Mapping[str, Any] | None = None,
    expected_modules: Sequence[str] | None = None,
    config: Any = None,
) -> FusionPlan:
    """Discovery of ``spec`` on a meta-device ``model`` finds modules (exactly ``expected_modules`` if given).

    Nothing is loaded; the family's fused class and transforms are rehearsed on the meta device
    with the model's config (or ``config``). Returns the plan.
    """
    from fusion_core.config import parse_fusion_config
    from fusion_core.discovery import discover
    from fusion_core.errors import DiscoveryError, PlanError
    from fusion_core.plugins import FamilyRegistry

    resolved = resolve_model(model, config)
    registry = FamilyRegistry()
    registry.register_family(spec)
    fusion = parse_fusion_config({spec.name: _setting(options)}, registry)
    try:
        plan = discover(resolved.model_cls, resolved.config, fusion).plan
    except (DiscoveryError, PlanError) as exc:
        nothing = "planned nothing: " if "found nothing to fuse" in str(exc) else ""
        raise AssertionError(f"family {spec.name!r} on {resolved.label}: {nothing}{exc}") from exc
    if not plan.modules:
        raise AssertionError(f"family {spec.name!r} planned nothing on {resolved.label}")
    if expected_modules is not None:
        got = [m.path for m in plan.modules]
        if got != list(expected_modules):
            raise AssertionError(f"family {spec.name!r} planned {got}, expected {list(expected_modules)}")
    return plan


@contextmanager
def registered(*specs: ModuleFusionSpec[Any]) -> Iterator[None]:
    """Register ``specs`` in the process-wide registry for the block (replacing same-named families)."""
    from fusion_core.plugins import get_registry

    registry = get_registry()
    replaced = []
    for spec in specs:
        if spec.name in registry:
            replaced.append(registry.unregister_family(spec.name))
        registry.register_family(spec)
    try:
        yield
    finally:
        for spec in specs:
            if spec.name in registry:
                registry.unregister_family(spec.name)
        for family in replaced:
            registry.register_family(family.spec, source=family.source)


def assert_fused_load(
    spec: ModuleFusionSpec[Any],
    model: ModelSource,
    directory: str | os.PathLike[str],
    options: FamilyOptions | Mapping[str, Any] | None = None,
    seed: int = 0,
    config: Any = None,
) -> Comparison:
    """End to end: fused load, comparison with the plain load, exact round trip.

    A tiny model or a ``(model_class, config)`` pair is built with random weights (seeded) and
    saved under ``directory``; a checkpoint directory is used as it is. The checkpoint is loaded
    with ``spec`` enabled (registered for the duration); every fused module and, where it can,
    the whole model are compared with the plain model on the same random inputs
    (:mod:`fusion_core.compare`), and saving must write the source checkpoint back exactly.
    The fused load must leave torch's and Python's random generators where a plain load of the
    checkpoint leaves them (each seeded with ``seed`` first), and so must the fused model's first
    forward: what a family decides or checks once per process is seen where this runs first in its
    process. Returns the comparison.
    """
    from fusion_core.compare import compare_models, round_trip
    from fusion_core.hf import from_pretrained, get_fusion_plan

    resolved = resolve_model(model, config)
    plain = build_model(resolved, seed)
    if resolved.directory is not None:
        source = resolved.directory
    else:
        source = Path(directory) / resolved.label
        plain.save_pretrained(source)
    label = f"family {spec.name!r} on {resolved.label}"
    loaded, plain_generators = _generators_after(seed, lambda: resolved.model_cls.from_pretrained(source))
    with registered(spec):
        fused, fused_generators = _generators_after(seed, lambda: from_pretrained(
            resolved.model_cls, source, fusion_config={spec.name: _setting(options)}))
    _same_generators(label, "the fused load", plain_generators, fused_generators)
    plan = get_fusion_plan(fused)
    if plan is None:
        raise AssertionError(f"{label}: the fused load returned an unfused model")
    _first_forwards_draw_alike(label, loaded, fused, seed)
    comparison = compare_models(plain, fused, plan, specs={spec.name: spec}, seed=seed, repeats=1)
    comparison.round_trip = round_trip(fused, source)
    if spec_member(spec, "preserves") == "training_loss":
        assert_training_loss(plain, fused, seed=seed, label=label)
    if not comparison.ok:
        failures = [m.as_dict() for m in comparison.modules if not m.ok]
        raise AssertionError(
            f"{label}: modules {failures}, whole model "
            f"{comparison.whole_model.as_dict()}, round trip {comparison.round_trip.as_dict()}"
        )
    return comparison


_Generators = tuple[Any, torch.Tensor]
"""Python's ``random`` state and torch's CPU generator's."""


def _generators_after(seed: int, work: Callable[[], Any]) -> tuple[Any, _Generators]:
    """What ``work()`` returns, run with both generators seeded with ``seed``, and the generators after it; the
    caller's generators are put back afterwards (the check seeds nothing for the rest of a test)."""
    with kept_random_state():
        torch.manual_seed(seed)
        random.seed(seed)
        result = work()
        return result, (random.getstate(), torch.random.get_rng_state())


def _same_generators(label: str, what: str, plain: _Generators, fused: _Generators) -> None:
    if plain[0] != fused[0] or not torch.equal(plain[1], fused[1]):
        raise AssertionError(
            f"{label}: {what} left torch's or Python's random generator elsewhere than the plain model's did; a user "
            "who seeds, loads and then initialises an adapter would get other weights (see fusion_core.random_state)"
        )


def _first_forwards_draw_alike(label: str, plain: nn.Module, fused: nn.Module, seed: int) -> None:
    """The fused model's first forward (where a family decides or checks what it does once) draws what the plain
    model's draws. A forward that raises is left to the comparison, which reports it."""
    inputs = model_inputs(fused, torch.Generator().manual_seed(seed))
    if inputs is None:
        return
    try:
        with torch.no_grad():
            _, plain_generators = _generators_after(seed, lambda: plain(**inputs))
            _, fused_generators = _generators_after(seed, lambda: fused(**inputs))
    except Exception:  # the comparison runs both again and reports the failure
        return
    _same_generators(label, "the fused model's first forward", plain_generators, fused_generators)


def _linear_weights(model: nn.Module) -> tuple[dict[str, int], list[str]]:
    """What a quantizer picking ``isinstance(m, nn.Linear)`` modules sees: weight elements per module path, and
    the ``nn.Linear`` modules whose ``weight`` is missing (a quantizer reading it would crash)."""
    seen: dict[str, int] = {}
    weightless: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        try:
            weight = module.weight
        except AttributeError:
            weight = None
        if isinstance(weight, torch.Tensor):
            seen[name] = weight.numel()
        else:
            weightless.append(name)
    return seen, weightless


def _quantized_elements(model: nn.Module) -> int:
    """Elements of every module's ``weight`` that a quantizer changed: a tensor class of its own, or integer storage."""
    total = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if not is_torch_tensor(weight) or not weight.is_floating_point():
            total += weight.numel()
    return total


def assert_quantizers_see_the_same_weights(
    spec: ModuleFusionSpec[Any],
    model: ModelSource,
    options: FamilyOptions | Mapping[str, Any] | None = None,
    seed: int = 0,
    config: Any = None,
    quantize: Callable[[nn.Module], Any] | None = None,
) -> dict[str, int]:
    """A quantizer run on the fused model sees the weights it sees on the unfused one, no fewer, no more.

    Quantizers (torchao's ``quantize_``, quanto's ``quantize``, transformers' quantizers at load)
    pick modules with ``isinstance(m, nn.Linear)`` and quantize their ``weight``. The model is
    built (seeded), fused with ``spec`` by :func:`fusion_core.fuse`, and on both the weight
    elements of those modules are counted: they must be equal, and every ``nn.Linear`` of the
    fused model must still hold a weight tensor (a family that moves a Linear's weight elsewhere
    leaves one that crashes a quantizer's filter, or that it silently skips). A module it fuses
    that no quantizer would see is not an error here if the fused model then refuses the quantizer
    by name (``fusion-quantization`` does); this check is for families that stay quantizable.

    With ``quantize`` (a callable run on each model, e.g. ``lambda m: quantize_(m, Int8WeightOnlyConfig())``),
    the elements it quantized are compared too (weights of a quantizer's tensor class or integer
    storage). Returns the counts: ``{"unfused": n, "fused": n}`` and, with ``quantize``,
    ``{"unfused_quantized": n, "fused_quantized": n}``.
    """
    from fusion_core.inplace import fuse

    resolved = resolve_model(model, config)
    plain = build_model(resolved, seed)
    with registered(spec):
        fused = fuse(copy.deepcopy(plain), {spec.name: _setting(options)})
    where = f"family {spec.name!r} on {resolved.label}"
    unfused_seen, _ = _linear_weights(plain)
    fused_seen, weightless = _linear_weights(fused)
    if weightless:
        raise AssertionError(f"{where}: fused nn.Linear modules without a weight tensor {weightless[:4]}: a quantizer "
                             "picking nn.Linear reads .weight and crashes or skips them; keep the weight on the module "
                             "(fusion_core.merged keeps merged tensors in an nn.Linear container)")
    counts = {"unfused": sum(unfused_seen.values()), "fused": sum(fused_seen.values())}
    if counts["unfused"] != counts["fused"]:
        only_plain = sorted(set(unfused_seen) - set(fused_seen))[:4]
        only_fused = sorted(set(fused_seen) - set(unfused_seen))[:4]
        raise AssertionError(f"{where}: a quantizer picking nn.Linear would see {counts['fused']} weight elements on "
                             f"the fused model, {counts['unfused']} on the unfused one (only unfused: {only_plain}; "
                             f"only fused: {only_fused})")
    if quantize is not None:
        for label, target in (("unfused", plain), ("fused", fused)):
            quantize(target)
            counts[f"{label}_quantized"] = _quantized_elements(target)
        if counts["unfused_quantized"] != counts["fused_quantized"]:
            raise AssertionError(f"{where}: the quantizer quantized {counts['fused_quantized']} weight elements of "
                                 f"the fused model, {counts['unfused_quantized']} of the unfused one")
    return counts
