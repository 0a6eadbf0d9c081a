"""A decode step's keys and values appended into a cache layer's buffer (``fusion_linear_kernels.cache_growth``):
the layer holds and hands back what transformers' own concatenation gives, step after step, through growth, crops,
beam reorders and copies; it writes into one buffer until the buffer is full; a tensor kept from an earlier step keeps
its values; any layer or call it does not know runs the layer's own ``update``; the attention kernel reads a layer's
views as it reads contiguous keys; a sliding window's layer hands back and keeps what its own ``update`` does, its
token count included; and a decode through them gives the modules' tokens."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from fusion_linear_kernels import attention_kernel, cache_growth

cache_utils = pytest.importorskip("transformers.cache_utils")
if not hasattr(cache_utils, "DynamicLayer"):
    pytest.skip("this transformers has no cache layers", allow_module_level=True)


def _steps(count: int, batch: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(2, batch, 3, 1, 8, generator=generator).bfloat16()) for _ in range(count)]  # type: ignore[misc]


def _caches(prompt: int = 5, batch: int = 2, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """Two dynamic caches holding the same prompt at layer 0: one for :func:`cache_growth.append`, one for
    transformers' own ``update``."""
    keys, values = torch.randn(2, batch, 3, prompt, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    caches = (cache_utils.DynamicCache(), cache_utils.DynamicCache())
    for cache in caches:
        cache.update(keys.clone(), values.clone(), 0)
    return caches


def _sliding_caches(window: int, prompt: int = 5) -> tuple[Any, Any]:
    """Two dynamic caches whose layer 0 is a sliding window's, holding the same prompt (as :func:`_caches`)."""
    keys, values = torch.randn(2, 2, 3, prompt, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    caches = (cache_utils.DynamicCache(), cache_utils.DynamicCache())
    for cache in caches:
        cache.layers = [cache_utils.DynamicSlidingWindowLayer(sliding_window=window)]
        cache.update(keys.clone(), values.clone(), 0)
    return caches


def _assert_same(grown: Any, reference: Any) -> None:
    assert torch.equal(grown.layers[0].keys, reference.layers[0].keys)
    assert torch.equal(grown.layers[0].values, reference.layers[0].values)


def test_appends_give_what_concatenation_gives_into_one_buffer_until_it_is_full() -> None:
    grown, reference = _caches()
    pointers = []
    for key, value in _steps(150):
        got = cache_growth.append(grown, 0, key, value)
        expected = reference.update(key, value, 0)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        assert got[0] is grown.layers[0].keys and got[1] is grown.layers[0].values
        pointers.append(grown.layers[0].keys.data_ptr())
    _assert_same(grown, reference)
    # Room for 5 + 1 + 0 + 64 = 70 tokens, 70 + 1 + 8 + 64 = 143, then 225: two growths, each a move to a new buffer.
    # Counted as moves between steps, not as distinct addresses: the allocator may hand the third buffer the first's.
    assert sum(before != after for before, after in itertools.pairwise(pointers)) == 2
    assert grown.get_seq_length() == reference.get_seq_length() == 155


def test_a_kept_tensor_keeps_its_values_and_crops_and_reorders_run_as_transformers_does() -> None:
    grown, reference = _caches()
    steps = _steps(12)
    for key, value in steps[:4]:
        cache_growth.append(grown, 0, key, value)
        reference.update(key, value, 0)
    kept, kept_copy = grown.layers[0].keys, grown.layers[0].keys.clone()
    for cache in (grown, reference):
        cache.crop(-2)  # a view of the buffer's first 7 tokens, below what was written: the next step concatenates
    for key, value in steps[4:8]:
        cache_growth.append(grown, 0, key, value)
        reference.update(key, value, 0)
    assert torch.equal(kept, kept_copy)
    _assert_same(grown, reference)
    for cache in (grown, reference):
        cache.reorder_cache(torch.tensor([1, 0]))  # beam search
    for key, value in steps[8:]:
        cache_growth.append(grown, 0, key, value)
        reference.update(key, value, 0)
    _assert_same(grown, reference)
    copied = copy.deepcopy(grown)  # a copy's layer is another layer: its buffer is its own
    for key, value in _steps(3, seed=1):
        cache_growth.append(copied, 0, key, value)
        reference.update(key, value, 0)
    _assert_same(copied, reference)
    assert grown.get_seq_length() == 15 and copied.get_seq_length() == 18


@pytest.mark.skipif(not hasattr(cache_utils, "DynamicSlidingWindowLayer"), reason="this transformers has no sliding "
                    "window's cache layer")
@pytest.mark.parametrize(("window", "prompt"), [(8, 5), (8, 12), (2, 3), (100, 5)])
def test_a_sliding_window_hands_back_and_keeps_what_its_own_update_does(window: int, prompt: int) -> None:
    layer_type = cache_utils.DynamicSlidingWindowLayer
    assert cache_growth.slides(layer_type) and cache_growth.grows(layer_type)
    assert not cache_growth.concatenates(layer_type)
    grown, reference = _sliding_caches(window, prompt)
    pointers = []
    for key, value in _steps(150):
        got = cache_growth.append(grown, 0, key, value)
        expected = reference.update(key, value, 0)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        _assert_same(grown, reference)
        assert grown.layers[0].cumulative_length == reference.layers[0].cumulative_length
        assert grown.get_seq_length() == reference.get_seq_length()
        pointers.append(grown.layers[0].keys.untyped_storage().data_ptr())  # the buffer's: the keys' start slides
    assert grown.get_seq_length() == prompt + 150
    # The window keeps min(prompt, window - 1) tokens, so a buffer holds kept + 1 + kept // 8 + 64 before a move: at
    # a window of 8, one buffer a 65 steps (150 steps: two moves), and at 100 (4 + 1 + 0 + 64, then 73 + 1 + 9 + 64,
    # full at 99 kept) also two.
    assert sum(before != after for before, after in itertools.pairwise(pointers)) == 2
    grown.reorder_cache(torch.tensor([1, 0]))  # beam search: a new tensor, so a new buffer
    reference.reorder_cache(torch.tensor([1, 0]))
    for key, value in _steps(3, seed=1):
        cache_growth.append(grown, 0, key, value)
        reference.update(key, value, 0)
    _assert_same(grown, reference)


@pytest.mark.skipif(not hasattr(cache_utils, "DynamicSlidingWindowLayer"), reason="this transformers has no sliding "
                    "window's cache layer")
def test_a_sliding_window_recording_its_past_or_of_another_update_runs_its_own() -> None:
    class Counting(cache_utils.DynamicSlidingWindowLayer):  # type: ignore[misc, name-defined]
        def update(self, *args: Any, **kwargs: Any) -> Any:
            self.calls = getattr(self, "calls", 0) + 1
            return super().update(*args, **kwargs)

    assert not cache_growth.slides(Counting) and not cache_growth.grows(Counting)
    assert not cache_growth.slides(cache_utils.DynamicLayer)
    grown, reference = _sliding_caches(8)
    if not hasattr(grown.layers[0], "activate_past_recording"):
        pytest.skip("this transformers' sliding window does not record its past")
    for key, value in _steps(2, seed=2):  # grown first: recording then drops the buffer it kept for the layer
        cache_growth.append(grown, 0, key, value)
        reference.update(key, value, 0)
    assert grown.layers[0] in cache_growth._GROWN
    for cache in (grown, reference):
        cache.layers[0].activate_past_recording()
    for key, value in _steps(6):
        got = cache_growth.append(grown, 0, key, value)
        expected = reference.update(key, value, 0)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert grown.layers[0].keys.shape[2] == 13  # all of it, recorded: its own update ran
    assert grown.layers[0] not in cache_growth._GROWN
    _assert_same(grown, reference)


def test_layers_and_calls_it_does_not_know_run_the_layers_own_update() -> None:
    assert cache_growth.concatenates(cache_utils.DynamicLayer)
    if hasattr(cache_utils, "DynamicSlidingWindowLayer"):  # it keeps the window's last keys: not a concatenation
        assert not cache_growth.concatenates(cache_utils.DynamicSlidingWindowLayer)

    class Counting(cache_utils.DynamicLayer):  # type: ignore[misc, name-defined]
        def update(self, *args: Any, **kwargs: Any) -> Any:
            self.calls = getattr(self, "calls", 0) + 1
            return super().update(*args, **kwargs)

    assert not cache_growth.concatenates(Counting)

    class Unhashable(cache_utils.DynamicLayer):  # type: ignore[misc, name-defined]
        __hash__ = None  # type: ignore[assignment]

    assert not cache_growth.concatenates(Unhashable)  # it could not be a weak key: its layers keep their update
    odd, reference = _caches()
    odd.layers[0].__class__ = Unhashable
    other, _ = _caches()
    cache_growth.append(other, 0, *_steps(1)[0])  # a layer grown meanwhile: the module's record is not empty
    for key, value in _steps(2):
        cache_growth.append(odd, 0, key, value)
        reference.update(key, value, 0)
    _assert_same(odd, reference)
    calls: list[int] = []

    def counted(cache: Any) -> Any:
        original = cache.update
        cache.update = lambda *a, **k: calls.append(1) or original(*a, **k)
        return cache

    grown = counted(_caches()[0])
    key, value = _steps(1)[0]
    cache_growth.append(grown, 0, key, value)
    assert not calls
    cache_growth.append(grown, 0, key.float(), value.float())  # another dtype
    cache_growth.append(grown, 0, torch.cat([key, key], dim=2), torch.cat([value, value], dim=2))  # two tokens
    with torch.inference_mode():  # an inference tensor's buffer ...
        fresh, reference = _caches()
        fresh = counted(fresh)
        cache_growth.append(fresh, 0, key, value)
        reference.update(key, value, 0)
    assert len(calls) == 2
    cache_growth.append(fresh, 0, key, value)  # ... is not written outside inference mode
    reference.update(key, value, 0)
    assert len(calls) == 3
    _assert_same(fresh, reference)


@pytest.mark.parametrize("dtype", attention_kernel.DTYPES, ids=str)
def test_the_kernel_reads_a_layers_views_as_contiguous_keys(dtype: torch.dtype) -> None:
    if attention_kernel.kernel(dtype) is None:
        pytest.skip(f"the attention kernel for {dtype} cannot be built here")
    grown, _ = _caches(dtype=dtype)
    for key, value in _steps(9):
        keys, values = cache_growth.append(grown, 0, key.to(dtype), value.to(dtype))
    assert not keys.is_contiguous()
    query = torch.randn(2, 6, 1, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = attention_kernel.attend(query, keys, values, 0.35)
    expected = attention_kernel.attend(query, keys.contiguous(), values.contiguous(), 0.35)
    assert got is not None and expected is not None and torch.equal(got, expected)
    assert attention_kernel.attend(query, keys, values.contiguous(), 0.35) is None  # strides apart: torch's
