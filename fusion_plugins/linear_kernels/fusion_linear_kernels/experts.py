"""transformers 5.x's experts modules at decode: the experts implementation measured fastest for each kind of call.

5.x holds the experts of a mixture-of-experts block as one module with stacked 3-D weights
(``gate_up_proj``, ``down_proj``) whose class transformers decorates with
``use_experts_implementation``: its ``forward`` dispatches to ``config._experts_implementation``
through transformers' experts interface (``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``),
``grouped_mm`` by default, ``"eager"`` being the class's own loop over the routed experts. At a
decode step the default need not be the fastest: which kernel reads a routed expert's weight fastest
differs by machine and shape (``benchmarks/bench_decode.py --model olmoe-1b-7b`` prints the choices:
on the development machine the one-row kind kept ``grouped_mm``; the issue's Xeon measured GEMVs on
the routed experts 1.5x faster than ``grouped_mm``).

So the fused experts module (:class:`fusion_linear_kernels.family.ExpertsKernelsMixin`) chooses, per
*kind* of call (device, dtype, weight shapes, rows, routed experts per token, the configured
implementation, the mode), among :data:`CANDIDATES`: transformers' own implementations that this
transformers registers, :func:`routed_gemv` (one GEMV per routed expert and projection, where
oneDNN's bfloat16 GEMM reorders each weight it multiplies) and, within the bound only, :func:`routed_choice` (the
same with each product run by the kernel choice of :mod:`fusion_linear_kernels.choice`). The first call of a kind
(that this machine has no stored decision for: :class:`fusion_core.plugin.Decisions`, topic
``"linear_kernels.experts[<the candidates>]"``) runs each
on its real input, admits those whose output stands for the configured implementation's
(bit-identical in exact mode; within :func:`admission_bound` otherwise), times the admitted ones over
a pass of routings to other experts (:func:`timed_routings`: weights read from memory, as decode reads
them) and keeps the fastest (the configured one unless another is faster beyond the facility's
margin). No weight moves: the module's tensors, ``state_dict`` and checkpoint are the original ones.

The configured implementation runs unchanged for more than :data:`~fusion_linear_kernels.choice.MAX_ROWS`
rows (prefill), with autograd recording, on other devices, for tensor subclasses (a quantizer's
experts), for other call signatures, and under ``torch.compile`` (the traced code is the original's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fusion_core import FusedModule
from fusion_core.plugin import Decisions, apply_gate, experts_implementation, is_expert_parallel, pass_size
from fusion_linear_kernels import choice, row_dot
from fusion_linear_kernels.choice import MAX_ROWS
from fusion_linear_kernels.tolerance import admitted

CANDIDATES = ("eager", "grouped_mm", "batched_mm", "routed_gemv", "routed_choice")
"""The implementations tried: transformers' own where this transformers registers them (``eager``: the class's
loop), :func:`routed_gemv`, and within the bound only :func:`routed_choice`."""
WITHIN_BOUND_ONLY = ("routed_choice",)
"""The :data:`CANDIDATES` never tried in exact mode (their float32 sums run in another order)."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)

ExpertsKind = tuple[str, torch.dtype, tuple[tuple[int, ...], ...], int, int, str, bool]
"""(device, dtype, the 3-D weights' shapes, rows, routed experts per row, configured implementation, exact)."""
_DECISIONS: Decisions[ExpertsKind, str] = Decisions(f"linear_kernels.experts[{','.join(CANDIDATES)}]",
                                                                code=row_dot.CODE_DIGEST)
"""Stored under a topic that names the candidates, per build of the GEMV kernel (:data:`~fusion_linear_kernels.row_dot.
CODE_DIGEST`): a release that adds a candidate or changes the kernel measures its kinds again."""

ExpertsForward = Callable[..., torch.Tensor]


