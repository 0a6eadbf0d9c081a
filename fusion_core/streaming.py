"""Building a merged tensor at load with each byte written once: straight from the checkpoint, or not at all.

A fused load lets transformers load the original parts (``q_proj.weight``, ``k_proj.weight``, ...)
and then merges them. ``torch.cat`` over parts that transformers left memory-mapped reads every
part through the shard's mapping, one page fault at a time on one thread, and the parts' pages stay
resident for as long as any tensor of their shard lives: the fused model holds its merged
projections twice (see :mod:`fusion_core.mapped_files`). For an op whose target is its sources
placed whole, back to back (:meth:`~fusion_core.transforms.TransformOp.flat_offsets`: ``Concat``
along dim 0, ``Stack``, the experts' gate/up pairs), :func:`merge` does better:

- **no copy at all** when the loaded parts already lie back to back in memory in the merged order,
  in one storage or one mapped checkpoint file (``gate_proj`` then ``up_proj`` in a shard
  transformers wrote, where tensors are sorted by name): the merged tensor is a view of that
  memory, as the parts were;
- otherwise one destination tensor, and each part's bytes go into it once: read with ``pread`` from
  the checkpoint file when the part is a clean view of it (its mapping is never touched, so its
  pages never become resident), split into chunks read on a few threads as transformers' own loader
  reads shards; or copied from the part where it is not file-backed (a quantizer, an accelerator), in
  chunks on the same threads, cast on the way where the load asked for another dtype than the
  checkpoint's (:mod:`fusion_core.casting`: transformers then loads the part as stored).

Everything else (other ops, tensor subclasses, DTensors, mixed dtypes or devices) returns None and
the op's own ``forward`` runs; so does every merge while a torch.distributed process group is up
(:func:`fusion_core.aliases.in_process_group`: two-rank torchrun runs that streamed aborted at
teardown now and then, which the plain ``torch.cat`` never did). The result is the op's forward
output bit for bit: the parts' bytes, in the op's order.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager

import torch

from fusion_core.aliases import in_process_group
from fusion_core.mapped_files import FileExtent, MappedFiles, clean, open_checked
from fusion_core.transforms import TransformOp

_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Bytes one thread reads at a time: big enough that handing it over costs nothing, small enough that the
#: parts of one merge (a 5 MB q_proj, two 1 MB k/v) keep every worker busy.
_CHUNK = 2 << 20
_WORKERS = max(1, min(8, os.cpu_count() or 1))
#: The reading threads of the current :func:`readers` block, if any.
_READERS: contextvars.ContextVar[ThreadPoolExecutor | None] = contextvars.ContextVar("fusion_core_readers",
                                                                                      default=None)


def merge(
    op: TransformOp, tensors: Sequence[torch.Tensor], files: MappedFiles | None, dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """``op.forward(tensors)[0]`` built in place (see the module docs), or None where this does not apply.

    ``files`` is the load's snapshot of mapped checkpoint files (None: copy every part from memory).
    With ``dtype``, the merged tensor has that dtype and a part of another dtype is cast as it is
    copied in (:mod:`fusion_core.casting`): ``op.forward([t.to(dtype) for t in tensors])[0]``.
    """
    if op.arity[1] != 1 or not tensors or in_process_group():
        return None
    offsets = op.flat_offsets([tuple(t.shape) for t in tensors])
    first = tensors[0]
    if offsets is None or first.device.type == "meta" or not all(
        type(t) in _PLAIN and (dtype is not None or t.dtype == first.dtype) and t.device == first.device
        and t.is_contiguous() for t in tensors
    ):
        return None
    dtype = dtype or first.dtype
    (shape,) = op.forward_shapes([tuple(t.shape) for t in tensors])
    in_place = _already_merged(tensors, offsets, shape, files) if all(t.dtype == dtype for t in tensors) else None
    if in_place is not None:
        return in_place
    merged = torch.empty(shape, dtype=dtype, device=first.device)
    flat = merged.view(-1)
    jobs: list[Callable[[], None]] = []  # each fills one chunk of the merged tensor
    with _descriptors() as descriptors:
        for tensor, offset in zip(tensors, offsets, strict=True):
            target = flat.narrow(0, offset, tensor.numel())
            extent = files.file_extent(tensor) if files is not None and tensor.dtype == dtype else None
            fd = _descriptor(extent, descriptors) if extent is not None and clean(tensor) else None
            if extent is None or fd is None:
                jobs.extend(_copies(target, tensor.reshape(-1)))
            else:
                jobs.extend(_reads(fd, extent, target.data_ptr()))
        _run(jobs)
    return merged


def process_memory_copies(tensors: Sequence[torch.Tensor], huge_pages: bool = False) -> list[torch.Tensor | None]:
    """For each tensor that is a clean view of a privately mapped checkpoint file (what transformers loads), a copy
    in memory this process owns, read from the file with ``pread`` as :func:`merge` reads parts (the mapping is never
    touched, so its pages never become resident); None for every other tensor (anonymous memory, a tensor subclass,
    another device, a page written since it was mapped, another OS), and for all of them inside a torch.distributed
    process group (see the module docs).

    Why a family wants this: a kernel may read a weight in a file mapping more slowly than the same bytes in
    anonymous memory (``torch.mv`` does, by about a fifth, on the development VM), and a merge that found its parts
    back to back in the file leaves the merged tensor a view of the mapping.

    With ``huge_pages``, each copy asks Linux to back its memory with transparent huge pages before it is read into
    (:func:`advise_huge_pages`)."""
    if in_process_group():
        return [None] * len(tensors)
    files = MappedFiles.snapshot()
    copies: list[torch.Tensor | None] = []
    jobs: list[Callable[[], None]] = []
    with _descriptors() as descriptors:
        for tensor in tensors:
            plain = type(tensor) in _PLAIN and tensor.device.type == "cpu"
            extent = files.file_extent(tensor) if plain else None
            fd = _descriptor(extent, descriptors) if extent is not None and clean(tensor) else None
            if extent is None or fd is None:
                copies.append(None)
                continue
            copy = torch.empty(tensor.shape, dtype=tensor.dtype)
            if huge_pages:
                advise_huge_pages(copy)
            jobs.extend(_reads(fd, extent, copy.data_ptr()))
            copies.append(copy)
        _run(jobs)
    return copies


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, or None where there is none to call (not Linux: ``MADV_HUGEPAGE`` is Linux's number)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside a new CPU tensor's memory with transparent huge pages
    (``madvise(MADV_HUGEPAGE)``), before anything is written there; whether the system took the advice.

    Why: a kernel streaming a weight from memory misses the TLB once per page; on small (4 KiB) pages that costs
    read bandwidth, most in a virtual machine, whose host maps the memory again (on the 2-core Xeon VM of
    docs/benchmarks.md a reduction read 25 GB/s on small pages and 36 GB/s on huge ones). The advice changes no
    value; where the system has no huge pages to give, or says no (``never`` in
    ``/sys/kernel/mm/transparent_hugepage/enabled``), the memory stays on small pages."""
    madvise = _madvise()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if madvise is None or tensor.device.type != "cpu" or last <= first:
        return False
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0


