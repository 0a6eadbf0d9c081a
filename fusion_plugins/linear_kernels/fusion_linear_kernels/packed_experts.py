"""transformers 5.x experts held prepacked: one oneDNN-packed matrix per expert *instead of* the dense 3-D stack.

At a decode step a mixture-of-experts layer reads the routed experts' weights, and every implementation
transformers ships multiplies a bfloat16 expert weight with oneDNN's GEMM, which reorders the weight on
every call (``grouped_mm`` runs one ``mm`` per expert on the CPU). ``benchmarks/bench_decode.py --model
olmoe-1b-7b --layers 4`` prints, per stack, the packed against the dense GEMM over a pass of experts, and the
decode it gives end to end. So, like a linear layer's weight (:mod:`fusion_linear_kernels.packing`), each 3-D expert
weight (``gate_up_proj`` or ``up_proj``, and ``down_proj``) may be held as a :class:`PackedExperts`: a tensor
of the stack's shape and dtype holding one packed ``[out, in]`` matrix per expert (a transposed stack's
slices are packed transposed). The dense stack is released; :class:`PrepackExperts` is the invertible
transform, its inverse the stack again, bit for bit, which ``state_dict``, saves and ``unfuse`` present.

**Where it packs** (at load, once per kind of module, :func:`packs_module`, or read from this machine's stored
decisions: :class:`fusion_core.plugin.Decisions`, topic ``"linear_kernels.packed_experts"``; :func:`decisions` lists
them with the timings): every 3-D weight of the module is a plain CPU floating tensor that
:func:`fusion_linear_kernels.packing.ineligible` admits (not a quantizer's, not a DTensor, not in a
distributed job); each stack's expert matrices pack (:func:`fusion_linear_kernels.packing.measure`: the
packed GEMM within the bound of ``F.linear``, or bit-identical in exact mode, and faster at one row and not
slower at 64 over a pass of several experts, :func:`timed_experts`: one matrix timed again and again stays
in cache, where packing measured no faster); and :func:`routed` over packed experts gives the configured
implementation's output on synthetic inputs of 1 and 3 rows within
:func:`fusion_linear_kernels.experts.admission_bound` (bit-identical in exact mode). Biases stay dense. No
weight read directly by a parent's code (``<...>.experts.gate_up_proj``:
:mod:`fusion_linear_kernels.direct_reads`) is packed.

**At run time** a packed module runs :func:`routed` for every row count (prefill groups the rows by expert;
transformers' implementations cannot read a packed stack): autograd through the packed GEMMs' custom
operator gives input gradients (LoRA on other layers trains through a frozen experts layer) and refuses a
gradient for an expert weight by name; under ``torch.compile`` the module is one custom operator
(:func:`packed_experts_op`, with a fake implementation and a recomputing backward), so ``fullgraph=True``
compiles.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fusion_core import TransformOp
from fusion_core.plugin import Decisions, Shape, experts_implementation, pass_size
from fusion_linear_kernels import compat, experts, packing, row_dot
from fusion_linear_kernels.data_parallel import refusal as strided_view_refusal
from fusion_linear_kernels.tolerance import admitted

#: Synthetic row counts on which a packed module must give the configured implementation's output.
PROBE_ROWS = (1, 3)

_DECISIONS: Decisions[tuple[object, ...], tuple[bool, str]] = Decisions(
    "linear_kernels.packed_experts", code=row_dot.CODE_DIGEST)


class PackedExperts(torch.Tensor):
    """A 3-D experts weight ``[experts, out, in]`` (or ``[experts, in, out]`` when ``transposed``) held as one
    oneDNN-packed ``[out, in]`` matrix per expert; the stack's shape, dtype and device, no storage of its own.

    Only detaching (what ``nn.Parameter`` does) is defined on it; any other operation raises, naming the
    module (a strided view is what data-parallel wrappers ask for, see :mod:`fusion_linear_kernels.data_parallel`).
    :meth:`dense` gives the stack back.
    """

    experts: tuple[torch.Tensor, ...]
    transposed: bool

    @staticmethod
    def __new__(cls, experts: Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
                transposed: bool) -> PackedExperts:
        tensor = compat.wrapper_tensor(cls, tuple(shape), dtype)
        tensor.experts, tensor.transposed = tuple(experts), transposed  # type: ignore[attr-defined]
        return tensor  # type: ignore[return-value]

    def dense(self) -> torch.Tensor:
        """The dense stack: each expert's matrix unpacked (new memory, the original bytes)."""
        matrices = [packing.unpack(matrix) for matrix in self.experts]
        return torch.stack([m.t() for m in matrices] if self.transposed else matrices)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"PackedExperts(shape={tuple(self.shape)}, dtype={self.dtype}, experts prepacked)"

    __torch_function__ = compat.NO_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        self = args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            twin = PackedExperts(self.experts, self.shape, self.dtype, self.transposed)
            twin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("experts", "transposed")})
            return twin
        raise NotImplementedError(f"{func}: {strided_view_refusal(self, 'prepacked per expert')}")


