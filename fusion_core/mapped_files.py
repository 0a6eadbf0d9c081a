"""Which file bytes back a CPU tensor that transformers left memory-mapped, and whether they still hold its values.

transformers loads a safetensors shard through one private, copy-on-write mapping of the whole
file (``torch.UntypedStorage.from_file``), and when no dtype conversion is needed every tensor of
that shard is a view of it. A page of such a mapping enters the process's resident memory when it
is first read, and stays there as long as *any* tensor of the shard lives. So merging the parts of
a fused projection by reading them through the mapping leaves their pages resident next to the
merged copy: the fused model ends up holding its merged projections twice.

:func:`file_extent` finds, for a tensor, the file and offset its bytes are mapped from (Linux
``/proc/self/maps``), and :func:`clean` checks that none of its pages was written since it was mapped
(``/proc/self/pagemap``: a page written in a private mapping becomes a private anonymous copy, or is
swapped out, and then differs from the file). Bytes that pass both are the file's bytes, and can be
read with ``pread`` straight into the merged tensor without the mapping ever being touched. Anywhere
this cannot be established (another OS, an unreadable ``/proc``, a renamed or replaced file), the
answer is None or False and the caller copies through the tensor as before.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import cast

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PRESENT, _SWAPPED, _FILE_OR_SHARED = 0x80, 0x40, 0x20  # of a pagemap entry's top byte
#: A pagemap entry's top byte -> 1 for a page that may differ from the file: swapped out, or present but a
#: private anonymous copy (written); plain bytes, no tensor: this runs inside loads under torch.distributed too.
_TOP_BYTE = bytes(int(bool(b & _SWAPPED) or (bool(b & _PRESENT) and not b & _FILE_OR_SHARED)) for b in range(256))
_WRITTEN = b"\x01"


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/self/maps`` that maps a regular file privately."""

    start: int
    end: int
    offset: int
    inode: int
    path: str


@dataclass(frozen=True)
class FileExtent:
    """``length`` bytes of ``path`` from ``offset``: where a tensor's bytes are mapped from."""

    path: str
    offset: int
    length: int
    inode: int


class MappedFiles:
    """A snapshot of this process's private file mappings, taken once per load (mappings change only by
    loading, and a load holds every shard's mapping open until it returns)."""

    def __init__(self, mappings: list[Mapping]) -> None:
        self._mappings = sorted(mappings, key=lambda m: m.start)
        self._starts = [m.start for m in self._mappings]
        self._storages: dict[tuple[str, int], torch.UntypedStorage | None] = {}

    @classmethod
    def snapshot(cls) -> MappedFiles:
        """The current mappings; empty where ``/proc/self/maps`` cannot be read."""
        try:
            with open("/proc/self/maps") as handle:
                lines = handle.read().splitlines()
        except OSError:
            return cls([])
        return cls([m for line in lines if (m := _parse(line)) is not None])

    def file_extent(self, tensor: torch.Tensor) -> FileExtent | None:
        """The file bytes a contiguous CPU tensor is a view of, or None (anonymous memory, another device)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        return self.extent_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def extent_at(self, address: int, length: int) -> FileExtent | None:
        """The file bytes mapped at ``length`` bytes from ``address``, when one private file mapping holds them all."""
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0:
            return None
        mapping = self._mappings[index]
        if address + length > mapping.end:
            return None
        return FileExtent(mapping.path, mapping.offset + address - mapping.start, length, mapping.inode)

    def storage(self, extent: FileExtent) -> torch.UntypedStorage | None:
        """A private, copy-on-write mapping of the extent's whole file as a torch storage (one per file and load;
        pages are read only when used), or None when its path no longer names the mapped file.

        torch owns it like the storage transformers loads a shard into: no Python object stands behind it.
        """
        key = (extent.path, extent.inode)
        if key not in self._storages:
            fd = open_checked(extent)
            if fd is None:
                self._storages[key] = None
            else:
                try:
                    size = os.fstat(fd).st_size
                    mapped = torch.UntypedStorage.from_file(extent.path, False, size)
                    self._storages[key] = cast(torch.UntypedStorage, mapped)
                finally:
                    os.close(fd)
        return self._storages[key]


def _parse(line: str) -> Mapping | None:
    fields = line.split(maxsplit=5)
    if len(fields) < 6 or not fields[5].startswith("/") or fields[5].endswith(" (deleted)"):
        return None
    span, perms, offset, _device, inode, path = fields
    if len(perms) < 4 or perms[3] != "p" or inode == "0":
        return None
    start, _, end = span.partition("-")
    return Mapping(int(start, 16), int(end, 16), int(offset, 16), int(inode), path)


def clean(tensor: torch.Tensor) -> bool:
    """Whether no page under ``tensor`` was written or swapped since it was mapped (False when unknown)."""
    address = tensor.data_ptr()
    first = address // _PAGE
    last = (address + tensor.numel() * tensor.element_size() - 1) // _PAGE
    count = last - first + 1
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as handle:
            entries = os.pread(handle.fileno(), 8 * count, 8 * first)
    except OSError:
        return False
    if len(entries) != 8 * count:
        return False
    # Bits 63 (present), 62 (swapped) and 61 (file page or shared) are in the top byte of each little-endian entry.
    return _WRITTEN not in entries[7::8].translate(_TOP_BYTE)


def open_checked(extent: FileExtent) -> int | None:
    """A read-only descriptor of the extent's file, or None when the path no longer names the mapped file."""
    try:
        fd = os.open(extent.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    status = os.fstat(fd)
    if status.st_ino != extent.inode or status.st_size < extent.offset + extent.length:
        os.close(fd)
        return None
    return fd
