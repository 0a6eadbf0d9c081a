"""The conformance kit and its pytest plugin: it passes a correct family and catches broken ones.

Also runs ``fusion new-family``: the scaffold is pip-installed into a throwaway target directory
and its own tests run there, unchanged, finding the family through its entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fusion_patch_embeddings import PatchEmbeddingsFamily, PatchEmbeddingsOptions
from fusion_patch_embeddings.family import PatchLinearMixin
from pydantic import ConfigDict
from torch import nn

import fusion_core
from fusion_core import Flatten, WeightTransform, cli

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
                                    dtypes=(torch.float32, torch.bfloat16, torch.float16))


def test_discovery_check_names_the_modules(fusion_conformance):
    plan = fusion_conformance.discovery(FAMILY, "vivit", expected_modules=["embeddings.patch_embeddings.projection"])
    assert plan.modules[0].fused_class.__mro__[1] is PatchLinearMixin
    with pytest.raises(AssertionError, match="expected"):
        fusion_conformance.discovery(FAMILY, "vivit", expected_modules=["nowhere"])


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
