"""The packaging contract, exercised with real pip installs into a fresh environment.

The fresh environment sees the heavy dependencies (torch, transformers, ...) of the test
environment through a filtered mirror of its site-packages that leaves out every fusion
distribution; fusion-core, its plugin and a third-party family are then pip-installed into
it for real, and uninstalled again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

# The packaging contract does not depend on the transformers line: it runs on the newest line only.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]

THIRD_PARTY_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-fusion-transposed-head"
version = "3.1.4"
dependencies = ["fusion-core"]

[project.entry-points.fusion_core]
transposed_head = "acme_transposed_head"
"""

THIRD_PARTY_MODULE = '''
"""A third-party family: the LM head keeps its weight transposed and multiplies by it."""
import torch
from torch import nn

import fusion_core


class HeadMixin(fusion_core.FusedModule):
    def forward(self, input):
        out = input @ self.weight_t
        return out if self.bias is None else out + self.bias


class TransposedHead(fusion_core.FusionFamily):
    """LM heads that store their weight transposed."""

    name = "transposed_head"
    target_modules_patterns = (r"lm_head$",)

    def is_fusable(self, module, options):
        return type(module) is nn.Linear

    def make_fused_class(self, original_cls, options):
        return type(original_cls.__name__, (HeadMixin, original_cls), {})

    def make_transforms(self, config, options):
        return [fusion_core.WeightTransform(("weight",), ("weight_t",), fusion_core.Transpose(0, 1))]


@fusion_core.hookimpl
def register_fusion_families(register):
    register(TransposedHead())
'''