def _run(jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs``: on this thread when there is one, else on the reading threads (:func:`readers`)."""
    if len(jobs) == 1:
        jobs[0]()
    elif jobs:
        with _reading_threads(len(jobs)) as pool:
            _run_all(pool, jobs)


@contextmanager
def readers() -> Iterator[None]:
    """Merges in this block share one set of reading threads (a load's conversion: starting threads for each of
    hundreds of merges costs more than some of the reads). The threads are joined when the block ends: none
    outlives the load or reaches a forked child; outside such a block each merge starts and joins its own."""
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="fusion-core-merge") as pool:
        token = _READERS.set(pool)
        try:
            yield
        finally:
            _READERS.reset(token)


@contextmanager
def _reading_threads(jobs: int) -> Iterator[ThreadPoolExecutor]:
    """The threads of the enclosing :func:`readers` block, or, outside one, threads for this merge only."""
    shared = _READERS.get()
    if shared is not None:
        yield shared
        return
    with ThreadPoolExecutor(min(_WORKERS, jobs), thread_name_prefix="fusion-core-merge") as own:
        yield own


@contextmanager
def _descriptors() -> Iterator[dict[tuple[str, int], int | None]]:
    """The files one merge or copy opens (:func:`_descriptor`), closed when it ends."""
    opened: dict[tuple[str, int], int | None] = {}
    try:
        yield opened
    finally:
        for fd in opened.values():
            if fd is not None:
                os.close(fd)


def _reads(fd: int, extent: FileExtent, address: int) -> list[Callable[[], None]]:
    """Jobs reading the extent's bytes from ``fd`` into memory at ``address``, a chunk each."""
    return [functools.partial(_read, fd, extent.offset + start, address + start, min(_CHUNK, extent.length - start))
            for start in range(0, extent.length, _CHUNK)]


def _descriptor(extent: FileExtent, opened: dict[tuple[str, int], int | None]) -> int | None:
    """The (cached) descriptor of the extent's file; None when its path no longer names the mapped file."""
    key = (extent.path, extent.inode)
    if key not in opened:
        opened[key] = open_checked(extent)
    return opened[key]


def _already_merged(
    tensors: Sequence[torch.Tensor], offsets: Sequence[int], shape: tuple[int, ...], files: MappedFiles | None
) -> torch.Tensor | None:
    """The merged tensor as a view of the parts' own memory, when they lie there back to back in the merged order:
    in one storage, or in one file mapping (transformers gives each tensor of a shard its own storage over the
    shard's one mapping)."""
    first = tensors[0]
    size = first.element_size()
    base = first.data_ptr() - offsets[0] * size
    if any(t.data_ptr() != base + offset * size for t, offset in zip(tensors, offsets, strict=True)):
        return None
    storage = first.untyped_storage()
    start = int(first.storage_offset()) - offsets[0]
    if start >= 0 and all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors):
        return _view(storage, start, shape, first)
    # Back to back in one mapped checkpoint file (transformers gives each tensor of a shard its own storage over
    # the shard's mapping): a view of a mapping of that file of our own, where every part still holds the file's
    # bytes. Not an alias of the parts' memory: a storage freed by a Python deleter at interpreter exit aborts
    # torch.distributed's teardown.
    length = math.prod(shape) * size
    span = files.extent_at(base, length) if files is not None and first.device.type == "cpu" else None
    if files is None or span is None or span.offset % size or not all(clean(t) for t in tensors):
        return None
    mapped = files.storage(span)
    if mapped is None:
        return None
    return _view(mapped, span.offset // size, shape, first)


def _view(storage: torch.UntypedStorage, offset: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A contiguous ``shape`` tensor of ``like``'s dtype and device over ``storage`` from element ``offset``."""
    view = torch.empty(0, dtype=like.dtype, device=like.device)
    return view.set_(storage, offset, shape, torch.empty(shape, device="meta").stride())


def _copies(target: torch.Tensor, source: torch.Tensor) -> list[Callable[[], None]]:
    """Jobs copying (and casting) the flat ``source`` into the flat ``target``: chunks of ``_CHUNK`` target bytes on
    the CPU. Filling fresh memory from several threads one chunk each is about three times as fast as one copy
    that torch splits across its own threads, which fault the same new pages from both ends (measured at
    Qwen2.5-1.5B shapes on a 2-core machine: 110 MB in 150 ms vs 40 ms)."""
    if target.device.type != "cpu":
        return [functools.partial(_copy, target, source, 0, target.numel())]
    step = max(1, _CHUNK // target.element_size())
    return [functools.partial(_copy, target, source, start, min(start + step, target.numel()))
            for start in range(0, target.numel(), step)]


def _copy(target: torch.Tensor, source: torch.Tensor, start: int, stop: int) -> None:
    target[start:stop].copy_(source[start:stop])


def _run_all(pool: ThreadPoolExecutor, jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs`` on ``pool``; return once every one has ended, then raise the first failure. A job still
    running when the merge gives up (a short read) would go on writing into a merged tensor already freed."""
    futures = [pool.submit(job) for job in jobs]
    wait(futures)
    for future in futures:
        future.result()


def _read(fd: int, offset: int, address: int, length: int) -> None:
    """``length`` bytes of the file at ``offset`` into memory at ``address`` (``preadv`` releases the GIL)."""
    buffer = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
    done = 0
    while done < length:
        count = os.preadv(fd, [buffer[done:]], offset + done)
        if count <= 0:
            raise OSError(f"short read: {done} of {length} bytes at offset {offset}")
        done += count


__all__ = ["merge", "process_memory_copies", "readers"]
