"""Reliability: a bad checkpoint is a clear fusion-core error before any model is returned.

Each case copies a real tiny Qwen2-VL checkpoint, damages it, and loads it fused. Errors detected
from the safetensors headers come before transformers is even called (a spy checks); the rest come
from transformers' own loading report and are turned into errors naming key, module and family.
fusion-core never unpickles: a spy on ``torch.load`` and ``pickle.load`` checks that too.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

import fusion_core
from fusion_core.patching import installed_classes
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

QWEN = auto_class(TINY_MODELS["qwen2_vl"])
PATCH = {"patch_embeddings": True}
FUSED = "patch_embed.proj.weight"
WHERE = "family 'patch_embeddings', module 'model.visual.patch_embed.proj'"


@pytest.fixture
def source(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2_vl")[0]


@pytest.fixture
def sharded(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2_vl", max_shard_size="20KB")[0]


@pytest.fixture
def spy(monkeypatch, source, sharded):
    """Counts transformers from_pretrained calls and every unpickling attempt."""
    calls = {"from_pretrained": 0, "unpickle": 0}
    original = PreTrainedModel.from_pretrained.__func__
    torch_load, pickle_load, pickle_loads = torch.load, pickle.load, pickle.loads

    def from_pretrained(cls, *args, **kwargs):
        calls["from_pretrained"] += 1
        return original(cls, *args, **kwargs)

    def counting(function):
        def wrapper(*args, **kwargs):
            calls["unpickle"] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(torch, "load", counting(torch_load))
    monkeypatch.setattr(pickle, "load", counting(pickle_load))
    monkeypatch.setattr(pickle, "loads", counting(pickle_loads))
    return calls


def _copy(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target


def _fused_key(tensors) -> str:
    return next(k for k in tensors if k.endswith(FUSED))


def _rewrite(directory: Path, change, file: str = "model.safetensors") -> None:
    tensors = load_file(directory / file)
    change(tensors)
    save_file(tensors, directory / file, metadata={"format": "pt"})


def _expect(error, text, directory, spy, before_transformers=True):
    with pytest.raises(error) as info:
        fusion_core.from_pretrained(QWEN, directory, fusion_config=PATCH)
    assert text in str(info.value), str(info.value)
    assert installed_classes() == []
    assert spy["unpickle"] == 0
    if before_transformers:
        assert spy["from_pretrained"] == 0
    return str(info.value)


# -- tensors: missing, extra, mis-shaped, wrong dtype ------------------------------------------------------

def _drop_fused(t):
    del t[_fused_key(t)]


def _extra_bias(t):
    t[_fused_key(t).replace("weight", "bias")] = torch.zeros(32)


def _extra_leaf(t):
    t[_fused_key(t).replace("weight", "weight_scale")] = torch.ones(1)


def _shape(new_shape):
    def change(t):
        key = _fused_key(t)
        t[key] = torch.zeros(new_shape, dtype=t[key].dtype)
    return change


def _dtype(dtype):
    def change(t):
        key = _fused_key(t)
        t[key] = t[key].to(dtype)
    return change


def _fused_layout(t):
    key = _fused_key(t)
    t[key] = t[key].flatten(1)


TENSOR_FAULTS = [
    ("extra-bias-on-fused-module", _extra_bias, "unexpected tensor 'visual.patch_embed.proj.bias'"),
    ("extra-leaf-on-fused-module", _extra_leaf, "unexpected tensor 'visual.patch_embed.proj.weight_scale'"),
    ("wrong-shape-kernel", _shape((32, 3, 2, 14, 13)), "has shape [32, 3, 2, 14, 13], expected [32, 3, 2, 14, 14]"),
    ("wrong-shape-out", _shape((31, 3, 2, 14, 14)), "expected [32, 3, 2, 14, 14]"),
    ("wrong-rank", _shape((32, 3, 2, 196)), "expected [32, 3, 2, 14, 14]"),
    ("fused-layout-in-original-dir", _fused_layout, "has shape [32, 1176]"),
    ("dtype-int32", _dtype(torch.int32), "is stored as I32"),
    ("dtype-int8", _dtype(torch.int8), "is stored as I8"),
    ("dtype-int64", _dtype(torch.int64), "is stored as I64"),
    ("dtype-uint8", _dtype(torch.uint8), "is stored as U8"),
    ("dtype-bool", _dtype(torch.bool), "is stored as BOOL"),
]


@pytest.mark.parametrize(("change", "text"), [c[1:] for c in TENSOR_FAULTS], ids=[c[0] for c in TENSOR_FAULTS])
def test_bad_fused_tensor_is_named_before_transformers_loads(change, text, source, spy, tmp_path):
    directory = _copy(source, tmp_path)
    _rewrite(directory, change)
    message = _expect(fusion_core.CheckpointError, text, directory, spy)
    assert WHERE in message


def test_missing_fused_tensor_is_named_before_a_model_is_returned(source, spy, tmp_path):
    """Absence from the headers alone does not prove a tensor is missing (transformers 5.x renames
    and converts keys inside paths), so transformers' loading report decides; it is an error all the same."""
    directory = _copy(source, tmp_path)
    _rewrite(directory, _drop_fused)
    message = _expect(fusion_core.FusionLoadError, "missing key", directory, spy, before_transformers=False)
    assert WHERE in message and "visual.patch_embed.proj.weight" in message


