"""PEFT LoRA on fused models, by the original module names.

On a fused model the modules LoRA targets are no longer what PEFT knows: ``q_proj`` is a
:class:`~fusion_core.plugin.MergedSlice` (rows of the merged ``qkv_proj.weight``) and a fused patch
embedding is a ``Conv3d`` subclass holding a flattened 2-D weight. This integration teaches PEFT's
LoRA about both, so that ``LoraConfig(target_modules=["q_proj", "v_proj", "gate_proj", "proj"])``
works on a fused model exactly as on the unfused one.

**How.** PEFT builds each LoRA layer around a *stand-in*: a real ``nn.Linear`` / ``nn.Conv3d`` whose
parameters are views of the fused tensors in the original layout, so PEFT's own layer classes
size, initialise and place the adapter as they would on the unfused model. The LoRA layer's
``base_layer`` is then the fused module itself, so the base projection still runs fused (q, k
and v still share one GEMM) and LoRA adds its term on top, as vLLM does with one LoRA slot per
packed segment. Merging and unmerging run PEFT's own code on a stand-in holding a *copy* of the
base tensors, and the result is copied back into the fused storage: PEFT's safe merge assigns
``weight.data = ...``, which would not write through a view. Adapter files hold the same keys,
shapes and values as on the unfused model (the LoRA weights live at ``q_proj.lora_A`` either
way), ``merge_and_unload()`` leaves the merged bytes a merge on the unfused model leaves, and
``unload()`` puts the fused module back.

**Switching on.** The plugin (:mod:`fusion_peft.plugin`) calls :func:`activate` whenever fusion-core
fuses a module on a real device (not discovery's rehearsal on the meta device). When PEFT's LoRA
module is already imported, its module factory and its ``target_modules="all-linear"`` expansion
(:func:`fusion_core.plugin.wrap_lora_factories`) (which must count a slice as the ``nn.Linear`` it stands
for) are wrapped now; otherwise a finder wraps them right after PEFT is imported. Nothing is imported early, and the
wrapper hands every module that fusion did not make to PEFT unchanged. On a PEFT release without those private names,
``import peft`` and LoRA on unfused models still work; LoRA on a model holding fused modules is refused with an
ImportError naming the release, the missing name and this distribution.

**Quantized merged projections** (torchao, bitsandbytes, quanto): the slice's base output is the
quantized merged GEMM's rows, as on the unfused quantized layer (QLoRA); PEFT sizes and places the
adapter from a stand-in that holds only the shape, dtype and device of the quantized weight.

Not supported, refused with a clear error: DoRA on a fused patch embedding (PEFT's DoRA reads the
convolution's 5-D weight in its forward); on a quantized merged slice, DoRA, initialisations
computed from the base weight, and merging the adapter in (they need the base weight in the
original layout); and LoRA targets that are fusion's own merged containers (``qkv_proj``,
``gate_up_proj``): target the original projections instead.
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fusion_core import ModulePlan
from fusion_core.plugin import (
    LORA_MODULE,
    MergedProjection,
    MergedSlice,
    container_parts,
    detach_plan,
    is_torch_tensor,
    module_plan,
    wrap_lora_factories,
)

__all__ = ["activate", "reset", "tuner_layer_paths"]

_LORA_MODULE = LORA_MODULE
_lock = threading.Lock()
_state = {"installed": False, "finder": False}


# -- switching on -----------------------------------------------------------------------------
def activate() -> None:
    """Teach PEFT about fused modules: now if PEFT's LoRA is imported, else right after it is."""
    with _lock:
        if _state["installed"]:
            return
        if _LORA_MODULE in sys.modules:
            _install(sys.modules[_LORA_MODULE])
        elif not _state["finder"]:
            _state["finder"] = True  # looked for once: a later install of peft needs a new process anyway
            if importlib.util.find_spec("peft") is not None:
                sys.meta_path.insert(0, _AfterImport())


