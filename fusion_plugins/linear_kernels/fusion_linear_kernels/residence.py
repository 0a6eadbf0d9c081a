"""Dense weights a decode kernel reads live in the process's own memory, not in the checkpoint's file mapping.

transformers (4.57 and 5.x alike) loads a safetensors checkpoint whose dtype matches without copying it: each
parameter is a view of a private mapping of the file (``rw-p ... model.safetensors`` in ``/proc/self/maps``), backed
by page-cache pages; and a merge that finds its parts back to back in the file (``gate_proj`` then ``up_proj``) leaves
the merged weight a view of such a mapping too. A GEMV reads a weight there more slowly than the same bytes in
anonymous memory. Measured on the development VM (2-core Xeon, torch 2.13.0, bf16, ``torch.mv`` over Qwen2-0.5B's 48
gate/up weights, 418 MB, best of 5 passes): **20.1-20.4 GB/s mapped, 24.3-24.6 GB/s** for copies of the same
weights (a throwaway probe). ``benchmarks/bench_decode.py`` shows the same in its floor note, ``mv over the
weights``, which reads plain's weights: as loaded (``--as-loaded``) 19.5 GB/s at Qwen2-0.5B and 23.8 GB/s at
Llama-3.2-1B, copied (the default) 22.5 and 28.0 GB/s. (Copies on transparent huge pages read at 24.7-25.2 GB/s in
the probe but took 7x longer to make: not taken.)

So after a load converts, each dense weight a ``linear_kernels`` layer runs (the tied LM head included: the table is
one parameter object, moved once, and stays tied) that is a clean view of a privately mapped file is read from the
file into memory the process owns (:func:`fusion_core.plugin.process_memory_copies`: ``pread``, the mapping's pages
never become resident), and the parameter takes the copy (``param.data``: the same parameter object, the same bits).
Memory stays near the plain model's: plain holds those pages resident in the mapping once its first forward reads
them, the fused model holds the copy instead (a throwaway probe: peak RSS after a load and a 32-token generate,
Qwen2-0.5B, 1366 MB fused against 1317 MB plain). Nothing else moves: a weight whose bytes another parameter or
buffer also covers (moving one would untie them), packed weights (oneDNN made its copy already), a quantizer's
tensors, other devices, anything :func:`~fusion_core.plugin.process_memory_copies` declines (no ``/proc``, a
written page, a process group), and nothing at all in exact mode: a GEMM's bits can depend on the weight's address
(on an AMD EPYC, ``F.linear`` of a float32 weight 24 bytes past a 64-byte boundary, as the file view lay, differed
from the same weight in an aligned copy), and exact mode promises plain's bits.

**Huge pages.** Each copy asks Linux for transparent huge pages before it is read into
(:func:`fusion_core.plugin.process_memory_copies` with ``huge_pages``): a GEMV streaming a weight misses the TLB once
per page, and on small pages that costs bandwidth, most in a virtual machine. Measured on the 2-core Xeon VM with
throwaway probes, not in the repository (bf16,
the GEMV kernel over a pass of copies, GB/s, small / huge pages): 9728x896 27.5 / 32.3, 896x896 26.9 / 31.7,
151936x896 28.0 / 35.0, 896x4864 32.9 / 35.4; Qwen2-0.5B loaded with every family on, a greedy ``generate`` of
33 tokens after a 16-token prompt (prefill included), best of 3, over 33, 3 fresh processes each: 62.9-65.4 against
55.0-57.4 ms a token (760 MB on huge pages).
The cost is at load, when the pages are first written: 2.35-2.53 s against 3.24-3.38 s there. That VM's host backs
a free 2 MiB block of the guest's memory only when it is touched again (nothing was compacted: ``compact_stall``
stayed 0), so on other machines it is less. ``FUSION_LINEAR_KERNELS_HUGE_PAGES=0`` in the environment keeps the
copies on small pages; a system whose ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never`` keeps them there
anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from fusion_core.plugin import process_memory_copies

HUGE_PAGES_VARIABLE = "FUSION_LINEAR_KERNELS_HUGE_PAGES"
"""The environment variable that, set to ``0``, keeps the moved weights on small pages (see the module docs)."""


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` a strided CPU tensor's elements may cover, or None for one Python cannot see the
    memory of (a packed weight, a tensor subclass without storage)."""
    try:
        start = tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (reach + 1) * tensor.element_size()


def _overlapped(model: nn.Module) -> set[int]:
    """The ids of the model's parameters and buffers whose bytes another distinct one also covers (tied weights held
    as two tensors, views of one another)."""
    spans = []
    for tensor in {id(t): t for _, t in (*model.named_parameters(remove_duplicate=False),
                                         *model.named_buffers(remove_duplicate=False))}.values():
        span = _span(tensor) if tensor.device.type == "cpu" and tensor.numel() else None
        if span is not None:
            spans.append((*span, id(tensor)))
    spans.sort()
    overlapped: set[int] = set()
    reach, owner = -1, 0
    for start, end, key in spans:
        if start < reach:
            overlapped.update((key, owner))
        if end > reach:
            reach, owner = end, key
    return overlapped


def move_into_process_memory(model: nn.Module, parameters: Iterable[nn.Parameter]) -> int:
    """Read each of ``parameters`` that lies in a checkpoint's file mapping into memory this process owns, keeping the
    parameter object (see the module docs); returns the bytes moved."""
    candidates = list({id(p): p for p in parameters
                       if type(p) is nn.Parameter and p.device.type == "cpu" and _span(p) is not None}.values())
    if not candidates:
        return 0
    shared = _overlapped(model)
    candidates = [p for p in candidates if id(p) not in shared]
    moved = 0
    copies = process_memory_copies([p.data for p in candidates], huge_pages=huge_pages())
    for param, copy in zip(candidates, copies, strict=True):
        if copy is not None:
            param.data = copy
            moved += copy.numel() * copy.element_size()
    return moved


def huge_pages() -> bool:
    """Whether the moved weights ask for huge pages: unless :data:`HUGE_PAGES_VARIABLE` is ``0``."""
    return os.environ.get(HUGE_PAGES_VARIABLE, "1").strip() != "0"
