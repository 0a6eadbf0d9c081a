"""``fusion new-family NAME``: a plugin distribution that installs and passes its own tests as written.

The skeleton family is real, so the generated tests exercise the whole kit: it runs ``nn.Linear``
layers with their weight stored transposed (``[in, out]``, one ``addmm``), a transform with a
rename (``weight`` -> ``weight_t``) that the kit checks forward and back. Replace its three
methods with your own fusion; keep the tests.
"""

from __future__ import annotations

import re
from pathlib import Path

from fusion_core.commands._common import UsageError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "fusion-core family {name!r}: nn.Linear with a transposed weight (replace with your fusion)."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["fusion-core>=0.1,<0.2"]

[project.optional-dependencies]
test = ["pytest>=8"]

# The entry point, named after the family: `fusion list` and fusion_config={{"{name}": True}} import the plugin
# when the family is first asked for (the "fusion_core.families" group; see docs/writing-a-family.md).
[project.entry-points."fusion_core.families"]
{name} = "{package}.plugin"

[tool.setuptools.packages.find]
include = ["{package}*"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

INIT = '''\
"""The ``{name}`` fusion family."""

from {package}.family import {cls}, {cls}Options

__all__ = ["{cls}", "{cls}Options"]
'''

FAMILY = '''\
"""``{name}``: ``nn.Linear`` layers run on a weight stored transposed, ``[in, out]``.

This is the skeleton `fusion new-family` writes: a complete, correct family to replace with
your own fusion. The four parts of a family:

1. ``is_fusable(module, options)``: is this (meta-device) module something the fused class
   computes exactly? Decide from the module itself, never from names alone.
2. ``target_modules_patterns``: optional regexes that pre-filter module paths.
3. ``fused_mixin``: the fused behaviour, mixed into a subclass of each original class (the
   default ``make_fused_class``); it does not override ``__init__``, and ``fusion_finalize()``
   runs once the fused tensors are in place.
4. ``make_transforms(config, options)``: module-relative weight transforms from the original
   checkpoint layout to the fused one; fusion-core inverts them to save the original layout.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fusion_core import FamilyOptions, FusedModule, FusionFamily, Transpose, WeightTransform


class {cls}Options(FamilyOptions):
    """Options of ``{name}`` (validated by fusion-core inside ``fusion_config``)."""

    min_features: int = Field(default=1, ge=1, description="Leave Linear layers with fewer input features alone.")


class TransposedLinearMixin(FusedModule):
    """The fused behaviour: ``bias + input @ weight_t`` on the transposed weight."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = input @ self.weight_t
        return out if self.bias is None else out + self.bias


class {cls}(FusionFamily):
    """nn.Linear layers run on a weight stored transposed (skeleton: replace with your fusion)."""

    name = "{name}"
    options_model = {cls}Options
    # The default make_fused_class mixes this into a subclass of each original class, keeping
    # the class name (transformers and accelerate match some lists by name). Override
    # make_fused_class only when one mixin is not enough.
    fused_mixin = TransposedLinearMixin
    target_modules_patterns = ()

    def is_fusable(self, module: nn.Module, options: Any) -> bool:
        # Exact class check: a subclass may compute something else (see docs/recipes.md).
        return type(module) is nn.Linear and module.in_features >= options.min_features

    def make_transforms(self, config: Any, options: Any) -> list[WeightTransform]:
        # ``config`` is the model's PretrainedConfig in a real load (None in module-level kit
        # checks unless the test passes config=).
        return [WeightTransform(("weight",), ("weight_t",), Transpose(0, 1))]
'''

PLUGIN = '''\
"""Entry point of the ``{dist}`` distribution (group ``fusion_core``)."""

from collections.abc import Callable
from typing import Any

import fusion_core
from {package}.family import {cls}


@fusion_core.hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register({cls}())
'''

TEST = '''\
"""The ``{name}`` family checked by fusion-core's conformance kit (the pytest plugin's fixtures)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusion_core
from {package} import {cls}, {cls}Options

FAMILY = {cls}()


def make_module() -> nn.Module:
    return nn.Linear(24, 16)


def make_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(5, 24, generator=torch.Generator().manual_seed(0)).to(dtype)]


def test_conformance(fusion_conformance):
    """Options schema, numerics per dtype, both round trips, discovery and a fused load on a tiny model."""
    fusion_conformance.check_family(FAMILY, make_module, make_inputs, tiny_model="qwen2_vl")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_numerically_equivalent(fusion_conformance, dtype):
    fusion_conformance.numerics(FAMILY, make_module, make_inputs, dtypes=[dtype])


def test_option_leaves_small_layers_alone(fusion_conformance):
    plan = fusion_conformance.discovery(FAMILY, "qwen2_vl", options={cls}Options(min_features=64))
    in_features = [m.transforms[0].sources[0].shape[1] for m in plan.modules]
    assert in_features and min(in_features) >= 64
    assert not FAMILY.is_fusable(nn.Linear(8, 4), {cls}Options(min_features=64))


def test_registered_through_its_entry_point():
    family = fusion_core.get_registry().get("{name}")
    assert family.source.distribution == "{dist}"
    assert isinstance(family.spec, {cls})
'''

README = '''\
# {dist}

A [fusion-core](https://pypi.org/project/fusion-core/) family, `{name}`.

```bash
pip install -e .            # registers the family through the `fusion_core` entry point
fusion list                 # shows `{name}` with this distribution
pytest                      # the conformance kit (fusion-core's pytest plugin) checks the family
```

Use it:

```python
import fusion_core
model = fusion_core.from_pretrained(AutoModel, "path/to/checkpoint", fusion_config={{"{name}": True}})
fusion_core.save_pretrained(model, "out/")   # the original checkpoint layout
```

The skeleton runs `nn.Linear` on a transposed weight; replace `is_fusable`, `make_fused_class`
and `make_transforms` in `{package}/family.py` with your fusion, and keep the tests green.
'''


def new_family(name: str, directory: str | Path = ".") -> dict[str, object]:
    """Write the distribution ``fusion-<name>`` into ``directory/<name>``; return what was written."""
    if not _NAME.match(name):
        raise UsageError(f"family name {name!r} must be a lowercase identifier (letters, digits, _)")
    root = Path(directory) / name
    if root.exists() and any(root.iterdir()):
        raise UsageError(f"{root} exists and is not empty")
    values = {
        "name": name,
        "dist": "fusion-" + name.replace("_", "-"),
        "package": "fusion_" + name,
        "cls": "".join(part.capitalize() for part in name.split("_")) + "Family",
    }
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"{values['package']}/__init__.py": INIT,
        f"{values['package']}/family.py": FAMILY,
        f"{values['package']}/plugin.py": PLUGIN,
        f"tests/test_{name}.py": TEST,
    }
    for relative, template in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values))
    return {"command": "new-family", "family": name, "distribution": values["dist"], "package": values["package"],
            "directory": str(root), "files": sorted(files)}