def is_packed_experts(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is an experts weight :class:`PrepackExperts` packed."""
    return isinstance(tensor, PackedExperts)


def expert_matrix(stack: torch.Tensor, expert: int, transposed: bool) -> torch.Tensor:
    """Expert ``expert``'s ``[out, in]`` matrix of a dense 3-D ``stack``, contiguous (what oneDNN packs)."""
    matrix = stack.detach()[expert]
    return (matrix.t() if transposed else matrix).contiguous()


def pack(stack: torch.Tensor, transposed: bool) -> PackedExperts:
    """``stack`` (dense, 3-D, on the CPU) packed per expert."""
    matrices = [compat.pack(expert_matrix(stack, e, transposed)) for e in range(stack.shape[0])]
    return PackedExperts(matrices, stack.shape, stack.dtype, transposed)


def timed_experts(stack: torch.Tensor, transposed: bool) -> list[torch.Tensor]:
    """The ``[out, in]`` matrices of the experts a packing measurement times: evenly spread, as many as a pass reads
    from memory (:func:`fusion_core.plugin.pass_size`: one expert's matrix, timed again and again, may stay in
    cache)."""
    dense = stack.detach()
    count = pass_size(dense[0].numel() * dense.element_size(), available=int(dense.shape[0]))
    picks = sorted({round(i * (dense.shape[0] - 1) / max(count - 1, 1)) for i in range(count)})
    return [expert_matrix(dense, e, transposed) for e in picks]


@dataclass(frozen=True)
class PrepackExperts(TransformOp):
    """A 3-D experts weight -> :class:`PackedExperts`; inverse: the dense stack, bit for bit.

    Bound only where :func:`packs_module` said so, at load; meta tensors (discovery's rehearsal) pass unchanged.
    """

    transposed: bool = False

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        shape = tuple(shapes[0])
        if len(shape) != 3:
            raise ValueError(f"an experts weight is 3-D; got shape {shape}")
        return (shape,)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        (stack,) = tensors
        if is_packed_experts(stack) or stack.device.type == "meta":
            return (stack,)
        with torch.no_grad():
            return (pack(stack, self.transposed),)

    def inverse(self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]) -> tuple[torch.Tensor, ...]:
        (stack,) = tensors
        return (stack.dense() if is_packed_experts(stack) else stack,)


# -- the computation ---------------------------------------------------------------------------------
def _projection(path: str) -> experts.Projection:
    """An expert's matrix applied by the packed GEMM where its stack is packed (``F.linear`` on a dense one)."""

    def project(rows: torch.Tensor, stack: torch.Tensor, bias: torch.Tensor | None, expert: int,
                transposed: bool) -> torch.Tensor:
        b = None if bias is None else bias[expert]
        if is_packed_experts(stack):
            return packing.linear(rows, stack.experts[expert], b, path)  # type: ignore[attr-defined]
        weight = stack[expert]
        return F.linear(rows, weight.t() if transposed else weight, b)

    return project


