"""Which candidate kernel each kind of linear call runs: measured once per kind on the real input.

A *kind* is what a kernel's speed depends on: the device, the dtype, the weight's shape and strides, whether there
is a bias, the input's row count (1 to :data:`MAX_ROWS`) and the mode (exact or within the bound). The first eager
call of a kind (that this machine has no stored decision for: :class:`fusion_core.plugin.Decisions`, topic
``"linear_kernels.choice[<the candidates' names>]"``, stored per build of the GEMV kernel) computes every applicable
candidate (:data:`fusion_linear_kernels.kernels.CANDIDATES`) on its real input, admits those whose output stands for
``F.linear``'s (:mod:`fusion_linear_kernels.tolerance`), times the admitted ones over a pass of copies of the weight
(read from memory, as decode reads every layer's) and keeps the fastest for the kind; ``F.linear`` keeps a kind
unless another candidate was faster by more than the facility's margin. Every layer of a model shares its kinds, so
a decoder measures each shape once.

Where the choice does not apply, the call runs ``F.linear``, the original kernel, without
measuring (:func:`runs_original`): more than :data:`MAX_ROWS` rows (prefill, where every kernel is
a GEMM), autograd (an input or parameter that requires grad while grad is enabled: training),
devices other than the CPU, tensors that are not torch's own (a quantizer's weight keeps its
quantizer's kernel, unless it is int8 weight-only with one scale per row, where torch's int8 GEMM is
a candidate: :data:`fusion_linear_kernels.kernels.INT8`; DTensors), dtype mixes, autocast that would cast an
operand (:func:`autocast_dtype`: the other kernels are not among the operators it casts for). Under
``torch.compile`` the fused module calls ``F.linear`` before it gets here (:mod:`fusion_linear_kernels.family`).

Each layer and merged projection calls through its own :class:`Caller`, which remembers the kind of its last call
and the kernel that ran it: a decode step calls every layer with the same kind of input again, and working the kind
out anew (a dozen attribute reads, a tuple hashed) cost 37 us a call between GEMVs that evict the interpreter's
caches (6.5 us warm), and remembering it made a Qwen2-0.5B decode step 1.6% faster (docs/benchmarks.md).

**Rows torch would not fold.** ``F.linear`` runs a 3-D input as the rows of one GEMM where the input's strides are
the contiguous ones (:func:`folds`), or where the weight requires grad. A slice such as ``hidden_states[:, -1:, :]``,
which transformers hands the LM head at prefill, keeps the strides of the whole sequence; on a weight that does not
require grad (a frozen model, a PEFT base model, and the detached copies a measurement times) torch then runs a
batched GEMM over a transposed copy of the entire weight: 2.3 s a call for a 128256x2048 bfloat16 head against 28 ms
on the same row, on a 2-core AMD EPYC. Timed that way, ``F.linear`` lost a Llama-3.2-1B head's decision to
``torch.mv``, which then ran every decode step at 52 ms where ``F.linear`` takes 33. Within the bound a layer runs such
an input as its rows (:func:`as_rows`: a view, or a copy of at most :data:`MAX_ROWS` rows), so a decision is measured
on, and applies to, what decode runs; in exact mode the call runs ``F.linear`` on it as it is, without choosing (the
batched GEMM is another kernel, whose bits are its own).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F

from fusion_core.plugin import Decisions, device_key, distinct_copies
from fusion_linear_kernels import compat, kernels, row_dot
from fusion_linear_kernels.kernels import LINEAR, Candidate
from fusion_linear_kernels.tolerance import admission_bound, admitted

MAX_ROWS = 8
"""Inputs of at most this many rows (tokens times batch) choose a kernel: decode steps, small batches, the draft
tokens a step of assisted generation checks."""

Kind = tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], bool, int, bool, str]
"""(device, dtype, weight shape, weight strides, has bias, rows, exact, weight class): a quantizer's int8 weight
and a dense one of the same shape and dtype are other kinds (their candidates differ)."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _named(name: object) -> Candidate | None:
    """The candidate a stored decision names (None: not one of this release's, measured again)."""
    return next((candidate for candidate in kernels.CANDIDATES if candidate.name == name), None)


_DECISIONS: Decisions[Kind, Candidate] = Decisions(
    f"linear_kernels.choice[{','.join(candidate.name for candidate in kernels.CANDIDATES)}]",
    save=lambda c: c.name, load=_named, code=row_dot.CODE_DIGEST)