@functools.cache
def _interface() -> Any:
    """transformers' experts interface, or None on a release without one (4.57). Asked for every module a
    discovery scans: the import is tried once."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return ALL_EXPERTS_FUNCTIONS


@functools.cache
def original_forward(cls: type) -> ExpertsForward | None:
    """The experts class's own forward (the ``"eager"`` implementation) under transformers'
    ``use_experts_implementation`` dispatcher; None for a class without that dispatcher, or whose forward is not the
    dispatcher itself: a subclass whose own forward calls the dispatcher and does more (Ergo's experts give each
    route a row and a learned norm around it), which an implementation chosen here would skip. Cached by class: it
    is read at every decode call that runs another implementation."""
    for klass in cls.__mro__:
        if issubclass(klass, FusedModule):  # a fused subclass and the family's mixin: the original class is below
            continue
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        # The dispatcher copies the wrapped forward's names (functools.wraps), not its code object's.
        if "use_experts_implementation" in getattr(getattr(forward, "__code__", None), "co_qualname", ""):
            wrapped: ExpertsForward | None = getattr(forward, "__wrapped__", None)
            return wrapped
        return None
    return None


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a 5.x experts module dispatching through transformers' experts interface."""
    config = getattr(module, "config", None)
    return (_interface() is not None and original_forward(type(module)) is not None
            and experts_implementation(config) is not None
            and any(p.dim() == 3 for p in module.parameters(recurse=False)))


Projection = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int, bool], torch.Tensor]
"""``project(rows, stack, bias_stack, expert, transposed)``: ``rows`` through expert ``expert``'s matrix of a 3-D
``stack`` (``[experts, out, in]``, or ``[experts, in, out]`` when ``transposed``), plus its bias."""


def routed(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
           project: Projection, held: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The experts' output over the routed (row, expert) pairs only, each expert's matrices applied by ``project``.

    The arithmetic of transformers' ``batched_mm`` implementation (the module's gate or activation, biases,
    transposed weights, a post-expert norm; each pair's output times its routing weight, summed over the routed
    experts, then cast to the input's dtype), with the pairs grouped by expert (one row at decode: the row's
    experts in routing order). ``held`` stands in for the module's own 3-D weights, by name. Raises
    ``NotImplementedError`` under expert parallelism (its sentinel experts), which :func:`choose` reads as "not
    applicable".
    """
    if is_expert_parallel(module):
        raise NotImplementedError("the routed experts' computation does not run expert-parallel experts")
    # transformers 5.0's dispatcher sets no has_gate (every expert is gated there) nor a post-expert norm.
    gated, biased = bool(getattr(module, "has_gate", True)), bool(getattr(module, "has_bias", False))
    transposed = bool(getattr(module, "is_transposed", False))
    up_name = "gate_up_proj" if gated else "up_proj"
    up, down = (getattr(module, name) if held is None or name not in held else held[name]
                for name in (up_name, "down_proj"))
    up_bias = getattr(module, f"{up_name}_bias") if biased else None
    down_bias = module.down_proj_bias if biased else None
    post_norm = getattr(module, "has_post_expert_norm", False)

    def expert_output(expert: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = project(rows, up, up_bias, expert, transposed)
        hidden = apply_gate(module, hidden) if gated else module.act_fn(hidden)
        out = project(hidden, down, down_bias, expert, transposed)
        return module.post_expert_norm(out) if post_norm else out

    rows, top_k = top_k_index.shape
    sample_weights = top_k_weights.reshape(-1)
    if rows == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    if rows == 1:  # a decode step: the row's experts in routing order, no grouping to do
        weighted = torch.cat([expert_output(expert, hidden_states) for expert in top_k_index[0].tolist()])
        return (weighted * sample_weights.unsqueeze(-1)).sum(dim=0, keepdim=True).to(hidden_states.dtype)
    flat_ids = top_k_index.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    ids, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    pieces = []
    for pairs, expert in zip(torch.split(order, counts.tolist()), ids.tolist(), strict=True):
        pieces.append(expert_output(expert, hidden_states[pairs // top_k]) * sample_weights[pairs].unsqueeze(-1))
    weighted = torch.cat(pieces)[torch.argsort(order)]  # back in (row, k) order
    return weighted.view(rows, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _gemv(rows: torch.Tensor, stack: torch.Tensor, bias: torch.Tensor | None, expert: int,
          transposed: bool) -> torch.Tensor:
    """One BLAS matrix-vector product per row (``mv``; a vector-matrix product for a transposed stack), the bias
    added after. A single row (a decode step) takes its one product as it is, not stacked: a decode step calls this
    for each projection of each routed expert (16 calls a layer at a top-8 routing), and a stack of one costs an
    operator each time."""
    weight = stack[expert]

    def product(row: torch.Tensor) -> torch.Tensor:
        return torch.matmul(row, weight) if transposed else torch.mv(weight, row)

    out = product(rows[0]).unsqueeze(0) if rows.shape[0] == 1 else torch.stack([product(row) for row in rows])
    return out if bias is None else out + bias[expert]


def routed_gemv(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output computed with one matrix-vector product per routed (row, expert) pair and projection
    (:func:`routed` with BLAS GEMVs): each routed expert's weight is read where it lies, instead of being gathered
    into a batch (``batched_mm``) or multiplied by oneDNN's GEMM, which reorders a bfloat16 weight on every call
    (``eager``, ``grouped_mm``)."""
    return routed(module, hidden_states, top_k_index, top_k_weights, _gemv)


