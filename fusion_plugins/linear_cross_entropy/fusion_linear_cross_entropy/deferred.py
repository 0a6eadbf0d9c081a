"""The placeholder that stands where a model's logits would be, and the pointwise ops applied to it.

While the fused forward runs the model's own ``forward``, the LM head returns a
:class:`DeferredLogits` instead of computing ``[tokens, vocab]`` logits: a tensor subclass over a
zero-stride expanded scalar, so its ``shape``, ``dtype`` and ``device`` are those of the real logits
and it costs no memory. What the model then does to its logits before the loss (Cohere's
``logit_scale``, Granite's ``logits_scaling``, Gemma 2/3's tanh soft-capping, an upcast) is recorded
by ``__torch_function__`` as an elementwise op and replayed later on each chunk of real logits, in
the same order and dtype, so every element comes out as the model computes it. An op that is not
known to be elementwise raises :class:`fusion_core.FusionError` naming it and the model class: a
placeholder never silently stands in for data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusion_core import FusionError

#: Elementwise ops (by ``__name__``, in every spelling: ``torch.mul``, ``Tensor.mul``, ``Tensor.__mul__``,
#: ``Tensor.mul_``) a model may apply to its logits between the head and the loss.
POINTWISE = frozenset({
    "mul", "multiply", "div", "divide", "true_divide", "add", "sub", "subtract", "neg", "negative",
    "tanh", "sigmoid", "clamp", "clip", "clamp_min", "clamp_max", "pow", "square",
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous",
    "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__div__", "__rdiv__", "__add__", "__radd__",
    "__sub__", "__rsub__", "__neg__", "__pow__",
    "__imul__", "__itruediv__", "__idiv__", "__iadd__", "__isub__",
})
#: Ops whose tensor arguments only give a dtype or a device (``logits.to(labels)``): any tensor is fine there.
CONVERSIONS = frozenset({"to", "type", "type_as"})
#: Reads of metadata that do not touch the (absent) data.
METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "is_contiguous", "get_device", "__len__", "stride", "storage_offset", "is_inference",
})


@dataclass
class Source:
    """Where a placeholder's logits come from: the head's input, the head, and the model it belongs to."""

    hidden: torch.Tensor
    head: nn.Module
    run: Callable[[torch.Tensor], torch.Tensor]
    """The head's real forward (hooks included) on rows of ``hidden``."""
    owner: str
    """The model class's name, for error messages."""
    linear: nn.Linear | None = None
    """The head, when it is a plain ``nn.Linear`` called on ``hidden`` alone: its GEMMs can be written out."""
    computed: dict[int, torch.Tensor] = field(default_factory=dict)
    """Logits computed for ``return_logits``, by ``id`` of the placeholder the loss received."""


class _Slot:
    """Marks where the logits go in a recorded op's arguments."""

    def __repr__(self) -> str:
        return "<logits>"


SLOT = _Slot()


