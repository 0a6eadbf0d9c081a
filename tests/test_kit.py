"""The conformance kit and its pytest plugin: it passes a correct family and catches broken ones.

Also runs ``fusion new-family``: the scaffold is pip-installed into a throwaway target directory
and its own tests run there, unchanged, finding the family through its entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from fusion_patch_embeddings import PatchEmbeddingsFamily, PatchEmbeddingsOptions
from fusion_patch_embeddings.family import PatchLinearMixin
from pydantic import ConfigDict
from torch import nn

import fusion_core
from fusion_core import (
    Flatten,
    FusedModule,
    FusionFamily,
    Stack,
    TransformOp,
    Transpose,
    Unstack,
    WeightTransform,
    cli,
)
from fusion_core.testing import kit

FAMILY = PatchEmbeddingsFamily()


def make_conv() -> nn.Module:
    return nn.Conv3d(3, 16, kernel_size=(2, 4, 4), stride=(2, 4, 4))


def make_rows(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(9, 3, 2, 4, 4, generator=torch.Generator().manual_seed(0)).to(dtype)]


def test_plugin_is_registered_with_pytest(pytestconfig):
    plugin = pytestconfig.pluginmanager.get_plugin("fusion_core")
    assert plugin is not None and plugin.__name__ == "fusion_core.testing.pytest_plugin"


def test_a_correct_family_passes_every_check(fusion_conformance):
    fusion_conformance.check_family(FAMILY, make_conv, make_rows, tiny_model="qwen2_vl",
                                    dtypes=(torch.float32, torch.bfloat16, torch.float16), quantizers=True)


def test_discovery_check_names_the_modules(fusion_conformance):
    plan = fusion_conformance.discovery(FAMILY, "vivit", expected_modules=["embeddings.patch_embeddings.projection"])
    assert plan.modules[0].fused_class.__mro__[1] is PatchLinearMixin
    with pytest.raises(AssertionError, match="expected"):
        fusion_conformance.discovery(FAMILY, "vivit", expected_modules=["nowhere"])
    with pytest.raises(AssertionError, match="'patch_embeddings' on llama: planned nothing"):
        fusion_conformance.discovery(FAMILY, "llama")


class _Off(PatchLinearMixin):
    def forward(self, input):
        return super().forward(input) * 1.01


class _WrongNumerics(PatchEmbeddingsFamily):
    name = "wrong_numerics"

    def make_fused_class(self, original_cls, options):
        return type(original_cls.__name__, (_Off, original_cls), {})


class _Lossy(Flatten):
    def inverse(self, tensors, source_shapes):
        return (tensors[0].to(torch.bfloat16).to(tensors[0].dtype).reshape(source_shapes[0]),)


class _LossyTransforms(PatchEmbeddingsFamily):
    name = "lossy_transforms"

    def make_transforms(self, config, options):
        return [WeightTransform(("weight",), ("weight",), _Lossy(1))]


class _MutableOptions(PatchEmbeddingsOptions):
    model_config = ConfigDict(extra="forbid", frozen=False)


class _MutableOptionsFamily(PatchEmbeddingsFamily):
    name = "mutable_options"
    options_model = _MutableOptions


class _HiddenWeightMixin(FusedModule):
    """Keeps the Linear's weight transposed as ``weight_t`` and drops ``weight``: no nn.Linear quantizer sees it."""

    def forward(self, x):
        return x @ self.weight_t


class _HiddenWeight(FusionFamily):
    """A third-party family that moves an nn.Linear's weight out of sight of quantizers."""

    name = "hidden_weight"
    fused_mixin = _HiddenWeightMixin
    target_modules_patterns = (r"mlp\.down_proj$",)

    def is_fusable(self, module, options):
        return type(module) is nn.Linear and module.bias is None

    def make_transforms(self, config, options):
        return [WeightTransform(("weight",), ("weight_t",), Transpose(0, 1))]


def test_quantizer_visibility_passes_families_built_on_the_building_blocks(fusion_conformance):
    """patch_embeddings (a Conv3d: nothing for a Linear quantizer, fused or not) and the merged projections of qkv /
    gate_up (an nn.Linear container) show a Linear quantizer the same weight elements as the unfused model."""
    registry = fusion_core.get_registry()
    for spec, model in ((FAMILY, "qwen2_vl"), (registry.get("qkv").spec, "llama"), (registry.get("gate_up").spec,
                                                                                     "llama")):
        counts = fusion_conformance.quantizer_visibility(spec, model)
        assert counts["fused"] == counts["unfused"] > 0


