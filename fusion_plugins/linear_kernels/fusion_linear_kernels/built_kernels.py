"""Kernels built on this machine, once per key in a process (the GEMV kernel's, per dtype and bias).

A kernel is built at its first request and kept; a build that fails is kept as None (the layers keep the other
candidates, and no later call tries again), and the first failure is reported once, as a warning of the owner's
class: a machine without a C++ compiler says so once, not once per shape. ``fusion_core.reset_state()`` clears a
cache through the plugin's ``fusion_reset_state`` hook (:meth:`BuiltKernels.clear`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
_MISSING = object()


class BuiltKernels(Generic[K]):
    """One owner's kernels by key: :meth:`get` builds a missing one (None where that raised), :meth:`clear` forgets
    them and whether a failure was reported."""

    def __init__(self, warning: type[Warning], build: Callable[[K], Callable[..., Any]],
                 describe: Callable[[K], str]) -> None:
        self._warning = warning
        self._build = build
        self._describe = describe
        self._kernels: dict[K, Callable[..., Any] | None] = {}
        self._lock = threading.Lock()
        self.warned = False
        """Whether a failed build was reported since the last :meth:`clear`."""

    def __len__(self) -> int:
        return len(self._kernels)

    def get(self, key: K) -> Callable[..., Any] | None:
        """The kernel for ``key``, ``build(key)`` at its first request; None where that raised (reported once per
        cache as ``describe(key)`` "could not be built", with the error's first line). A call for a kernel already
        built does no more than a dict lookup: the GEMVs ask at every call."""
        found = self._kernels.get(key, _MISSING)
        if found is not _MISSING:
            return found  # type: ignore[return-value]
        with self._lock:
            if key not in self._kernels:
                self._kernels[key] = self._built(key)
        return self._kernels[key]

    def _built(self, key: K) -> Callable[..., Any] | None:
        try:
            return self._build(key)
        except Exception as exc:  # any failure to build leaves the other candidates, never a broken layer
            if not self.warned:
                self.warned = True
                first = str(exc).splitlines()[0] if str(exc) else ""
                warnings.warn(f"linear_kernels: {self._describe(key)} could not be built ({type(exc).__name__}: "
                              f"{first}); those layers keep the other kernels", self._warning, stacklevel=6)
            return None

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()
            self.warned = False
