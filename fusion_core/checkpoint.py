"""Checkpoint files on disk: safetensors headers, shard indexes, key matching, and atomic directory writes.

fusion-core reads only safetensors (it never unpickles a file) and only headers here: enough to
check a fused load's plan against the checkpoint (every key present, with the planned shape and
a usable dtype, :func:`check_checkpoint`) before transformers reads any tensor data. Model keys
are matched to checkpoint keys by one rule, :class:`KeyMatcher` (the renaming transformers itself
loads with), everywhere a key is looked up.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import stat
import struct
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fusion_core.compat.transformers import LoadedNames
from fusion_core.errors import CheckpointError, SaveError
from fusion_core.transforms import FusionPlan, ModulePlan

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str


_header_cache: dict[Path, tuple[tuple[int, int, int], dict[str, TensorInfo]]] = {}
_header_cache_lock = threading.Lock()


def clear_header_cache() -> None:
    """Forget every parsed safetensors header (the next read parses the file again)."""
    with _header_cache_lock:
        _header_cache.clear()


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header; raise :class:`CheckpointError` naming the file.

    Parsed headers are kept per file while its inode, size and modification time stay the same,
    so a repeated load of the same checkpoint does not read every shard header again.
    """
    try:
        status = path.stat()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint file: {exc}") from exc
    stamp = (status.st_ino, status.st_size, status.st_mtime_ns)
    key = path.absolute()
    with _header_cache_lock:
        cached = _header_cache.get(key)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    infos = _parse_safetensors_header(path)
    with _header_cache_lock:
        _header_cache[key] = (stamp, infos)
    return infos


def _parse_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {len(prefix)} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors header (claims {header_len} bytes of {size})")
            header = json.loads(handle.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read checkpoint file: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    data_len = size - 8 - header_len
    infos: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {key!r}") from None
        if not (
            isinstance(dtype, str)
            and all(type(d) is int and d >= 0 for d in shape)
            and type(start) is int
            and type(end) is int
        ):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {key!r}: {entry!r}")
        if not (0 <= start <= end <= data_len):
            raise CheckpointError(
                f"{path}: tensor {key!r} lies at bytes {start}-{end} but the file holds {data_len} data bytes "
                "(truncated or corrupt file)"
            )
        itemsize = DTYPE_SIZES.get(dtype)
        if itemsize is not None and end - start != itemsize * math.prod(shape):
            raise CheckpointError(
                f"{path}: tensor {key!r} is {dtype} {list(shape)} ({itemsize * math.prod(shape)} bytes) but its data "
                f"offsets span {end - start} bytes (corrupt header)"
            )
        infos[key] = TensorInfo(key, dtype, shape, path.name)
    return infos


def with_variant(name: str, variant: str | None) -> str:
    """A weights file's name for ``from_pretrained(..., variant=...)``, as transformers names it.

    ``model.safetensors`` -> ``model.fp16.safetensors``, ``model.safetensors.index.json`` ->
    ``model.safetensors.index.fp16.json`` (the variant goes before the last suffix).
    """
    if variant is None:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{variant}.{suffix}"


def read_checkpoint_index(directory: Path, variant: str | None = None) -> dict[str, TensorInfo]:
    """Every tensor of a local safetensors checkpoint (single file or sharded), from headers only.

    ``variant`` reads the files ``from_pretrained(..., variant=variant)`` reads (:func:`with_variant`)."""
    directory = Path(directory)
    index_path = directory / with_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
    single = directory / with_variant(SAFE_WEIGHTS_NAME, variant)
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: unreadable shard index: {exc}") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: 'weight_map' is not an object")
        tensors: dict[str, TensorInfo] = {}
        headers: dict[str, dict[str, TensorInfo]] = {}
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or os.sep in shard or shard.startswith(".."):
                raise CheckpointError(f"{index_path}: invalid shard name {shard!r}")
            shard_path = directory / shard
            if not shard_path.is_file():
                keys = sorted(k for k, v in weight_map.items() if v == shard)
                raise CheckpointError(f"{index_path}: shard {shard!r} is missing (holds {keys[:3]}...)")
            headers[shard] = read_safetensors_header(shard_path)
        for key, shard in weight_map.items():
            info = headers[shard].get(key)
            if info is None:
                raise CheckpointError(
                    f"{index_path}: key {key!r} is indexed in shard {shard!r}, which does not hold it"
                )
            tensors[key] = info
        return tensors
    if single.is_file():
        return dict(read_safetensors_header(single))
    if any((directory / name).is_file() for name in PICKLE_WEIGHTS_NAMES):
        raise CheckpointError(
            f"{directory}: only a pickle checkpoint (pytorch_model.bin) is present. fusion-core never unpickles "
            "files; convert it to safetensors first (load it with plain transformers you trust, then "
            "save_pretrained)"
        )
    raise CheckpointError(f"{directory}: no {single.name} or {index_path.name} found")


