"""A linear layer's weight held in oneDNN's prepacked layout *instead of* its dense ``[out, in]`` tensor.

``F.linear`` on a bfloat16 CPU tensor hands oneDNN the dense weight, which oneDNN reorders into its
blocked layout on every call: at one row (a decode step) that reorder costs as much as the GEMV
itself. :class:`PrepackLinearWeight` is the invertible transform that does the reorder once, at
load: its ``forward`` replaces ``weight`` by the packed tensor (:func:`fusion_linear_kernels.compat.pack`,
same shape, dtype and device; the dense tensor is released, so memory stays the plain model's), its
``inverse`` is ``to_dense()``, bit for bit, which is what ``state_dict`` / ``save_pretrained`` /
``fusion_core.unfuse`` present and the core verifies once per kind at load.

**Where it packs** (decided by :func:`packs`, once per kind = weight shape, dtype and mode, on the
first layer of that kind a load converts, or read from this machine's stored decisions:
:class:`fusion_core.plugin.Decisions`, topic ``"linear_kernels.packing"``; :func:`pack_decisions` lists them):

- only torch's own dense, strided, 2-D CPU tensors (not a quantizer's tensor subclass, not a DTensor,
  not on an accelerator or ``meta``: those are returned unchanged and keep ``F.linear``), of a
  floating dtype, with oneDNN available in this build, and not in a distributed job
  (:mod:`fusion_linear_kernels.data_parallel`);
- only where the packed kernel stands for ``F.linear``: on synthetic inputs of :data:`PROBE_ROWS`
  rows its output must be bit-identical to ``F.linear``'s in exact mode (without a bias), within
  :mod:`fusion_linear_kernels.tolerance`'s bound otherwise (with and without a bias). Measured here:
  bfloat16 without a bias was bit-identical at every row count and weight tried; float32 at one row
  differs in the last bits (packed in the default mode only); with a bias, the packed kernel adds
  it in another order than ``F.linear``'s GEMM, which moved the last bit of about one bfloat16 output
  in 20,000, so **exact mode packs no layer with a bias** (:func:`fusion_linear_kernels.family.packing_plan`).
  The probes are evidence on synthetic inputs, not a proof for every input: exact mode's promise
  (logits bit-identical to the model without this family) is what the tests check on whole models;
- only where it is faster: timed over a pass of copies of the layer's weight (read from memory, as
  decode reads every layer's) on a synthetic input, it must be faster beyond the facility's margin
  (:func:`fusion_core.plugin.faster`) at :data:`DECODE_ROWS` row (decode) than the kernel the dense
  weight would run there (:func:`fusion_linear_kernels.choice.choose`: ``F.linear`` or ``torch.mv``, which
  beats the packed GEMV on some shapes: a 896x4864 bfloat16 down projection on a 2-core Xeon read at 25 GB/s
  by ``torch.mv``, 21 GB/s packed), and ``F.linear`` must not be faster beyond it at :data:`PREFILL_ROWS`
  rows (a prompt: a packed weight has no dense copy to fall back on). Timing does not depend on the
  values, so the decision is made at load, on synthetic inputs, not on the first real call.

A weight shared with another module (a tied LM head: it is the embedding table) is never packed:
the plugin's ``fusion_convert_loaded`` hook drops the transform from that module's plan. Nor, outside exact mode, is a
weight a decoder layer's decode step reads (:func:`fusion_linear_kernels.decode_layer.read_by_steps`: the step reads
dense weights only, and one packed projection turns its whole layer's step off).

**At run time** (:func:`linear`) a packed layer calls the packed kernel for every row count; with
autograd recording (an input or the bias that requires grad, or the weight's own ``requires_grad``
while grad is enabled) it goes through the custom operator ``fusion_linear_kernels::packed_linear``,
whose backward gives the input (and bias) gradients from a temporary dense copy and refuses a
gradient for the weight by name (:func:`refusal`). Under ``torch.compile`` the same custom operator
is traced (it has a fake implementation, so ``fullgraph=True`` compiles, Inductor included), and so is
``torch.export`` (whose non-strict tracing hands the layer fake tensors of another class). Under autocast,
where the original ``F.linear`` would run in autocast's dtype, the operands are cast to it first and the
operator runs (a weight packed in another dtype is cast from a dense copy): the same dtype and numbers
as the original, never a float32 result where it gave bfloat16. An input of another dtype or device than
the weight otherwise runs ``F.linear`` on a dense copy, as the original module would (with its errors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from fusion_core import TransformOp
from fusion_core.plugin import Decisions, Shape, distinct_copies, faster
from fusion_linear_kernels import choice, compat, row_dot
from fusion_linear_kernels.data_parallel import in_distributed_job
from fusion_linear_kernels.kernels import LINEAR, Candidate
from fusion_linear_kernels.tolerance import admission_bound, admitted

PROBE_ROWS = (1, 2, 3, 4, 16, 64)
"""Row counts whose outputs the packed kernel must match (exactly, or within the bound) before a kind is packed."""
DECODE_ROWS = 1
"""The row count at which packing must be faster (one decode step)."""
PREFILL_ROWS = 64
"""The row count at which packing must not be slower (a prompt)."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)

