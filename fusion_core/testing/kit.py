"""Conformance checks for fusion families, usable from any test suite.

Each check runs the real thing on real modules: a family's fused class against the original
module, its transforms forward and back, the state-dict round trip, discovery on a model.
A failed check raises ``AssertionError`` with what differed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fusion_core.layout import convert_to_fused, finalize
from fusion_core.plugins import validate_spec
from fusion_core.spec import FamilyOptions, ModuleFusionSpec
from fusion_core.transforms import BoundTransform, FusionPlan, ModulePlan, bind_transforms

#: Documented numerical tolerances (max abs difference, relative to max |reference| + 1) per dtype.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}


def fuse_module(
    module: nn.Module, spec: ModuleFusionSpec, options: FamilyOptions | None = None, config: Any = None,
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
                            list(spec.make_transforms(config, options)))
    fused_cls = spec.make_fused_class(type(module), options)
    plan = ModulePlan(spec.name, path, type(module), fused_cls, bound, tuple(leaves))
    fused.__class__ = fused_cls
    convert_to_fused(fused, plan)
    finalize(fused, plan)
    return fused


def relative_error(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Max abs difference relative to ``max |reference| + 1``: the metric :data:`TOLERANCES` bounds."""
    return float((reference.float() - candidate.float()).abs().max()) / (float(reference.float().abs().max()) + 1.0)


_max_error = relative_error


def assert_numerically_equivalent(
    module_factory: Callable[[], nn.Module],
    inputs_factory: Callable[[torch.dtype], Sequence[torch.Tensor]],
    spec: ModuleFusionSpec,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    options: FamilyOptions | None = None,
    config: Any = None,
) -> dict[torch.dtype, float]:
    """Fused vs original forward, per dtype, within :data:`TOLERANCES`; returns the errors."""
    errors: dict[torch.dtype, float] = {}
    for dtype in dtypes:
        torch.manual_seed(0)
        original = module_factory().to(dtype).eval()
        fused = fuse_module(original, spec, options, config)
        inputs = list(inputs_factory(dtype))
        with torch.no_grad():
            expected = original(*inputs)
            got = fused(*inputs)
        if expected.shape != got.shape:
            raise AssertionError(f"{dtype}: fused output shape {tuple(got.shape)} != original {tuple(expected.shape)}")
        error = _max_error(expected, got)
        if error > TOLERANCES[dtype]:
            raise AssertionError(f"{dtype}: fused output differs by {error:.3g} (tolerance {TOLERANCES[dtype]:.3g})")
        errors[dtype] = error
    return errors


def assert_state_dict_round_trip(
    module: nn.Module, spec: ModuleFusionSpec, options: FamilyOptions | None = None, config: Any = None
) -> None:
    """The fused module presents the original state dict bit for bit and accepts it back."""
    original_state = module.state_dict()
    fused = fuse_module(module, spec, options, config)
    presented = fused.state_dict()
    if list(presented) != list(original_state):
        raise AssertionError(f"state-dict keys differ: {list(presented)} vs {list(original_state)}")
    for key, tensor in original_state.items():
        other = presented[key]
        if other.shape != tensor.shape or other.dtype != tensor.dtype or not torch.equal(other, tensor):
            raise AssertionError(f"tensor {key!r} differs after the fused round trip")
    reloaded = fuse_module(module, spec, options, config)
    reloaded.load_state_dict(presented)
    for key, tensor in reloaded.state_dict().items():
        if not torch.equal(tensor, original_state[key]):
            raise AssertionError(f"tensor {key!r} differs after load_state_dict of the original layout")


def assert_transform_round_trip(
    module: nn.Module, spec: ModuleFusionSpec, options: FamilyOptions | None = None, config: Any = None
) -> list[BoundTransform]:
    """Every transform of ``spec``, bound to ``module``, goes forward and back bit for bit.

    Forward outputs must have the shapes the plan inferred (so a plan checked on shapes is what
    loading does), and the inverse must give back the same dtypes, shapes and bytes.
    """
    validate_spec(spec)
    options = options if options is not None else spec.options_model()
    state = module.state_dict()
    bound = bind_transforms(spec.name, "", {k: tuple(v.shape) for k, v in state.items()},
                            list(spec.make_transforms(config, options)))
    for transform in bound:
        sources = [state[s.name] for s in transform.sources]
        with torch.no_grad():
            outputs = transform.op.forward([t.clone() for t in sources])
            if [tuple(o.shape) for o in outputs] != [t.shape for t in transform.targets]:
                raise AssertionError(
                    f"{transform.op!r}: forward gave shapes {[tuple(o.shape) for o in outputs]}, the plan inferred "
                    f"{[t.shape for t in transform.targets]}"
                )
            back = transform.op.inverse(list(outputs), [s.shape for s in transform.sources])
        for spec_leaf, original, restored in zip(transform.sources, sources, back, strict=True):
            if restored.dtype != original.dtype or restored.shape != original.shape or not torch.equal(
                restored.contiguous().view(-1).view(torch.uint8), original.contiguous().view(-1).view(torch.uint8)
            ):
                raise AssertionError(f"{transform.op!r}: tensor {spec_leaf.name!r} is not restored bit for bit")
    return list(bound)