def test_quantizer_visibility_catches_a_weight_moved_out_of_sight(fusion_conformance):
    with pytest.raises(AssertionError, match=r"family 'hidden_weight' on llama: fused nn.Linear modules without a "
                                             r"weight tensor \['model.layers.0.mlp.down_proj'"):
        fusion_conformance.quantizer_visibility(_HiddenWeight(), "llama")


def test_quantizer_visibility_compares_what_a_quantizer_quantized(fusion_conformance):
    """With ``quantize``, the elements it changed are compared too (here a stand-in that casts Linear weights to int8,
    fused ones included; and one that leaves the merged containers alone, as torch's quantize_dynamic would)."""
    def to_int8(model, keep=lambda module: False):
        for module in model.modules():
            if isinstance(module, nn.Linear) and not keep(module) and isinstance(module._parameters.get("weight"),
                                                                                 nn.Parameter):
                module.weight = nn.Parameter(module.weight.detach().to(torch.int8), requires_grad=False)

    qkv = fusion_core.get_registry().get("qkv").spec
    counts = fusion_conformance.quantizer_visibility(qkv, "llama", quantize=to_int8)
    assert counts["fused_quantized"] == counts["unfused_quantized"] > 0
    with pytest.raises(AssertionError, match=r"family 'qkv' on llama: the quantizer quantized \d+ weight elements of "
                                             r"the fused model, \d+ of the unfused one"):
        fusion_conformance.quantizer_visibility(qkv, "llama", quantize=lambda m: to_int8(
            m, keep=lambda module: type(module) is not nn.Linear))


def test_wrong_numerics_are_caught(fusion_conformance):
    with pytest.raises(AssertionError, match="differs by"):
        fusion_conformance.numerics(_WrongNumerics(), make_conv, make_rows)


def test_lossy_transforms_are_caught(fusion_conformance):
    with pytest.raises(AssertionError, match="not restored bit for bit"):
        fusion_conformance.transform_round_trip(_LossyTransforms(), make_conv())
    with pytest.raises(AssertionError, match="differs after the fused round trip"):
        fusion_conformance.state_dict_round_trip(_LossyTransforms(), make_conv())


def test_mutable_options_are_caught(fusion_conformance):
    with pytest.raises(AssertionError, match="frozen"):
        fusion_conformance.options_schema(_MutableOptionsFamily())
    schema = fusion_conformance.options_schema(FAMILY)
    assert schema["additionalProperties"] is False and "exclude_modules" in schema["properties"]


def test_fused_load_check_catches_wrong_numerics_end_to_end(fusion_conformance):
    comparison = fusion_conformance.fused_load(FAMILY, "videomae")
    assert comparison.ok and comparison.round_trip.ok and comparison.whole_model.ran
    with pytest.raises(AssertionError, match="'wrong_numerics' on videomae"):
        fusion_conformance.fused_load(_WrongNumerics(), "videomae")


class _Drawing(PatchLinearMixin):
    def forward(self, input):
        torch.rand(1)  # a "check" on a random sample, as a first call might run
        return super().forward(input)


class _DrawingForward(PatchEmbeddingsFamily):
    name = "drawing_forward"

    def make_fused_class(self, original_cls, options):
        return type(original_cls.__name__, (_Drawing, original_cls), {})


def test_fused_load_check_catches_a_forward_that_draws_where_the_original_does_not(fusion_conformance):
    with pytest.raises(AssertionError, match="'drawing_forward' on videomae: the fused model's first forward left "
                                             "torch's or Python's random generator elsewhere"):
        fusion_conformance.fused_load(_DrawingForward(), "videomae")


def test_registered_fixture_replaces_and_restores(fusion_registered):
    class Replacement(PatchEmbeddingsFamily):
        """A stand-in."""

    fusion_registered(Replacement())
    assert isinstance(fusion_core.get_registry().get("patch_embeddings").spec, Replacement)


def test_registered_family_is_back_afterwards():
    # Runs after the previous test in file order: the installed family must be back.
    family = fusion_core.get_registry().get("patch_embeddings")
    assert type(family.spec) is PatchEmbeddingsFamily and family.source.distribution == "fusion-patch-embeddings"


def test_tiny_checkpoint_fixture(fusion_tiny_checkpoint):
    directory = fusion_tiny_checkpoint("videomae")
    assert (directory / "config.json").is_file() and directory == fusion_tiny_checkpoint("videomae")