PackKind = tuple[tuple[int, ...], torch.dtype, bool]
"""(weight shape, dtype, exact): what a packing decision is filed under."""
_DECISIONS: Decisions[PackKind, tuple[bool, str]] = Decisions(
    "linear_kernels.packing", code=row_dot.CODE_DIGEST)


def is_packed(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is a weight :class:`PrepackLinearWeight` packed (oneDNN's layout)."""
    return tensor is not None and tensor.is_mkldnn


def unpack(tensor: torch.Tensor) -> torch.Tensor:
    """The dense weight: ``to_dense()`` of a packed one (new memory, the original bytes), else ``tensor`` itself."""
    return tensor.to_dense() if is_packed(tensor) else tensor


def ineligible(weight: torch.Tensor) -> str | None:
    """Why ``weight`` is never packed, whatever the measurements; None when it may be."""
    if type(weight) not in _PLAIN:
        return f"a {type(weight).__qualname__}, not torch's own tensor (a quantizer's or a DTensor keeps its kernel)"
    if weight.device.type != "cpu":
        return f"on {weight.device.type}, not the CPU"
    if weight.layout != torch.strided or weight.dim() != 2 or weight.numel() == 0:
        return "not a dense, non-empty 2-D tensor"
    if not weight.is_floating_point() or weight.dtype == torch.float64:
        return f"{weight.dtype}: oneDNN packs bfloat16, float16 and float32"
    if not compat.available():
        return "this torch build has no oneDNN prepacked linear"
    if in_distributed_job():
        return ("a distributed job: data-parallel wrappers shard and broadcast a weight's storage, which a packed one "
                "lacks (fusion_linear_kernels.data_parallel)")
    return None


def packs(weight: torch.Tensor, exact: bool) -> bool:
    """Whether weights of ``weight``'s kind are held packed (see the module docs); decided once per kind."""
    if ineligible(weight) is not None:
        return False
    kind: PackKind = (tuple(weight.shape), weight.dtype, exact)
    return _DECISIONS.decide(kind, lambda: measure(distinct_copies(weight.detach()), exact))[0]


def measure(weights: Sequence[torch.Tensor], exact: bool) -> tuple[bool, str]:
    """(pack?, why) for a kind of weight: the numerical probes on the first of ``weights`` (all of one shape and
    dtype), then the timings of one pass over all of them, dense and packed. Several distinct weights are read
    from memory, as a decode step reads them, where one weight timed again and again may be served from cache."""
    weight = weights[0]
    out, inn = weight.shape
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            packed = [compat.pack(w) for w in weights]
            bias = torch.randn(out, generator=generator).to(weight.dtype)
            for rows in PROBE_ROWS:
                x = torch.randn(1, rows, inn, generator=generator).to(weight.dtype)
                for b in (None,) if exact else (None, bias):  # exact mode packs no layer with a bias
                    reference = F.linear(x, weight, b)
                    got = compat.packed_linear(x, packed[0], b)
                    if not admitted(got, reference, admission_bound(x, weight, reference), exact):
                        return False, f"not {'bit-identical to' if exact else 'within the bound of'} F.linear " \
                                      f"at {rows} rows{' with a bias' if b is not None else ''}"
            decode, prefill = (torch.randn(1, rows, inn, generator=generator).to(weight.dtype)
                               for rows in (DECODE_ROWS, PREFILL_ROWS))
            # A dense weight's decode runs what choice.py chooses (torch.mv on some shapes): packing must beat that.
            unpacked = choice.choose(decode, weight, None, exact, copies=weights)
            choice.remember(decode, weight, exact, unpacked)  # a dense layer's first decode call times nothing
            times = {rows: [t / len(weights) for t in _DECISIONS.times(_dense_and_packed(x, kernel, weights, packed),
                                                                         x.device)]
                     for rows, x, kernel in ((DECODE_ROWS, decode, unpacked), (PREFILL_ROWS, prefill, LINEAR))}
    except (RuntimeError, NotImplementedError) as exc:  # a dtype or shape oneDNN does not pack here
        first = str(exc).splitlines()[0] if str(exc) else ""
        return False, f"oneDNN refused to pack it: {type(exc).__name__}: {first}"
    (dense, fast), (dense_prefill, fast_prefill) = times[DECODE_ROWS], times[PREFILL_ROWS]
    over = f" (each, a pass over {len(weights)})" if len(weights) > 1 else ""
    timing = (f"{DECODE_ROWS} row {dense * 1e3:.3f} ({unpacked.name}) -> {fast * 1e3:.3f} ms, "
              f"{PREFILL_ROWS} rows {dense_prefill * 1e3:.3f} -> {fast_prefill * 1e3:.3f} ms{over}")
    if not faster(fast, dense):
        return False, f"not faster at decode ({timing})"
    if faster(dense_prefill, fast_prefill):
        return False, f"slower at prefill ({timing})"
    return True, timing


def _dense_and_packed(x: torch.Tensor, kernel: Candidate, weights: Sequence[torch.Tensor],
                      packed: Sequence[torch.Tensor]) -> tuple[Callable[[], object], Callable[[], object]]:
    """The two ways a packing decision times: a pass of ``kernel`` over the dense weights, then of the packed one."""
    return (lambda: [kernel.run(x, w, None) for w in weights],
            lambda: [compat.packed_linear(x, p, None) for p in packed])


def pack_decisions() -> dict[PackKind, tuple[bool, str]]:
    """The packing decision of each kind in this process (measured, or stored for this machine): (packed?, why or
    the timings)."""
    return dict(_DECISIONS)


def clear_pack_decisions() -> None:
    """Forget every packing decision, here and stored for this machine: the next weight of each kind is measured."""
    _DECISIONS.forget()


@dataclass(frozen=True)
class PrepackLinearWeight(TransformOp):
    """``weight`` -> the same weight in oneDNN's prepacked layout, where :func:`packs` says so (else unchanged).

    Inverse: ``to_dense()`` (bit for bit); a weight left dense passes through both ways. Meta
    tensors (discovery's rehearsal) are returned unchanged, with their shape.
    """

    exact: bool = False

    def forward_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        shape = tuple(shapes[0])
        if len(shape) != 2:
            raise ValueError(f"a linear weight is 2-D; got shape {shape}")
        return (shape,)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        (weight,) = tensors
        if is_packed(weight) or not packs(weight, self.exact):
            return (weight,)
        with torch.no_grad():
            return (compat.pack(weight),)

    def inverse(self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[Shape]) -> tuple[torch.Tensor, ...]:
        return (unpack(tensors[0]),)


def refusal(module: str) -> str:
    """The error a gradient for a packed weight raises."""
    return (f"linear_kernels holds the weight of {module or 'this linear layer'} prepacked for inference (oneDNN's "
            "blocked layout, no dense copy), so it cannot be trained: freeze it (weight.requires_grad_(False), as "
            "LoRA and other adapters do), or load the model without linear_kernels (or call fusion_core.unfuse(model)) "
            "to train its weights")


@torch.library.custom_op("fusion_linear_kernels::packed_linear", mutates_args=(),
                         schema="(Tensor input, Tensor weight, Tensor? bias, str module) -> Tensor")
def packed_linear_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     module: str) -> torch.Tensor:
    """The packed kernel as a custom operator: traced by ``torch.compile``, differentiated by autograd (a dense
    ``weight`` runs ``F.linear``: traced code cannot tell the layouts apart). An input of another dtype than the
    weight comes only from :func:`linear` under autocast: the dense weight is cast to it, as autocast casts it."""
    if input.dtype != weight.dtype:
        return F.linear(input, unpack(weight).to(input.dtype), bias)
    if not is_packed(weight):
        return F.linear(input, weight, bias)
    return compat.packed_linear(input, weight, bias)


@packed_linear_op.register_fake
def _packed_linear_fake(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        module: str) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.custom_op("fusion_linear_kernels::packed_linear_input_grad", mutates_args=(),
                         schema="(Tensor grad, Tensor weight) -> Tensor")
def packed_linear_input_grad_op(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad @ dense weight``, the input gradient of :func:`packed_linear_op`, from a temporary dense copy of a packed
    weight. An operator so that a traced backward (``torch.compile`` with autograd) reads the layout when it runs:
    the traced code sees a fake, strided weight."""
    return grad.matmul(unpack(weight).to(grad.dtype))


@packed_linear_input_grad_op.register_fake
def _packed_linear_input_grad_fake(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.new_empty((*grad.shape[:-1], weight.shape[1]))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.weight, ctx.module = inputs[1], inputs[3]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
    if ctx.needs_input_grad[1]:
        raise RuntimeError(refusal(ctx.module))
    grad_input = packed_linear_input_grad_op(grad, ctx.weight) if ctx.needs_input_grad[0] else None
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
    return grad_input, None, grad_bias, None


packed_linear_op.register_autograd(_backward, setup_context=_setup_context)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, module: str = "") -> torch.Tensor:
    """``F.linear(input, dense, bias)`` for a packed ``weight`` (see the module docs for the paths)."""
    cast = choice.autocast_dtype(input, weight, bias)
    if cast is not None:  # autocast's F.linear: every operand in its dtype (a weight packed in another, densely)
        autocast: torch.Tensor = packed_linear_op(input.to(cast), weight, None if bias is None else bias.to(cast),
                                                  module)
        return autocast
    if input.dtype != weight.dtype or input.device != weight.device or (
            bias is not None and bias.dtype != weight.dtype):
        return F.linear(input, unpack(weight), bias)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))):
        out: torch.Tensor = packed_linear_op(input, weight, bias, module)
        return out
    if type(input) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
        return F.linear(input, unpack(weight), bias)
    return compat.packed_linear(input, weight, bias)