def test_shard_index_dropping_the_fused_key_is_named_before_a_model_is_returned(sharded, spy, tmp_path):
    directory = _copy(sharded, tmp_path)
    index = _index(directory)
    kept = {k: v for k, v in index["weight_map"].items() if not k.endswith(FUSED)}
    _write_index(directory, {**index, "weight_map": kept})
    message = _expect(fusion_core.FusionLoadError, "missing key", directory, spy, before_transformers=False)
    assert WHERE in message


def test_float16_fused_tensor_in_a_float32_checkpoint_loads_and_saves_back_exactly(source, spy, tmp_path):
    """A floating dtype that differs is not an error: transformers casts, the save keeps the loaded bytes."""
    directory = _copy(source, tmp_path)
    _rewrite(directory, _dtype(torch.float16))
    model = fusion_core.from_pretrained(QWEN, directory, fusion_config=PATCH, dtype=torch.float16)
    fusion_core.save_pretrained(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    original = load_file(directory / "model.safetensors")
    key = _fused_key(original)
    assert saved[key].dtype == torch.float16 and torch.equal(saved[key], original[key])


# -- files: truncated, corrupt headers ----------------------------------------------------------------------

def _bytes_fault(mutate):
    def apply(path: Path) -> None:
        path.write_bytes(mutate(path.read_bytes()))
    return apply


def _header(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def _with_header(edit):
    def mutate(data: bytes) -> bytes:
        header, body = _header(data)
        edit(header)
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + body
    return mutate


def _set_entry(field, value):
    def edit(header):
        header[_fused_key(header)][field] = value
    return edit


def _shrink_offsets(header):
    entry = header[_fused_key(header)]
    entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][1] - 4]


FILE_FAULTS = [
    ("truncated-half", _bytes_fault(lambda d: d[: len(d) // 2]), "truncated or corrupt file"),
    ("truncated-last-byte", _bytes_fault(lambda d: d[:-1]), "truncated or corrupt file"),
    ("empty-file", _bytes_fault(lambda d: b""), "not a safetensors file (only 0 bytes)"),
    ("four-bytes", _bytes_fault(lambda d: d[:4]), "only 4 bytes"),
    ("header-length-huge", _bytes_fault(lambda d: struct.pack("<Q", 2**60) + d[8:]), "corrupt safetensors header"),
    ("header-length-zero", _bytes_fault(lambda d: struct.pack("<Q", 0) + d[8:]), "corrupt safetensors header"),
    ("header-not-json", _bytes_fault(lambda d: d[:8] + b"\x00" * 16 + d[24:]), "corrupt safetensors header"),
    ("header-not-utf8", _bytes_fault(lambda d: d[:8] + b"\xff\xfe" + d[10:]), "corrupt safetensors header"),
    ("header-is-list", _bytes_fault(lambda d: struct.pack("<Q", 2) + b"[]" + d[8 + _header(d)[0].__len__():]),
     "corrupt safetensors header"),
    ("entry-without-offsets", _bytes_fault(_with_header(lambda h: h[_fused_key(h)].pop("data_offsets"))),
     "corrupt safetensors header entry for"),
    ("entry-string-offsets", _bytes_fault(_with_header(_set_entry("data_offsets", "ab"))),
     "corrupt safetensors header entry for"),
    ("entry-negative-dim", _bytes_fault(_with_header(_set_entry("shape", [32, -3, 2, 14, 14]))),
     "corrupt safetensors header entry for"),
    ("entry-offsets-past-end", _bytes_fault(_with_header(_set_entry("data_offsets", [0, 10**9]))),
     "truncated or corrupt file"),
    ("entry-size-disagrees-with-shape", _bytes_fault(_with_header(_shrink_offsets)), "corrupt header"),
    ("entry-dtype-not-string", _bytes_fault(_with_header(_set_entry("dtype", 4))),
     "corrupt safetensors header entry for"),
]


@pytest.mark.parametrize(("damage", "text"), [c[1:] for c in FILE_FAULTS], ids=[c[0] for c in FILE_FAULTS])
def test_damaged_safetensors_file_is_rejected_before_transformers_reads_it(damage, text, source, spy, tmp_path):
    directory = _copy(source, tmp_path)
    damage(directory / "model.safetensors")
    message = _expect(fusion_core.CheckpointError, text, directory, spy)
    assert "model.safetensors" in message


# -- shards -----------------------------------------------------------------------------------------------

def _index(directory: Path) -> dict:
    return json.loads((directory / "model.safetensors.index.json").read_text())


def _write_index(directory: Path, index) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps(index) if not isinstance(index, str) else index)


def _missing_shard(directory):
    index = _index(directory)
    shard = index["weight_map"][_fused_key(index["weight_map"])]
    (directory / shard).unlink()


def _key_in_wrong_shard(directory):
    index = _index(directory)
    key = _fused_key(index["weight_map"])
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][key])
    index["weight_map"][key] = other
    _write_index(directory, index)