def _chosen(rows: torch.Tensor, stack: torch.Tensor, bias: torch.Tensor | None, expert: int,
            transposed: bool) -> torch.Tensor:
    """Expert ``expert``'s ``[out, in]`` matrix applied by the kernel choice
    (:func:`fusion_linear_kernels.choice.linear`, within the bound): the kernel measured for that matrix's kind of
    call, the one the packing decision (:mod:`fusion_linear_kernels.packed_experts`) set a packed expert matrix
    against. A transposed stack, whose matrix would be a strided view, runs :func:`_gemv`'s product."""
    if transposed:
        return _gemv(rows, stack, bias, expert, transposed)
    return choice.linear(rows, stack[expert], None if bias is None else bias[expert], exact=False)


def routed_choice(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`routed` with each routed expert's products run by the kernel choice (:func:`_chosen`): the row-dot,
    blocked-rows or few-rows GEMV where those measured fastest, which read an expert's matrix at the memory's
    bandwidth where ``torch.mv`` runs one thread's loop. The dense experts' decode when the packing decision leaves
    them dense because those kernels were faster. Within the bound only."""
    return routed(module, hidden_states, top_k_index, top_k_weights, _chosen)


_OWN: dict[str, ExpertsForward] = {"routed_gemv": routed_gemv, "routed_choice": routed_choice}
"""The family's own implementations, by name (the other :data:`CANDIDATES` are transformers')."""


def implementation(module: nn.Module, name: str) -> ExpertsForward:
    """The experts implementation ``name`` for ``module``'s class: one of the family's own (:data:`_OWN`), or
    transformers' (``"eager"``: the class's forward)."""
    if name in _OWN:
        return _OWN[name]
    original = original_forward(type(module))
    if original is None:
        raise TypeError(f"{type(module).__qualname__} does not dispatch through transformers' experts interface")
    if name == "eager":
        return original
    interface = _interface()
    if hasattr(interface, "get_interface"):
        chosen: ExpertsForward = interface.get_interface(name, original)
        return chosen
    return interface[name]  # type: ignore[no-any-return]  # 5.0's interface: a mapping of name to function


def available() -> tuple[str, ...]:
    """The :data:`CANDIDATES` this transformers registers (``eager`` always)."""
    interface = _interface()
    return tuple(name for name in CANDIDATES
                 if name == "eager" or name in _OWN or (interface is not None and name in interface))


def applies(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> bool:
    """Whether this call chooses (see the module docs for when the configured implementation runs as it is)."""
    weights = [p for p in module.parameters(recurse=False)]
    if not weights or type(hidden_states) not in _PLAIN or any(type(w) not in _PLAIN for w in weights):
        return False
    if hidden_states.device.type != "cpu" or any(w.device.type != "cpu" or w.dtype != hidden_states.dtype
                                                 for w in weights):
        return False
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(w.requires_grad for w in weights)):
        return False
    rows = hidden_states.numel() // max(int(hidden_states.shape[-1]), 1)
    return hidden_states.dim() == 2 and top_k_index.dim() == 2 and 0 < rows <= MAX_ROWS


def kind_of(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, exact: bool) -> ExpertsKind:
    """The kind a call's decision is filed under."""
    shapes = tuple(tuple(p.shape) for p in module.parameters(recurse=False))
    configured = str(experts_implementation(module.config))  # type: ignore[union-attr]
    return (str(hidden_states.device), hidden_states.dtype, shapes, int(hidden_states.shape[0]),
            int(top_k_index.shape[-1]), configured, exact)


