"""The transformers adapter: fused ``from_pretrained`` and original-format ``save_pretrained``.

Loading route (measured in FINDINGS.md as the cheapest and cleanest on transformers 4.57 and
5.x): selected instances are built with their original ``__init__`` and switched to their fused
class, so transformers loads the *original* checkpoint into them with its own machinery
(dtype, device maps, sharding, memory mapping) and reports nothing missing. Right after
loading, each fused instance converts its tensors in place (a reshape is a view of the loaded
storage) and presents the original layout again to ``state_dict()``, which is what every
``save_pretrained`` writes.

Where fusion-core records what it applied: ``config.json`` gets a ``"fusion_core"`` key
(``{"fusion_config": {...}}``). transformers stores unknown keys as plain attributes and never
acts on this one, so the directory loads with plain transformers 4.57 and 5.x silently and
unfused; :func:`from_pretrained` reuses it. The top-level ``fusion_config`` key, which
transformers 5.x *does* act on, is read as a fallback but never written, and is stripped from
the config before transformers sees it.

A fused-layout save (``save_original_format=False``) writes ``fused_config.json`` instead of
``config.json``: plain transformers refuses the directory (no ``config.json``) instead of
loading mis-shaped tensors, and :func:`from_pretrained` loads it without any conversion.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from torch import nn

from fusion_core.checkpoint import (
    FLOAT_DTYPES,
    KeyMatcher,
    TensorInfo,
    atomic_directory,
    read_checkpoint_index,
)
from fusion_core.config import parse_fusion_config
from fusion_core.discovery import Discovery, discover
from fusion_core.errors import CheckpointError, FusionLoadError, SaveError
from fusion_core.layout import convert_to_fused, finalize, fused_layout, module_plan
from fusion_core.patching import BuildScope, class_patch_scope
from fusion_core.plugins import get_registry
from fusion_core.transforms import FusionPlan, ModulePlan

RECORD_KEY = "fusion_core"
LEGACY_KEY = "fusion_config"
CONFIG_NAME = "config.json"
FUSED_CONFIG_NAME = "fused_config.json"
PLAN_ATTRIBUTE = "_fusion_plan"

# transformers' loading is not thread-safe (4.57 patches nn.Module.register_parameter and 5.x
# sets the global default dtype while a model is built), so the loads fusion-core makes run
# one at a time. Class patching itself is per thread (see patching.py).
LOAD_LOCK = threading.RLock()

_HUB_KWARGS = (
    "revision", "cache_dir", "force_download", "local_files_only", "token", "subfolder", "proxies",
    "trust_remote_code", "code_revision",
)


def get_fusion_plan(model: nn.Module) -> FusionPlan | None:
    """The :class:`FusionPlan` a model was loaded with, or None for a model fusion did not touch."""
    return model.__dict__.get(PLAN_ATTRIBUTE)


def is_fused_layout_dir(path: Path) -> bool:
    return path.is_dir() and (path / FUSED_CONFIG_NAME).is_file() and not (path / CONFIG_NAME).exists()


def load_config(model_cls: Any, name_or_path: str | Path, fused_dir: bool, kwargs: dict[str, Any]) -> Any:
    config = kwargs.pop("config", None)
    if config is not None and not isinstance(config, (str, Path)):
        return copy.deepcopy(config)
    from transformers import AutoConfig

    if fused_dir:
        data = json.loads((Path(name_or_path) / FUSED_CONFIG_NAME).read_text())
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise CheckpointError(f"{Path(name_or_path) / FUSED_CONFIG_NAME} has no model_type")
        data.pop("transformers_version", None)
        return AutoConfig.for_model(model_type, **data)
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    source = config if config is not None else name_or_path
    config_class = getattr(model_cls, "config_class", None)
    if isinstance(model_cls, type) and issubclass(model_cls, nn.Module) and config_class is not None:
        return config_class.from_pretrained(source, **hub)
    return AutoConfig.from_pretrained(source, **hub)


def pop_fusion_record(config: Any) -> tuple[dict[str, Any] | None, Any]:
    """Remove fusion settings from ``config`` so transformers never acts on them; return them."""
    record = getattr(config, RECORD_KEY, None)
    legacy = getattr(config, LEGACY_KEY, None)
    for key in (RECORD_KEY, LEGACY_KEY):
        if hasattr(config, key):
            delattr(config, key)
    if record is not None and not isinstance(record, dict):
        raise CheckpointError(f"config key {RECORD_KEY!r} must be an object, got {record!r}")
    return record, legacy


def from_pretrained(
    model_cls: Any,
    name_or_path: str | Path,
    fusion_config: Any = None,
    **transformers_kwargs: Any,
) -> Any:
    """Load a model with the families of ``fusion_config`` fused, from its original checkpoint.

    ``model_cls`` is a transformers Auto class or a concrete ``PreTrainedModel`` subclass;
    ``transformers_kwargs`` go to its ``from_pretrained`` (``dtype``, ``device_map``, ...).
    ``fusion_config`` (a mapping or :class:`FusionConfig`) wins over the one stored in the
    checkpoint's config; with neither, or with no family enabled, this is a plain load.

    Raises ``pydantic.ValidationError`` for a bad ``fusion_config``, and a
    :class:`~fusion_core.errors.FusionError` naming the key, module and family for anything
    that would leave a fused parameter not loaded from the checkpoint.
    """
    kwargs = dict(transformers_kwargs)
    want_info = bool(kwargs.pop("output_loading_info", False))
    registry = get_registry()
    # An explicit fusion_config is checked first, before any file is read.
    explicit = parse_fusion_config(fusion_config, registry) if fusion_config is not None else None
    local = Path(name_or_path)
    fused_dir = is_fused_layout_dir(local)
    config = load_config(model_cls, name_or_path, fused_dir, kwargs)
    record, legacy = pop_fusion_record(config)
    stored = (record or {}).get("fusion_config", legacy)
    fusion = explicit if explicit is not None else parse_fusion_config(stored or {}, registry)
    if fused_dir and fusion.model_dump() != parse_fusion_config(stored or {}, registry).model_dump():
        raise CheckpointError(
            f"{name_or_path} holds a fused-layout checkpoint made with fusion_config={stored}; it can only be "
            f"loaded with that fusion_config, not {fusion.model_dump()} (convert it to the original layout first)"
        )
    if not fusion.enabled_names():
        with LOAD_LOCK:
            return model_cls.from_pretrained(name_or_path, config=config, output_loading_info=want_info, **kwargs)
    with LOAD_LOCK:
        discovery = discover(model_cls, config, fusion, registry)
    if local.is_dir():
        check_checkpoint(local / kwargs.get("subfolder", ""), discovery.plan, fused_dir)
    on_built = convert_to_fused if fused_dir else None
    with LOAD_LOCK, class_patch_scope(discovery.routes, on_built=on_built) as scope:
        model, info = model_cls.from_pretrained(name_or_path, config=config, output_loading_info=True, **kwargs)
    _verify_build(model, scope, discovery)
    _verify_loading_info(info, discovery.plan, fused_dir)
    # Under the lock too: while another load runs, 4.57's init_empty_weights sends every parameter
    # registered in *any* thread to the meta device, the fused ones created here included.
    with LOAD_LOCK:
        _convert_built(scope, fused_dir, registry)
    setattr(model.config, RECORD_KEY, {"fusion_config": fusion.model_dump()})
    model.__dict__[PLAN_ATTRIBUTE] = discovery.plan
    return (model, info) if want_info else model


def _convert_built(scope: BuildScope, fused_dir: bool, registry: Any) -> None:
    """Bring every loaded fused instance into its fused layout and let it finalize; errors name the family."""
    verified: set[tuple[object, ...]] = set()
    for module, plan in scope.built:
        source = registry.get(plan.family).source if plan.family in registry else "unknown source"
        try:
            if not fused_dir:
                unloaded = _meta_tensors(module)
                if unloaded:
                    raise FusionLoadError(
                        f"family {plan.family!r}, module {plan.path!r}: tensors {unloaded} are on the meta device "
                        "after loading (offloaded to disk?); fused modules must be loaded onto a real device"
                    )
                convert_to_fused(module, plan, verified)
            finalize(module, plan)
        except FusionLoadError as exc:
            raise FusionLoadError(f"{exc} [{source}]") from None
        except Exception as exc:  # the family's fusion_finalize or op, on real data
            raise FusionLoadError(
                f"family {plan.family!r} ({source}), module {plan.path!r}: fusing the loaded "
                f"{plan.original_class.__qualname__} failed: {type(exc).__name__}: {exc}"
            ) from exc
        on_meta = _meta_tensors(module)
        if on_meta:
            raise FusionLoadError(
                f"family {plan.family!r} ({source}), module {plan.path!r}: tensors {on_meta} are on the meta device "
                "after fusing (a transformers load in another thread patched parameter registration?)"
            )


def check_checkpoint(directory: Path, plan: FusionPlan, fused_dir: bool) -> None:
    """Check the plan against the checkpoint's headers before transformers reads any data.

    Every fused tensor found in the checkpoint must have the planned shape and a floating dtype.
    A tensor that is not found under a recognisable name is left to transformers' loading report,
    which :func:`_verify_loading_info` turns into an error all the same: transformers 5.x renames
    and converts keys inside the path for some models (VideoMAE's ``q_bias`` becomes
    ``query.bias``), so absence from the headers alone does not prove a tensor is missing.
    """
    tensors = read_checkpoint_index(directory)
    matcher = KeyMatcher(tensors)
    for module in plan.modules:
        planned = _planned_tensors(module, fused_dir)
        found = {model_key: matcher.lookup(model_key) for model_key in planned}
        where = f"family {module.family!r}, module {module.path!r}"
        prefixes: set[str] = set()
        for model_key, (leaf, shape) in planned.items():
            ckpt_key = found[model_key]
            if ckpt_key is None:
                continue
            info = tensors[ckpt_key]
            prefixes.add(ckpt_key[: len(ckpt_key) - len(leaf)])
            if shape is not None and info.shape != shape:
                raise CheckpointError(
                    f"{where}: checkpoint tensor {ckpt_key!r} ({info.file}) has shape {list(info.shape)}, "
                    f"expected {list(shape)}"
                )
            if info.dtype not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"{where}: checkpoint tensor {ckpt_key!r} ({info.file}) is stored as {info.dtype}; "
                    "a floating-point dtype is expected"
                )
        if all(found.values()):  # names match one to one: anything else under the module is extra
            _check_extra(tensors.values(), prefixes, {leaf for leaf, _ in planned.values()}, module, directory)


def _planned_tensors(module: ModulePlan, fused_dir: bool) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Model key -> (module-relative leaf, expected shape or None) of every tensor of a fused module."""
    moved = {s.name for t in module.transforms for s in t.sources}
    planned: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for leaf in module.original_leaves:
        if leaf not in moved:
            planned[module.full_key(leaf)] = (leaf, None)
    for bound in module.transforms:
        for spec in bound.targets if fused_dir else bound.sources:
            planned[module.full_key(spec.name)] = (spec.name, spec.shape)
    return planned