"""Stored under a topic that names the candidates, per build of the GEMV kernel (:data:`~fusion_linear_kernels.row_dot.
CODE_DIGEST`): a release that adds a candidate or changes the kernel measures its kinds again."""


def rows_of(input: torch.Tensor) -> int:
    """The number of rows ``F.linear`` sees: every dimension but the last, multiplied."""
    return input.numel() // max(int(input.shape[-1]), 1)


def autocast_dtype(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype | None:
    """The dtype autocast runs ``F.linear(input, weight, bias)`` in, where that casts an operand; None where autocast
    is off for the input's device, or every operand already has its dtype.

    Autocast casts the operands of the operators it lists (``linear``, ``mm``, ...), not those of the other kernels
    a layer may run (``torch.mv``, the packed GEMM): those must see the operands as ``F.linear`` would."""
    if input.is_cpu:  # the common case, asked without building a device object (a decode step asks per layer)
        device = "cpu"
        if not torch.is_autocast_enabled(device):
            return None
    else:
        device = input.device.type
        if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
            return None
    if not input.is_floating_point():
        return None
    dtype = torch.get_autocast_dtype(device)
    if input.dtype == weight.dtype == dtype and (bias is None or bias.dtype == dtype):
        return None
    return dtype


def runs_original(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this call runs ``F.linear`` without choosing (see the module docs for each case)."""
    if type(input) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
        return True
    if autocast_dtype(input, weight, bias) is not None:
        return True
    if type(weight) not in _PLAIN and compat.int8_rows(weight) is None:  # a quantizer's tensor keeps its kernel ...
        return True  # ... unless it is int8 weight-only, where torch's int8 GEMM is a candidate
    if input.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2 or input.dim() == 0:
        return True
    if input.layout != torch.strided or weight.layout != torch.strided:
        return True
    if input.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        return True
    if torch.is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return True
    return not 0 < rows_of(input) <= MAX_ROWS


def folds(input: torch.Tensor) -> bool:
    """Whether ``F.linear`` runs ``input`` as the rows of one GEMM: a matrix, or an input whose strides are the
    contiguous strides of its shape (torch's matmul folds only those; see the module docs)."""
    if input.dim() <= 2:
        return True
    expected = 1
    for size, stride in zip(reversed(input.shape), reversed(input.stride()), strict=True):
        if stride != expected:
            return False
        expected *= size
    return True


def as_rows(input: torch.Tensor, exact: bool) -> torch.Tensor:
    """``input`` itself, or within the bound (not ``exact``) its rows as a matrix where torch would not fold it and
    it has at most :data:`MAX_ROWS` rows (a view where its memory allows, else a copy of those few rows)."""
    if exact or folds(input) or not 0 < rows_of(input) <= MAX_ROWS:
        return input
    return input.reshape(-1, input.shape[-1])


def kind_of(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool) -> Kind:
    """The kind a call's decision is filed under."""
    cls = "torch" if type(weight) in _PLAIN else f"{type(weight).__module__}.{type(weight).__qualname__}"
    return (device_key(input.device), input.dtype, tuple(weight.shape), tuple(weight.stride()), bias is not None,
            rows_of(input), exact, cls)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool = False) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, run by the kernel chosen for this kind of call."""
    rows = as_rows(input, exact)
    candidate = chosen(rows, weight, bias, exact)
    if candidate is None:
        return F.linear(input, weight, bias)
    return _shaped(candidate.run(rows, weight, bias), input, rows)


_LIBRARY = torch.library.Library("fusion_linear_kernels", "FRAGMENT")
_LIBRARY.define("chosen_linear(Tensor input, Tensor weight, Tensor? bias, bool exact) -> Tensor")


_TRACED_CALLERS: dict[tuple[int, bool], tuple[weakref.ref[torch.Tensor], Caller]] = {}
"""Each weight the operator ran on (by identity and mode): its :class:`Caller`, dropped when the weight dies."""


def _chosen_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool) -> torch.Tensor:
    """:func:`linear` as one operator, for compiled code (:func:`traced_linear`): the kind is worked out, and measured
    at its first call, when the compiled code runs, on the real tensors (traced code has only fake ones).

    Compiled code passes the same parameter objects at every step, so each weight keeps a :class:`Caller`, as an eager
    layer does, and a call like its last one skips working the kind out: on a 2-core Xeon (AMX-BF16), a 896x896 bf16
    weight, one row, 3000 calls, about 11 us a call around the kernel before and 5 after (a throwaway probe)."""
    key = (id(weight), exact)
    entry = _TRACED_CALLERS.get(key)
    if entry is None or entry[0]() is not weight:
        entry = (weakref.ref(weight, lambda _, key=key: _TRACED_CALLERS.pop(key, None)), Caller(exact))
        _TRACED_CALLERS[key] = entry
    return entry[1](input, weight, bias)


# Defined with torch.library.Library, not torch.library.custom_op: the operator runs for every dense layer at every
# decode step (Qwen2-0.5B, every family on: 73 to 97 calls a token), and custom_op's wrappers cost about 18 us a call on
# a 2-core Xeon (AMX-BF16) where this costs about 6. It has no autograd formula: traced code calls it only where
# autograd records nothing (traced_linear: runs_original).
_LIBRARY.impl("chosen_linear", _chosen_linear, "CompositeExplicitAutograd")
chosen_linear_op = torch.ops.fusion_linear_kernels.chosen_linear.default


@torch.library.register_fake("fusion_linear_kernels::chosen_linear")
def _chosen_linear_fake(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        exact: bool) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def traced_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  exact: bool = False) -> torch.Tensor:
    """What ``torch.compile``'s traced code runs for ``F.linear(input, weight, bias)``: the chosen kernel's operator
    (:func:`chosen_linear_op`) where an eager call would choose, so that compiled decode reads the weights as eager
    decode does; ``F.linear`` itself wherever eager runs the original without choosing (:func:`runs_original`: what
    the trace sees of grad mode, autocast, devices, dtypes and rows is what its guards hold), and under
    ``torch.export``, whose programs stay of torch's own operators (other runtimes read them)."""
    if torch.compiler.is_exporting() or runs_original(input, weight, bias):
        return F.linear(input, weight, bias)
    out: torch.Tensor = chosen_linear_op(input, weight, bias, exact)
    return out


def _shaped(out: torch.Tensor, input: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out``, computed on ``rows`` (:func:`as_rows`), in the shape ``F.linear(input, ...)`` has."""
    return out if rows is input else out.view(*input.shape[:-1], out.shape[-1])


def chosen(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool) -> Candidate | None:
    """The candidate chosen for this kind of call (measured at its first call), or None where the call runs
    ``F.linear`` without choosing (:func:`runs_original`, or rows torch would not fold: see the module docs)."""
    if runs_original(input, weight, bias) or not folds(input):
        return None
    kind = kind_of(input, weight, bias, exact)
    return _DECISIONS.get(kind) or _DECISIONS.decide(kind, lambda: choose(input, weight, bias, exact))


def decided(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Candidate | None:
    """The candidate decided within the bound for this kind of call, without measuring one: None where none is decided
    yet, or where the call runs ``F.linear`` without choosing (:func:`chosen` decides)."""
    if runs_original(input, weight, bias) or not folds(input):
        return None
    return _DECISIONS.get(kind_of(input, weight, bias, False))


def generation() -> int:
    """The decisions' generation: it changes whenever they are forgotten (:func:`clear_decisions`,
    ``fusion_core.reset_state()``), so whatever was derived from them is worked out again."""
    return _DECISIONS.generation


class Caller:
    """:func:`linear` for one caller (a layer, a merged projection), remembering its last chosen call.

    A call with the same weight and bias objects, an input of the same shape, strides and dtype, and nothing about
    the weight changed that its kind reads (shape, strides, dtype, device: ``param.data = ...`` keeps the object) is
    of the same kind, so it runs the same kernel without working the kind out again; any other call takes the whole
    path of :func:`linear` and is remembered in turn. What it remembers lasts while the decisions do (their
    :attr:`~fusion_core.plugin.Decisions.generation`: :func:`clear_decisions` and ``reset_state()`` end it); the
    weight is held weakly (a replaced weight is not kept alive), and pickling or copying a caller drops it all. A
    merged projection that runs one GEMM per part (where merging does not pay) passes a new view of the part's rows
    at each call, so it works the kind out every time, as every call did before.
    """

    __slots__ = ("_last", "exact")

    def __init__(self, exact: bool = False) -> None:
        self.exact = exact
        self._last: tuple[int, Callable[[], object], object, torch.Size, tuple[int, ...], torch.dtype, torch.Size,
                          tuple[int, ...], torch.dtype, Candidate, bool] | None = None

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        last = self._last
        if last is not None:
            (generation, held, held_bias, shape, input_strides, dtype, weight_shape, strides, weight_dtype, candidate,
             flat) = last
            if (generation == _DECISIONS.generation and held() is weight and held_bias is bias
                    and type(input) is torch.Tensor and input.shape == shape and input.stride() == input_strides
                    and input.dtype is dtype and input.is_cpu and input.layout is torch.strided
                    and weight.shape == weight_shape and weight.stride() == strides
                    and weight.dtype is weight_dtype and weight.is_cpu and (bias is None or bias.dtype is dtype)
                    and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                                          or (bias is not None and bias.requires_grad)))
                    and not torch.is_autocast_enabled("cpu")):
                rows = input.reshape(-1, input.shape[-1]) if flat else input
                return _shaped(candidate.run(rows, weight, bias), input, rows)
        rows = as_rows(input, self.exact)
        candidate = chosen(rows, weight, bias, self.exact)
        if candidate is None:
            return F.linear(input, weight, bias)
        self._last = (_DECISIONS.generation, weakref.ref(weight), bias, input.shape, input.stride(), input.dtype,
                      weight.shape, weight.stride(), weight.dtype, candidate, rows is not input)
        return _shaped(candidate.run(rows, weight, bias), input, rows)

    def __reduce__(self) -> tuple[type[Caller], tuple[bool]]:
        return type(self), (self.exact,)

    def __deepcopy__(self, memo: dict[int, object]) -> Caller:
        return type(self)(self.exact)


def choose(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool,
           candidates: Sequence[Candidate] | None = None, copies: Sequence[torch.Tensor] | None = None,
           keep: Candidate = LINEAR, table: Decisions[Any, Any] | None = None) -> Candidate:
    """The fastest of ``candidates`` (default: :data:`~fusion_linear_kernels.kernels.CANDIDATES`) admitted on this
    input, timed over a pass of ``copies`` of ``weight`` (default: :func:`~fusion_core.plugin.distinct_copies`) by
    ``table`` (default: this module's decisions); ``keep`` (default ``F.linear``) unless another is faster beyond the
    margin. A ``keep`` other than ``F.linear`` must be admitted too; where none of them is, ``F.linear``."""
    candidates = kernels.CANDIDATES if candidates is None else candidates
    x = input.detach()
    with torch.no_grad():
        reference = F.linear(x, weight, bias)
        bound = admission_bound(x, weight, reference)
        taken = [
            c for c in (keep, *(c for c in candidates if c is not keep)) if c is LINEAR or (
                (c.exact or not exact) and c.applies(x, weight, bias)
                and admitted(c.run(x, weight, bias), reference, bound, exact))
        ]
        if len(taken) <= 1:
            return taken[0] if taken else LINEAR
        weights = distinct_copies(weight.detach()) if copies is None else copies
        timer = _DECISIONS if table is None else table
        return taken[timer.fastest([_call(c, x, weights, bias) for c in taken], x.device)]


def remember(input: torch.Tensor, weight: torch.Tensor, exact: bool, candidate: Candidate) -> None:
    """Keep ``candidate`` as the decision for calls of ``input``'s kind on ``weight`` without a bias, where a caller
    chose it as :func:`choose` does (packing does at decode), so that the first such call does not time it again."""
    _DECISIONS.decide(kind_of(input, weight, None, exact), lambda: candidate)


def _call(candidate: Candidate, x: torch.Tensor, weights: Sequence[torch.Tensor],
          bias: torch.Tensor | None) -> Callable[[], object]:
    return lambda: [candidate.run(x, weight, bias) for weight in weights]


def decisions() -> dict[Kind, str]:
    """The candidate chosen for each kind in this process (measured, or stored for this machine), by name."""
    return {kind: candidate.name for kind, candidate in _DECISIONS.items()}


def clear_decisions() -> None:
    """Forget every decision, here and stored for this machine: the next call of each kind measures again."""
    _DECISIONS.forget()