class KeyMatcher:
    """Finds the checkpoint key of a model key by the rule transformers loads with, never by a shared suffix.

    ``names`` (:func:`fusion_core.compat.transformers.loaded_names` of the model) renames each
    checkpoint key the way transformers does when it loads (its base-model prefix handling, its
    key mapping and weight conversions: ``visual.`` -> ``model.visual.``, ``q_layernorm`` ->
    ``q_norm``); without it, keys match as they are. A model key matches the one checkpoint key
    that transformers loads into it, so two towers of a model that share a ``layers.0.self_attn``
    suffix are never paired with each other's tensors. Built once per checkpoint.
    """

    def __init__(
        self,
        checkpoint_keys: Iterable[str],
        names: LoadedNames | None = None,
        key_mapping: Mapping[str, str] | None = None,
    ) -> None:
        keys = list(checkpoint_keys)
        #: checkpoint key -> the model key transformers loads it into (keys it merges, splits or drops are absent)
        self.renamed = names.rename(keys, key_mapping) if names is not None else {key: key for key in keys}
        self._by_model_key = {model_key: key for key, model_key in self.renamed.items()}

    def lookup(self, model_key: str) -> str | None:
        return self._by_model_key.get(model_key)

    def module_prefix(self, module: ModulePlan, leaves: Iterable[str]) -> str | None:
        """The checkpoint's name prefix of ``module`` (``visual.patch_embed.``), found through the first of its
        module-relative ``leaves`` the checkpoint holds under the same leaf name; None when it holds none."""
        for leaf in leaves:
            key = self.lookup(module.full_key(leaf))
            if key is not None and key.endswith(leaf):
                return key[: len(key) - len(leaf)]
        return None

    def keys_under(self, paths: Iterable[str]) -> dict[str, list[tuple[str, str]]]:
        """Per module path of ``paths``: (model key, checkpoint key) of every checkpoint tensor loaded inside it."""
        wanted = set(paths)
        found: dict[str, list[tuple[str, str]]] = {path: [] for path in wanted}
        for key, model_key in self.renamed.items():
            parts = model_key.split(".")
            for i in range(len(parts)):
                path = ".".join(parts[:i])
                if path in wanted:
                    found[path].append((model_key, key))
        return found


def match_keys(
    model_keys: Iterable[str], checkpoint_keys: Iterable[str], names: LoadedNames | None = None
) -> dict[str, str]:
    """Map each model key to its checkpoint key (see :class:`KeyMatcher`); unmatched keys are absent."""
    matcher = KeyMatcher(checkpoint_keys, names)
    found = {key: matcher.lookup(key) for key in model_keys}
    return {key: value for key, value in found.items() if value is not None}


