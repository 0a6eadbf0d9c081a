"""Merges at load write each byte once (fusion_core.streaming); saves split back without copies (aliases)."""

from __future__ import annotations

import filecmp
import json
import multiprocessing
import os
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import fusion_core
from fusion_core import Concat, Stack, streaming
from fusion_core.aliases import split_views
from fusion_core.mapped_files import MappedFiles, clean
from fusion_core.testing import kit
from fusion_core.wrapped import same_bits

FUSION = {"qkv": True, "gate_up": True}
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux /proc")


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama in bf16 whose projections span many pages each (a page is clean or written as a whole)."""
    directory = tmp_path_factory.mktemp("llama-bf16")
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _plain(path: Path, **kwargs: object) -> torch.nn.Module:
    kwargs.setdefault("dtype", torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _fused(path: Path, **kwargs: object) -> torch.nn.Module:
    kwargs.setdefault("dtype", torch.bfloat16)
    return fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION, **kwargs)


def _offsets(path: Path) -> dict[str, int]:
    """Checkpoint key -> the file offset of its first byte."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {k: 8 + length + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def test_a_fused_load_maps_gate_up_and_reads_qkv_without_touching_the_parts(llama_bf16: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real_read = streaming._read
    monkeypatch.setattr(streaming, "_read", lambda fd, offset, address, length: (
        reads.append(length), real_read(fd, offset, address, length))[1])
    fused = _fused(llama_bf16)
    files = MappedFiles.snapshot()
    shard = llama_bf16 / "model.safetensors"
    offsets = _offsets(shard)
    for index, layer in enumerate(fused.model.layers):
        gate_up, qkv = layer.mlp.gate_up_proj.weight, layer.self_attn.qkv_proj.weight
        # gate_proj then up_proj lie back to back in the shard: the merged weight is the checkpoint's own bytes.
        extent = files.file_extent(gate_up)
        assert extent is not None and Path(extent.path) == shard.resolve()
        assert extent.offset == offsets[f"model.layers.{index}.mlp.gate_proj.weight"]
        # q, k, v do not (k_proj, o_proj, q_proj, v_proj by name): a copy, read from the file, not through the
        # mapping (every byte of every part was read with pread: counted below).
        assert files.file_extent(qkv) is None
    plain = _plain(llama_bf16)
    for layer, reference in zip(fused.model.layers, plain.model.layers, strict=True):
        mlp, attn = reference.mlp, reference.self_attn
        assert same_bits(layer.mlp.gate_up_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert same_bits(layer.self_attn.qkv_proj.weight,
                         torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert sum(reads) == sum(p.numel() * 2 for layer in plain.model.layers
                             for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                       layer.self_attn.v_proj.weight))


def test_a_part_written_after_mapping_is_copied_from_memory_not_read_from_the_file(llama_bf16: Path) -> None:
    attn = _plain(llama_bf16).model.layers[1].self_attn
    parts = [attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()]
    assert all(clean(p) for p in parts)
    with torch.no_grad():
        parts[1][3, 5] = 7.0  # its page is now a private copy: the file holds other bytes
    assert not clean(parts[1]) and clean(parts[0])
    merged = streaming.merge(Concat(3), parts, MappedFiles.snapshot())
    assert merged is not None and same_bits(merged, torch.cat(parts))
    assert merged[parts[0].shape[0] + 3, 5] == 7.0


def test_a_merge_whose_read_fails_raises_only_after_its_other_reads_have_ended(
        llama_bf16: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    attn = _plain(llama_bf16).model.layers[0].self_attn
    parts = [attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()]
    files = MappedFiles.snapshot()
    failing = files.file_extent(parts[0])
    assert failing is not None and all(clean(p) for p in parts)
    ended: list[int] = []
    real_read = streaming._read

    def read(fd: int, offset: int, address: int, length: int) -> None:
        if offset == failing.offset:
            raise OSError("short read: 0 of 1 bytes")  # as a file truncated under the load
        time.sleep(0.2)
        real_read(fd, offset, address, length)
        ended.append(offset)

    monkeypatch.setattr(streaming, "_read", read)
    with pytest.raises(OSError, match="short read"):
        streaming.merge(Concat(3), parts, files)
    # Every other read had ended when the merge raised: none writes into the freed merged tensor afterwards.
    assert len(ended) == 2


def test_parts_back_to_back_in_memory_become_a_view_and_any_other_order_a_copy() -> None:
    rows = torch.randn(10, 4)
    ordered = streaming.merge(Concat(2), [rows[:6], rows[6:]], None)
    assert ordered is not None and ordered.data_ptr() == rows.data_ptr() and same_bits(ordered, rows)
    swapped = streaming.merge(Concat(2), [rows[6:], rows[:6]], None)
    assert swapped is not None and swapped.data_ptr() != rows.data_ptr()
    assert same_bits(swapped, torch.cat([rows[6:], rows[:6]]))
    experts = [torch.randn(3, 4) for _ in range(4)]
    stacked = streaming.merge(Stack(4), experts, None)
    assert stacked is not None and same_bits(stacked, torch.stack(experts))
    # Not the sources back to back (rows of parts interleave): the op's own forward runs.
    assert streaming.merge(Concat(2, dim=1), [torch.randn(3, 2), torch.randn(3, 5)], None) is None


def test_the_kit_catches_an_op_whose_flat_offsets_disagree_with_its_forward() -> None:
    class Reversed(Concat):
        def flat_offsets(self, shapes):  # type: ignore[no-untyped-def]
            return tuple(reversed(super().flat_offsets(shapes) or ()))

    kit.assert_transform_op(Concat(2), [(3, 4), (3, 4)])
    with pytest.raises(AssertionError, match="flat_offsets"):
        kit.assert_transform_op(Reversed(2), [(3, 4), (3, 4)])


@pytest.mark.parametrize(("dtype", "device_map"), [(torch.bfloat16, None), (torch.float32, None),
                                                   (torch.bfloat16, "cpu")])
def test_sharded_loads_with_and_without_a_dtype_conversion_compute_what_plain_loads_do(
    llama_bf16: Path, tmp_path: Path, dtype: torch.dtype, device_map: str | None
) -> None:
    sharded = tmp_path / "sharded"
    _plain(llama_bf16).save_pretrained(sharded, max_shard_size="100KB")  # gate and up in different shards too
    assert len(list(sharded.glob("*.safetensors"))) > 3
    kwargs = {"dtype": dtype, "device_map": device_map}
    fused, plain = _fused(sharded, **kwargs), _plain(sharded, **kwargs)
    tokens = torch.randint(0, plain.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert same_bits(fused(tokens).logits, plain(tokens).logits)


def _merge_calls(monkeypatch: pytest.MonkeyPatch, refuse: bool = False) -> list[tuple[list[torch.dtype], object]]:
    """Record (the parts' dtypes, the dtype asked for) of every merge of real tensors; ``refuse``: each returns None."""
    calls: list[tuple[list[torch.dtype], object]] = []
    merge = streaming.merge

    def spy(op: object, tensors: list[torch.Tensor], files: object, dtype: torch.dtype | None = None) -> object:
        if tensors and not tensors[0].is_meta:
            calls.append(([t.dtype for t in tensors], dtype))
            if refuse:
                return None
        return merge(op, tensors, files, dtype)  # type: ignore[arg-type]

    monkeypatch.setattr(streaming, "merge", spy)
    return calls


@pytest.mark.parametrize("refused", [False, True])
def test_a_load_in_another_dtype_loads_the_merged_parts_as_stored_and_casts_them_once(
    llama_bf16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    plain = _plain(llama_bf16, dtype=torch.float32)
    calls = _merge_calls(monkeypatch, refuse=refused)
    fused = _fused(llama_bf16, dtype=torch.float32)
    # transformers left every merged part as the checkpoint stores it; the merge cast it (or, refused, the op did)
    assert calls and all(dtypes == [torch.bfloat16] * len(dtypes) and dtype == torch.float32 for dtypes, dtype in calls)
    assert {t.dtype for t in fused.state_dict().values()} == {torch.float32}
    tokens = torch.randint(0, plain.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert same_bits(fused(tokens).logits, plain(tokens).logits)
    plain.save_pretrained(tmp_path / "plain")
    fusion_core.save_pretrained(fused, tmp_path / "fused")
    assert filecmp.cmp(tmp_path / "plain" / "model.safetensors", tmp_path / "fused" / "model.safetensors",
                       shallow=False)


def test_a_load_in_the_stored_dtype_or_onto_a_device_map_casts_nothing_in_the_merge(
    llama_bf16: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _merge_calls(monkeypatch)
    _fused(llama_bf16, dtype=torch.bfloat16)
    _fused(llama_bf16, dtype=torch.float32, device_map="auto")  # not known to be the CPU: transformers casts
    assert calls and all(dtype is None for _, dtype in calls)
    assert {dtypes[0] for dtypes, _ in calls} == {torch.bfloat16, torch.float32}


def test_state_dict_parts_alias_the_merged_weight_each_with_a_storage_of_its_own(llama_bf16: Path) -> None:
    fused = _fused(llama_bf16)
    state = fused.state_dict()
    qkv = fused.model.layers[0].self_attn.qkv_proj.weight
    q, k = state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.k_proj.weight"]
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == qkv.data_ptr() + q.numel() * q.element_size()
    storages = {t.untyped_storage().data_ptr() for t in (q, k, qkv)}
    assert len(storages) == 2 and k.untyped_storage().nbytes() == k.numel() * k.element_size()
    assert split_views(Concat(2), [torch.randn(4, 3, requires_grad=True)], [(2, 3), (2, 3)]) is None


@pytest.mark.parametrize("shard_size", [None, "100KB"])
def test_a_fused_save_writes_what_a_plain_save_writes(llama_bf16: Path, tmp_path: Path, shard_size: str | None) -> None:
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    _plain(llama_bf16).save_pretrained(tmp_path / "plain", **kwargs)
    fusion_core.save_pretrained(_fused(llama_bf16), tmp_path / "fused", **kwargs)
    written = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors*"))
    assert written == sorted(p.name for p in (tmp_path / "fused").glob("*.safetensors*"))
    for name in written:
        assert filecmp.cmp(tmp_path / "plain" / name, tmp_path / "fused" / name, shallow=False), name


_FORKED_PARTS: list[torch.Tensor] = []
_FORKED_EXPECTED: list[bytes] = []


def _merge_in_forked_child() -> bool:
    # Compared as bytes, not with torch ops: a parallel torch op in a child forked after the parent's OpenMP
    # threads started can deadlock in OpenMP itself (a hang here before CI's one-thread lanes hid it).
    merged = streaming.merge(Concat(3), _FORKED_PARTS, MappedFiles.snapshot())
    return merged is not None and merged.view(torch.int16).numpy().tobytes() == _FORKED_EXPECTED[0]


def test_a_forked_child_reads_with_threads_of_its_own(llama_bf16: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child inherits none of the parent's threads: a merge there must not wait on any (it would hang)."""
    attn = _plain(llama_bf16).model.layers[1].self_attn
    parts = [attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()]
    assert streaming.merge(Concat(3), parts, MappedFiles.snapshot()) is not None  # the parent's threads started
    monkeypatch.setattr(sys.modules[__name__], "_FORKED_PARTS", parts)
    expected = torch.cat(parts).view(torch.int16).numpy().tobytes()
    monkeypatch.setattr(sys.modules[__name__], "_FORKED_EXPECTED", [expected])
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_merge_in_forked_child).get(timeout=60)


def test_process_memory_copies_reads_mapped_tensors_from_the_file_and_declines_the_rest(
        llama_bf16: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real_read = streaming._read
    monkeypatch.setattr(streaming, "_read", lambda fd, offset, address, length: (
        reads.append(length), real_read(fd, offset, address, length))[1])
    layer = _plain(llama_bf16).model.layers[0]
    mapped, written = layer.mlp.down_proj.weight.detach(), layer.self_attn.o_proj.weight.detach()
    with torch.no_grad():
        written[0, 0] = 3.0  # its first page is a private copy now: the file no longer holds its bytes
    anonymous = mapped.clone()
    files = MappedFiles.snapshot()
    assert files.file_extent(mapped) is not None and files.file_extent(anonymous) is None
    copy, *declined = streaming.process_memory_copies([mapped, anonymous, written])
    assert declined == [None, None]
    assert copy is not None and same_bits(copy, mapped) and MappedFiles.snapshot().file_extent(copy) is None
    assert sum(reads) == mapped.numel() * mapped.element_size()  # read from the file, not through the mapping


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="transparent huge pages are Linux's, and this system turned them off")
def test_process_memory_copies_on_huge_pages_advise_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "weight.bin"
    source = torch.randn(2048, 2048, dtype=torch.bfloat16)  # 8 MiB: three or four whole 2 MiB pages
    path.write_bytes(source.view(torch.uint8).numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=source.numel(), dtype=torch.bfloat16).view(2048, 2048)
    assert MappedFiles.snapshot().file_extent(mapped) is not None
    huge, small = (streaming.process_memory_copies([mapped], huge_pages=flag)[0] for flag in (True, False))
    for copy in (huge, small):
        assert copy is not None and same_bits(copy, source)
    assert "hg" in _vm_flags(_first_whole_huge_page(huge))  # madvise(MADV_HUGEPAGE) marks the mapping "hg"
    assert "hg" not in _vm_flags(_first_whole_huge_page(small))


def _first_whole_huge_page(tensor: torch.Tensor) -> int:
    page = 2 << 20
    return -(-tensor.data_ptr() // page) * page