def routed(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
           top_k_weights: torch.Tensor, path: str = "", held: Mapping[str, torch.Tensor] | None = None,
           ) -> torch.Tensor:
    """The experts' output (:func:`fusion_linear_kernels.experts.routed`: ``batched_mm``'s arithmetic over the routed
    pairs, grouped by expert), one GEMM per routed expert and projection, packed where the module's stacks are
    (:class:`PackedExperts`); ``path`` names the module in a refusal, ``held`` stands in for its 3-D weights."""
    return experts.routed(module, hidden_states, top_k_index, top_k_weights, _projection(path), held)


# -- torch.compile: the packed module as one operator ------------------------------------------------
_MODULES: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()


def register(module: nn.Module) -> str:
    """The key under which :func:`packed_experts_op` finds ``module`` (registered on first use)."""
    key = str(id(module))
    _MODULES[key] = module
    return key


#: Passed as :func:`packed_experts_op`'s ``trained`` when an expert weight requires grad: its backward then refuses.
TRAINED = torch.zeros((), requires_grad=True)
#: Passed as ``trained`` otherwise.
FROZEN = torch.zeros(())


@torch.library.custom_op("fusion_linear_kernels::packed_experts", mutates_args=(),
                         schema="(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, Tensor trained, "
                                "str module, str path) -> Tensor")
def packed_experts_op(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      trained: torch.Tensor, module: str, path: str) -> torch.Tensor:
    """:func:`routed` on the registered module, as an operator ``torch.compile`` traces without looking inside, and
    whose backward refuses a gradient for the expert weights (``trained`` is :data:`TRAINED`) by name."""
    return routed(_MODULES[module], hidden_states, top_k_index, top_k_weights, path)


@packed_experts_op.register_fake
def _packed_experts_fake(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                         trained: torch.Tensor, module: str, path: str) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)


@torch.library.custom_op("fusion_linear_kernels::packed_experts_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, "
                                "str module, str path) -> (Tensor, Tensor)")
def packed_experts_backward_op(grad: torch.Tensor, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor, module: str,
                               path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`packed_experts_op` for ``hidden_states`` and ``top_k_weights``, by running
    :func:`routed` again under autograd (an operator too: traced backward graphs do not look inside it either)."""
    with compat.recording_inside_an_operator():
        hidden = hidden_states.detach().requires_grad_(True)
        weights = top_k_weights.detach().requires_grad_(True)
        out = routed(_MODULES[module], hidden, top_k_index, weights, path)
        grad_hidden, grad_weights = torch.autograd.grad(out, (hidden, weights), grad, allow_unused=True)
    return (torch.zeros_like(hidden_states) if grad_hidden is None else grad_hidden,
            torch.zeros_like(top_k_weights) if grad_weights is None else grad_weights)


@packed_experts_backward_op.register_fake
def _packed_experts_backward_fake(grad: torch.Tensor, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                  top_k_weights: torch.Tensor, module: str,
                                  path: str) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden_states.new_empty(hidden_states.shape), top_k_weights.new_empty(top_k_weights.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    hidden_states, top_k_index, top_k_weights, _, ctx.module, ctx.path = inputs
    ctx.save_for_backward(hidden_states, top_k_index, top_k_weights)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None, None, None]:
    if ctx.needs_input_grad[3]:
        raise RuntimeError(packing.refusal(f"the experts of {ctx.path}" if ctx.path else "these experts"))
    hidden_states, top_k_index, top_k_weights = ctx.saved_tensors
    grad_hidden, grad_weights = packed_experts_backward_op(grad, hidden_states, top_k_index, top_k_weights,
                                                           ctx.module, ctx.path)
    return (grad_hidden if ctx.needs_input_grad[0] else None, None,
            grad_weights if ctx.needs_input_grad[2] else None, None, None, None)


packed_experts_op.register_autograd(_backward, setup_context=_setup_context)


# -- where it packs ------------------------------------------------------------------------------------
def _probe_inputs(rows: int, hidden: int, experts: int, top_k: int, dtype: torch.dtype,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Synthetic routing: ``rows`` random rows, each to ``top_k`` distinct experts, softmax routing weights."""
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, top_k, generator=generator), -1).to(dtype)
    return x, index, weights


