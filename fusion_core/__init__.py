"""fusion-core: load transformers models with fused modules, save them in their original layout.

>>> import fusion_core                                                   # doctest: +SKIP
>>> model = fusion_core.from_pretrained(AutoModelForImageTextToText, path,
...                                     fusion_config={"patch_embeddings": True})
>>> fusion_core.save_pretrained(model, out_dir)   # the original checkpoint layout

Families (``patch_embeddings``, ...) are separate plugin distributions found through the
``fusion_core`` entry-point group; ``fusion list`` shows what is installed.
"""

from __future__ import annotations

from importlib import metadata

from fusion_core.config import FusionConfig, parse_fusion_config
from fusion_core.errors import (
    CheckpointError,
    DiscoveryError,
    FusionError,
    FusionLoadError,
    PlanError,
    PluginError,
    SaveError,
    UnknownFamilyError,
)
from fusion_core.hf import from_pretrained, get_fusion_plan, save_pretrained
from fusion_core.hookspecs import hookimpl
from fusion_core.layout import fused_layout
from fusion_core.plugins import get_registry, register_family, reset_registry, unregister_family
from fusion_core.spec import FamilyOptions, FusedModule, FusionFamily, ModuleFusionSpec
from fusion_core.transforms import (
    Concat,
    Flatten,
    FusionPlan,
    Identity,
    ModulePlan,
    Split,
    TransformOp,
    Transpose,
    WeightTransform,
)

try:
    __version__ = metadata.version("fusion-core")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "CheckpointError",
    "Concat",
    "DiscoveryError",
    "FamilyOptions",
    "Flatten",
    "FusedModule",
    "FusionConfig",
    "FusionError",
    "FusionFamily",
    "FusionLoadError",
    "FusionPlan",
    "Identity",
    "ModuleFusionSpec",
    "ModulePlan",
    "PlanError",
    "PluginError",
    "SaveError",
    "Split",
    "TransformOp",
    "Transpose",
    "UnknownFamilyError",
    "WeightTransform",
    "__version__",
    "from_pretrained",
    "fused_layout",
    "get_fusion_plan",
    "get_registry",
    "hookimpl",
    "parse_fusion_config",
    "register_family",
    "reset_registry",
    "save_pretrained",
    "unregister_family",
]
