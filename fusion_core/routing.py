"""Opt-in: transformers' own ``from_pretrained(..., fusion_config=...)`` loads through fusion-core.

Tools that load a model by name with keyword arguments (``pipeline(..., model_kwargs=...)``,
TRL's ``model_init_kwargs``, evaluation harnesses, a Trainer script) never call
:func:`fusion_core.from_pretrained`. After :func:`integrate_transformers`, their
``AutoModel*.from_pretrained`` and ``PreTrainedModel.from_pretrained`` calls that ask for fusion
go to :func:`fusion_core.from_pretrained`, with all of its guarantees:

- a call with a ``fusion_config`` keyword (any value, ``None`` included), or of a checkpoint
  whose config stores a fusion record (:func:`fusion_core.record.names_fusion`), is routed;
- every other call runs transformers' own method, with its arguments as given;
- a family name fusion-core does not have is refused (``pydantic.ValidationError``, as by
  :func:`fusion_core.from_pretrained`) naming the distribution to install; it never reaches
  transformers' own fusion registry (FINDINGS.md: that path can return random weights).

**Process-wide and thread-safe.** Activation replaces the public classmethod
``PreTrainedModel.from_pretrained`` for the whole process, under a lock; a thread loading while
another switches it on or off sees one method or the other. Routed loads serialize on
:data:`fusion_core.patching.LOAD_LOCK`; loads that are not routed run as transformers runs them,
and transformers 4.57's own loading is not thread-safe (``init_empty_weights`` patches
``nn.Module.register_parameter`` for the whole process while a load runs), so concurrent plain
loads there need the caller's own serialization. Every Auto class resolves the
config and then calls the concrete class's ``from_pretrained`` with the ``fusion_config`` keyword
it was given (transformers' configs do not take that keyword: checked on every release in
:data:`fusion_core.compat.transformers.CHECKED_RELEASES`), or with a config that carries the
stored record, so Auto classes, model classes and subclasses that override ``from_pretrained``
and call ``super()`` are all covered.
The routed load itself marks its own context, so the ``from_pretrained`` fusion-core calls
inside it runs transformers' method and never recurses.

**Nesting.** ``integrate_transformers()`` switches it on and returns a handle; used as a context
manager, leaving the block restores the state before the call. ``integrate_transformers(False)``
switches it off (as a context manager: off inside the block only). So::

    with fusion_core.integrate_transformers():
        with fusion_core.integrate_transformers():
            ...                 # on
        ...                     # still on: the outer block holds it
    ...                         # off again

**Across threads** each handle undoes its own change, never another's: an activation is a token
that leaving its block takes back, and routing is on while any token is in force, so one thread
leaving its block never switches routing off under another thread's block. Switching off is
process-wide too: ``integrate_transformers(False)`` takes back every token in force at that
moment, in every thread (without a block, for good; that is how a plain call switches off however
often it was switched on); leaving its block gives back those of them whose blocks are still open.
It does not forbid what comes after it: an activation made later, in any thread, switches routing
on again, also inside the ``False`` block.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from types import TracebackType
from typing import Any

__all__ = ["TransformersIntegration", "integrate_transformers", "is_integrated"]

_lock = threading.Lock()
_active: set[TransformersIntegration] = set()  # the activations in force; routed while there is one
_original: Any = None  # PreTrainedModel's own from_pretrained classmethod object, while replaced
_ROUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("fusion_core_routed", default=False)


class TransformersIntegration:
    """The handle :func:`integrate_transformers` returns; leaving it as a context manager undoes that call's change.

    An activation handle is itself the token that keeps routing on; a switch-off handle remembers
    the activations it took back. Leaving a handle a second time changes nothing.
    """

    def __init__(self, taken_back: set[TransformersIntegration] | None) -> None:
        self._taken_back = taken_back  # None for an activation; else the activations this switch-off took back
        self._left = False

    def __enter__(self) -> TransformersIntegration:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        with _lock:
            if self._left:
                return
            self._left = True
            if self._taken_back is None:
                _active.discard(self)
            else:  # give back what this switch-off took, except activations whose own blocks have ended since
                _active.update(handle for handle in self._taken_back if not handle._left)
            _install(bool(_active))


def integrate_transformers(enable: bool = True) -> TransformersIntegration:
    """Route transformers' own ``from_pretrained(..., fusion_config=...)`` through fusion-core (``False``: stop).

    >>> import fusion_core                                                       # doctest: +SKIP
    >>> from transformers import AutoModelForCausalLM, pipeline
    >>> fusion_core.integrate_transformers()
    >>> model = AutoModelForCausalLM.from_pretrained(path, fusion_config={"qkv": True})
    >>> with fusion_core.integrate_transformers():   # only inside the block
    ...     pipe = pipeline("text-generation", model=path, model_kwargs={"fusion_config": {"qkv": True}})
    """
    with _lock:
        if enable:
            handle = TransformersIntegration(None)
            _active.add(handle)
        else:
            handle = TransformersIntegration(set(_active))
            _active.clear()
        _install(bool(_active))
    return handle


def is_integrated() -> bool:
    """Whether transformers' ``from_pretrained`` currently routes fused loads to fusion-core."""
    return bool(_active)


def reset_integration() -> None:
    """Switch the integration off whatever the nesting: transformers' own ``from_pretrained`` is back."""
    with _lock:
        _active.clear()
        _install(False)


def _install(routed: bool) -> None:
    """Install or remove the routed method to match ``routed`` (callers hold ``_lock``)."""
    global _original
    if routed == (_original is not None):
        return  # already as asked (switching off never imports transformers)
    from transformers import PreTrainedModel

    if routed:
        _original = PreTrainedModel.__dict__["from_pretrained"]
        PreTrainedModel.from_pretrained = classmethod(_routed(_original.__func__))
    else:
        PreTrainedModel.from_pretrained = _original
        _original = None


def _routed(original: Any) -> Any:
    """``original`` (``from_pretrained`` taking ``cls``), sending the calls that ask for fusion to fusion-core."""

    @functools.wraps(original)
    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if _ROUTED.get():  # the load fusion-core itself makes
            return original(cls, *args, **kwargs)
        from fusion_core.record import names_fusion

        name_or_path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if "fusion_config" not in kwargs and not names_fusion(name_or_path, kwargs):
            return original(cls, *args, **kwargs)
        if name_or_path is None:
            return original(cls, *args, **kwargs)  # transformers' own error for the missing argument
        if len(args) > 1:
            raise TypeError(
                f"{cls.__name__}.from_pretrained with fusion: positional model arguments {args[1:]!r} are not "
                "supported (pass them as keyword arguments)"
            )
        kwargs = dict(kwargs)
        kwargs.pop("pretrained_model_name_or_path", None)
        fusion_config = kwargs.pop("fusion_config", None)
        from fusion_core.hf import from_pretrained as fused_from_pretrained

        token = _ROUTED.set(True)
        try:
            return fused_from_pretrained(cls, name_or_path, fusion_config=fusion_config, **kwargs)
        finally:
            _ROUTED.reset(token)

    from_pretrained.__fusion_core_routed__ = True  # type: ignore[attr-defined]
    return from_pretrained
