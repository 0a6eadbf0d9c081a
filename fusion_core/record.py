"""The on-disk record of a fused checkpoint: what fusion-core applied, and which layout the tensors are in.

``config.json`` gets a ``"fusion_core"`` key (``{"fusion_config": {...}}``). transformers stores
unknown keys as plain attributes and never acts on this one, so the directory loads with plain
transformers 4.57 and 5.x silently and unfused; :func:`fusion_core.from_pretrained` reuses it.
The top-level ``fusion_config`` key, which transformers 5.x *does* act on, is read as a fallback
but never written, and is stripped from the config before transformers sees it.

A fused-layout checkpoint (``save_pretrained(..., save_original_format=False)`` or ``fusion
convert --to fused``) holds ``fused_config.json`` instead of ``config.json``, whose record adds
``"layout": "fused"``: plain transformers refuses the directory (no ``config.json``) instead of
loading mis-shaped tensors, and fusion-core loads it without any conversion.

This module is the only one that knows these names; the adapter, the commands and ``fusion
convert`` read and write the record through it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from torch import nn

from fusion_core.compat import transformers as compat
from fusion_core.errors import CheckpointError

RECORD_KEY = "fusion_core"
LEGACY_KEY = "fusion_config"
CONFIG_NAME = "config.json"
FUSED_CONFIG_NAME = "fused_config.json"

_HUB_KWARGS = (
    "revision", "cache_dir", "force_download", "local_files_only", "token", "subfolder", "proxies",
    "trust_remote_code", "code_revision",
)


def is_fused_layout_dir(path: Path) -> bool:
    """A local directory holding a fused-layout checkpoint (``fused_config.json`` and no ``config.json``)."""
    return path.is_dir() and (path / FUSED_CONFIG_NAME).is_file() and not (path / CONFIG_NAME).exists()


def load_config(model_cls: Any, name_or_path: str | Path | None, fused_dir: bool, kwargs: dict[str, Any]) -> Any:
    """The transformers config of a checkpoint, with the overrides in ``kwargs`` applied as ``from_pretrained`` does.

    Pops from ``kwargs`` ``config`` (the caller's) and every argument the config took as an
    attribute (``num_labels``, ``id2label``, ``output_hidden_states``, ``rope_scaling``, ...), so
    ``kwargs`` is left with what transformers passes on along with the config it loaded:
    ``from_pretrained(path, config=<this config>, **kwargs)`` then builds what the plain load
    builds. The split is transformers' own (:func:`fusion_core.compat.transformers.config_overrides`):
    the config class's ``from_pretrained(..., return_unused_kwargs=True)``, or ``from_dict`` for a
    fused-layout directory's ``fused_config.json``. A config object given as ``config`` is copied
    and takes no override: transformers then passes every other argument to the model's ``__init__``.
    """
    config = kwargs.pop("config", None)
    if config is not None and not isinstance(config, (str, Path)):
        return copy.deepcopy(config)
    from transformers import CONFIG_MAPPING, AutoConfig

    config_class: Any = getattr(model_cls, "config_class", None)
    concrete = isinstance(model_cls, type) and issubclass(model_cls, nn.Module) and config_class is not None
    overrides, passed_on = compat.config_overrides(kwargs, auto=not concrete)
    if fused_dir and name_or_path is not None:
        path = Path(name_or_path) / FUSED_CONFIG_NAME
        data = json.loads(path.read_text())
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise CheckpointError(f"{path} has no model_type")
        if not concrete and model_type not in CONFIG_MAPPING:
            raise CheckpointError(f"{path}: transformers has no config class for model_type {model_type!r}")
        data.pop("transformers_version", None)
        config, unused = (config_class if concrete else CONFIG_MAPPING[model_type]).from_dict(
            data, return_unused_kwargs=True, **overrides
        )
    else:
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        # An Auto class reads the config from the checkpoint whatever path ``config`` names; a model class from it.
        source = config if concrete and config is not None else name_or_path
        config, unused = (config_class if concrete else AutoConfig).from_pretrained(
            source, return_unused_kwargs=True, **hub, **overrides
        )
    for name in overrides.keys() - unused.keys() - passed_on:
        del kwargs[name]
    return config


def pop_stored_fusion_config(config: Any) -> dict[str, Any] | None:
    """Remove fusion settings from ``config`` so transformers never acts on them; return the stored
    ``fusion_config`` (the record's, else the legacy top-level key's), or None."""
    record = getattr(config, RECORD_KEY, None)
    legacy = getattr(config, LEGACY_KEY, None)
    for key in (RECORD_KEY, LEGACY_KEY):
        if hasattr(config, key):
            delattr(config, key)
    if record is not None and not isinstance(record, dict):
        raise CheckpointError(f"config key {RECORD_KEY!r} must be an object, got {record!r}")
    stored: dict[str, Any] | None = (record or {}).get("fusion_config", legacy)
    return stored


def attach_record(config: Any, fusion_config: dict[str, Any]) -> None:
    """Record on a loaded model's config what was applied; ``save_pretrained`` writes it to ``config.json``."""
    setattr(config, RECORD_KEY, {"fusion_config": fusion_config})


def write_config(directory: Path, data: dict[str, Any], fusion_config: dict[str, Any] | None, fused: bool) -> Path:
    """Write a checkpoint's config with the record: ``fused_config.json`` for the fused layout, else ``config.json``.

    ``fusion_config`` replaces the record's (None keeps the one ``data`` holds); the legacy key is dropped.
    """
    data = dict(data)
    data.pop(LEGACY_KEY, None)
    record = dict(data.get(RECORD_KEY) or {})
    if fusion_config is not None:
        record["fusion_config"] = fusion_config
    record.pop("layout", None)
    if fused:
        record["layout"] = "fused"
    data[RECORD_KEY] = record
    path = directory / (FUSED_CONFIG_NAME if fused else CONFIG_NAME)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def names_fusion(name_or_path: str | Path | None, kwargs: dict[str, Any]) -> bool:
    """Whether a checkpoint's config stores fusion settings (the record, or the legacy key), read
    without loading a model; ``kwargs`` are the load's (``config``, ``subfolder``, hub arguments).

    A config object passed as ``config`` answers for itself. A checkpoint this cannot read
    answers False: the plain load that follows reports the problem in transformers' own words.
    """
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, Path)):
        return any(getattr(config, key, None) is not None for key in (RECORD_KEY, LEGACY_KEY))
    source = config if config is not None else name_or_path
    if source is None:
        return False
    local = Path(source) / kwargs.get("subfolder", "")
    if local.is_dir():
        if is_fused_layout_dir(local):
            return True
        try:
            data = json.loads((local / CONFIG_NAME).read_text())
        except (OSError, ValueError):
            return False
    else:
        from transformers import PretrainedConfig

        try:
            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            data, _ = PretrainedConfig.get_config_dict(str(source), **hub)
        except Exception:  # not a checkpoint transformers can find: its own load says why
            return False
    return isinstance(data, dict) and any(data.get(key) is not None for key in (RECORD_KEY, LEGACY_KEY))