# -- fusion new-family ---------------------------------------------------------------------------
def test_new_family_scaffold_installs_and_passes_its_own_tests(tmp_path, capsys):
    assert cli.main(["new-family", "fast_thing", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "fast_thing"
    assert "fusion-fast-thing" in capsys.readouterr().out
    assert (root / "pyproject.toml").read_text().count('fast_thing = "fusion_fast_thing.plugin"') == 1
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(root)],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_CORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    listing = subprocess.run([sys.executable, "-m", "fusion_core", "list"], capture_output=True, text=True, env=env,
                             timeout=600)
    assert "fast_thing" in listing.stdout and "fusion-fast-thing" in listing.stdout, listing.stdout + listing.stderr
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
                           capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "skipped" not in tests.stdout and "failed" not in tests.stdout
    # The installed copy, not the source tree, was tested.
    assert (site / "fusion_fast_thing" / "family.py").is_file()


def test_new_family_refuses_bad_names_and_existing_directories(tmp_path):
    assert cli.main(["new-family", "Bad-Name", "--dir", str(tmp_path)]) == 2
    assert cli.main(["new-family", "ok_name", "--dir", str(tmp_path)]) == 0
    assert cli.main(["new-family", "ok_name", "--dir", str(tmp_path)]) == 2
    assert Path(tmp_path / "ok_name" / "tests" / "test_ok_name.py").is_file()


# -- custom transform ops: the TransformOp contract ------------------------------------------------
@dataclass(frozen=True)
class _WrongShapes(Stack):
    def forward_shapes(self, shapes):
        return ((len(shapes), *shapes[0][::-1]),)


@dataclass(frozen=True)
class _SharedSlices(Stack):
    def inverse(self, tensors, source_shapes):
        return tuple(torch.unbind(tensors[0], dim=self.dim))  # views of one storage


class _NotADataclass(TransformOp):
    arity = (1, 1)

    def forward_shapes(self, shapes):
        return (tuple(shapes[0]),)

    def forward(self, tensors):
        return (tensors[0],)

    def inverse(self, tensors, source_shapes):
        return (tensors[0],)


@dataclass(frozen=True)
class _TypeErrorOnBadShapes(Unstack):
    def forward_shapes(self, shapes):
        if shapes[0][self.dim] != self.n:
            raise TypeError("wrong")
        return super().forward_shapes(shapes)


def test_shipped_ops_honour_the_op_contract(fusion_conformance):
    fusion_conformance.transform_op(Stack(3), [(4, 2)] * 3, bad_shapes=[(4, 2), (4, 3), (4, 2)])
    fusion_conformance.transform_op(Unstack(2, 1), [(4, 2, 5)], bad_shapes=[(4, 3, 5)])
    fusion_conformance.transform_op(Flatten(1), [(8, 3, 2, 2)], bad_shapes=[(8,)])


@pytest.mark.parametrize(
    ("op", "match"),
    [
        (_WrongShapes(2), "forward_shapes"),
        (_SharedSlices(2), "view of part of an input"),
        (_NotADataclass(), "must show the op's parameters"),
        (_Lossy(1), "not restored bit for bit"),
    ],
)
def test_broken_custom_ops_are_caught(fusion_conformance, op, match):
    with pytest.raises(AssertionError, match=match):
        fusion_conformance.transform_op(op, [(4, 3)] * op.arity[0] if op.arity[0] > 1 else [(4, 3, 2)])


def test_an_op_that_rejects_shapes_with_another_error_is_caught(fusion_conformance):
    with pytest.raises(AssertionError, match="not ValueError"):
        fusion_conformance.transform_op(_TypeErrorOnBadShapes(2), [(2, 3)], bad_shapes=[(3, 3)])


# -- any model, config=, structured outputs ----------------------------------------------------------
class _Transposed(FusedModule):
    def forward(self, input):
        return input @ self.weight_t + (0 if self.bias is None else self.bias)


class _ConfigTransposed(FusionFamily):
    """Down projections on a transposed weight, only when the model config says so (reads config)."""

    name = "config_transposed"
    fused_mixin = _Transposed
    target_modules_patterns = (r"mlp\.down_proj$",)

    def is_fusable(self, module, options):
        return type(module) is nn.Linear

    def make_transforms(self, config, options):
        if config is None or config.hidden_size != 32:  # the failure mode of issue 13: [] without a config
            return []
        return [WeightTransform(("weight",), ("weight_t",), Transpose(0, 1))]


def _linear() -> nn.Module:
    return nn.Linear(64, 32)


def _linear_inputs(dtype):
    return [torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)]


def test_a_family_that_needs_the_config_gets_it_from_the_model(fusion_conformance):
    fusion_conformance.check_family(_ConfigTransposed(), _linear, _linear_inputs, tiny_model="llama")
    with pytest.raises(AssertionError, match="config=None was passed to make_transforms"):
        fusion_conformance.numerics(_ConfigTransposed(), _linear, _linear_inputs)