def _check_extra(
    tensors: Iterable[TensorInfo], prefixes: set[str], leaves: set[str], module: ModulePlan, directory: Path
) -> None:
    for info in tensors:
        for prefix in prefixes:
            if info.key.startswith(prefix) and info.key[len(prefix):] not in leaves:
                raise CheckpointError(
                    f"family {module.family!r}, module {module.path!r}: the checkpoint in {directory} has an "
                    f"unexpected tensor {info.key!r} ({info.file}) that the fused module cannot hold"
                )


def _verify_build(model: nn.Module, scope: BuildScope, discovery: Discovery) -> None:
    paths = {id(m): name for name, m in model.named_modules()}
    built_paths = set()
    for module, plan in scope.built:
        actual = paths.get(id(module))
        if actual != plan.path:
            raise FusionLoadError(
                f"family {plan.family!r}: module planned at {plan.path!r} was built at {actual!r}; the model "
                f"constructs {plan.original_class.__qualname__} instances in an order discovery could not predict"
            )
        built_paths.add(actual)
    missing = [m for m in discovery.plan.modules if m.path not in built_paths]
    if missing or scope.surplus:
        raise FusionLoadError(
            f"the model built by transformers differs from the one discovery planned: not fused "
            f"{[m.path for m in missing]}, unplanned instances {[c.__qualname__ for c in scope.surplus]}"
        )


