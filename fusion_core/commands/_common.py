"""Shared by the subcommands: resolving a checkpoint directory, the fusion_config, progress bars."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fusion_core.config import FusionConfig, parse_fusion_config
from fusion_core.errors import CheckpointError, FusionError
from fusion_core.record import (
    CONFIG_NAME,
    FUSED_CONFIG_NAME,
    is_fused_layout_dir,
    load_config,
    pop_stored_fusion_config,
)

T = TypeVar("T")


class UsageError(FusionError, ValueError):
    """A command-line argument is wrong (exit status 2)."""


@dataclass
class Checkpoint:
    """A local checkpoint directory, resolved without reading a weight."""

    directory: Path
    fused_layout: bool
    model_cls: Any
    config: Any
    """The transformers config, with fusion-core's record removed (what transformers may see)."""
    stored_fusion_config: dict[str, Any] | None
    raw_config: dict[str, Any]

    @property
    def layout(self) -> str:
        return "fused" if self.fused_layout else "original"


def resolve_checkpoint(directory: str | Path, model_class: str | None = None) -> Checkpoint:
    """Read ``config.json`` (or ``fused_config.json``) and pick the model class it names."""
    import transformers

    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (fusion commands work on local checkpoints)")
    fused = is_fused_layout_dir(path)
    config_file = path / (FUSED_CONFIG_NAME if fused else CONFIG_NAME)
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_NAME} (or {FUSED_CONFIG_NAME}) found")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON: {exc}") from None
    names = [model_class] if model_class else list(raw.get("architectures") or [])
    if not names:
        names = _class_for_model_type(raw.get("model_type"))
    if not names:
        raise UsageError(f"{config_file} names no architecture; pass --model-class (e.g. AutoModel)")
    model_cls = getattr(transformers, names[0], None)
    if model_cls is None:
        raise UsageError(
            f"transformers {transformers.__version__} has no class {names[0]!r} (from "
            f"{'--model-class' if model_class else config_file.name + ' architectures'})"
        )
    config = load_config(model_cls, path, fused, {})
    return Checkpoint(path, fused, model_cls, config, pop_stored_fusion_config(config), raw)


# Task classes tried, in order, for a config.json without "architectures" (transformers 4.57 omits it
# for some composite models built with from_config).
_AUTO_MAPPINGS = (
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def _class_for_model_type(model_type: str | None) -> list[str]:
    from transformers.models.auto import modeling_auto

    for mapping in _AUTO_MAPPINGS:
        name = getattr(modeling_auto, mapping, {}).get(model_type or "")
        if isinstance(name, str):
            return [name]
    return []


def fusion_config_from_args(
    families: str | None,
    options: str | None,
    config_file: str | None,
    checkpoint: Checkpoint | None = None,
) -> FusionConfig:
    """``-f a,b`` + ``--options JSON`` + ``--config FILE``, else the checkpoint's stored fusion_config.

    ``--options`` maps family names to option mappings and enables those families too;
    ``--config`` holds a whole ``fusion_config`` mapping (or ``{"fusion_config": {...}}``).
    """
    value: dict[str, Any] = {}
    if config_file:
        try:
            data = json.loads(Path(config_file).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"--config {config_file}: {exc}") from None
        if isinstance(data, Mapping) and isinstance(data.get("fusion_config"), Mapping):
            data = data["fusion_config"]
        if not isinstance(data, Mapping):
            raise UsageError(f"--config {config_file}: expected a JSON object of family name -> setting")
        value.update(data)
    for name in (families or "").split(","):
        if name.strip():
            value.setdefault(name.strip(), True)
    if options:
        try:
            extra = json.loads(options)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--options is not valid JSON: {exc}") from None
        if not isinstance(extra, Mapping):
            raise UsageError('--options must be a JSON object: {"family": {"option": value}}')
        value.update(extra)
    if not value and checkpoint is not None and checkpoint.stored_fusion_config:
        value = dict(checkpoint.stored_fusion_config)
    if not value:
        raise UsageError("no fusion family given: use -f FAMILY[,FAMILY] (see `fusion list`)")
    fusion = parse_fusion_config(value)
    if not fusion.enabled_names():
        raise UsageError(f"fusion_config {fusion.model_dump()} enables no family")
    return fusion


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "", enabled: bool | None = None,
             unit: str = "it") -> Iterator[T]:
    """A tqdm bar on stderr; ``enabled=None`` shows it only when stderr is a terminal."""
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    yield from tqdm(iterable, total=total, desc=desc, disable=not show, file=sys.stderr, unit=unit,
                    leave=False, dynamic_ncols=True)