def assert_options_schema(spec: ModuleFusionSpec) -> dict[str, Any]:
    """The options model is valid, strict, frozen, JSON-describable and accepted by ``FusionConfig``.

    Returns the JSON schema (what ``fusion list --json`` shows users).
    """
    import pydantic

    from fusion_core.config import parse_fusion_config
    from fusion_core.plugins import FamilyRegistry

    validate_spec(spec)
    model = spec.options_model
    defaults = model()
    schema = model.model_json_schema()
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
    for setting in (True, False, {}, defaults.model_dump(mode="json", exclude_defaults=True)):
        parse_fusion_config({spec.name: setting}, registry)
    try:
        parse_fusion_config({spec.name: {"__surely_not_an_option__": 1}}, registry)
    except pydantic.ValidationError as exc:
        if spec.name not in str(exc):
            raise AssertionError(f"an invalid option error does not name the family: {exc}") from None
    else:
        raise AssertionError("FusionConfig accepted an unknown option")
    return schema


def assert_discovers(
    spec: ModuleFusionSpec,
    model: str | tuple[Any, Any],
    options: FamilyOptions | dict[str, Any] | None = None,
    expected_modules: Sequence[str] | None = None,
) -> FusionPlan:
    """Discovery of ``spec`` on a meta-device model finds modules (exactly ``expected_modules`` if given).

    ``model`` is the name of a tiny model (:data:`fusion_core.testing.tiny_models.TINY_MODELS`)
    or a ``(model_class, config)`` pair. Nothing is loaded; the family's fused class and
    transforms are rehearsed on the meta device. Returns the plan.
    """
    from fusion_core.config import parse_fusion_config
    from fusion_core.discovery import discover
    from fusion_core.plugins import FamilyRegistry
    from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

    if isinstance(model, str):
        tiny = TINY_MODELS[model]
        config = tiny.make_config()
        if config is None:
            raise LookupError(f"this transformers has no {model}")
        model_cls = auto_class(tiny)
    else:
        model_cls, config = model
    registry = FamilyRegistry()
    registry.register_family(spec)
    setting = options.model_dump(mode="json", exclude_unset=True) if isinstance(options, FamilyOptions) else options
    fusion = parse_fusion_config({spec.name: setting if setting is not None else True}, registry)
    plan = discover(model_cls, config, fusion, registry).plan
    if not plan.modules:
        raise AssertionError(f"family {spec.name!r} planned nothing")
    if expected_modules is not None:
        got = [m.path for m in plan.modules]
        if got != list(expected_modules):
            raise AssertionError(f"family {spec.name!r} planned {got}, expected {list(expected_modules)}")
    return plan


@contextmanager
def registered(*specs: ModuleFusionSpec) -> Iterator[None]:
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
    spec: ModuleFusionSpec,
    model: str,
    directory: Any,
    options: dict[str, Any] | None = None,
    seed: int = 0,
) -> Any:
    """End to end on a tiny real model: fused load, comparison with the plain load, exact round trip.

    Saves the tiny model ``model`` under ``directory``, loads it with ``spec`` enabled (registered
    for the duration), compares every fused module and, where it can, the whole model with the
    plain load on the same random inputs (:mod:`fusion_core.testing.compare`), and checks that
    saving writes the source checkpoint back exactly. Returns the comparison.
    """
    from pathlib import Path

    import fusion_core
    from fusion_core.testing.compare import compare_models, round_trip
    from fusion_core.testing.tiny_models import TINY_MODELS, auto_class, save_tiny_model

    tiny = TINY_MODELS[model]
    source = Path(directory) / model
    plain = save_tiny_model(tiny, source, seed=seed)
    with registered(spec):
        fused = fusion_core.from_pretrained(auto_class(tiny), source, fusion_config={spec.name: options or True})
    plan = fusion_core.get_fusion_plan(fused)
    comparison = compare_models(plain, fused, plan, specs={spec.name: spec}, seed=seed, repeats=1)
    comparison.round_trip = round_trip(fused, source)
    if not comparison.ok:
        failures = [m.as_dict() for m in comparison.modules if not m.ok]
        raise AssertionError(
            f"family {spec.name!r} on {model}: modules {failures}, whole model {comparison.whole_model.as_dict()}, "
            f"round trip {comparison.round_trip.as_dict()}"
        )
    return comparison