def _traversal(directory):
    index = _index(directory)
    index["weight_map"][_fused_key(index["weight_map"])] = "../model.safetensors"
    _write_index(directory, index)


SHARD_FAULTS = [
    ("missing-shard", _missing_shard, "is missing (holds"),
    ("key-in-wrong-shard", _key_in_wrong_shard, "which does not hold it"),
    ("index-not-json", lambda d: _write_index(d, "{not json"), "unreadable shard index"),
    ("index-without-weight-map", lambda d: _write_index(d, {"metadata": {}}), "unreadable shard index"),
    ("index-weight-map-list", lambda d: _write_index(d, {"weight_map": []}), "'weight_map' is not an object"),
    ("shard-path-traversal", _traversal, "invalid shard name '../model.safetensors'"),
]


@pytest.mark.parametrize(("damage", "text"), [c[1:] for c in SHARD_FAULTS], ids=[c[0] for c in SHARD_FAULTS])
def test_broken_shard_index_is_rejected_before_transformers_reads_it(damage, text, sharded, spy, tmp_path):
    directory = _copy(sharded, tmp_path)
    damage(directory)
    _expect(fusion_core.CheckpointError, text, directory, spy)


def test_truncated_shard_is_rejected(sharded, spy, tmp_path):
    directory = _copy(sharded, tmp_path)
    shard = _index(directory)["weight_map"][_fused_key(_index(directory)["weight_map"])]
    _bytes_fault(lambda d: d[:-16])(directory / shard)
    message = _expect(fusion_core.CheckpointError, "truncated or corrupt file", directory, spy)
    assert shard in message


# -- pickle checkpoints: never unpickled by fusion-core ------------------------------------------------------

def _to_bin_only(directory: Path) -> None:
    # torch.save writes a pickle; nothing here ever reads it back.
    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


def test_bin_only_checkpoint_is_refused_without_unpickling(source, spy, tmp_path):
    directory = _copy(source, tmp_path)
    _to_bin_only(directory)
    message = _expect(fusion_core.CheckpointError, "fusion-core never unpickles", directory, spy)
    assert "pytorch_model.bin" in message


def test_bin_index_only_checkpoint_is_refused_without_unpickling(source, spy, tmp_path):
    directory = _copy(source, tmp_path)
    _to_bin_only(directory)
    (directory / "pytorch_model.bin").rename(directory / "pytorch_model-00001-of-00001.bin")
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model-00001"}}))
    _expect(fusion_core.CheckpointError, "fusion-core never unpickles", directory, spy)


def test_safetensors_is_used_when_a_bin_sits_beside_it(source, spy, tmp_path):
    directory = _copy(source, tmp_path)
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle anyone should read")
    model = fusion_core.from_pretrained(QWEN, directory, fusion_config=PATCH)
    assert fusion_core.get_fusion_plan(model) is not None and spy["unpickle"] == 0


def test_no_weights_at_all(source, spy, tmp_path):
    directory = _copy(source, tmp_path)
    (directory / "model.safetensors").unlink()
    _expect(fusion_core.CheckpointError, "no model.safetensors or model.safetensors.index.json found", directory, spy)


# -- faults only transformers' loading report reveals --------------------------------------------------------

def test_missing_fused_tensor_reported_by_transformers_is_an_error(source, spy, tmp_path, monkeypatch):
    """With the header check bypassed, transformers' own report still stops the load (no random weights)."""
    directory = _copy(source, tmp_path)
    _rewrite(directory, _drop_fused)
    monkeypatch.setattr("fusion_core.hf.check_checkpoint", lambda *args, **kwargs: None)
    message = _expect(fusion_core.FusionLoadError, "transformers reported missing key", directory, spy,
                      before_transformers=False)
    assert "family 'patch_embeddings'" in message and "model.visual.patch_embed.proj" in message


def test_wrong_shape_of_a_plain_tensor_is_transformers_error(source, spy, tmp_path):
    """Not a fused module: transformers' own size-mismatch error stands, and no model is returned."""
    directory = _copy(source, tmp_path)

    def change(t):
        key = next(k for k in t if k.endswith("layers.0.mlp.up_proj.weight"))
        t[key] = torch.zeros(3, 3)

    _rewrite(directory, change)
    with pytest.raises(Exception, match=r"(?i)size mismatch|shape|mismatched"):
        fusion_core.from_pretrained(QWEN, directory, fusion_config=PATCH)
    assert installed_classes() == [] and spy["unpickle"] == 0
