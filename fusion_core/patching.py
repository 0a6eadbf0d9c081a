"""Scoped class patching: selected instances are built as their fused class, nothing else is.

While a fused model is built, each patched class gets an ``__init__`` wrapper that first runs
the original ``__init__`` (so the instance has the original layout a checkpoint loader fills)
and then, *only when the current context is inside a build scope that routes this exact class*,
switches the new instance to the fused class. The routing lives in a
:class:`contextvars.ContextVar`, so a plain model built at the same time in another thread stays
plain, and the wrappers are removed when the last scope using a class exits, on every exit path.

Why ``__init__`` and not module attributes or ``__new__``: a module attribute swap is seen by
every thread and by code that imported the class elsewhere; a ``__new__`` override cannot be
removed again in CPython (``object.__new__`` then rejects constructor arguments). Patching is
by class identity, never by name, so same-named classes elsewhere are untouched, and copies or
unpickling (which do not call ``__init__``) are never redirected.

Instances are selected one by one: discovery records, per class, the decision for each instance
in the order the model constructs them (:func:`construction_order`, so a module that ``__init__``
builds and then replaces gets no plan, and the one that replaces it gets its path's plan); the
k-th instance constructed in the scope gets the k-th decision. The pipeline checks afterwards
that every fused instance sits at the module path it was planned for.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fusion_core.transforms import ModulePlan


@dataclass(frozen=True)
class ClassRoute:
    """Per original class: its fused class and the plan of each instance in model order (None: left alone)."""

    original_class: type[nn.Module]
    fused_class: type[nn.Module]
    instances: tuple[ModulePlan | None, ...]


@dataclass
class BuildScope:
    """The routing of one build, and what it built."""

    routes: Mapping[type[nn.Module], ClassRoute]
    on_built: Callable[[nn.Module, ModulePlan], None] | None = None
    root: type[nn.Module] | None = None
    counters: dict[type[nn.Module], int] = field(default_factory=dict)
    built: list[tuple[nn.Module, ModulePlan]] = field(default_factory=list)
    surplus: dict[type[nn.Module], int] = field(default_factory=dict)

    def restart(self) -> None:
        """Forget every instance built so far: the root class starts another model (see :func:`class_patch_scope`)."""
        self.counters.clear()
        self.built.clear()
        self.surplus.clear()

    def reserve(self, cls: type[nn.Module]) -> int:
        """The construction index of a new instance of ``cls``, counted when its ``__init__`` starts."""
        index = self.counters.get(cls, 0)
        self.counters[cls] = index + 1
        return index

    def route(self, instance: nn.Module, index: int) -> None:
        cls = type(instance)
        route = self.routes[cls]
        if index >= len(route.instances):
            self.surplus[cls] = self.surplus.get(cls, 0) + 1
            return
        plan = route.instances[index]
        if plan is None:
            return
        instance.__class__ = route.fused_class
        self.built.append((instance, plan))
        if self.on_built is not None:
            self.on_built(instance, plan)


_ACTIVE: contextvars.ContextVar[BuildScope | None] = contextvars.ContextVar("fusion_core_build_scope", default=None)
_lock = threading.Lock()
# class -> [number of scopes using it, the __init__ found in its own __dict__ (None: inherited)]
_installed: dict[type[nn.Module], list[Any]] = {}

#: Held by every fused load and by discovery, whoever calls them. transformers' loading is not
#: thread-safe (4.57 patches ``nn.Module.register_parameter`` and 5.x sets the global default
#: dtype while a model is built), and discovery may patch ``register_parameter`` process-wide to
#: build a meta model; class patching itself is per thread (the scopes above).
LOAD_LOCK = threading.RLock()


def _make_wrapper(cls: type[nn.Module], original_init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original_init)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        # Counted when construction starts, the order construction_order() records in discovery.
        scope = _ACTIVE.get() if type(self) is cls else None
        if scope is not None and cls is scope.root and scope.counters:
            scope.restart()
        index = scope.reserve(cls) if scope is not None and cls in scope.routes else None
        original_init(self, *args, **kwargs)
        if scope is not None and index is not None:
            scope.route(self, index)

    __init__.__fusion_core_wrapper__ = True  # type: ignore[attr-defined]
    return __init__


def _install(cls: type[nn.Module]) -> None:
    entry = _installed.get(cls)
    if entry is not None:
        entry[0] += 1
        return
    own = cls.__dict__.get("__init__")
    _installed[cls] = [1, own]
    cls.__init__ = _make_wrapper(cls, own if own is not None else cls.__init__)  # type: ignore[method-assign]


def _uninstall(cls: type[nn.Module]) -> None:
    entry = _installed[cls]
    entry[0] -= 1
    if entry[0]:
        return
    del _installed[cls]
    if entry[1] is not None:
        cls.__init__ = entry[1]  # type: ignore[method-assign]
    else:
        delattr(cls, "__init__")


def installed_classes() -> list[type[nn.Module]]:
    """Classes that currently carry a build wrapper (empty whenever no fused build runs)."""
    with _lock:
        return list(_installed)


@contextmanager
def class_patch_scope(
    routes: Mapping[type[nn.Module], ClassRoute],
    on_built: Callable[[nn.Module, ModulePlan], None] | None = None,
    root: type[nn.Module] | None = None,
) -> Iterator[BuildScope]:
    """Route construction of ``routes``' classes to their fused classes inside this block only.

    ``root`` is the model class the block loads. Each time construction of one starts, the instances
    counted so far are forgotten and the count starts again from the plan's first instance: a loader
    may build a throwaway model before the one it fills (transformers 4.57 builds one on the meta
    device to name a GGUF file's tensors), and the model that is loaded is the last one built.
    """
    scope = BuildScope(routes=dict(routes), on_built=on_built, root=root)
    watched = set(scope.routes) | ({root} if root is not None else set())
    with _lock:
        for cls in watched:
            _install(cls)
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)
        with _lock:
            for cls in watched:
                _uninstall(cls)


@contextmanager
def no_routing() -> Iterator[None]:
    """Build plain modules inside an active scope (discovery uses this)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def context_scoped_patch(cls: type, attribute: str, wrap: Callable[[Any], Any]) -> None:
    """Make sure ``cls.attribute`` is a wrapper made by ``wrap`` (around whatever is there now); idempotent.

    For the two process-wide patches fusion-core needs while it builds a meta model
    (``nn.Module.__init__``, ``nn.Module.register_parameter``): the wrapper acts only in the context
    that asked for it (a :class:`contextvars.ContextVar` it reads) and passes everything else through,
    so it is installed once and never removed. Installing and restoring around each build raced with
    other code patching the same attribute (transformers 4.57's ``init_empty_weights``, in a plain load
    on another thread): whoever restored second put a stale function back for good. A wrapper someone
    replaced is wrapped again the next time it is needed.
    """
    with _lock:
        current = getattr(cls, attribute)
        if getattr(current, "__fusion_core_patch__", None) == (cls, attribute):
            return
        wrapper = functools.wraps(current)(wrap(current))
        wrapper.__fusion_core_patch__ = (cls, attribute)  # type: ignore[attr-defined]
        setattr(cls, attribute, wrapper)


_RECORDING: contextvars.ContextVar[list[nn.Module] | None] = contextvars.ContextVar(
    "fusion_core_construction_order", default=None
)


def _recording_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        record = _RECORDING.get()
        if record is not None:
            record.append(self)
        original(self, *args, **kwargs)

    return __init__


@contextmanager
def construction_order() -> Iterator[list[nn.Module]]:
    """Record every module constructed in this block, in the order their construction starts.

    The order the build wrappers count instances in (:meth:`BuildScope.reserve`), discarded
    instances included: a decoder layer that builds an attention module and then replaces it
    constructs two. ``nn.Module.__init__`` carries a wrapper that records only in this context
    (:func:`context_scoped_patch`), so modules other threads build are neither recorded nor changed.
    """
    order: list[nn.Module] = []
    context_scoped_patch(nn.Module, "__init__", _recording_init)
    token = _RECORDING.set(order)
    try:
        yield order
    finally:
        _RECORDING.reset(token)