def _keys(info: dict[str, Any], name: str) -> list[str]:
    return [k[0] if isinstance(k, tuple) else str(k) for k in info.get(name) or ()]


def _verify_loading_info(info: dict[str, Any], plan: FusionPlan, fused_dir: bool) -> None:
    """No silent weights: any missing, unexpected or mismatched key of a fused module raises."""
    owners: dict[str, ModulePlan] = {}
    for module in plan.modules:
        for key in _planned_tensors(module, fused_dir):
            owners[key] = module
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        for key in _keys(info, kind):
            for model_key, module in owners.items():
                if key == model_key or model_key.endswith("." + key) or key.endswith("." + model_key):
                    raise FusionLoadError(
                        f"family {module.family!r}, module {module.path!r}: transformers reported "
                        f"{kind.replace('_', ' ')[:-1]} {key!r}; a fused module never keeps an unloaded weight"
                    )


def _meta_tensors(module: nn.Module) -> list[str]:
    """Names of the module's parameters and buffers that hold no data (meta device)."""
    return [name for name, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta]


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    save_original_format: bool = True,
    **transformers_kwargs: Any,
) -> None:
    """Save ``model`` atomically: in the original checkpoint layout by default.

    With ``save_original_format=True`` the directory is what the original model would have
    written (same tensor names, shapes, dtypes and bytes) plus a ``"fusion_core"`` record in
    ``config.json`` that only fusion-core reads. With ``False`` it keeps the fused layout and
    writes ``fused_config.json`` instead of ``config.json`` (see the module docs). Either the
    whole new directory appears, or the old one stays as it was.
    """
    if transformers_kwargs.get("safe_serialization", True) is False:
        raise SaveError("fusion-core writes safetensors only; safe_serialization=False is not supported")
    fused = get_fusion_plan(model) is not None or any(module_plan(m) is not None for m in model.modules())
    if not save_original_format and not fused:
        raise SaveError("save_original_format=False needs a fused model; this one has no fused module")
    target = Path(directory)
    with atomic_directory(target) as staging:
        with nullcontext() if save_original_format else fused_layout():
            model.save_pretrained(staging, **transformers_kwargs)
        if not save_original_format:
            config_path = staging / CONFIG_NAME
            data = json.loads(config_path.read_text())
            data.setdefault(RECORD_KEY, {})["layout"] = "fused"
            (staging / FUSED_CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            config_path.unlink()
