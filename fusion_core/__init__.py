"""fusion-core: load transformers models with fused modules, save them in their original layout.

>>> import fusion_core                                                   # doctest: +SKIP
>>> model = fusion_core.from_pretrained(AutoModelForImageTextToText, path,
...                                     fusion_config={"patch_embeddings": True})
>>> fusion_core.save_pretrained(model, out_dir)   # the original checkpoint layout

Families (``patch_embeddings``, ...) and integrations (``peft``, ``tensor_parallel``) are separate
plugin distributions found through the ``fusion_core`` entry-point group; ``fusion list`` shows
what is installed.

The public names below are imported on first use (PEP 562), so ``import fusion_core`` costs a
few milliseconds; pydantic, pluggy and the pipeline load when a name is first touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fusion_core.compat.transformers import check_supported as _check_supported
from fusion_core.lazy import resolve as _resolve

_check_supported()  # an unsupported transformers fails here, with the range, not deep inside a load

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "FusionConfig": "fusion_core.config",
    "parse_fusion_config": "fusion_core.config",
    "CheckpointError": "fusion_core.errors",
    "DiscoveryError": "fusion_core.errors",
    "FusionConfigError": "fusion_core.errors",
    "FusionError": "fusion_core.errors",
    "FusionLoadError": "fusion_core.errors",
    "PlanError": "fusion_core.errors",
    "PluginError": "fusion_core.errors",
    "SaveError": "fusion_core.errors",
    "MissingIntegrationError": "fusion_core.errors",
    "UnknownFamilyError": "fusion_core.errors",
    "Integration": "fusion_core.integration",
    "reset_state": "fusion_core.state",
    "from_pretrained": "fusion_core.hf",
    "fuse": "fusion_core.inplace",
    "unfuse": "fusion_core.inplace",
    "get_fusion_plan": "fusion_core.hf",
    "save_pretrained": "fusion_core.hf",
    "hookimpl": "fusion_core.hookspecs",
    "integrate_transformers": "fusion_core.routing",
    "fused_layout": "fusion_core.layout",
    "original_named_parameters": "fusion_core.layout",
    "original_parameter": "fusion_core.layout",
    "get_registry": "fusion_core.plugins",
    "register_family": "fusion_core.plugins",
    "reset_registry": "fusion_core.plugins",
    "unregister_family": "fusion_core.plugins",
    "FamilyOptions": "fusion_core.spec",
    "FusedModule": "fusion_core.spec",
    "FusionFamily": "fusion_core.spec",
    "ModuleFusionSpec": "fusion_core.spec",
    "Concat": "fusion_core.transforms",
    "Flatten": "fusion_core.transforms",
    "FusionPlan": "fusion_core.transforms",
    "Identity": "fusion_core.transforms",
    "ModulePlan": "fusion_core.transforms",
    "Split": "fusion_core.transforms",
    "Stack": "fusion_core.transforms",
    "TransformOp": "fusion_core.transforms",
    "Transpose": "fusion_core.transforms",
    "Unstack": "fusion_core.transforms",
    "WeightTransform": "fusion_core.transforms",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return _resolve(globals(), _EXPORTS, name)
    if name == "__version__":
        from importlib import metadata

        try:
            value: Any = metadata.version("fusion-core")
        except metadata.PackageNotFoundError:  # a source tree that is not installed
            value = "0+unknown"
    else:
        try:  # submodules as attributes: fusion_core.discovery, fusion_core.testing, ...
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from fusion_core.config import (
        FusionConfig as FusionConfig,
        parse_fusion_config as parse_fusion_config,
    )
    from fusion_core.errors import (
        CheckpointError as CheckpointError,
        DiscoveryError as DiscoveryError,
        FusionConfigError as FusionConfigError,
        FusionError as FusionError,
        FusionLoadError as FusionLoadError,
        MissingIntegrationError as MissingIntegrationError,
        PlanError as PlanError,
        PluginError as PluginError,
        SaveError as SaveError,
        UnknownFamilyError as UnknownFamilyError,
    )
    from fusion_core.hf import (
        from_pretrained as from_pretrained,
        get_fusion_plan as get_fusion_plan,
        save_pretrained as save_pretrained,
    )
    from fusion_core.hookspecs import hookimpl as hookimpl
    from fusion_core.inplace import (
        fuse as fuse,
        unfuse as unfuse,
    )
    from fusion_core.integration import Integration as Integration
    from fusion_core.layout import (
        fused_layout as fused_layout,
        original_named_parameters as original_named_parameters,
        original_parameter as original_parameter,
    )
    from fusion_core.plugins import (
        get_registry as get_registry,
        register_family as register_family,
        reset_registry as reset_registry,
        unregister_family as unregister_family,
    )
    from fusion_core.routing import integrate_transformers as integrate_transformers
    from fusion_core.spec import (
        FamilyOptions as FamilyOptions,
        FusedModule as FusedModule,
        FusionFamily as FusionFamily,
        ModuleFusionSpec as ModuleFusionSpec,
    )
    from fusion_core.state import reset_state as reset_state
    from fusion_core.transforms import (
        Concat as Concat,
        Flatten as Flatten,
        FusionPlan as FusionPlan,
        Identity as Identity,
        ModulePlan as ModulePlan,
        Split as Split,
        Stack as Stack,
        TransformOp as TransformOp,
        Transpose as Transpose,
        Unstack as Unstack,
        WeightTransform as WeightTransform,
    )

    __version__: str
