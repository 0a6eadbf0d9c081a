"""Reliability: ``fusion_core.save_pretrained`` leaves the old directory or a complete new one, never a mix.

Faults are injected into the real write path: transformers' own safetensors writer is replaced by one
that writes part of a file and then raises (``OSError(ENOSPC)``: the disk is full, or any exception),
the config writer likewise, and the final rename. After each fault the target is compared file by file
with what it held before, and no staging directory is left beside it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils as modeling_utils
from fusion_patch_embeddings.family import PatchLinearMixin
from safetensors.torch import save_file
from transformers import PretrainedConfig

import fusion_core
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

QWEN = auto_class(TINY_MODELS["qwen2_vl"])
PATCH = {"patch_embeddings": True}


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*")) if p.is_file()
    }


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".fusion-tmp-" in p.name or ".fusion-old-" in p.name)


@pytest.fixture
def source(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2_vl")[0]


@pytest.fixture
def model(source):
    return fusion_core.from_pretrained(QWEN, source, fusion_config=PATCH)


@pytest.fixture
def old(tmp_path, source) -> Path:
    """A target directory that already holds a complete, different save (plus a file of the user's)."""
    target = tmp_path / "out"
    shutil.copytree(source, target)
    (target / "README.md").write_text("the user's notes")
    return target


class Injected(Exception):
    pass


def _partial_weights(exc: BaseException, after_files: int = 0):
    """A safetensors writer that writes ``after_files`` files fully, then half of the next, then raises."""
    written = {"n": 0}

    def writer(tensors, filename, metadata=None):
        if written["n"] >= after_files:
            save_file(tensors, filename, metadata=metadata)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            raise exc
        written["n"] += 1
        return save_file(tensors, filename, metadata=metadata)

    return writer


FAULTS = [
    ("disk-full-in-weights", lambda: _partial_weights(OSError(errno.ENOSPC, "No space left on device"))),
    ("exception-in-weights", lambda: _partial_weights(Injected("writer crashed"))),
    ("interrupt-in-weights", lambda: _partial_weights(KeyboardInterrupt())),
]


@pytest.mark.parametrize("make_writer", [f[1] for f in FAULTS], ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("existing", [True, False], ids=["over-old-dir", "new-dir"])
def test_fault_while_writing_weights_leaves_old_directory_intact(make_writer, existing, model, old, monkeypatch):
    target = old if existing else old.parent / "fresh"
    before = _snapshot(target) if existing else None
    monkeypatch.setattr(modeling_utils, "safe_save_file", make_writer())
    with pytest.raises((OSError, Injected, KeyboardInterrupt)):
        fusion_core.save_pretrained(model, target)
    if existing:
        assert _snapshot(target) == before
    else:
        assert not target.exists()
    assert _leftovers(target.parent) == []


def test_disk_full_on_the_second_shard_leaves_old_directory_intact(model, old, monkeypatch):
    before = _snapshot(old)
    monkeypatch.setattr(modeling_utils, "safe_save_file",
                        _partial_weights(OSError(errno.ENOSPC, "No space left on device"), after_files=1))
    with pytest.raises(OSError, match="No space left"):
        fusion_core.save_pretrained(model, old, max_shard_size="20KB")
    assert _snapshot(old) == before and _leftovers(old.parent) == []


def test_disk_full_while_writing_config_leaves_old_directory_intact(model, old, monkeypatch):
    before = _snapshot(old)
    original = PretrainedConfig.to_json_file

    def to_json_file(self, path, *args, **kwargs):
        original(self, path, *args, **kwargs)
        Path(path).write_text(Path(path).read_text()[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PretrainedConfig, "to_json_file", to_json_file)
    with pytest.raises(OSError):
        fusion_core.save_pretrained(model, old)
    assert _snapshot(old) == before and _leftovers(old.parent) == []


def test_fault_in_a_fused_layout_save_leaves_old_directory_intact(model, old, monkeypatch):
    before = _snapshot(old)

    def write_text(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", write_text)  # fused_config.json is written after the weights
    with pytest.raises(OSError):
        fusion_core.save_pretrained(model, old, save_original_format=False)
    monkeypatch.undo()
    assert _snapshot(old) == before and _leftovers(old.parent) == []


def test_failed_final_rename_restores_the_old_directory(model, old, monkeypatch):
    before = _snapshot(old)
    real_rename = os.rename
    calls = {"n": 0}

    def rename(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:  # 1: old -> backup, 2: staging -> target
            raise OSError(errno.EIO, "I/O error")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="I/O error"):
        fusion_core.save_pretrained(model, old)
    monkeypatch.undo()
    assert _snapshot(old) == before and _leftovers(old.parent) == []


def test_complete_save_replaces_the_whole_directory(model, old, source):
    fusion_core.save_pretrained(model, old)
    assert not (old / "README.md").exists()  # a save is the whole new directory, not a merge
    assert (old / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert _leftovers(old.parent) == []


def test_saved_directory_has_ordinary_permissions(model, tmp_path):
    fusion_core.save_pretrained(model, tmp_path / "fresh")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o777 & ~umask
    existing = tmp_path / "shared"
    existing.mkdir()
    existing.chmod(0o775)
    fusion_core.save_pretrained(model, existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o775


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [({"safe_serialization": False}, "safetensors only"), ({"save_original_format": False}, "needs a fused model")],
)
def test_refused_saves_write_nothing(kwargs, text, source, old):
    plain = fusion_core.from_pretrained(QWEN, source)
    before = _snapshot(old)
    with pytest.raises(fusion_core.SaveError, match=text):
        fusion_core.save_pretrained(plain, old, **kwargs)
    assert _snapshot(old) == before and _leftovers(old.parent) == []


def test_target_that_is_a_file_is_refused_and_kept(model, tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    with pytest.raises(fusion_core.SaveError, match="not a directory"):
        fusion_core.save_pretrained(model, target)
    assert target.read_text() == "keep me" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("shards", [None, "20KB"], ids=["single-file", "sharded"])
def test_saving_over_the_memory_mapped_source_directory_is_byte_identical(shards, source, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(source, directory)
    kwargs = {"max_shard_size": shards} if shards else {}
    if shards:
        fusion_core.save_pretrained(fusion_core.from_pretrained(QWEN, directory, fusion_config=PATCH),
                                    directory, **kwargs)
    weights_before = {k: v for k, v in _snapshot(directory).items() if k.endswith((".safetensors", ".json"))
                      and k != "config.json"}
    model = fusion_core.from_pretrained(QWEN, directory, fusion_config=PATCH)  # tensors map the files
    inputs = {"hidden_states": torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0)),
              "grid_thw": torch.tensor([[1, 4, 4]])}
    with torch.no_grad():
        expected = model.model.visual(**inputs)
    for _ in range(2):  # twice: the second save replaces a directory the first save wrote
        fusion_core.save_pretrained(model, directory, **kwargs)
        after = {k: v for k, v in _snapshot(directory).items() if k in weights_before}
        assert after == weights_before
    with torch.no_grad():
        assert torch.equal(model.model.visual(**inputs)[0], expected[0])  # the mapped tensors are still valid
    again = fusion_core.from_pretrained(QWEN, directory)
    assert isinstance(again.model.visual.patch_embed.proj, PatchLinearMixin)
    with torch.no_grad():
        assert torch.equal(again.model.visual(**inputs)[0], expected[0])
    assert _leftovers(tmp_path) == []



def test_a_fused_module_the_model_replaced_is_refused_before_anything_is_written(llama, tmp_path):
    """BigBird swaps its own attention module after loading (a short input switches it to full attention,
    rebuilt from the q/k/v children): the save would lack those tensors, so it is refused by name."""
    from transformers import AutoModelForCausalLM

    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"qkv": True})
    layer = model.model.layers[0]
    replacement = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        replacement.add_module(name, getattr(layer.self_attn, name))
    layer.self_attn = replacement
    with pytest.raises(fusion_core.SaveError, match=r"family 'qkv', module 'model.layers.0.self_attn': the model "
                                                    r"replaced the fused module"):
        fusion_core.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_an_original_format_save_refuses_fused_tensors_a_wrapper_moved(llama: Path, tmp_path: Path) -> None:
    """A fused module wrapped after the load keeps its fused tensor under a new name: the save refuses,
    writing nothing."""
    from transformers import AutoModelForCausalLM

    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"qkv": True})
    attention = model.model.layers[0].self_attn

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

    attention.qkv_proj = Wrapper(attention.qkv_proj)
    with pytest.raises(fusion_core.SaveError, match=r"'qkv'.*model\.layers\.0\.self_attn\.qkv_proj\.inner\.weight"):
        fusion_core.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
