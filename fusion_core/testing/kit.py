"""Conformance checks for fusion families, usable from any test suite.

Each check runs the real thing on real modules: a family's fused class against the original
module, its transforms forward and back, the state-dict round trip, discovery on a model.
A failed check raises ``AssertionError`` with what differed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fusion_core.layout import convert_to_fused, finalize
from fusion_core.plugins import validate_spec
from fusion_core.spec import FamilyOptions, ModuleFusionSpec
from fusion_core.transforms import ModulePlan, bind_transforms

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


def _max_error(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    return float((reference.float() - candidate.float()).abs().max()) / (float(reference.float().abs().max()) + 1.0)


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