def stacks(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's 3-D expert weights by name (``gate_up_proj`` or ``up_proj``, ``down_proj``)."""
    return {name: p for name, p in module._parameters.items() if p is not None and p.dim() == 3}


def top_k_of(module: nn.Module) -> int:
    """How many experts a row is routed to, from the module's config (what the probes route to)."""
    config = getattr(module, "config", None)
    for name in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2


def configured_name(module: nn.Module) -> str:
    """The experts implementation the module's config selects."""
    return str(experts_implementation(module.config))  # type: ignore[union-attr]


def packs_module(module: nn.Module, exact: bool) -> bool:
    """Whether ``module``'s expert weights are held packed (see the module docs); measured once per kind of module
    (class, weight shapes, dtype, mode, configured implementation, experts per row)."""
    weights = stacks(module)
    transposed = bool(getattr(module, "is_transposed", False))
    if not weights or any(not is_packed_experts(w) and (type(w) not in (torch.Tensor, nn.Parameter) or w.shape[0] == 0
                                                        or packing.ineligible(w.detach()[0]) is not None)
                          for w in weights.values()):  # a stack packed already (repacking after .to()) was eligible
        return False
    first = next(iter(weights.values()))
    top_k = min(top_k_of(module), int(first.shape[0]))
    kind = (type(module), tuple((n, tuple(w.shape)) for n, w in weights.items()), first.dtype, exact, top_k,
            configured_name(module))
    return _DECISIONS.decide(kind, lambda: _measure(module, weights, exact, top_k, transposed))[0]


def _measure(module: nn.Module, weights: dict[str, torch.Tensor], exact: bool, top_k: int,
             transposed: bool) -> tuple[bool, str]:
    """The per-expert kinds pack, and :func:`routed` over the routed experts packed gives the configured output."""
    if "down_proj" not in weights:
        return False, "no down_proj"
    try:
        configured = experts.implementation(module, configured_name(module))
    except (KeyError, TypeError) as exc:
        return False, f"no configured implementation: {type(exc).__name__}: {exc}"
    timings = []
    for name, stack in weights.items():
        verdict, why = packing.measure(timed_experts(stack, transposed), exact)
        if not verdict:
            return False, f"{name}: {why}"
        timings.append(f"{name}: {why}")
    count = int(next(iter(weights.values())).shape[0])
    down = weights["down_proj"]
    hidden = int(down.shape[2] if transposed else down.shape[1])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in PROBE_ROWS:
            x, index, routing = _probe_inputs(rows, hidden, count, top_k, down.dtype, generator)
            used = set(index.reshape(-1).tolist())
            packed = {name: PackedExperts([compat.pack(expert_matrix(w, e, transposed)) if e in used else w[e]
                                           for e in range(count)], w.shape, w.dtype, transposed)
                      for name, w in weights.items()}  # only the routed experts packed: the probe's memory is small
            try:
                reference = configured(module, x, index, routing)
                got = routed(module, x, index, routing, held=packed)
            except (RuntimeError, NotImplementedError, ValueError, AttributeError, KeyError) as exc:
                return False, f"the packed experts did not run: {type(exc).__name__}: {exc}"
            if not admitted(got, reference, experts.admission_bound(reference, top_k), exact):
                return False, (f"not {'bit-identical to' if exact else 'within the bound of'} {configured_name(module)}"
                               f" at {rows} rows")
    return True, "; ".join(timings)


def decisions() -> dict[tuple[object, ...], tuple[bool, str]]:
    """Whether each kind of experts module in this process (measured, or stored for this machine) holds its experts
    packed, and why: (class, weight names and shapes, dtype, exact, experts per row, configured implementation) ->
    (packed, why)."""
    return dict(_DECISIONS)


def clear_decisions() -> None:
    """Forget every module-level packing decision of experts, here and stored for this machine."""
    _DECISIONS.forget()
