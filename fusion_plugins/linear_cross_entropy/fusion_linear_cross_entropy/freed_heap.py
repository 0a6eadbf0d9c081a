"""Freed heap given back to the system at the decoder layers' boundaries of a training call (glibc only).

Once the chunked loss no longer builds the logits, what a CPU training step's resident memory peaks on is mostly
memory that is already free: glibc's malloc keeps the heap it freed. After its first free of a large block it raises
its mmap threshold (up to 32 MiB), so a layer's activations and their recomputation come from the heap, and the holes
they leave between blocks still in use are seldom reused or returned. Measured on a 2-core Xeon VM (Qwen2-0.5B widths,
24 layers, LoRA with non-reentrant gradient checkpointing, 2048 tokens, bf16, a throwaway script with ``mallinfo2``):
over the forward the heap grew from 227 to 1042 MB while the memory in use in it grew by 105 MB (the saved layer
inputs), and the backward's recomputation added as much again; the step peaked at its end.

So, during a training call with labels, each layer the model checkpoints (transformers'
``GradientCheckpointingLayer``) gets a forward pre-hook for the call's duration, and the hidden states it is given a
gradient hook: before a layer's forward and after the gradient of its input is computed (the layer's backward, its
recomputation included), ``malloc_trim(0)`` gives the free heap's pages back once the free heap has grown by
:data:`MIN_GROWTH` since the last trim. Trimming drops the pages of free chunks only (``madvise``): no value changes,
and the memory in use is untouched. Growth-triggered, it trims about three times a step there: the step's peak went
from 0.326x plain's to 0.245x at 0.988x plain's time (``benchmarks/bench_train.py``). Trimming more often held the
peak lower and cost time, the freed pages refaulting and 12-18 ms a trim: at 128 MiB of growth 0.205x and about 8%,
at every boundary about 10% (docs/benchmarks.md).

Where the C library is not glibc (no ``malloc_trim`` and ``mallinfo2``, glibc 2.33 on), nothing is hooked. The hooks
are removed when the forward returns; the gradient hooks go with the autograd graph.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

MIN_GROWTH = 256 * 2**20
"""Bytes the free heap grows by between two trims."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _glibc() -> tuple[Callable[[], int], Callable[[], int]] | None:
    """``(free heap bytes, trim)`` of this process's glibc, or None where its C library has not both. Looked up among
    the process's own symbols (as fusion-core finds ``madvise``), not by ``ctypes.util.find_library``,
    which runs ``ldconfig`` in a subprocess."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        info, trim = libc.mallinfo2, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    info.restype, info.argtypes = _MallInfo2, []
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]

    def free() -> int:
        return int(info().fordblks)

    def release() -> int:
        return int(trim(0))

    return free, release


def available() -> bool:
    """Whether this process's allocator is glibc's, with ``malloc_trim`` and ``mallinfo2``."""
    return _glibc() is not None


class _Trimmer:
    """Trims when the free heap has grown by :data:`MIN_GROWTH` since the last trim."""

    def __init__(self, free: Callable[[], int], trim: Callable[[], int]) -> None:
        self.free, self.trim = free, trim
        self.floor = free()

    def __call__(self) -> None:
        if self.free() - self.floor >= MIN_GROWTH:
            self.trim()
            self.floor = self.free()

    def before_layer(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:  # grad mode may be off: reentrant checkpointing
            hidden.register_hook(self.after_backward)

    def after_backward(self, grad: torch.Tensor) -> None:
        self()


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that transformers checkpoints (``GradientCheckpointingLayer``), or none."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - every supported release has it
        return []
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


@contextmanager
def trimmed_at_layers(model: nn.Module) -> Iterator[None]:
    """For the ``with`` block (a training call's forward), the hooks of the module docs on ``model``'s layers."""
    glibc = _glibc()
    layers = checkpointed_layers(model) if glibc is not None else []
    if glibc is None or not layers:
        yield
        return
    trimmer = _Trimmer(*glibc)
    handles = [layer.register_forward_pre_hook(trimmer.before_layer, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
