"""The ``release_freed_memory`` option: during a training call with labels, glibc's free heap is trimmed at the
decoder layers' boundaries, forward and backward, once the memory it keeps resident unused has grown enough or the
memory in use has risen enough; nothing else changes, and nothing stays hooked.

The C library is faked (:func:`fake_glibc`) so that the tests see every look and trim the family asks for; the tests
of what is counted run against this process's real glibc where it has one.
"""

from __future__ import annotations

import mmap
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from fusion_linear_cross_entropy import freed_heap
from torch import nn
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.testing.kit import relative_l2

LAYERS = 3
needs_glibc = pytest.mark.skipif(not freed_heap.available(),
                                 reason="no glibc malloc_trim and mallinfo2, or no /proc/self/statm to read")
CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).save_pretrained(directory)
    return directory


@pytest.fixture
def fake_glibc(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This process's C library stands in for one whose unused resident memory grows by ``MIN_GROWTH`` between any
    two looks at it; returns the looks and trims asked for, in order."""
    calls: list[str] = []

    def look() -> tuple[int, int]:
        calls.append("look")
        return 0, calls.count("look") * freed_heap.MIN_GROWTH  # (in use, unused)

    def trim() -> int:
        calls.append("trim")
        return 1

    monkeypatch.setattr(freed_heap, "_glibc", lambda: (look, trim))
    return calls


def _load(path: Path, **options: Any) -> nn.Module:
    return fusion_core.from_pretrained(AutoModelForCausalLM, path,
                                       fusion_config={"linear_cross_entropy": options or True})


def _inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**_inputs()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hooked(model: nn.Module) -> list[nn.Module]:
    return [m for m in freed_heap.checkpointed_layers(model) if m._forward_pre_hooks]


@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["no-checkpointing", "non-reentrant", "reentrant"])
def test_the_heap_is_looked_at_every_layer_boundary_forward_and_backward(path: Path, fake_glibc: list[str],
                                                                         checkpointing: bool | None) -> None:
    fused = _load(path)
    if checkpointing is not None:
        fused.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model = fused.train()
    model.zero_grad(set_to_none=True)
    loss = model(**_inputs()).loss
    assert fake_glibc.count("look") == 1 + LAYERS  # the start, then before each layer's forward
    assert not _hooked(model)  # the forward's hooks are gone when it returns
    loss.backward()
    assert fake_glibc.count("look") == 1 + 2 * LAYERS  # and after each layer's backward (its input's gradient)
    # growing by MIN_GROWTH a look, the first look after a trim only sets the level counted from
    assert fake_glibc.count("trim") == LAYERS


def test_trimming_changes_no_loss_or_gradient(path: Path, fake_glibc: list[str]) -> None:
    kept_loss, kept = _step(_load(path, release_freed_memory=False))
    assert not fake_glibc
    loss, grads = _step(_load(path))
    assert "trim" in fake_glibc
    assert torch.equal(loss, kept_loss) and grads.keys() == kept.keys()
    assert all(torch.equal(grads[name], kept[name]) for name in kept)


@needs_glibc
def test_a_step_with_this_process_glibc_trims_as_a_step_without(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freed_heap, "MIN_GROWTH", 0)  # a trim at every boundary
    kept_loss, kept = _step(_load(path, release_freed_memory=False))
    loss, grads = _step(_load(path))
    assert relative_l2(kept_loss, loss) == 0
    assert all(torch.equal(grads[name], kept[name]) for name in kept)


def test_no_trim_outside_a_training_call_with_labels(path: Path, fake_glibc: list[str]) -> None:
    fused = _load(path)
    inputs = _inputs()
    with torch.no_grad():
        fused.eval()(**inputs)
        fused.train()(**inputs)
    fused.train()(input_ids=inputs["input_ids"])
    fused.eval()(**inputs)
    assert not fake_glibc
    assert not _hooked(fused)


def test_a_c_library_without_malloc_trim_hooks_nothing(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freed_heap, "_glibc", lambda: None)
    made: list[object] = []
    monkeypatch.setattr(freed_heap, "_Trimmer", lambda *args: made.append(args))
    loss, grads = _step(_load(path))
    assert not made and torch.isfinite(loss) and grads


def test_the_trimmer_counts_growth_from_the_first_look_after_a_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freed_heap, "MIN_GROWTH", 256 * 2**20)
    values = iter([0, 100, 255, 256, 600, 855, 856, 1200])
    trims: list[int] = []

    def look() -> tuple[int, int]:  # (in use, unused): the unused memory grows, nothing in use
        return 0, next(values) * 2**20

    trimmer = freed_heap._Trimmer(look, lambda: trims.append(1) or 0)
    for _ in range(6):
        trimmer()
    # 100 (no), 255 (no), 256 (trim), 600 (the layer after it refaulted its working set: the level counted from,
    # not a trim), 855 (no: 255 above it), 856 (trim)
    assert trims == [1, 1] and trimmer.floor == 600 * 2**20
    trimmer()
    assert trims == [1, 1] and trimmer.floor == 1200 * 2**20


def test_memory_in_use_rising_from_one_look_to_the_next_trims_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # a full fine-tuning's backward: every layer adds its gradients to the memory in use, and the unused memory
    # stays at one layer's working set (no growth that MIN_GROWTH would count)
    monkeypatch.setattr(freed_heap, "MIN_GROWTH", 256 * 2**20)
    monkeypatch.setattr(freed_heap, "MIN_RISE", 64 * 2**20)
    in_use = iter([1000, 1008, 1016, 1100, 1164, 1227, 1227, 1300])  # MiB at each look, the first at the start
    trims: list[int] = []

    def look() -> tuple[int, int]:  # (in use, unused)
        return next(in_use) * 2**20, 300 * 2**20

    trimmer = freed_heap._Trimmer(look, lambda: trims.append(1) or 0)
    risen = []
    for _ in range(7):
        before = len(trims)
        trimmer()
        risen.append(len(trims) > before)
    # +8 (no), +8 (no), +84 (trim), +64 (trim, though the look after a trim only sets the level), +63 (no: the level
    # is set now), +0 (no), +73 (trim)
    assert risen == [False, False, True, True, False, False, True]
    assert trimmer.floor == 300 * 2**20


def _looked() -> tuple[int, int]:
    """(in use, unused) of this process's glibc now."""
    glibc = freed_heap._glibc()
    assert glibc is not None
    return glibc[0]()


@needs_glibc
def test_resident_memory_malloc_did_not_hand_out_counts_as_unused() -> None:
    size = 64 * 2**20
    before = _looked()[1]
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # outside malloc; written: resident
    try:
        pages.write(b"\1" * size)
        assert _looked()[1] - before >= size * 0.9
    finally:
        pages.close()
    assert _looked()[1] - before < size * 0.5


@needs_glibc
def test_memory_malloc_handed_out_counts_as_in_use_not_unused() -> None:
    used_before, before = _looked()
    held = torch.ones(64 * 2**20, dtype=torch.uint8)  # resident, and in malloc's hands
    used, unused = _looked()
    assert unused - before < 16 * 2**20
    assert used - used_before >= 60 * 2**20
    del held  # held until the looks above


def test_the_option_pickles_with_the_model(path: Path) -> None:
    fused = _load(path, release_freed_memory=False)
    copied = pickle.loads(pickle.dumps(fused))
    assert type(copied) is type(fused) and not type(copied).release_freed_memory
    assert type(_load(path)).release_freed_memory

