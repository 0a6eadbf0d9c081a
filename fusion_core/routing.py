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
"""

from __future__ import annotations

import contextvars
import functools
import threading
from types import TracebackType
from typing import Any

__all__ = ["TransformersIntegration", "integrate_transformers", "is_integrated"]

_lock = threading.Lock()
_depth = 0  # how many activations are in force; the methods are replaced while it is above 0
_original: Any = None  # PreTrainedModel's own from_pretrained classmethod object, while replaced
_ROUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("fusion_core_routed", default=False)


class TransformersIntegration:
    """The handle :func:`integrate_transformers` returns; leaving it as a context manager restores the state before."""

    def __init__(self, previous_depth: int) -> None:
        self._previous = previous_depth

    def __enter__(self) -> TransformersIntegration:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        with _lock:
            _apply(self._previous)


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
        previous = _depth
        _apply(previous + 1 if enable else 0)
    return TransformersIntegration(previous)


def is_integrated() -> bool:
    """Whether transformers' ``from_pretrained`` currently routes fused loads to fusion-core."""
    return _depth > 0


def reset_integration() -> None:
    """Switch the integration off whatever the nesting: transformers' own ``from_pretrained`` is back."""
    with _lock:
        _apply(0)


def _apply(depth: int) -> None:
    """Set the activation depth and install or remove the routed method to match (callers hold ``_lock``)."""
    global _depth, _original
    _depth = depth
    if (depth > 0) == (_original is not None):
        return  # already as asked (switching off never imports transformers)
    from transformers import PreTrainedModel

    if depth > 0:
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
