"""Weight transform operations and plans: shapes, exact inverses, and conflict detection."""

from __future__ import annotations

import pytest
import torch

from fusion_core import Concat, Flatten, Identity, PlanError, Split, Stack, Transpose, Unstack, WeightTransform
from fusion_core.transforms import BoundTransform, FusionPlan, LeafSpec, ModulePlan, bind_transforms


@pytest.mark.parametrize(
    ("op", "shapes"),
    [
        (Identity(), [(3, 4)]),
        (Flatten(1), [(8, 3, 2, 14, 14)]),
        (Flatten(2), [(2, 3, 4, 5)]),
        (Transpose(0, 1), [(3, 5)]),
        (Concat(3, 0), [(8, 4), (2, 4), (2, 4)]),
        (Concat(2, 1), [(4, 3), (4, 5)]),
        (Split((2, 6), 0), [(8, 4)]),
        (Stack(3, 0), [(4, 2), (4, 2), (4, 2)]),
        (Stack(2, 2), [(4, 2), (4, 2)]),
        (Unstack(3, 0), [(3, 4, 2)]),
        (Unstack(2, 1), [(4, 2, 5)]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_inverse_restores_input_bit_for_bit(op, shapes, dtype):
    inputs = [torch.randint(-100, 100, shape).to(dtype) for shape in shapes]
    outputs = op.forward(inputs)
    assert [tuple(o.shape) for o in outputs] == list(op.forward_shapes(shapes))
    restored = op.inverse(outputs, shapes)
    assert len(restored) == len(inputs)
    for original, back in zip(inputs, restored, strict=True):
        assert back.dtype == original.dtype and torch.equal(back, original)


def test_flatten_of_contiguous_tensor_is_a_view():
    weight = torch.randn(8, 3, 2, 14, 14)
    (flat,) = Flatten(1).forward([weight])
    assert flat.data_ptr() == weight.data_ptr() and flat.shape == (8, 3 * 2 * 14 * 14)
    (back,) = Flatten(1).inverse([flat], [(8, 3, 2, 14, 14)])
    assert back.data_ptr() == weight.data_ptr()


def test_concat_inverse_does_not_share_storage():
    parts = Concat(2, 0).inverse([torch.randn(6, 2)], [(4, 2), (2, 2)])
    assert parts[0].untyped_storage().data_ptr() != parts[1].untyped_storage().data_ptr()


def test_stack_adds_a_leading_dimension_and_unstack_removes_it():
    experts = [torch.randn(6, 4) for _ in range(3)]
    (stacked,) = Stack(3).forward(experts)
    assert stacked.shape == (3, 6, 4) and Stack(3).forward_shapes([(6, 4)] * 3) == ((3, 6, 4),)
    assert all(torch.equal(stacked[i], e) for i, e in enumerate(experts))
    assert Unstack(3).forward_shapes([(3, 6, 4)]) == ((6, 4),) * 3
    assert WeightTransform(("a", "b", "c"), ("abc",), Stack(3)).op.arity == (3, 1)
    assert WeightTransform(("abc",), ("a", "b"), Unstack(2)).op.arity == (1, 2)


def test_stack_inverse_and_unstack_forward_do_not_share_storage():
    for parts in (Stack(2).inverse([torch.randn(2, 3, 4)], [(3, 4)] * 2), Unstack(2).forward([torch.randn(2, 3)])):
        assert parts[0].untyped_storage().data_ptr() != parts[1].untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("op", "shapes"),
    [
        (Flatten(5), [(2, 3)]),
        (Concat(2, 1), [(4, 3), (5, 5)]),
        (Split((3, 3), 0), [(8, 4)]),
        (Transpose(0, 4), [(2, 2)]),
        (Stack(2, 0), [(4, 2), (4, 3)]),
        (Stack(2, 3), [(4, 2), (4, 2)]),
        (Unstack(3, 0), [(2, 4)]),
        (Unstack(2, 2), [(2, 4)]),
    ],
)
def test_shape_errors_are_value_errors(op, shapes):
    with pytest.raises(ValueError):
        op.forward_shapes(shapes)


@pytest.mark.parametrize("op", [Stack, Unstack])
def test_stack_and_unstack_refuse_an_empty_stack(op):
    with pytest.raises(ValueError, match="n must be at least 1"):
        op(0)


def test_weight_transform_checks_arity():
    with pytest.raises(ValueError, match="takes 3 source"):
        WeightTransform(("a", "b"), ("c",), Concat(3))
    with pytest.raises(TypeError, match="tuples of leaf names"):
        WeightTransform("weight", ("weight",))  # type: ignore[arg-type]


def test_bind_infers_shapes_and_names_the_module():
    bound = bind_transforms("fam", "m.x", {"weight": (4, 3, 2, 2, 2), "bias": (4,)},
                            [WeightTransform(("weight",), ("weight",), Flatten(1))])
    assert bound[0].targets[0].shape == (4, 24)
    with pytest.raises(PlanError, match=r"family 'fam', module 'm.x'.*needs tensor\(s\) \['q.weight'\]"):
        bind_transforms("fam", "m.x", {"weight": (4, 3)}, [WeightTransform(("q.weight",), ("w",))])


def test_bind_optional_and_partial_sources():
    transforms = [WeightTransform(("q.bias", "k.bias"), ("qk.bias",), Concat(2), optional=True)]
    assert bind_transforms("f", "p", {"w": (2,)}, transforms) == ()
    with pytest.raises(PlanError, match="k.bias"):
        bind_transforms("f", "p", {"q.bias": (2,)}, transforms)


def test_bind_rejects_double_use_and_clobbering():
    with pytest.raises(PlanError, match="consumed by two"):
        bind_transforms("f", "p", {"a": (2,)}, [WeightTransform(("a",), ("b",)), WeightTransform(("a",), ("c",))])
    with pytest.raises(PlanError, match="overwrite"):
        bind_transforms("f", "p", {"a": (2,), "b": (2,)}, [WeightTransform(("a",), ("b",))])
    with pytest.raises(PlanError, match="rejects shapes"):
        bind_transforms("f", "p", {"a": (2, 3), "b": (4, 4)}, [WeightTransform(("a", "b"), ("c",), Concat(2, 0))])


def _plan(family: str, path: str, leaf: str = "weight") -> ModulePlan:
    bound = bind_transforms(family, path, {leaf: (2, 2)}, [WeightTransform((leaf,), (leaf,))])
    return ModulePlan(family, path, torch.nn.Linear, torch.nn.Linear, bound, (leaf,))


def test_plan_detects_two_families_on_one_module():
    with pytest.raises(PlanError, match="families 'a' and 'b' both replace module 'x'"):
        FusionPlan((_plan("a", "x"), _plan("b", "x")))


def test_plan_accepts_disjoint_modules_and_describes_them():
    plan = FusionPlan((_plan("a", "x"), _plan("b", "y")))
    assert plan.families == ("a", "b")
    rows = plan.describe()
    assert rows[0]["original"] == {"x.weight": [2, 2]} and rows[1]["module"] == "y"


def test_plan_detects_nested_claims_on_one_key():
    outer = _plan("a", "x", leaf="sub.weight")
    inner = _plan("b", "x.sub")
    with pytest.raises(PlanError, match=r"'x.sub.weight' is claimed by family 'a' \(module 'x'\) and by family 'b'"):
        FusionPlan((outer, inner))


def test_a_module_inside_one_another_family_fuses_is_left_to_it():
    """Nested claims under a family that owns its submodules: the inner plan is dropped (in either order);
    a plan sharing no tensor is kept; under a family that does not own them, both stay (a conflict)."""
    from torch import nn

    from fusion_core.discovery import _leave_nested_to_outer

    def plan(family: str, path: str, leaves: list[str]) -> ModulePlan:
        sources = tuple(LeafSpec(leaf, (2, 2)) for leaf in leaves)
        bound = BoundTransform(sources, (LeafSpec("merged", (2 * len(leaves), 2)),), Concat(n=len(leaves)))
        return ModulePlan(family, path, nn.Module, nn.Module, (bound,), tuple(leaves))

    outer = plan("moe", "layers.0.mlp", ["experts.0.gate_proj.weight", "experts.0.up_proj.weight"])
    inner = plan("gate_up", "layers.0.mlp.experts.0", ["gate_proj.weight", "up_proj.weight"])
    shared = plan("gate_up", "layers.0.mlp.shared_expert", ["gate_proj.weight", "up_proj.weight"])
    for order in ([outer, inner, shared], [inner, shared, outer]):
        kept, nested = _leave_nested_to_outer(order, {"moe"})
        assert {p.path for p in kept} == {"layers.0.mlp", "layers.0.mlp.shared_expert"}
        assert [(i.path, o.path) for i, o in nested] == [("layers.0.mlp.experts.0", "layers.0.mlp")]
    unrelated = plan("other", "layers.0.mlp.experts.0", ["down_proj.weight", "act.weight"])
    kept, nested = _leave_nested_to_outer([outer, unrelated], {"moe"})
    assert kept == [outer, unrelated] and not nested  # inside, but claiming none of the outer's tensors
    kept, nested = _leave_nested_to_outer([outer, inner], set())
    assert kept == [outer, inner] and not nested
    with pytest.raises(PlanError, match="claimed by family"):
        FusionPlan(tuple(kept))