def admission_bound(reference: torch.Tensor, top_k: int) -> float:
    """How far another implementation's output may be from the configured one's.

    Both run the same per-expert products in the same dtype; they differ in where intermediate results
    are rounded to the dtype (each expert's projections and gate) and in the order the ``top_k`` weighted
    expert outputs are summed, each step at most a unit in the last place of its value. Bounded by
    ``2 (top_k + 1) eps(dtype) max|r|``: a cancellation that makes ``max|r|`` small against the expert
    outputs makes the bound stricter, so an implementation is refused, never wrongly taken.
    """
    return 2 * (top_k + 1) * torch.finfo(reference.dtype).eps * float(reference.abs().max())


def run(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
        exact: bool, configured: ExpertsForward) -> torch.Tensor:
    """The experts' output, by the implementation chosen for this kind of call (``configured`` is the module's
    dispatching forward, bound)."""
    if not applies(module, hidden_states, top_k_index):
        return configured(hidden_states, top_k_index, top_k_weights)
    kind = kind_of(module, hidden_states, top_k_index, exact)
    name = _DECISIONS.get(kind) or _DECISIONS.decide(
        kind, lambda: choose(module, hidden_states, top_k_index, top_k_weights, exact))
    if name == kind[5]:
        return configured(hidden_states, top_k_index, top_k_weights)
    return implementation(module, name)(module, hidden_states, top_k_index, top_k_weights)


def choose(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
           exact: bool) -> str:
    """The fastest admitted implementation for this input, timed over :func:`timed_routings` (the configured one
    unless another is faster beyond the margin)."""
    configured = str(experts_implementation(module.config))  # type: ignore[union-attr]
    args = (hidden_states.detach(), top_k_index, top_k_weights.detach())
    with torch.no_grad():
        reference = implementation(module, configured)(module, *args)
        bound = admission_bound(reference, int(top_k_index.shape[-1]))
        taken = [configured]
        for name in available():
            if name == configured or (exact and name in WITHIN_BOUND_ONLY):
                continue
            try:
                output = implementation(module, name)(module, *args)
            except (RuntimeError, NotImplementedError, ValueError, AttributeError):  # not for these experts
                continue
            if admitted(output, reference, bound, exact):
                taken.append(name)
        if len(taken) == 1:
            return configured
        routings = timed_routings(module, top_k_index)
        ways = [_call(implementation(module, name), module, args[0], routings, args[2]) for name in taken]
        return taken[_DECISIONS.fastest(ways, reference.device)]


def timed_routings(module: nn.Module, top_k_index: torch.Tensor) -> list[torch.Tensor]:
    """The routings a timed pass runs: the call's experts renumbered onto other experts, call after call, so that
    a pass reads distinct experts' weights from memory (:func:`fusion_core.plugin.pass_size`), as decode steps
    do, where the same experts timed again and again would be served from cache."""
    stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    count = int(stacked[0].shape[0])
    unique, index = torch.unique(top_k_index, return_inverse=True)
    routed_now = int(unique.numel())
    each = routed_now * sum(p.numel() // count * p.element_size() for p in stacked)
    calls = pass_size(each, available=max(1, count // routed_now))
    return [((index + i * routed_now) % count).to(top_k_index.dtype) for i in range(calls)]


def _call(forward: ExpertsForward, module: nn.Module, hidden_states: torch.Tensor, routings: list[torch.Tensor],
          top_k_weights: torch.Tensor) -> Callable[[], object]:
    return lambda: [forward(module, hidden_states, routing, top_k_weights) for routing in routings]


def decisions() -> dict[ExpertsKind, str]:
    """The implementation chosen for each kind of experts call in this process (measured, or stored for this
    machine)."""
    return dict(_DECISIONS)


def clear_decisions() -> None:
    """Forget every experts decision, here and stored for this machine: the next call of each kind measures again."""
    _DECISIONS.forget()