def reset() -> None:
    """Forget the finder waiting for PEFT's import (``fusion_core.reset_state``); an installed wrapper stays."""
    with _lock:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterImport)]
        _state["finder"] = False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds PEFT's LoRA module like the normal finders do, and installs the wrapper once it ran."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != _LORA_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _InstallingLoader(spec.loader)
        return spec


class _InstallingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            _install(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect and linecache
        return getattr(self._loader, name)


def _install(lora_model_module: ModuleType) -> None:
    if _state["installed"]:
        return
    try:
        wrap_lora_factories(lora_model_module, _create_new_module, _all_linear)
    except ImportError as exc:
        _refuse_lora_on_fused_models(lora_model_module, exc)
    _state["installed"] = True


def _refuse_lora_on_fused_models(lora_model_module: ModuleType, missing: ImportError) -> None:
    """On a PEFT release without the names LoRA on fused modules wraps, refuse exactly that, when it is asked for.

    This runs inside ``import peft`` (or a fused load), which must not fail for it: LoRA on the unfused model needs
    nothing of this integration. So ``LoraModel`` (the tuner every LoRA entry point of PEFT builds:
    ``get_peft_model``, ``PeftModel.from_pretrained``, ``inject_adapter_in_model``) refuses a model holding fused
    modules, naming the release, the missing name and this distribution. A release without ``LoraModel`` has no
    tuner this integration knows to guard, and is left alone.
    """
    lora_model = getattr(lora_model_module, "LoraModel", None)
    if lora_model is None:
        return
    reason = (f"LoRA on a fused model needs fusion-peft (fusion-core's PEFT integration), which cannot serve the "
              f"installed PEFT: {missing}")
    init = lora_model.__init__

    def __init__(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        fused = next((name for name, module in model.named_modules() if module_plan(module) is not None), None)
        if fused is not None:
            raise ImportError(f"{reason} (fused: {fused!r})")
        init(self, model, *args, **kwargs)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    lora_model.__init__ = __init__


def _create_new_module(original: Any) -> Any:
    """PEFT's LoRA module factory, building fused-aware layers for the modules fusion made."""

    def _create_new_module(lora_config: Any, adapter_name: str, target: nn.Module, **kwargs: Any) -> nn.Module:
        new_module = _fused_lora_layer(lora_config, adapter_name, target, **kwargs)
        if new_module is None:
            created: nn.Module = original(lora_config, adapter_name, target, **kwargs)
            return created
        return new_module

    _create_new_module.__wrapped__ = original  # type: ignore[attr-defined]
    return _create_new_module


def _all_linear(original: Any) -> Any:
    """``target_modules="all-linear"`` counts merged slices as the linear layers they are (not their container)."""

    def _maybe_include_all_linear_layers(peft_config: Any, model: nn.Module) -> Any:
        targets = getattr(peft_config, "target_modules", None)
        shorthand = isinstance(targets, str) and targets.lower() == "all-linear"
        result = original(peft_config, model)
        if shorthand and isinstance(result.target_modules, set):
            wrapped = tuple(f"{name}." for name in tuner_layer_paths(model))
            result.target_modules |= {
                name for name, module in model.named_modules()
                if isinstance(module, MergedSlice) and not name.startswith(wrapped)
            }
            # The merged containers are nn.Linear too (for quantizers); adapters go on the parts instead.
            result.target_modules -= {
                name for name, module in model.named_modules() if isinstance(module, MergedProjection)
            }
        return result

    _maybe_include_all_linear_layers.__wrapped__ = original  # type: ignore[attr-defined]
    return _maybe_include_all_linear_layers


def tuner_layer_paths(model: nn.Module) -> list[str]:
    """Paths of PEFT tuner layers in ``model`` (none when PEFT was never imported)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, tuners.BaseTunerLayer)]


# -- the LoRA layers --------------------------------------------------------------------------
def _fused_lora_layer(lora_config: Any, adapter_name: str, target: nn.Module, **kwargs: Any) -> nn.Module | None:
    """A LoRA layer for a module fusion made, or None to let PEFT decide."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(target, BaseTunerLayer) or kwargs.get("parameter_name") is not None:
        return None
    if isinstance(target, MergedSlice):
        quantized = _quantized(target)
        init = getattr(lora_config, "init_lora_weights", True)
        if quantized is not None and (getattr(lora_config, "use_dora", False) or init not in (True, False, "gaussian")):
            raise ValueError(
                f"LoRA with use_dora={getattr(lora_config, 'use_dora', False)}, init_lora_weights={init!r} on this "
                f"slice of fusion-core's merged projection is not supported once the projection is quantized "
                f"({quantized}): it reads the base weight, which the quantized merged layer does not hold in the "
                "original layout; use plain LoRA (init_lora_weights=True or 'gaussian'), or adapt the unfused model"
            )
        layer_cls: type[nn.Module] = _layer_classes()[nn.Linear]
    elif module_plan(target) is not None:
        plan = _plan(target)
        layer_cls = _layer_class_for(plan.original_class, target)
        if getattr(lora_config, "use_dora", False) and not issubclass(plan.original_class, nn.Linear):
            raise ValueError(
                f"LoRA with use_dora=True is not supported on the fused {plan.original_class.__name__} at "
                f"{plan.path!r} (family {plan.family!r}); use plain LoRA, or load that module unfused"
            )
    elif (names := container_parts(target)) is not None:
        parts = "/".join(names)
        raise ValueError(
            f"this module is fusion-core's merged container of {parts}; LoRA targets the original "
            f"projections by name ({parts}), as on the unfused model"
        )
    else:
        return None
    kwargs.pop("parameter_name", None)
    if getattr(lora_config, "fan_in_fan_out", False) and issubclass(layer_cls, _layer_classes()[nn.Linear]):
        lora_config.fan_in_fan_out = False  # what PEFT's default dispatch does for nn.Linear
    stand_in = _stand_in(target, copy_tensors=False)
    layer = layer_cls(stand_in, adapter_name, config=lora_config, **kwargs)
    layer.base_layer = target
    if _rewrites_base(getattr(lora_config, "init_lora_weights", True)):
        _write_back(target, stand_in)
    return layer


def _rewrites_base(init: Any) -> bool:
    """Whether an adapter initialised with ``init_lora_weights=init`` rewrites the base weight, which must then reach
    the fused tensors: every value but ``True``, ``False`` and ``"gaussian"`` (which draw only the adapter's own
    matrices). PiSSA sets ``base_layer.weight.data`` to the residual, OLoRA subtracts in place, CorDA and LoftQ
    rewrite it too; an initialisation PEFT adds later is written back as well (a copy of the layer's tensors, once)."""
    return not (init is True or init is False or init == "gaussian")


def _init_of(update_layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``init_lora_weights`` of a call ``update_layer(*args, **kwargs)``, whichever way the release passes it:
    inside ``config`` (PEFT 0.18 and later) or as an argument of its own (0.17: ``init_lora_weights``, positional
    or by name)."""
    try:
        arguments = inspect.signature(update_layer).bind_partial(*args, **kwargs).arguments
    except TypeError:
        arguments = dict(kwargs)
    if arguments.get("config") is not None:
        return getattr(arguments["config"], "init_lora_weights", True)
    return arguments.get("init_lora_weights", arguments.get("kwargs", {}).get("init_lora_weights", True))


def _quantized(target: MergedSlice) -> str | None:
    """What quantized the merged projection ``target`` is a slice of (for messages), or None when it is plain.

    LoRA trains on such a slice as on the unfused quantized layer (QLoRA): the base output is the quantized merged
    GEMM's rows and the adapter adds its term; what needs the base weight in the original layout (merging, DoRA,
    initialisations from the weight) is refused.
    """
    container = target.merged.owner
    # A subclass of fusion-core's container is another family's runtime form of it (linear_kernels packs its
    # weight, a torch tensor in an opaque layout): not quantized, its rows are read and written through a dense copy.
    if isinstance(container, MergedProjection) and is_torch_tensor(target.merged.weight):
        return None
    return f"{type(container).__name__} with a {type(target.merged.weight).__name__} weight"


def _layer_class_for(original: type[nn.Module], target: nn.Module) -> type[nn.Module]:
    for base, layer_cls in _layer_classes().items():
        if issubclass(original, base):
            return layer_cls
    raise ValueError(f"LoRA does not support the fused {type(target).__name__} (originally {original.__qualname__})")


_classes: dict[type[nn.Module], type[nn.Module]] = {}


def _layer_classes() -> dict[type[nn.Module], type[nn.Module]]:
    """Original module class -> our LoRA layer class (PEFT's, with fused-aware merging), built once."""
    if not _classes:
        from peft.tuners.lora import layer

        for original, peft_cls in ((nn.Linear, layer.Linear), (nn.Conv3d, layer.Conv3d), (nn.Conv2d, layer.Conv2d),
                                   (nn.Conv1d, layer.Conv1d), (nn.Embedding, layer.Embedding)):
            _classes[original] = _LAYERS[peft_cls.__name__] = type(
                f"Fused{peft_cls.__name__}", (_FusedBaseMixin, peft_cls), {"__module__": __name__}
            )
    return _classes


# Module-level names of the built classes, so that pickle finds them (see __getattr__).
_LAYERS: dict[str, type[nn.Module]] = {}


def __getattr__(name: str) -> Any:
    if name.startswith("Fused"):
        _layer_classes()
        if name[len("Fused"):] in _LAYERS:
            return _LAYERS[name[len("Fused"):]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _FusedBaseMixin:
    """PEFT's LoRA layer whose ``base_layer`` is a fused module.

    Everything that reads or rewrites the base tensors in the original layout (adding an
    adapter, merging, unmerging) runs on a stand-in of the original class; the forward calls
    the fused module itself.
    """

    base_layer: nn.Module

    def update_layer(self, *args: Any, **kwargs: Any) -> Any:
        init = _init_of(super().update_layer, args, kwargs)  # type: ignore[misc]
        with _on_stand_in(self, copy_tensors=_rewrites_base(init)):
            return super().update_layer(*args, **kwargs)  # type: ignore[misc]

    def merge(self, *args: Any, **kwargs: Any) -> None:
        quantized = _quantized(self.base_layer) if isinstance(self.base_layer, MergedSlice) else None
        if quantized is not None:
            raise ValueError(
                f"merging a LoRA adapter into a slice of fusion-core's quantized merged projection ({quantized}) is "
                "not supported: the merged weight would have to be dequantized and quantized again as a whole; "
                "save the adapter and merge it into the unquantized model"
            )
        with _on_stand_in(self, copy_tensors=True):
            super().merge(*args, **kwargs)  # type: ignore[misc]

    def unmerge(self, *args: Any, **kwargs: Any) -> None:
        if isinstance(self.base_layer, MergedSlice) and _quantized(self.base_layer) is not None:
            # Never merged (merge refuses): PEFT's unmerge only warns; nothing may be written back into the slice.
            super().unmerge(*args, **kwargs)  # type: ignore[misc]
            return
        with _on_stand_in(self, copy_tensors=True):
            super().unmerge(*args, **kwargs)  # type: ignore[misc]


@contextmanager
def _on_stand_in(layer: Any, copy_tensors: bool) -> Iterator[None]:
    """Swap ``layer.base_layer`` for a stand-in; with ``copy_tensors``, copy its tensors back after."""
    fused = layer.base_layer
    if not (isinstance(fused, MergedSlice) or module_plan(fused) is not None):
        yield  # the stand-in itself, during PEFT's __init__
        return
    stand_in = _stand_in(fused, copy_tensors)
    layer._modules["base_layer"] = stand_in
    try:
        yield
    finally:
        layer._modules["base_layer"] = fused
    if copy_tensors:
        _write_back(fused, stand_in)


def _stand_in(module: nn.Module, copy_tensors: bool) -> nn.Module:
    """A module of the original class holding ``module``'s tensors in the original layout.

    Views of the fused storage, or copies with ``copy_tensors``. For a slice it is an
    ``nn.Linear``; for a fused module, a shallow copy switched back to its original class.
    """
    def own(tensor: torch.Tensor | None) -> nn.Parameter | None:
        if tensor is None:
            return None
        data = tensor.detach().clone() if copy_tensors else tensor.detach()
        return nn.Parameter(data, requires_grad=False)

    if isinstance(module, MergedSlice):
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = module.in_features, module.out_features
        if _quantized(module) is None:
            weight = module.weight
            # Rows of a packed container come as a view of another tensor class (linear_kernels' dense view): the
            # stand-in holds them as torch's own tensor, which PEFT may replace (``weight.data = ...``); a write
            # reaches the container through _write_back.
            linear.register_parameter("weight", own(weight if is_torch_tensor(weight) else weight.clone()))
        else:  # PEFT reads only the shape, dtype and device of a quantized base (a zero-stride view of one element)
            merged = module.merged.weight
            shape_only = torch.zeros((), dtype=merged.dtype, device=merged.device)
            linear.register_parameter("weight", nn.Parameter(shape_only.expand(module.out_features, module.in_features),
                                                             requires_grad=False))
        linear.register_parameter("bias", own(module.bias))
        linear.register_parameter("bias", own(module.bias))
        return linear
    plan = _plan(module)
    stand_in = copy.copy(module)
    for name in ("_parameters", "_buffers", "_modules"):
        stand_in.__dict__[name] = dict(module.__dict__[name])
    for name, value in module.__dict__.items():
        if name.endswith("_hooks") and isinstance(value, dict):
            stand_in.__dict__[name] = OrderedDict()
    detach_plan(stand_in, ModulePlan)
    stand_in.__class__ = plan.original_class
    with torch.no_grad():
        for bound in plan.transforms:
            fused = [_leaf(module, t.name) for t in bound.targets]
            for spec, tensor in zip(bound.sources, bound.op.inverse(fused, [s.shape for s in bound.sources]),
                                    strict=True):
                owner, name = _parent(stand_in, spec.name)
                owner._parameters[name] = own(tensor)
    return stand_in


def _write_back(fused: nn.Module, stand_in: nn.Module) -> None:
    """Copy the stand-in's (possibly merged) tensors into the fused storage, in the fused layout."""
    with torch.no_grad():
        if isinstance(fused, MergedSlice):
            weight = fused.merged.weight
            if weight.layout == torch.strided:
                fused.weight.copy_(_leaf(stand_in, "weight"))
            else:
                # The container is fused itself (linear_kernels holds its weight packed): its rows exist only in the
                # original layout, so they are written there and the container's own plan converts them back.
                container = fused.merged.owner
                holder = _stand_in(container, copy_tensors=True)
                fused.merged.rows(_leaf(holder, "weight"), fused.index).copy_(_leaf(stand_in, "weight"))
                _write_back(container, holder)
            if fused.bias is not None:
                fused.bias.copy_(_leaf(stand_in, "bias"))
            return
        for bound in _plan(fused).transforms:
            sources = [_leaf(stand_in, s.name) for s in bound.sources]
            for spec, tensor in zip(bound.targets, bound.op.forward(sources), strict=True):
                _leaf(fused, spec.name).copy_(tensor)


def _parent(module: nn.Module, leaf: str) -> tuple[nn.Module, str]:
    path, _, name = leaf.rpartition(".")
    return (module.get_submodule(path) if path else module), name


def _leaf(module: nn.Module, leaf: str) -> torch.Tensor:
    owner, name = _parent(module, leaf)
    param = owner._parameters.get(name)
    if param is not None:
        return param
    buffer = owner._buffers.get(name)
    if buffer is None:
        raise AttributeError(f"{type(module).__name__} has no tensor {leaf!r}")
    return buffer


def _plan(module: nn.Module) -> ModulePlan:
    plan = module_plan(module)
    if plan is None:
        raise TypeError(f"{type(module).__name__} is not a module fusion-core fused")
    return plan