def test_entry_points_take_a_model_class_and_config_pair(fusion_conformance):
    pair = (transformers.AutoModelForCausalLM, kit.model_config("mistral"))
    plan = fusion_conformance.discovery(_ConfigTransposed(), pair)
    assert [m.path for m in plan.modules] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(AssertionError, match="expected"):
        fusion_conformance.discovery(_ConfigTransposed(), pair, expected_modules=["model.layers.0.mlp.down_proj"])
    assert fusion_conformance.fused_load(_ConfigTransposed(), pair).ok
    with pytest.raises(AssertionError, match="'wrong_numerics' on vivit"):
        fusion_conformance.fused_load(_WrongNumerics(), (transformers.AutoModel, kit.model_config("vivit")))


def test_fused_load_takes_a_checkpoint_directory(fusion_conformance, fusion_tiny_checkpoint):
    directory = fusion_tiny_checkpoint("qwen2")
    comparison = fusion_conformance.fused_load(_ConfigTransposed(), directory)
    assert comparison.ok and comparison.whole_model.ran
    plan = fusion_conformance.discovery(_ConfigTransposed(), directory)
    assert plan.modules[0].transforms[0].targets[0].shape == (64, 32)


class _Pair(nn.Module):
    """A block returning (hidden, router_logits), like transformers 4.57's MoE blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.router = nn.Linear(8, 4)

    def forward(self, hidden):
        return self.proj(hidden), self.router(hidden)


class _SameBlock(FusedModule):
    def forward(self, hidden):
        return super().forward(hidden)


class _RouterOff(FusedModule):
    def forward(self, hidden):
        out, logits = super().forward(hidden)
        return out, logits + 1.0


class _PairFamily(FusionFamily):
    """A family that changes no weight: the forward of a tuple-returning block."""

    name = "pair_block"
    fused_mixin = _SameBlock

    def is_fusable(self, module, options):
        return isinstance(module, _Pair) or "SparseMoeBlock" in type(module).__name__


class _BrokenRouter(_PairFamily):
    name = "broken_router"
    fused_mixin = _RouterOff


def test_tuple_outputs_are_compared_in_full(fusion_conformance):
    inputs = lambda dtype: [torch.randn(5, 8, dtype=dtype)]  # noqa: E731
    fusion_conformance.numerics(_PairFamily(), _Pair, inputs)
    with pytest.raises(AssertionError, match="differs by"):
        fusion_conformance.numerics(_BrokenRouter(), _Pair, inputs)


def test_an_moe_block_of_a_tiny_model_is_checked_whatever_it_returns(fusion_conformance):
    make = kit.module_factory("olmoe", "model.layers.0.mlp")
    inputs = lambda dtype: [torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(0)).to(dtype)]  # noqa: E731
    fusion_conformance.numerics(_PairFamily(), make, inputs)
    plan = fusion_conformance.discovery(_PairFamily(), "olmoe")
    assert [m.path for m in plan.modules] == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_text_and_moe_tiny_models_are_accepted_everywhere(fusion_tiny_checkpoint):
    from fusion_core.testing.tiny_models import MOE_MODELS, TEXT_MODELS, TINY_MODELS

    for name in ("llama", "mistral", "mixtral", "qwen2_moe"):
        assert kit.resolve_model(name).config.model_type == name
    assert (fusion_tiny_checkpoint("mistral") / "config.json").is_file()
    with pytest.raises(KeyError, match="tiny models: qwen2_vl"):
        kit.resolve_model("no_such_model")
    # One namespace: no name in two tables.
    assert len({*TINY_MODELS, *TEXT_MODELS, *MOE_MODELS}) == sum(map(len, (TINY_MODELS, TEXT_MODELS, MOE_MODELS)))


def test_the_product_does_not_import_the_test_kit():
    # Issue 12: `fusion check` and the rest of the package run without fusion_core.testing.
    import ast

    package = Path(fusion_core.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if "testing" in path.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "fusion_core.testing" or n.startswith("fusion_core.testing.") for n in names):
                offenders.append(str(path.relative_to(package)))
    assert not offenders, f"product modules importing the test kit: {offenders}"
    check = subprocess.run([sys.executable, "-c", "import sys, fusion_core.commands.check, fusion_core.compare; "
                            "print(any(m.startswith('fusion_core.testing') for m in sys.modules))"],
                           capture_output=True, text=True, timeout=600)
    assert check.stdout.strip() == "False", check.stdout + check.stderr