def _run(python: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_CORE_")}
    result = subprocess.run([str(python), *args], capture_output=True, text=True, env=env, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def _pip(fresh: Path, *args: str) -> None:
    _run(Path(sys.executable), "-m", "pip", "--python", str(fresh), "install", "-q", "--no-deps",
         "--no-build-isolation", *args)


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fresh")
    mirror = root / "mirror"
    mirror.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    shared = [mirror]
    for entry in site.iterdir():
        lowered = entry.name.lower()
        if lowered.startswith(("fusion", "__editable__", "acme")):
            continue
        if lowered.endswith(".pth"):
            # Directories a .pth adds (scripts/_env.sh shares one torch installation this way) are
            # dependencies too (the fusion distributions' editable .pth files were left out above).
            shared += [Path(line) for line in entry.read_text().splitlines()
                       if line and not line.startswith(("#", "import")) and Path(line).is_dir()]
            continue
        (mirror / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    fresh_site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (fresh_site / "_shared_dependencies.pth").write_text("".join(f"{path}\n" for path in shared))
    _pip(python, str(ROOT))
    return python


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _families(python: Path) -> dict[str, dict]:
    listing = json.loads(_run(python.parent / "fusion", "list", "--json").stdout)
    return {f["name"]: f for f in listing["families"]}


LOAD = """
import sys, torch, fusion_core
from transformers import AutoModelForCausalLM
path, family = sys.argv[1], sys.argv[2]
try:
    model = fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config={family: True})
except Exception as exc:
    print(f"ERROR {type(exc).__name__}: {exc}")
    raise SystemExit(3)
plain = AutoModelForCausalLM.from_pretrained(path)
ids = torch.tensor([[1, 5, 7, 9]])
with torch.no_grad():
    diff = (model(ids).logits - plain(ids).logits).abs().max().item()
print("FUSED", [m.path for m in fusion_core.get_fusion_plan(model).modules], diff)
"""


def test_core_alone_has_no_family_and_names_the_plugin_to_install(fresh_python, llama_dir):
    assert _families(fresh_python) == {}
    result = _run(fresh_python, "-c", LOAD, str(llama_dir), "patch_embeddings", check=False)
    assert result.returncode == 3
    assert "unknown fusion family 'patch_embeddings'" in result.stdout
    assert "pip install fusion-patch-embeddings" in result.stdout


def test_installing_the_plugin_lists_it_with_its_distribution(fresh_python):
    _pip(fresh_python, str(ROOT / "fusion_plugins" / "patch_embeddings"))
    family = _families(fresh_python)["patch_embeddings"]
    assert family["distribution"] == "fusion-patch-embeddings"
    assert family["version"] == "0.1.0"
    assert family["options_schema"]["additionalProperties"] is False


def _install_third_party_family(fresh_python: Path, tmp_path: Path) -> None:
    """pip-install the ``acme-fusion-transposed-head`` distribution (THIRD_PARTY_*) into the fresh environment."""
    package = tmp_path / "acme"
    package.mkdir()
    (package / "pyproject.toml").write_text(THIRD_PARTY_PYPROJECT)
    (package / "acme_transposed_head.py").write_text(textwrap.dedent(THIRD_PARTY_MODULE))
    _pip(fresh_python, str(package))


def test_third_party_family_is_found_used_and_gone_when_uninstalled(fresh_python, llama_dir, tmp_path):
    _install_third_party_family(fresh_python, tmp_path)
    family = _families(fresh_python)["transposed_head"]
    assert (family["distribution"], family["version"]) == ("acme-fusion-transposed-head", "3.1.4")
    used = _run(fresh_python, "-c", LOAD, str(llama_dir), "transposed_head")
    fused_line = next(line for line in used.stdout.splitlines() if line.startswith("FUSED"))
    assert "['lm_head']" in fused_line and float(fused_line.split()[-1]) < 1e-5
    _run(Path(sys.executable), "-m", "pip", "--python", str(fresh_python), "uninstall", "-y", "-q",
         "acme-fusion-transposed-head")
    assert "transposed_head" not in _families(fresh_python)
    gone = _run(fresh_python, "-c", LOAD, str(llama_dir), "transposed_head", check=False)
    assert gone.returncode == 3 and "unknown fusion family 'transposed_head'" in gone.stdout


def test_the_distributions_ship_their_type_hints(fresh_python):
    """PEP 561: the core and the plugin packages carry ``py.typed`` when installed from their wheels."""
    _pip(fresh_python, str(ROOT / "fusion_plugins" / "patch_embeddings"))
    script = ("import pathlib, fusion_core, fusion_patch_embeddings\n"
              "for package in (fusion_core, fusion_patch_embeddings):\n"
              "    print(pathlib.Path(package.__file__).parent / 'py.typed')\n")
    markers = [Path(line) for line in _run(fresh_python, "-I", "-c", script).stdout.split()]  # -I: not the cwd
    assert len(markers) == 2 and all(marker.is_file() for marker in markers), markers
    assert all("site-packages" in str(marker) for marker in markers)  # the installed wheels, not the source tree


TP_LOAD = """
import sys, fusion_core
from transformers import AutoModelForCausalLM
try:
    fusion_core.from_pretrained(AutoModelForCausalLM, sys.argv[1], fusion_config={"transposed_head": True},
                                tp_plan="auto")
except Exception as exc:
    print(f"ERROR {type(exc).__name__}: {exc}")
    raise SystemExit(3)
"""


def test_an_integration_distribution_is_a_plugin_and_its_absence_is_named(fresh_python, llama_dir, tmp_path):
    _install_third_party_family(fresh_python, tmp_path)
    refused = _run(fresh_python, "-c", TP_LOAD, str(llama_dir), check=False)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "ERROR MissingIntegrationError" in refused.stdout and "pip install fusion-tensor-parallel" in refused.stdout
    _pip(fresh_python, str(ROOT / "fusion_plugins" / "tensor_parallel"))
    listing = json.loads(_run(fresh_python.parent / "fusion", "list", "--json").stdout)
    assert [(i["name"], i["distribution"]) for i in listing["integrations"]] == [
        ("tensor_parallel", "fusion-tensor-parallel")]
    # Installed, the integration serves the load: transformers itself now asks for a process group.
    served = _run(fresh_python, "-c", TP_LOAD, str(llama_dir), check=False)
    assert "MissingIntegrationError" not in served.stdout
    _run(Path(sys.executable), "-m", "pip", "--python", str(fresh_python), "uninstall", "-y", "-q",
         "fusion-tensor-parallel", "acme-fusion-transposed-head")
