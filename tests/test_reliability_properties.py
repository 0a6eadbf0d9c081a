"""Reliability properties (hypothesis): every transform op is lossless, and conflicts are always found.

Tensors are drawn as raw bit patterns (NaN payloads, infinities, -0.0 and subnormals included) and
compared bit for bit, in float32, float16, bfloat16 and int8.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from fusion_core import (
    Concat,
    Flatten,
    FusionPlan,
    Identity,
    PlanError,
    Split,
    Stack,
    Transpose,
    Unstack,
    WeightTransform,
)
from fusion_core.layout import convert_to_fused, finalize, fused_layout
from fusion_core.transforms import BoundTransform, LeafSpec, ModulePlan, bind_transforms, check_conflicts
from fusion_core.wrapped import same_bits

SETTINGS = settings(max_examples=60, deadline=None)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.int8: torch.int8}

shapes = st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple)


def _random_bits(shape, dtype, seed):
    bits = _BITS[dtype]
    info = torch.iinfo(bits)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=gen).view(dtype)


@st.composite
def op_cases(draw):
    """An op with source tensors it accepts."""
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    shape = draw(shapes)
    kind = draw(st.sampled_from(["identity", "flatten", "transpose", "concat", "split", "stack", "unstack"]))
    if kind == "identity":
        return Identity(), [_random_bits(shape, dtype, seed)]
    if kind == "flatten":
        return Flatten(start_dim=draw(st.integers(0, len(shape) - 1))), [_random_bits(shape, dtype, seed)]
    if kind == "transpose":
        dims = st.integers(0, len(shape) - 1)
        return Transpose(draw(dims), draw(dims)), [_random_bits(shape, dtype, seed)]
    if kind == "stack":
        n = draw(st.integers(1, 4))
        dim = draw(st.integers(0, len(shape)))
        return Stack(n=n, dim=dim), [_random_bits(shape, dtype, seed + i) for i in range(n)]
    dim = draw(st.integers(0, len(shape) - 1))
    if kind == "unstack":  # at least one entry: zero tensors cannot be stacked back (Stack needs n >= 1)
        shape = (*shape[:dim], max(shape[dim], 1), *shape[dim + 1:])
        return Unstack(n=shape[dim], dim=dim), [_random_bits(shape, dtype, seed)]
    if kind == "concat":
        sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        parts = [_random_bits((*shape[:dim], s, *shape[dim + 1:]), dtype, seed + i) for i, s in enumerate(sizes)]
        return Concat(n=len(sizes), dim=dim), parts
    cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=0, max_size=3)))
    sizes = tuple(b - a for a, b in itertools.pairwise([0, *cuts, shape[dim]]))
    return Split(sizes=sizes, dim=dim), [_random_bits(shape, dtype, seed)]


@SETTINGS
@given(op_cases())
def test_every_op_inverse_restores_its_sources_bit_for_bit(case):
    op, sources = case
    shapes_in = [tuple(t.shape) for t in sources]
    outputs = op.forward(sources)
    assert [tuple(t.shape) for t in outputs] == list(op.forward_shapes(shapes_in))
    assert (len(sources), len(outputs)) == tuple(op.arity)
    restored = op.inverse(outputs, shapes_in)
    assert len(restored) == len(sources)
    for original, back in zip(sources, restored, strict=True):
        assert same_bits(original, back), op


@pytest.mark.parametrize("numel", [0, 1, 3])
def test_same_bits_on_rows_with_any_stride(numel):
    # Found by the properties here: Stack(n=2, dim=1) inverts into rows of stride 2, which
    # ``contiguous()`` leaves as they are when they hold 0 or 1 elements.
    row = torch.stack([torch.arange(numel, dtype=torch.float32), torch.zeros(numel)], dim=1).unbind(1)[0]
    assert row.stride() == (2,)
    assert same_bits(row, torch.arange(numel, dtype=torch.float32))
    assert not same_bits(row, torch.arange(numel, dtype=torch.float64))
    if numel:
        assert not same_bits(row, torch.arange(numel, dtype=torch.float32) + 1)


@SETTINGS
@given(op_cases())
def test_inverse_outputs_do_not_share_storage(case):
    """A saved checkpoint refuses tensors that share storage; split outputs must be separate."""
    op, sources = case
    restored = op.inverse(op.forward(sources), [tuple(t.shape) for t in sources])
    pointers = [t.untyped_storage().data_ptr() for t in restored if t.numel()]
    if len(restored) > 1:
        assert len(set(pointers)) == len(pointers)


@SETTINGS
@given(op_cases())
def test_fused_module_presents_and_accepts_the_original_layout_bit_for_bit(case):
    """Through the real layout machinery: convert in place, state_dict() back, load_state_dict() in."""
    op, sources = case
    names = tuple(f"src{i}" for i in range(len(sources)))
    targets = tuple(f"dst{i}" for i in range(op.arity[1]))
    module = nn.Module()
    for name, tensor in zip(names, sources, strict=True):
        module.register_buffer(name, tensor.clone())
    module.register_buffer("kept", _random_bits((3,), sources[0].dtype, 7))
    leaves = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    bound = bind_transforms("prop", "", leaves, [WeightTransform(names, targets, op)])
    plan = ModulePlan("prop", "", nn.Module, nn.Module, bound, tuple(leaves))
    convert_to_fused(module, plan, verified=set())
    finalize(module, plan)
    with fused_layout():
        assert set(module.state_dict()) == {*targets, "kept"}
    presented = module.state_dict()
    assert list(presented) == list(leaves)  # same keys, same order
    for name, tensor in zip(names, sources, strict=True):
        assert same_bits(presented[name], tensor)
    module.load_state_dict(presented)
    again = module.state_dict()
    for name, tensor in zip(names, sources, strict=True):
        assert same_bits(again[name], tensor)


# -- plan conflict detection ------------------------------------------------------------------------------

PATHS = ["m0", "m1", "m1.sub", "m2"]
LEAVES = ["w", "b", "sub.w", "sub.b"]

plans = st.lists(
    st.tuples(st.sampled_from(["fa", "fb", "fc"]), st.sampled_from(PATHS),
              st.lists(st.sampled_from(LEAVES), min_size=1, max_size=3, unique=True)),
    min_size=0, max_size=5,
)


def _plan(family, path, leaves):
    bound = tuple(
        BoundTransform((LeafSpec(leaf, (2,)),), (LeafSpec(leaf + "_f", (2,)),), Identity()) for leaf in leaves
    )
    return ModulePlan(family, path, nn.Module, nn.Module, bound, tuple(leaves))


@SETTINGS
@given(plans)
def test_conflict_detection_finds_every_overlap_and_nothing_else(drawn):
    modules = [_plan(*p) for p in drawn]
    paths = [m.path for m in modules]
    keys = [k for m in modules for k in m.original_keys]
    overlapping = len(set(paths)) < len(paths) or len(set(keys)) < len(keys)
    try:
        check_conflicts(modules)
        FusionPlan(tuple(modules))
    except PlanError as exc:
        assert overlapping, f"false conflict: {exc}"
        message = str(exc)
        duplicated = {p for p in paths if paths.count(p) > 1} | {k for k in keys if keys.count(k) > 1}
        assert any(repr(d) in message for d in duplicated), message
    else:
        assert not overlapping, f"missed overlap in {drawn}"


@SETTINGS
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(0, 3))
def test_bind_rejects_any_target_that_overwrites_a_kept_tensor(sizes, pick):
    leaves = {f"t{i}": (s,) for i, s in enumerate(sizes)}
    kept = f"t{pick % len(sizes)}"
    moved = next((k for k in leaves if k != kept), None)
    if moved is None:
        return
    transform = WeightTransform((moved,), (kept,), Identity())
    try:
        bind_transforms("prop", "m", leaves, [transform])
    except PlanError as exc:
        assert "would overwrite" in str(exc)
    else:
        raise AssertionError("a target overwrote a tensor that stays")


def test_properties_cover_every_op_and_dtype():
    """The op and dtype lists above are the complete public set (a new op must be added here)."""
    import fusion_core.transforms as transforms

    ops = {c for c in vars(transforms).values() if isinstance(c, type) and issubclass(c, transforms.TransformOp)}
    assert ops - {transforms.TransformOp} == {Identity, Flatten, Transpose, Concat, Split, Stack, Unstack}
    assert set(DTYPES) == {torch.float32, torch.float16, torch.bfloat16, torch.int8}