@dataclass(frozen=True)
class Op:
    """One recorded elementwise op: ``func`` with the logits at :data:`SLOT` in ``args``/``kwargs``."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        args = tuple(logits if a is SLOT else a for a in self.args)
        kwargs = {k: logits if v is SLOT else v for k, v in self.kwargs.items()}
        result: torch.Tensor = self.func(*args, **kwargs)
        return result

    def tensors(self) -> list[torch.Tensor]:
        """The tensor arguments (a learnable scale needs its gradient too)."""
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)]


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or repr(func)


def _describe(func: Any) -> str:
    if _name(func) == "__get__":  # an attribute read: name the attribute
        return f"Tensor.{getattr(getattr(func, '__self__', None), '__name__', '<attribute>')}"
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    qualified = getattr(func, "__qualname__", None)
    if qualified:
        return f"{getattr(func, '__module__', None) or ''}.{qualified}".lstrip(".")
    return f"{owner!r}.{_name(func)}" if owner is not None else repr(func)


def vocab_index(index: Any, dim: int) -> slice | None:
    """The slice of the last dimension when ``index`` narrows nothing else (``[..., a:b]``, ``[:, :, a:b]``)."""
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
        return None
    whole = slice(None)
    if (len(index) == 2 and index[0] is Ellipsis) or (len(index) == dim and all(i == whole for i in index[:-1])):
        return index[-1]
    return None


class DeferredLogits(torch.Tensor):
    """Logits not computed yet: the head's input, and the elementwise ops applied since.

    Built only by :meth:`make`. ``shape``/``dtype``/``device`` are the real logits'; the data is one
    expanded zero, never read.
    """

    fusion_source: Source
    fusion_ops: tuple[Op, ...]

    @staticmethod
    def make(source: Source, ops: tuple[Op, ...], shape: Sequence[int], dtype: torch.dtype,
             device: torch.device) -> DeferredLogits:
        base = torch.zeros((), dtype=dtype, device=device).expand(*shape)
        deferred = base.as_subclass(DeferredLogits)
        deferred.fusion_source = source
        deferred.fusion_ops = ops
        return deferred

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        shape = "x".join(str(n) for n in self.shape)
        return f"DeferredLogits({shape}, {self.dtype}, ops={[_name(op.func) for op in self.fusion_ops]})"

    def compute(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden`` (rows of the head's input), through the head and the recorded ops."""
        return self.replay(self.fusion_source.run(hidden))

    def replay(self, logits: torch.Tensor) -> torch.Tensor:
        """The recorded ops applied to rows of the head's output (``[rows, vocab]``)."""
        rows = logits.shape[0]
        for op in self.fusion_ops:
            logits = op(logits)
        return logits.reshape(rows, -1)

    def acts_per_logit(self) -> bool:
        """Whether every recorded op maps each logit alone: no slice of the vocabulary, no operand that varies
        along it. Then a block of the head's output columns replays on its own, as :meth:`replay` replays whole rows."""
        for op in self.fusion_ops:
            if op.func is torch.Tensor.__getitem__:
                return False
            if _name(op.func) not in CONVERSIONS and any(t.numel() != 1 for t in op.tensors()):
                return False
        return True

    def vocab_slice(self, index: Any) -> DeferredLogits:
        """``self[index]`` for an ``index`` that only narrows the vocabulary (``logits[..., :n]``: Inkling drops
        its padded vocabulary so): each chunk of rows is narrowed alike, so it replays chunk by chunk."""
        last = vocab_index(index, self.dim())
        if last is None:
            raise FusionError(
                f"linear_cross_entropy: {self.fusion_source.owner}'s forward indexes its logits with {index!r}, which "
                "the fused loss cannot replay chunk by chunk (only a slice of the vocabulary, logits[..., a:b], is)"
            )
        size = len(range(*last.indices(self.shape[-1])))
        op = Op(torch.Tensor.__getitem__, (SLOT, (Ellipsis, last)), {})
        return DeferredLogits.make(self.fusion_source, (*self.fusion_ops, op), (*self.shape[:-1], size), self.dtype,
                                   self.device)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name == "__getitem__" and len(args) == 2 and not kwargs and isinstance(args[0], DeferredLogits):
            return args[0].vocab_slice(args[1])
        if name == "__get__" or name in METADATA:
            result = super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
            if not isinstance(result, torch.Tensor):
                return result
        in_place = name.startswith("__i") or (name.endswith("_") and not name.startswith("__"))
        base = name[:-1] if in_place and not name.startswith("__") else name
        deferred = [a for a in (*args, *kwargs.values()) if isinstance(a, DeferredLogits)]
        owner = deferred[0].fusion_source.owner if deferred else "the model"
        if base not in POINTWISE or len(deferred) != 1:
            raise FusionError(
                f"linear_cross_entropy: {owner}'s forward applies {_describe(func)} to its logits, which the fused "
                "loss cannot replay chunk by chunk (only elementwise ops with scalar operands are); load the "
                "model without linear_cross_entropy, or call it in eval mode or without labels"
            )
        (target,) = deferred
        for other in (*args, *kwargs.values()):
            if isinstance(other, torch.Tensor) and other is not target and base not in CONVERSIONS:
                broadcast = other.dim() <= target.dim() and all(n == 1 for n in other.shape[:-1])
                if not (other.numel() == 1 or (broadcast and other.shape[-1] == target.shape[-1])):
                    raise FusionError(
                        f"linear_cross_entropy: {owner}'s forward applies {_describe(func)} to its logits with a "
                        f"tensor of shape {tuple(other.shape)}, which the fused loss cannot replay chunk by chunk"
                    )
        op = Op(func, tuple(SLOT if a is target else a for a in args),
                {k: SLOT if v is target else v for k, v in kwargs.items()})
        # The result's dtype and device, from the same op on one element (a 1-element probe promotes
        # like the full tensor: a 0-d operand does not widen it, a vocab-wide one does).
        probe = torch.zeros((1,) * target.dim(), dtype=target.dtype, device=target.device)
        with torch.no_grad():
            result = op(probe)
        if not isinstance(result, torch.Tensor) or result.dim() != target.dim():
            raise FusionError(f"linear_cross_entropy: {_describe(func)} on {owner}'s logits changes their shape")
        if in_place:
            target.fusion_ops = (*target.fusion_ops, op)
            return target
        return DeferredLogits.make(target.fusion_source, (*target.fusion_ops, op), target.shape, result.dtype,
                                   result.device)
