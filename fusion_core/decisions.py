"""Decisions measured once per kind ("which way is faster here"), remembered per machine and software.

A fused module that can compute the same thing several ways (the merged GEMM or one GEMM per part, a
GEMV kernel or ``F.linear``, a weight prepacked or dense, an experts implementation) asks its
:class:`Decisions` table, one per topic, for the way to run each *kind* of call: a tuple of what the
speed depends on (shapes, dtype, strides, rows, mode), which the caller builds. The first time a kind
is asked in a process:

- the store may hold the decision this machine and software took in an earlier process: it is used,
  nothing is timed (so two processes on one machine decide alike until the store is cleared);
- else the caller's ``measure`` runs, and its decision is kept for the process and written to the store.

**How a decision is measured**: the way decode runs. A pass reads distinct weights of the kind from
memory (:func:`distinct_copies`, :func:`pass_size`: more bytes than the CPU's last-level cache holds,
:func:`pass_bytes`, where one weight timed again and again, or a pass the cache holds, would be served from
cache; ``FUSION_CORE_PASS_BYTES`` sets another size), each way is timed by :func:`best_times` over at least
five interleaved rounds and until 50 ms were timed (a time budget, not a test of the noise: hence the
margin), and one tie rule decides (:meth:`Decisions.fastest`, :func:`faster`): the first way, the
original's, is kept unless another was faster by more than :data:`MARGIN`.

**The store** is one JSON file, ``decisions.json`` under ``$FUSION_CORE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/fusion_core``, else ``~/.cache/fusion_core``)::

    {"format": 1, "machines": {"<fingerprint digest>": {
        "fingerprint": {"cpu": ..., "cpu_flags": ..., "torch": ..., "torch_build": ..., "threads": ...},
        "decisions": {"<topic>[@<code>]": {"<kind as JSON>": <decision>}}}}}

keyed by :func:`fingerprint` (CPU model and flags, core and thread counts, torch version and build,
the versions of transformers, fusion-core and the plugins): another machine, or an upgrade, measures anew. Written
atomically (a temporary file, then ``os.replace``); a file that cannot be read or written is warned
about once (:class:`DecisionStoreWarning`) and the decisions are measured and kept in memory.

``FUSION_CORE_DECISIONS`` chooses how the store is used: ``stored`` (default: reuse, measure what is
missing and store it), ``measure`` (measure every kind again in this process and store the results)
or ``off`` (no store: measure, and keep the decisions in memory only). ``fusion tune`` forgets this
machine's stored decisions (:func:`forget_stored`). :func:`fusion_core.reset_state` forgets the
decisions in memory (:func:`reset`), not the store: the next call of each kind reads it again, as a
fresh process would.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

MODE_VARIABLE = "FUSION_CORE_DECISIONS"
CACHE_VARIABLE = "FUSION_CORE_CACHE_DIR"
PASS_VARIABLE = "FUSION_CORE_PASS_BYTES"
_MODES = ("stored", "measure", "off")
_FORMAT = 1

MARGIN = 1.02
"""Another way is taken over the first (the original's) only when it measured faster by more than this factor."""
PASS_BYTES = 64 * 2**20
"""Bytes of distinct weights a timed pass reads beyond the CPU's last-level cache (:func:`pass_bytes`), and on an
accelerator in all (more than an H100's 50 MB L2)."""
MAX_PASS = 4096
"""The most distinct tensors one pass reads."""
_MIN_ROUNDS, _MAX_ROUNDS, _MIN_SECONDS, _MAX_SECONDS = 5, 50, 0.05, 0.5

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class DecisionStoreWarning(UserWarning):
    """The decision store could not be read or written: decisions are measured and kept in memory instead."""


# -- measuring ---------------------------------------------------------------------------------------
def best_times(ways: Sequence[Callable[[], object]], device: torch.device) -> list[float]:
    """Seconds of the fastest call of each of ``ways``, in their order: one untimed round, then rounds calling every
    way once in alternating order (neither always runs on caches the other warmed), at least five and until 50 ms
    were timed (at most 50; as many as half a second holds, two at least, where the ways are that slow),
    synchronised on an accelerator. Callers run it under ``torch.no_grad``."""
    wait: Callable[[], None] = (
        (lambda: None) if device.type == "cpu" else (lambda: torch.accelerator.synchronize(device))
    )
    best = [float("inf")] * len(ways)
    order = list(range(len(ways)))
    spent, round_ = 0.0, 0
    while round_ <= 2 or (spent < _MAX_SECONDS and round_ <= _MIN_ROUNDS) or (
            spent < _MIN_SECONDS and round_ <= _MAX_ROUNDS):
        for index in order if round_ % 2 else reversed(order):
            wait()
            start = time.perf_counter()
            ways[index]()
            wait()
            if round_:  # round 0 warms every way up
                elapsed = time.perf_counter() - start
                best[index], spent = min(best[index], elapsed), spent + elapsed
        round_ += 1
    return best


def faster(seconds: float, than: float) -> bool:
    """The one tie rule: whether ``seconds`` is faster than ``than`` by more than :data:`MARGIN` (less is noise)."""
    return seconds * MARGIN < than


@functools.cache
def device_key(device: torch.device) -> str:
    """How a kind names its device: the CPU's model and flags are in every stored decision's fingerprint, an
    accelerator's model is here (a decision measured on one GPU is not another's)."""
    return f"{device} {torch.cuda.get_device_name(device)}" if device.type == "cuda" else str(device)


@functools.cache
def last_level_cache(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of the largest cache the first CPU reports (Linux sysfs: ``root/index*/size``, "491520K"); 0 where
    unknown."""
    sizes = [0]
    for path in root.glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text[:-1] if unit > 1 else text
        sizes.append(int(digits) * unit if digits.isdigit() else 0)
    return max(sizes)


def pass_bytes(device: torch.device | None = None) -> int:
    """Bytes of distinct weights a timed pass reads, so that each call reads its weight from memory as a decode step
    does: on the CPU, ``FUSION_CORE_PASS_BYTES`` where set, else the last-level cache plus :data:`PASS_BYTES`; on an
    accelerator, :data:`PASS_BYTES`. A pass the cache holds times the cache: on a 2-core Xeon whose VM reports a
    480 MiB L3, ``torch.mv`` over 896x4864 bfloat16 weights read 43 GB/s in a 64 MiB pass and 26 GB/s from 256 MiB
    on, the bandwidth decode gets, and which kernel was faster changed with it."""
    if device is not None and device.type != "cpu":
        return PASS_BYTES
    configured = os.environ.get(PASS_VARIABLE, "").strip()
    if configured:
        if not configured.isdigit() or int(configured) == 0:
            raise ValueError(f"{PASS_VARIABLE}={configured!r}: expected a positive number of bytes")
        return int(configured)
    return last_level_cache() + PASS_BYTES


def pass_size(nbytes: int, available: int = MAX_PASS, device: torch.device | None = None) -> int:
    """How many distinct tensors of ``nbytes`` each a timed pass reads: :func:`pass_bytes` in all, at least one, at
    most :data:`MAX_PASS` and ``available``."""
    return max(1, min(MAX_PASS, available, -(-pass_bytes(device) // max(nbytes, 1))))


def distinct_copies(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` and copies of it (same strides), :func:`pass_size` in all: a pass over them reads them from
    memory, as a decode step reads a model's weights. A tensor subclass (a quantizer's weight, whose copies may
    not behave as the original: torchao's refuse slicing in inference mode) is timed alone."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return [tensor]
    count = pass_size(tensor.numel() * tensor.element_size(), device=tensor.device)
    try:
        return [tensor, *(tensor.clone() for _ in range(count - 1))]
    except (RuntimeError, NotImplementedError, TypeError):
        return [tensor]


# -- the tables --------------------------------------------------------------------------------------
_TABLES: weakref.WeakValueDictionary[int, Decisions[Any, Any]] = weakref.WeakValueDictionary()


class Decisions(dict[K, T], Generic[K, T]):
    """The decisions of one ``topic`` (``"merge"``, ``"linear_kernels.choice"``, ...), by kind: a dict (this
    process's decisions) that :meth:`decide` fills from the store or by measuring.

    A decision is stored as JSON: ``save`` turns it into a JSON value (default: as it is; tuples become lists) and
    ``load`` back (default: lists become tuples); a stored value ``load`` maps to None is measured again.

    ``generation`` counts the times the table was cleared (:meth:`forget`, :func:`reset`): a caller that keeps a
    decision of its own to skip the lookup on a hot path (``linear_kernels``' layers) keeps it only while the
    generation it read it in lasts.

    ``code`` names the version of the code whose speed the decisions rest on (a digest of a kernel built on the
    machine: ``linear_kernels`` passes its GEMV kernel's): decisions stored under another are measured again, as for
    another machine, since the store's fingerprint knows only the distributions' versions, which a checkout of other
    code may share. The topic stays the table's name (what :attr:`topic`, a fake clock and ``fusion tune`` read).
    """

    def __init__(self, topic: str, save: Callable[[T], Any] | None = None,
                 load: Callable[[Any], T | None] | None = None, code: str = "") -> None:
        super().__init__()
        self.topic, self._save, self._load = topic, save, load
        self.code = code
        self._stored_as = f"{topic}@{code}" if code else topic
        self.generation = 0
        _TABLES[id(self)] = self

    def clear(self) -> None:
        """Forget this process's decisions (not the store's) and start a new :attr:`generation`."""
        super().clear()
        self.generation += 1

    def decide(self, kind: K, measure: Callable[[], T]) -> T:
        """The decision for ``kind``: this process's, else the store's (nothing timed), else ``measure()``'s (kept,
        and stored unless ``FUSION_CORE_DECISIONS=off``)."""
        if kind in self:
            return self[kind]
        how, key = mode(), _key(kind)
        if how == "stored":
            value = _stored(store_path()).get(self._stored_as, {}).get(key)
            value = None if value is None else (self._load or _tupled)(value)
            if value is not None:
                self[kind] = value
                return value
        value = self[kind] = measure()
        if how != "off":
            saved = value if self._save is None else self._save(value)
            _change(lambda machines: _mine(machines).setdefault(self._stored_as, {}).update({key: saved}) is None)
        return value

    def times(self, ways: Sequence[Callable[[], object]], device: torch.device) -> list[float]:
        """Seconds of each of ``ways`` (:func:`best_times`). The one seam where a test replaces the clock:
        ``monkeypatch.setattr(Decisions, "times", fake)``, ``fake(table, ways, device)`` (``table.topic`` says
        whose decision is timed); :func:`fusion_core.testing.decisions.fake_clock` builds one per topic."""
        return best_times(ways, device)

    def fastest(self, ways: Sequence[Callable[[], object]], device: torch.device) -> int:
        """The index of the way taken: the fastest, unless it is not :func:`faster` than the first (the original's
        way, kept on a tie)."""
        times = self.times(ways, device)
        best = min(range(len(times)), key=times.__getitem__)
        return best if faster(times[best], times[0]) else 0

    def forget(self) -> None:
        """Forget this topic's decisions, in this process and in the store for this machine: the next call of each
        kind measures again."""
        self.clear()
        if mode() != "off":
            _change(lambda machines: _mine(machines).pop(self._stored_as, None) is not None)


def reset() -> None:
    """Forget every table's decisions in this process (:func:`fusion_core.reset_state`); the store is kept."""
    for table in list(_TABLES.values()):
        table.clear()
    _SEEN.clear()
    _WARNED.clear()
    _host.cache_clear()


def mode() -> str:
    """``FUSION_CORE_DECISIONS``: ``"stored"`` (default), ``"measure"`` or ``"off"``."""
    raw = os.environ.get(MODE_VARIABLE, "").strip().lower() or "stored"
    if raw not in _MODES:
        raise ValueError(f"environment variable {MODE_VARIABLE}: unknown mode {raw!r}; expected one of "
                         f"{', '.join(_MODES)}")
    return raw


# -- the store ---------------------------------------------------------------------------------------
def store_path() -> Path:
    """The store: ``decisions.json`` under ``$FUSION_CORE_CACHE_DIR``, ``$XDG_CACHE_HOME/fusion_core`` or
    ``~/.cache/fusion_core``."""
    directory = os.environ.get(CACHE_VARIABLE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fusion_core")
    return Path(directory) / "decisions.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


@functools.cache
def _host() -> dict[str, str]:
    cpu, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as info:
            first = info.read().split("\n\n")[0].splitlines()  # the first processor's fields
        fields = {name.strip(): value.strip() for name, _, value in (line.partition(":") for line in first)}
        cpu = fields.get("model name", fields.get("CPU part", cpu))
        flags = " ".join(sorted(fields.get("flags", fields.get("Features", "")).split()))
    except OSError:  # not Linux: the model and torch's build (its CPU capability) stand for the flags
        pass
    return {"machine": platform.machine(), "cpu": cpu, "cpu_flags": _digest(flags), "cpus": str(os.cpu_count()),
            "torch": torch.__version__, "torch_build": _digest(torch.__config__.show()),
            "transformers": _version("transformers"), "fusion_core": _version("fusion-core"), "plugins": _plugins()}


def _plugins() -> str:
    """The installed plugin distributions and their versions (digested): most decisions are a family's
    (``linear_kernels``' kernels and layouts), and an upgrade of it may change what they measure."""
    found = {f"{ep.dist.name}=={ep.dist.version}" for group in ("fusion_core", "fusion_core.families")
             for ep in metadata.entry_points(group=group) if ep.dist is not None}
    return _digest(" ".join(sorted(found)))


def fingerprint() -> dict[str, str]:
    """What this machine's and software's decisions are stored under: CPU model and flags (digested), core count,
    torch's version, build and thread count, transformers', fusion-core's and the plugin distributions' versions."""
    return {**_host(), "threads": str(torch.get_num_threads())}


def _machine() -> str:
    return _digest(json.dumps(fingerprint(), sort_keys=True))


def _plain(value: object) -> object:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else str(value)  # dtype, device


def _key(kind: Hashable) -> str:
    return json.dumps(_plain(kind), separators=(",", ":"))


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


_WARNED: set[str] = set()


def _warn(message: str) -> None:
    if not _WARNED:
        _WARNED.add(message)
        warnings.warn(f"{message}; decisions are measured and kept in memory", DecisionStoreWarning, stacklevel=2)


def _read(path: Path) -> dict[str, Any]:
    """The store's content: ``{}`` where there is none, or (warned once) where it cannot be read."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        _warn(f"the decision store {path} cannot be read ({type(exc).__name__}: {exc})")
        return {}
    machines = data.get("machines") if isinstance(data, dict) and data.get("format") == _FORMAT else None
    if not (isinstance(machines, dict) and all(isinstance(m, dict) and isinstance(m.get("decisions"), dict)
                                               and all(isinstance(t, dict) for t in m["decisions"].values())
                                               for m in machines.values())):
        _warn(f"the decision store {path} is not a format-{_FORMAT} store")
        return {}
    return dict(data)


def _mine(machines: dict[str, Any]) -> dict[str, Any]:
    """This machine's and software's decisions by topic, in the store's ``machines`` (added when missing)."""
    name = _machine()
    if name not in machines:
        machines[name] = {"fingerprint": fingerprint(), "decisions": {}}
    return machines[name]["decisions"]  # type: ignore[no-any-return]


#: This machine's stored decisions by topic, per store file, as this process last read or wrote them: the store is
#: read once per process (and again after :func:`reset`), not once per kind on the first forward of each layer kind.
_SEEN: dict[Path, dict[str, Any]] = {}


def _stored(path: Path) -> dict[str, Any]:
    if path not in _SEEN:
        _SEEN[path] = _mine(_read(path).get("machines", {}))
    return _SEEN[path]


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """An exclusive lock on the store's directory for a read-edit-write of the store, so that processes deciding at
    once (the ranks of one job) each add their decisions, where the last writer would replace the others'. POSIX
    ``flock`` on the directory itself (no lock file beside the store); without it, or where the directory cannot be
    made or opened, no lock (the write then warns or succeeds as before)."""
    try:
        import fcntl

        directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _change(edit: Callable[[dict[str, Any]], bool]) -> None:
    """Apply ``edit`` to the store's machines and write the store atomically, when ``edit`` says it changed them."""
    path = store_path()
    with _exclusive(path.parent):
        _edit_and_write(path, edit)


def _edit_and_write(path: Path, edit: Callable[[dict[str, Any]], bool]) -> None:
    data = _read(path) or {"format": _FORMAT, "machines": {}}
    changed = edit(data["machines"])
    _SEEN[path] = _mine(data["machines"])  # what this process now knows the store holds
    if not changed:
        return
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".decisions.", delete=False) as out:
            temporary = out.name
            json.dump(data, out, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as exc:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
        _warn(f"the decision store {path} cannot be written ({type(exc).__name__}: {exc})")


def forget_stored(every_machine: bool = False) -> int:
    """Forget the stored decisions of this machine and software (of every machine with ``every_machine``), and this
    process's: the next call of each kind measures again. Returns how many were stored (``fusion tune``)."""
    forgotten = 0

    def edit(machines: dict[str, Any]) -> bool:
        nonlocal forgotten
        entries = [*machines.values()] if every_machine else [{"decisions": _mine(machines)}]
        forgotten = sum(len(table) for entry in entries for table in entry["decisions"].values())
        for entry in entries:
            entry["decisions"].clear()
        return forgotten > 0

    _change(edit)
    for table in list(_TABLES.values()):
        table.clear()
    return forgotten