def planned_tensors(module: ModulePlan, fused_layout: bool) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Model key -> (module-relative leaf, expected shape or None) of every tensor a fused module loads.

    Leaves the transforms do not touch keep their names and shapes; the transformed ones are the
    sources in an original-layout checkpoint and the targets in a fused-layout one.
    """
    moved = {s.name for t in module.transforms for s in t.sources}
    planned: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for leaf in module.original_leaves:
        if leaf not in moved:
            planned[module.full_key(leaf)] = (leaf, None)
    for bound in module.transforms:
        for spec in bound.targets if fused_layout else bound.sources:
            planned[module.full_key(spec.name)] = (spec.name, spec.shape)
    return planned


def check_checkpoint(
    directory: Path,
    tensors: Mapping[str, TensorInfo],
    plan: FusionPlan,
    fused_layout: bool,
    pre_quantized: bool = False,
    names: LoadedNames | None = None,
    key_mapping: Mapping[str, str] | None = None,
) -> None:
    """Check the plan against the checkpoint's headers before transformers reads any data.

    ``tensors`` is the checkpoint in ``directory`` as :func:`read_checkpoint_index` reads it (the caller reads it
    once, for this check and its own use).

    Every tensor the plan moves that is found in the checkpoint must have the planned shape and a
    floating dtype; a fused module's other tensors (a root's integer buffers) load as they would plainly.
    Checkpoint keys are matched to model keys as transformers loads them (``names``, ``key_mapping``:
    see :class:`KeyMatcher`).
    A ``pre_quantized`` checkpoint (its config names the quantizer that wrote it) stores quantized
    layers in the quantizer's own form: integer tensors of other shapes (bitsandbytes packs two
    4-bit codes per byte) beside tensors of its own (``SCB``, ``weight.absmax``). Those are the
    quantizer's to check while transformers loads them, and the conversion checks what it gets;
    here only floating-point tensors are held to the plan's shapes.
    A tensor that is not found under a recognisable name is left to transformers' loading report,
    which the adapter turns into an error all the same: transformers converts some keys while it
    loads (5.x splits a stored ``qkv_proj`` into ``q_proj``/``k_proj``/``v_proj`` for some models),
    so absence from the headers alone does not prove a tensor is missing.
    """
    matcher = KeyMatcher(tensors, names, key_mapping)
    inside = matcher.keys_under(m.path for m in plan.modules) if not pre_quantized else {}
    for module in plan.modules:
        planned = planned_tensors(module, fused_layout)
        found = {model_key: matcher.lookup(model_key) for model_key in planned}
        where = f"family {module.family!r}, module {module.path!r}"
        for model_key, (_leaf, shape) in planned.items():
            ckpt_key = found[model_key]
            if ckpt_key is None:
                continue
            info = tensors[ckpt_key]
            if pre_quantized and info.dtype not in FLOAT_DTYPES:
                continue
            if shape is not None and info.shape != shape:
                raise CheckpointError(
                    f"{where}: checkpoint tensor {ckpt_key!r} ({info.file}) has shape {list(info.shape)}, "
                    f"expected {list(shape)}"
                )
            if shape is not None and info.dtype not in FLOAT_DTYPES:  # moved by the plan (the rest loads as plain)
                raise CheckpointError(
                    f"{where}: checkpoint tensor {ckpt_key!r} ({info.file}) is stored as {info.dtype}; "
                    "a floating-point dtype is expected"
                )
        if all(found.values()) and not pre_quantized:  # names match one to one: anything else is extra
            for model_key, ckpt_key in inside[module.path]:
                if model_key not in planned:
                    raise CheckpointError(
                        f"{where}: the checkpoint in {directory} has an unexpected tensor {ckpt_key!r} "
                        f"({tensors[ckpt_key].file}) that the fused module cannot hold"
                    )


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces ``target`` only if the block succeeds.

    The old directory (if any) is moved aside and deleted only after the new one is in place, so
    an exception or a full disk leaves the old directory intact. Files of the old directory that
    are still memory-mapped stay valid (their inodes live until unmapped).
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_dir():
        raise SaveError(f"{target} exists and is not a directory")
    # os.mkdir, not mkdtemp (always 0o700): the new directory gets the old one's mode, or the umask's.
    staging = target.parent / f".{target.name}.fusion-tmp-{secrets.token_hex(6)}"
    os.mkdir(staging)
    if target.is_dir():
        os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    backup = None
    if target.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.fusion-old-", dir=target.parent))
        os.rename(target, backup / "old")
    try:
        os.rename(staging, target)
    except BaseException:
        if backup is not None:
            os.rename(backup / "old", target)
            shutil.rmtree(backup, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
