"""A decode step's keys and values appended to a dynamic cache layer without copying the cache at every step.

transformers' ``DynamicLayer.update`` concatenates: each step allocates the layer's keys and values anew, one token
longer, and copies every cached token into them. At long contexts that copy outgrows the step's own reads: on the
2-core AMD EPYC (AVX512-BF16; torch 2.13.0, bf16, a throwaway timing) the 56 concatenations of a step of Qwen3-0.6B's
widths (28 layers, 8 key/value heads of 128) took 8.6 ms at 1024 cached tokens and 28.5 ms at 4096, where the whole
fused step reads its weights in about 35 ms.

:func:`append` gives the layer's keys and values a buffer with room to spare (an eighth of the length and
:data:`MIN_SPARE` tokens more) and makes the layer's ``keys`` and ``values`` views of its first tokens: a step writes
its one token after them and lengthens the views, and only a step that finds the buffer full copies the cache into a
larger one. What the layer holds, and what ``update``'s caller gets, are the same values as transformers' own
concatenation gives (views of a longer buffer, not contiguous tensors: the attention kernel reads them by their
strides, torch's attention as any tensor).

**Sliding windows.** A sliding window's layer (transformers' ``DynamicSlidingWindowLayer``: Mistral's, Gemma 2's and
3's local layers) hands back its kept keys and the new ones, then keeps the window's last ``sliding_window - 1``
(:func:`slides`, checked once per class). Its ``update`` concatenates too, the whole window at every step: a
Mistral-7B-shaped layer at a full 4096-token window copies 16 MB a step. Here such a layer's keys are views of the
buffer's last tokens: a step writes its token at the high-water mark, hands back the kept tokens and the new one, and
moves the views' start past the tokens that left the window; a step that finds the buffer full copies the kept
tokens into a new one (a window of 4096 tokens: 4095 tokens every 576 steps). The layer's token count
(``cumulative_length``) counts as ``update`` counts it. A layer recording its past for assisted decoding
(``record_past``) keeps its own ``update``.

It never writes where a token was written before (only at the buffer's high-water mark), so a tensor anyone kept of an
earlier step's keys keeps its values, as with concatenation. A layer whose keys are not the views this module made at
its high-water mark (cropped, reordered for beam search, replaced) gets a new buffer, its keys copied in. Anything
else runs the layer's own ``update``: another layer class, an ``update`` that does more than concatenate or slide
(:func:`concatenates`, :func:`slides`), other shapes, dtypes or devices, an inference tensor outside inference mode.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import torch

MIN_SPARE = 64
"""The fewest tokens of room a new buffer leaves after the cache (besides an eighth of its length)."""

_GROWN: weakref.WeakKeyDictionary[Any, tuple[int, int, torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()
"""Each cache layer this module grew: where its keys start in the buffers, the tokens written (the high-water mark),
and the keys' and values' buffers."""


def _distinct(*shape: int) -> torch.Tensor:
    """A tensor of ``shape`` whose elements all differ: the checks' keys and values, drawn from no random generator
    (a load must leave the process's random state as it found it)."""
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


@functools.cache
def concatenates(layer_type: type) -> bool:
    """Whether ``layer_type``'s ``update`` does nothing but concatenate the new keys and values to its own along the
    sequence and return them (transformers' ``DynamicLayer``): checked once per class on tiny tensors, so a layer
    whose ``update`` also counts, trims or quantizes keeps it (as does one that cannot be a weak key: see
    :data:`_GROWN`)."""
    try:
        layer = _weakly_held(layer_type())
        first, second = _distinct(2, 1, 2, 3, 4), _distinct(2, 1, 2, 1, 4) + 100
        layer.update(first[0], first[1])
        updated = _updated_alone(layer, second[0], second[1], ("keys", "values"))
        if updated is None:
            return False
        keys, values = updated
        expected = [torch.cat([first[i], second[i]], dim=-2) for i in (0, 1)]
        return (keys is layer.keys and values is layer.values and torch.equal(keys, expected[0])
                and torch.equal(values, expected[1]))
    except Exception:  # a layer that cannot be built or updated so is not one this module grows
        return False


@functools.cache
def slides(layer_type: type) -> bool:
    """Whether ``layer_type``'s ``update`` is a sliding window's (transformers' ``DynamicSlidingWindowLayer``): it hands
    back its kept keys and values with the new ones, keeps the last ``sliding_window - 1``, adds the new tokens to
    ``cumulative_length`` and changes nothing else. Checked once per class on tiny tensors, through a window that
    fills and slides."""
    try:
        layer = _weakly_held(layer_type(sliding_window=4))
        tokens = _distinct(2, 1, 2, 6, 4)
        layer.update(tokens[0, :, :, :2], tokens[1, :, :, :2])
        for end in range(3, 7):  # three kept, then the window slides
            kept = layer.keys.shape[-2]
            updated = _updated_alone(layer, tokens[0, :, :, end - 1:end], tokens[1, :, :, end - 1:end],
                                     ("keys", "values", "cumulative_length"))
            if not (updated is not None and torch.equal(updated[0], tokens[0, :, :, end - kept - 1:end])
                    and torch.equal(updated[1], tokens[1, :, :, end - kept - 1:end])
                    and torch.equal(layer.keys, tokens[0, :, :, max(0, end - 3):end])
                    and torch.equal(layer.values, tokens[1, :, :, max(0, end - 3):end])
                    and layer.cumulative_length == end):
                return False
        return True
    except Exception:  # a layer that cannot be built or updated so is not one this module grows
        return False


def grows(layer_type: type) -> bool:
    """Whether :func:`reserve` can give a layer of ``layer_type`` room (it concatenates or slides); its instances may
    still decline (another shape, a layer recording its past)."""
    return concatenates(layer_type) or slides(layer_type)


def _updated_alone(layer: Any, key: torch.Tensor, value: torch.Tensor,
                   changing: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What ``layer.update(key, value)`` hands back, or None where it changed an attribute of the layer other than
    ``changing`` (added, removed, or given another value)."""
    before = {name: held for name, held in vars(layer).items() if name not in changing}
    keys, values = layer.update(key, value)
    after = {name: held for name, held in vars(layer).items() if name not in changing}
    unchanged = before.keys() == after.keys() and all(after[name] is was or _same(after[name], was)
                                                      for name, was in before.items())
    return (keys, values) if unchanged else None


def _weakly_held(layer: Any) -> Any:
    """``layer``, once it has shown it can be a key of :data:`_GROWN` (hashable, and held weakly); raises otherwise."""
    _GROWN[layer] = (0, 0, torch.empty(0), torch.empty(0))
    del _GROWN[layer]
    return layer


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False


def append(cache: Any, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update(key, value, layer_idx)`` for one new token a sequence (``key`` and ``value``: ``[batch,
    kv_heads, 1, width]``), appended into the layer's buffer where it can be (see the module docs)."""
    room = None
    if type(key) is torch.Tensor and type(value) is torch.Tensor and key.shape == value.shape:
        room = reserve(cache, layer_idx, key.shape, key.dtype, key.device)
    if room is None:
        return cache.update(key, value, layer_idx)
    key_buffer, value_buffer, length = room
    key_buffer[:, :, length:length + 1].copy_(key)
    value_buffer[:, :, length:length + 1].copy_(value)
    layer = cache.layers[layer_idx]
    if concatenates(type(layer)):
        return layer.keys, layer.values
    return key_buffer[:, :, :length + 1], value_buffer[:, :, :length + 1]  # a sliding window's: kept and new


def reserve(cache: Any, layer_idx: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Room in the layer's buffers for one new token a sequence of keys and values of ``shape`` (``[batch, kv_heads,
    1, width]``), ``dtype`` and ``device``: views of the keys' and values' buffers from the layer's first kept token
    on (``[batch, kv_heads, room, width]``, each sequence's and head's tokens contiguous) and the tokens the layer kept
    before this one. The caller writes the new token at that index at once, before anything reads the layer, and the
    views' first tokens up to it are what the layer's ``update`` would hand back. The layer's keys and values are
    already what ``update`` leaves (a sliding window's: without the token that left the window). None where the
    layer's own ``update`` must run (see the module docs)."""
    layer = cache.layers[layer_idx]
    sliding = not concatenates(type(layer))
    if sliding and not slides(type(layer)):
        return None  # nor, then, a weak key
    window = layer.__dict__.get("sliding_window") if sliding else None
    if sliding and not (type(window) is int and window > 1 and type(layer.__dict__.get("cumulative_length")) is int
                        and not layer.__dict__.get("record_past")):
        _GROWN.pop(layer, None)  # its own update from now on: the buffer is not kept for it
        return None
    keys, values = layer.__dict__.get("keys"), layer.__dict__.get("values")
    if not (_appendable(keys, shape, dtype, device) and _appendable(values, shape, dtype, device)
            and keys.shape == values.shape):
        _GROWN.pop(layer, None)
        return None
    length = keys.shape[2]
    grown = _GROWN.get(layer)
    if grown is not None:
        start, written, key_buffer, value_buffer = grown
        if not (written - start == length and written < key_buffer.shape[2]
                and _view_of(keys, key_buffer, start, length) and _view_of(values, value_buffer, start, length)):
            grown = None
    if grown is None:
        start, written = 0, length
        capacity = length + 1 + length // 8 + MIN_SPARE
        key_buffer, value_buffer = (t.new_empty(*t.shape[:2], capacity, t.shape[3]) for t in (keys, values))
        key_buffer[:, :, :length].copy_(keys)
        value_buffer[:, :, :length].copy_(values)
    kept = start if window is None else max(start, written + 2 - window)  # a window keeps its last window - 1
    layer.keys, layer.values = key_buffer[:, :, kept:written + 1], value_buffer[:, :, kept:written + 1]
    if window is not None:
        layer.cumulative_length += 1
    _GROWN[layer] = (kept, written + 1, key_buffer, value_buffer)
    return key_buffer[:, :, start:], value_buffer[:, :, start:], length


def _appendable(cached: object, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether one token of ``shape``, ``dtype`` and ``device`` can be written after ``cached`` into a buffer of
    ``cached``'s kind."""
    return (type(cached) is torch.Tensor and cached.dim() == 4 and len(shape) == 4 and shape[2] == 1
            and cached.shape[2] > 0 and tuple(shape[:2]) == cached.shape[:2] and shape[3] == cached.shape[3]
            and dtype is cached.dtype and device == cached.device and cached.layout is torch.strided
            and not cached.requires_grad and (torch.is_inference_mode_enabled() or not cached.is_inference()))


def _view_of(view: torch.Tensor, buffer: torch.Tensor, start: int, length: int) -> bool:
    """Whether ``view`` is ``buffer``'s ``length`` tokens from ``start`` on, as :func:`reserve` made it."""
    return (view.data_ptr() == buffer[:, :, start:].data_ptr() and view.shape[2] == length
            and view.stride() == buffer.stride()
            and (torch.is_inference_mode_enabled() or not buffer.is_inference()))


def clear() -> None:
    """Forget the grown layers (``fusion_core.reset_state()``); their buffers stay theirs."""
    _GROWN.clear()
