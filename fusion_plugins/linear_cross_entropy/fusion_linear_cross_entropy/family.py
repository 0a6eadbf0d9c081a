"""``linear_cross_entropy``: a causal LM's training loss from its hidden states, chunk by chunk.

A causal LM's training step builds ``[tokens, vocab]`` logits, a float32 copy of them for the loss,
and the gradient of both: at a 150k-token vocabulary that is several GB per 1k tokens of batch, often
the largest tensors of the step. This family fuses the model's **root** (the ``*ForCausalLM`` /
``*ForConditionalGeneration`` class the user loads) so that, in training mode with labels, the loss
is computed from the LM head's input a chunk of rows at a time (:mod:`fusion_linear_cross_entropy.loss`)
and those tensors never exist whole.

It does not rewrite any model's forward. The fused forward runs the model's own, with two things
intercepted for the duration of the call:

- the head (``get_output_embeddings()``, whatever sits there: ``nn.Linear``, a PEFT wrapper, a
  quantized layer) returns a :class:`~fusion_linear_cross_entropy.deferred.DeferredLogits`
  placeholder that records its input and the elementwise ops the model applies to the logits;
- ``loss_function`` (transformers' ``ForCausalLMLoss``) is answered by the chunked equivalent.

So every architecture whose forward is "head, elementwise scaling/capping or a slice of the vocabulary,
``self.loss_function``" is covered, whatever it calls its head and however it scales its logits; one whose
source indexes its logits otherwise is declined at plan time, and one that does something else to them at
run time fails with the op named (never a wrong loss). The output's
``logits`` is None (or, with ``return_logits``, the logits computed in the same pass, detached).
Auxiliary losses the forward adds (Mixtral's router loss) are added as before. In eval mode,
without labels or without grad, the forward is the original's, untouched: the family declares
``preserves = "training_loss"``.

No tensor changes layout: the checkpoint loads and saves as it is.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import nn

from fusion_core import FamilyOptions, FusedModule, FusionFamily
from fusion_core.plugin import aliases, forwards, fused_subclass, self_call
from fusion_linear_cross_entropy.deferred import DeferredLogits, Source
from fusion_linear_cross_entropy.freed_heap import trimmed_at_layers
from fusion_linear_cross_entropy.loss import chunked_causal_lm_loss
from fusion_linear_cross_entropy.tied_gradient import TiedGradient, tied_lookups

NAME = "linear_cross_entropy"


class LinearCrossEntropyOptions(FamilyOptions):
    """Options of ``linear_cross_entropy``: the chunk size, whether to return the logits with the loss, and whether to
    give freed heap back during a training call."""

    chunk_tokens: int | None = Field(
        default=None, ge=1,
        description="Tokens (rows of logits) computed at once; None: about 128 MiB of float32 logits, in "
        "multiples of 128 rows (256 at a 151936-token vocabulary).",
    )
    return_logits: bool = Field(
        default=False,
        description="Also return the logits (detached, in the model's dtype, computed in the same pass): costs "
        "one [tokens, vocab] tensor, still no float32 copy and no gradient of it.",
    )
    release_freed_memory: bool = Field(
        default=True,
        description="In a training call, give the heap glibc's malloc freed back to the system at the decoder "
        "layers' boundaries, forward and backward, once the memory it keeps resident unused has grown by 256 MiB, "
        "or the memory in use has risen by 64 MiB since the last boundary (fusion_linear_cross_entropy.freed_heap); "
        "nothing where the C library is not glibc.",
    )


def _causal_lm_loss() -> Any:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


_positions: dict[type, int | None] = {}


def _labels_position(cls: type) -> int | None:
    """The positional index of ``labels`` in ``cls.forward`` (after ``self``), or None if keyword-only/absent."""
    if cls not in _positions:
        try:
            parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            parameters = []
        _positions[cls] = next(
            (index for index, p in enumerate(parameters)
             if p.name == "labels" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    return _positions[cls]


@functools.cache
def _original_loss_property(cls: type) -> Any:
    """The ``loss_function`` descriptor the fused class overrides (transformers' property)."""
    mro = cls.__mro__
    for klass in mro[mro.index(LinearCrossEntropyMixin) + 1:]:
        if "loss_function" in klass.__dict__:
            return klass.__dict__["loss_function"]
    return None


class LinearCrossEntropyMixin(FusedModule):
    """The fused root: in training mode with labels, the loss without the logits; otherwise the original forward.

    ``chunk_tokens``, ``return_logits`` and ``release_freed_memory`` are the family options, set per fused class (see
    :func:`mixin_for`).
    """

    chunk_tokens: ClassVar[int | None] = None
    return_logits: ClassVar[bool] = False
    release_freed_memory: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give each fused class a ``forward`` with the original's signature.

        transformers and its tools read the root's forward signature: ``generate`` asks for
        ``logits_to_keep`` (without it, the prompt's full logits are computed), ``Trainer`` keeps only the
        dataset columns the forward names. A class made in a fresh process (unpickling) gets it too.
        """
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        original = next((k.__dict__["forward"] for k in mro[mro.index(LinearCrossEntropyMixin) + 1:]
                         if "forward" in k.__dict__), None)
        if original is None or original is nn.Module.forward or "forward" in cls.__dict__:
            return  # an option mixin, not a fused class

        def forward(self: LinearCrossEntropyMixin, *args: Any, **kwargs: Any) -> Any:
            return LinearCrossEntropyMixin.forward(self, *args, **kwargs)

        forward.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
        forward.__doc__, forward.__qualname__ = original.__doc__, f"{cls.__qualname__}.forward"
        cls.forward = forward  # type: ignore[method-assign]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            labels = kwargs.get("labels")
            if labels is None and args:  # passed by position?
                position = _labels_position(type(self))
                labels = args[position] if position is not None and len(args) > position else None
            if labels is not None:
                return _eager_forward()(self, args, kwargs)
        return super().forward(*args, **kwargs)

    def fusion_finalize(self) -> None:
        """Wrap the training path for Dynamo now, at load time (eager), not inside a traced call."""
        _eager_forward()

    def fusion_unfinalize(self) -> None:
        """Nothing to undo: the wrapper is the module's, not the instance's."""

    @property
    def loss_function(self) -> Any:
        original = _original_loss_property(type(self)).__get__(self, type(self))
        if self.__dict__.get("_fusion_lce_active") is None:
            return original
        return functools.partial(_loss, self, original)

    @loss_function.setter
    def loss_function(self, value: Any) -> None:
        _original_loss_property(type(self)).__set__(self, value)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fused=linear_cross_entropy"


def _loss(model: nn.Module, original: Any, logits: Any, *args: Any, **kwargs: Any) -> Any:
    """The model's ``loss_function`` during a fused call: chunked for the head's deferred logits."""
    if not isinstance(logits, DeferredLogits):  # the forward computed logits some other way: nothing to save
        return original(logits, *args, **kwargs)
    cls = type(model)
    interception = model.__dict__["_fusion_lce_active"]
    return chunked_causal_lm_loss(logits, *args, chunk_tokens=cls.chunk_tokens,  # type: ignore[attr-defined]
                                  return_logits=cls.return_logits, tied=interception.tied,  # type: ignore[attr-defined]
                                  **kwargs)


class _Interception:
    """The head's stand-in forward for one fused call: a placeholder, or the real forward while chunks run."""

    def __init__(self, model: nn.Module, head: nn.Module) -> None:
        self.owner = type(model).__name__
        self.head = head
        self.previous = head.__dict__.get("forward")
        self.real = head.forward
        self.passthrough = False
        self.sources: list[Source] = []
        self.tied: TiedGradient | None = None
        """The tied embedding's lookups in this call (:mod:`fusion_linear_cross_entropy.tied_gradient`), or None."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.passthrough or not args or not isinstance(args[0], torch.Tensor):
            return self.real(*args, **kwargs)
        hidden = args[0]
        flat = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():  # one row tells the logits' width, dtype and device, whatever the head is
            probe = self.real(flat[:1] if flat.shape[0] else flat.new_zeros(1, flat.shape[-1]), *args[1:], **kwargs)
        plain = (type(self.head) is nn.Linear and self.previous is None and len(args) == 1 and not kwargs
                 and all(type(t) in (torch.Tensor, nn.Parameter) for t in self.head.parameters()))
        source = Source(hidden, self.head, functools.partial(self.run, args[1:], kwargs), self.owner,
                        linear=self.head if plain else None)  # type: ignore[arg-type]
        self.sources.append(source)
        return DeferredLogits.make(source, (), (*hidden.shape[:-1], probe.shape[-1]), probe.dtype, probe.device)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any], rows: torch.Tensor) -> torch.Tensor:
        """The head called as a module on ``rows`` (its hooks run: PEFT, accelerate's offloading)."""
        self.passthrough = True
        try:
            logits: torch.Tensor = self.head(rows, *args, **kwargs)
            return logits
        finally:
            self.passthrough = False

    def __enter__(self) -> _Interception:
        self.head.forward = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is None:
            del self.head.forward
        else:
            self.head.forward = self.previous


_EAGER: list[Any] = []


def _eager_forward() -> Any:
    """:func:`_fused_forward` under ``torch.compiler.disable``, made on first use: ``torch.compiler.disable`` imports
    Dynamo (about a second), which a process that only loads the plugin (``fusion list``, any fused load) should
    not pay."""
    if not _EAGER:
        _EAGER.append(_eager(_fused_forward))
    return _EAGER[0]


def _eager(function: Any) -> Any:
    """``torch.compiler.disable``, with the reason Dynamo reports where the torch release takes one."""
    reason = ("linear_cross_entropy runs a training call with labels eagerly (Dynamo does not trace the LM head's "
              "stand-in and its placeholder logits); eval calls and calls without labels are traced whole")
    try:
        return torch.compiler.disable(function, reason=reason)  # type: ignore[no-untyped-call]
    except TypeError:  # torch < 2.8: no reason
        return torch.compiler.disable(function)  # type: ignore[no-untyped-call]


def _sharded_head(head: nn.Module) -> str | None:
    """Why ``head`` cannot run chunk by chunk: FSDP2 shards it in a group of its own, or it holds DTensors.

    A head that ``fully_shard`` was applied to (or to a module inside it) all-gathers a fresh unsharded weight in
    each call's pre-forward hook and frees it after: a chunk's logits would depend on that temporary weight, not
    on the sharded parameter, and the head would get no gradient. A head sharded with the model's root (one
    ``fully_shard(model)`` group) holds plain unsharded tensors during the root's forward and is fine. Looked up
    only where torch's FSDP / DTensor modules are already imported (a process that shards imports them).
    """
    fsdp, dtensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    sharded = getattr(fsdp, "FSDPModule", None)
    if sharded is not None and any(isinstance(m, sharded) for m in head.modules()):
        return "is sharded by FSDP2 in a group of its own (fully_shard on the head or a module inside it)"
    kind = getattr(dtensor, "DTensor", None)
    if kind is not None and any(isinstance(p, kind) for p in head.parameters()):
        return "holds DTensor parameters (sharded or tensor-parallel)"
    return None


_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _warn_once(model: nn.Module, message: str) -> None:
    """``message`` as a UserWarning, once per model instance."""
    if model not in _warned:
        _warned.add(model)
        warnings.warn(message, stacklevel=4)


def _fused_forward(model: LinearCrossEntropyMixin, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The original forward with the head deferred and the loss chunked; the output without the placeholder."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    original_loss = _original_loss_property(type(model)).__get__(model, type(model))
    if head is None or original_loss is not _causal_lm_loss():
        warnings.warn(f"linear_cross_entropy: {type(model).__name__} has "
                      + ("no output embeddings" if head is None else f"loss_function {original_loss!r}")
                      + " now; running its original forward (full logits)", stacklevel=3)
        return super(LinearCrossEntropyMixin, model).forward(*args, **kwargs)
    sharded = _sharded_head(head)
    if sharded is not None:
        _warn_once(model, f"linear_cross_entropy: the LM head of {type(model).__name__} {sharded}; the chunked "
                   "loss cannot take its gradients, so training calls run the original forward (full logits; the "
                   "same loss and gradients). To keep the chunked loss under FSDP2, shard the head with the model's "
                   "root (fully_shard(model) without a fully_shard of the head).")
        return super(LinearCrossEntropyMixin, model).forward(*args, **kwargs)
    interception = _Interception(model, head)
    model.__dict__["_fusion_lce_active"] = interception
    trimmed = trimmed_at_layers(model) if type(model).release_freed_memory else contextlib.nullcontext()
    try:
        with interception, trimmed, tied_lookups(model, head) as interception.tied:
            output = super(LinearCrossEntropyMixin, model).forward(*args, **kwargs)
    finally:
        del model.__dict__["_fusion_lce_active"]
    computed = {k: v for s in interception.sources for k, v in s.computed.items()}

    def replace(value: Any) -> Any:
        return computed.get(id(value)) if isinstance(value, DeferredLogits) else value

    if isinstance(output, tuple):
        return tuple(replace(v) for v in output)
    if hasattr(output, "items") and any(isinstance(v, DeferredLogits) for v in output.values()):
        return type(output)(**{k: replace(v) for k, v in output.items()})
    return output


_MIXIN_NAME = re.compile(r"LinearCrossEntropyMixin_chunk(auto|\d+)_logits([01])(_kept1)?")
_mixins: dict[tuple[int | None, bool, bool], type[LinearCrossEntropyMixin]] = {}


def mixin_for(chunk_tokens: int | None, return_logits: bool,
              release_freed_memory: bool = True) -> type[LinearCrossEntropyMixin]:
    """The fused mixin with these options as class attributes: one class per choice, named so pickle finds it.

    The options must reach the fused instance, and a fused class is ``fused_subclass(mixin, original)``
    (picklable by reference); a mixin per option choice, rebuilt by this module's ``__getattr__`` from
    its name, keeps both. ``_kept1`` in a name: release_freed_memory off; without it (also a name pickled before that
    option existed): on.
    """
    if chunk_tokens is None and not return_logits and release_freed_memory:
        return LinearCrossEntropyMixin
    key = (chunk_tokens, return_logits, release_freed_memory)
    if key not in _mixins:
        name = (f"LinearCrossEntropyMixin_chunk{chunk_tokens or 'auto'}_logits{int(return_logits)}"
                + ("" if release_freed_memory else "_kept1"))
        _mixins[key] = type(name, (LinearCrossEntropyMixin,), {
            "__module__": __name__, "__qualname__": name,
            "chunk_tokens": chunk_tokens, "return_logits": return_logits,
            "release_freed_memory": release_freed_memory,
        })
    return _mixins[key]


def __getattr__(name: str) -> Any:
    """Rebuild an option mixin from its name (how unpickling a fused model finds it)."""
    match = _MIXIN_NAME.fullmatch(name)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    chunk = None if match.group(1) == "auto" else int(match.group(1))
    return mixin_for(chunk, match.group(2) == "1", match.group(3) is None)


def _self_calls(tree: ast.AST) -> set[str]:
    """Every ``self.<name>(...)`` called in ``tree``."""
    return {node.func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"}


def _indexed_logits(tree: ast.AST, head: str) -> str | None:
    """The first subscript of the head's output, or of a name computed from it, in ``tree`` (as source), that
    narrows more than the vocabulary; or None.

    The placeholder the head returns replays elementwise ops and slices of the vocabulary only
    (:meth:`~fusion_linear_cross_entropy.deferred.DeferredLogits.vocab_slice`: Inkling's ``logits[..., :n]``), so a
    forward that indexes its logits otherwise (transformers 4.57's Moshi shifts them by hand: ``logits[..., :-1, :]``)
    is declined here, by name, rather than refused when it first runs.
    """
    assigned = aliases(tree)

    def is_logits(node: ast.AST, derived: set[str]) -> bool:
        return (isinstance(node, ast.Name) and node.id in derived) or self_call(node, (head,)) is not None

    def from_logits(expr: ast.AST, derived: set[str]) -> bool:
        return any(is_logits(node, derived) for node in ast.walk(expr))

    derived: set[str] = set()
    while True:
        grown = {name for name, values in assigned.items()
                 if name not in derived and any(from_logits(value, derived) for value in values)}
        if not grown:
            break
        derived |= grown
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_logits(node.value, derived)
                and not _narrows_vocabulary_only(node.slice)):
            return ast.unparse(node)
    return None


def _narrows_vocabulary_only(index: ast.expr) -> bool:
    """Whether a subscript's index is one the placeholder replays (:func:`~fusion_linear_cross_entropy.deferred.
    vocab_index`): ``[..., a:b]`` or ``[:, :, a:b]``, the last a slice of step 1 (the runtime checks the count of
    ``:`` against the logits' dimensions)."""
    if not (isinstance(index, ast.Tuple) and len(index.elts) >= 2 and isinstance(index.elts[-1], ast.Slice)):
        return False
    last, lead = index.elts[-1], index.elts[:-1]
    if last.step is not None and not (isinstance(last.step, ast.Constant) and last.step.value == 1):
        return False
    if len(lead) == 1 and isinstance(lead[0], ast.Constant) and lead[0].value is Ellipsis:
        return True
    return all(isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None for e in lead)


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` (a model's root) is not one this family computes the loss of; None when it is."""
    from transformers import PreTrainedModel

    name = type(module).__name__
    if not isinstance(module, PreTrainedModel):
        return f"{name} is not a transformers PreTrainedModel"
    try:
        head = module.get_output_embeddings()
    except (NotImplementedError, AttributeError):
        head = None
    if not isinstance(head, nn.Module):
        return f"{name} has no output embeddings (no LM head) to compute the loss from"
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"the output embeddings of {name} are not an nn.Linear-shaped head (a 2-D [vocab, hidden] weight)"
    if "labels" not in inspect.signature(type(module).forward).parameters:
        return f"{name}.forward takes no labels"
    loss = module.loss_function
    if loss is not _causal_lm_loss():
        return (f"the loss_function of {name} is {getattr(loss, '__qualname__', loss)!r}, not transformers' "
                "ForCausalLMLoss")
    path = next((path for path, sub in module.named_modules() if sub is head), "")
    return _forward_refusal(type(module), path.split(".")[0])


@functools.cache
def _forward_refusal(cls: type[nn.Module], head: str) -> str | None:
    """What the source of ``cls.forward`` says against it, whose LM head is ``self.<head>``; read once per class
    (``is_fusable`` and ``refusal`` both ask, at every load)."""
    name = cls.__name__
    tree = next((tree for _, _, tree in forwards(cls)), None)
    if tree is None:
        return f"the source of {name}.forward cannot be read"
    called = _self_calls(tree)
    if "loss_function" not in called:
        return f"{name}.forward does not compute its loss with self.loss_function(...)"
    if head not in called:
        return f"{name}.forward does not call its LM head (self.{head}(...))"
    indexed = _indexed_logits(tree, head)
    if indexed is not None:
        return (f"{name}.forward indexes its logits ({indexed}); the family replays elementwise ops and slices of "
                "the vocabulary only")
    return None


class LinearCrossEntropyFamily(FusionFamily[LinearCrossEntropyOptions]):
    """The causal-LM training loss from the hidden states chunk by chunk: no full logits, no float32 copy."""

    name = NAME
    options_model = LinearCrossEntropyOptions
    #: The model's root only (its path is "").
    target_modules_patterns: ClassVar[Sequence[str]] = ("^$",)
    #: In training mode with labels the loss and every gradient are the original's, the logits are not returned.
    preserves: ClassVar[str] = "training_loss"

    def is_fusable(self, module: nn.Module, options: LinearCrossEntropyOptions) -> bool:
        return refusal(module) is None

    def refusal(self, module: nn.Module, options: LinearCrossEntropyOptions) -> str | None:
        return refusal(module)

    def make_fused_class(self, original_cls: type[nn.Module], options: LinearCrossEntropyOptions) -> type[nn.Module]:
        return fused_subclass(mixin_for(options.chunk_tokens, options.return_logits, options.release_freed_memory),
                              original_cls)
