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
recomputation included), ``malloc_trim(0)`` gives the free heap's pages back once the memory malloc keeps resident
without using it has grown by :data:`MIN_GROWTH`, or the memory in use has risen by :data:`MIN_RISE` since the last
look. Trimming drops the pages of free chunks only (``madvise``): no value changes, and the memory in use is untouched.

What is counted, and from when, decides both the peak and the time (docs/benchmarks.md):

- *Resident and unused*: the process's anonymous resident memory less what malloc has handed out (``mallinfo2``'s
  ``uordblks`` and ``hblkhd``). The free heap's size (``fordblks``) is not enough: it still counts the chunks a trim
  emptied, so when later layers fault those pages back in and free them again, it does not move. Counting it let the
  unused resident memory grow by about 0.6 GB over a backward between trims (both widths below).
- *From the layer after a trim*: a trim empties the pages the next layer's working set is about to use. That layer
  faults them back in, and they stay resident for the layers after it to reuse. Counted from just after the trim,
  that working set alone (about 300 MB a layer at Llama-3.2-1B widths and 2048 tokens) reads as growth, and a trim
  then came at nearly every boundary, 31 a step, costing 10-20% of the step's time in refaulted pages. Counted from
  the first look after a trim, only what the layers leave behind beyond their working set counts: 6-9 trims a step
  at the Qwen2-0.5B and Llama-3.2-1B widths (LoRA, 2048 tokens; counted in throwaway runs), where the step's peak
  went from 0.245x plain's to 0.215x and from 0.277x to 0.259x, at plain's time (``benchmarks/bench_train.py``).
- *Memory in use rising*: in full fine-tuning every layer's backward adds its gradients to the memory in use (a net
  108 MiB a layer at Llama-3.2-1B widths and 2048 tokens), so the step peaks in its last layer's backward, and
  whatever malloc keeps unused there sits on top of that peak: counted from the first look after a trim, it had not
  grown enough for a trim in the last layers (370-395 MiB unused there, a working set of about 370). A rise of the
  memory in use by :data:`MIN_RISE` from one look to the next (the memory malloc has handed out, which no trim or
  refault moves) trims at once: at every backward boundary of a full fine-tuning of Llama-3.2-1B, in no forward,
  and not in a LoRA step, whose backward frees more than it adds. At Llama-3.2-1B widths (full fine-tuning,
  checkpointing, 2048 tokens, a 2-core AMD EPYC) the step's peak went from 0.633x plain's to 0.589x, at 1.05x plain's
  step time (each layer's working set faulted back in; ``benchmarks/bench_train.py``).

Where the C library is not glibc (no ``malloc_trim`` and ``mallinfo2``, glibc 2.33 on), nothing is hooked. The hooks
are removed when the forward returns; the gradient hooks go with the autograd graph.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

MIN_GROWTH = 256 * 2**20
"""Bytes the resident unused memory grows by, from the first look after a trim, before the next trim."""
MIN_RISE = 64 * 2**20
"""A rise of the memory in use (what malloc has handed out) from one look to the next that trims at once: above what a
forward adds a boundary (a layer's saved input, 8 MiB at Llama-3.2-1B widths and 2048 tokens), below what a 1B
model's layer adds in gradients."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _glibc() -> tuple[Callable[[], tuple[int, int]], Callable[[], int]] | None:
    """``(look, trim)`` of this process's glibc, or None where its C library has not both: ``look()`` is ``(in use,
    unused)``, the bytes malloc has handed out and the process's anonymous resident bytes it has not. Looked up among
    the process's own symbols (as fusion-core finds ``madvise``), not by ``ctypes.util.find_library``, which runs
    ``ldconfig`` in a subprocess."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        info, trim = libc.mallinfo2, libc.malloc_trim
        page = os.sysconf("SC_PAGE_SIZE")
        _anonymous_resident(page)
    except (OSError, AttributeError, ValueError):
        return None
    info.restype, info.argtypes = _MallInfo2, []
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]

    def look() -> tuple[int, int]:
        held = info()
        in_use = int(held.uordblks) + int(held.hblkhd)
        return in_use, _anonymous_resident(page) - in_use

    def release() -> int:
        return int(trim(0))

    return look, release


def _anonymous_resident(page: int) -> int:
    """Resident bytes not backed by a file (``/proc/self/statm``'s resident less shared pages): a checkpoint's
    memory-mapped weights faulting in are not malloc's to give back. Opened at each look (about 6 microseconds, a few
    dozen times a step): a descriptor kept open would go on reading the parent's figures in a forked child."""
    with open("/proc/self/statm", "rb") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * page


def available() -> bool:
    """Whether this process's allocator is glibc's, with ``malloc_trim`` and ``mallinfo2``, and its resident size
    can be read (``/proc/self/statm``)."""
    return _glibc() is not None


class _Trimmer:
    """Trims when the resident unused memory has grown by :data:`MIN_GROWTH` since the first look after the last trim,
    or the memory in use has risen by :data:`MIN_RISE` since the last look (the module docs say why each)."""

    def __init__(self, look: Callable[[], tuple[int, int]], trim: Callable[[], int]) -> None:
        self.look, self.trim = look, trim
        self.in_use, self.floor = look()
        self.settling = False

    def __call__(self) -> None:
        in_use, unused = self.look()
        rising, self.in_use = in_use - self.in_use >= MIN_RISE, in_use
        if rising or (not self.settling and unused - self.floor >= MIN_GROWTH):
            self.trim()
            self.settling = True
        elif self.settling:
            self.floor, self.settling = unused, False

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
