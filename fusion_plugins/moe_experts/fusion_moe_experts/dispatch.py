"""Running the routed experts of a block on stacked weights, without a Python loop over experts.

The tokens' (token, slot) pairs are sorted by expert once; then every expert's rows are
contiguous, and two grouped GEMMs (``[N, H] x [E, H, 2I]`` and ``[N, I] x [E, I, H]``, groups
delimited by the cumulative row counts) compute all experts at once. Every step has a shape fixed
by the input (no ``.item()``, no data-dependent size), so it traces under ``torch.compile``.

**Kernel rule** (measured, fusion_plugins/moe_experts/README.md "Speed"): ``torch.nn.functional.grouped_mm``
for float32, bfloat16 and float16, the dtypes it accepts, at every token count, with one exception
(:func:`upcasts`): bfloat16 weights on a CPU whose GEMMs have no native bfloat16 (oneDNN reports
none: no AVX-512-BF16 or AMX), in inference, with at least :data:`UPCAST_ROWS_PER_EXPERT` rows per
expert. There a bfloat16 GEMM runs several times slower than a float32 one, so from that many rows
it pays to upcast the expert weights: :func:`upcast_expert_outputs` converts :data:`UPCAST_CHUNK`
experts at a time into float32 buffers reused across the call (converting all 64 at once
allocates 1.6 GB and faults it in on every call) and runs float32 grouped GEMMs, rounding to
bfloat16 where the bfloat16 kernel rounds. Below that many rows the conversion (every expert's
weights, every call) costs more than it saves. The measured alternative, gathering each row's
expert weight for one ``bmm``, copies ``N x 2I x H`` weight elements per call and was slower at
every measured token count; it is kept only for the dtypes ``grouped_mm`` refuses (float64), where
it is the one loop-free kernel that still computes exactly.

``torch.nn.functional.grouped_mm`` is public from torch 2.10 (pytorch#168298; transformers' own MoE
dispatch checks for it the same way), while fusion-core's floor is torch 2.6. On a torch without it
(:func:`has_grouped_mm`) the experts run one GEMM each on their contiguous rows
(:func:`per_expert_linear`): a loop over experts, but no copies of their weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from fusion_core.plugin import native_bf16_gemms

#: What ``grouped_mm`` accepts (torch 2.13: "Float32, BFloat16 or Float16").
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Sorted rows per expert from which bfloat16 experts are upcast on a CPU without native bfloat16
#: (``bench_moe.py --kernels`` at OLMoE widths, chunked upcast vs bfloat16 ``grouped_mm``: 0.65x at 8 rows
#: per expert, 1.04x at 16, 2.18x at 32; the conversion of every expert's weights is paid at any row count).
UPCAST_ROWS_PER_EXPERT = 16
#: Experts upcast together: a float32 buffer of 4 OLMoE experts is 100 MB, reused across the call.
UPCAST_CHUNK = 4


class Routed:
    """The sorted dispatch of one call: rows of ``x`` in expert order and their groups.

    ``order`` sorts the flattened ``[T * k]`` (token, slot) pairs by expert (stable, so within an
    expert tokens keep their order); ``token`` is the token of each sorted row and ``offsets`` the
    cumulative row count per expert (int32, what ``grouped_mm`` takes); ``expert`` the expert of
    each sorted row (for the gather kernel).
    """

    __slots__ = ("expert", "offsets", "order", "token")

    def __init__(self, selected: torch.Tensor, num_experts: int) -> None:
        flat = selected.reshape(-1)
        self.order = flat.argsort(stable=True)
        self.token = self.order // selected.shape[-1]
        self.expert = flat[self.order]
        # index_add rather than bincount: bincount's output size depends on the data (dynamo breaks on it).
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add(
            0, flat, torch.ones_like(flat))
        self.offsets = counts.cumsum(0).to(torch.int32)


@torch.library.custom_op("fusion_moe_experts::grouped_linear", mutates_args=())
def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm`` as an op of our own: torch 2.13's fake (meta) kernel of ``grouped_mm`` accepts
    only bfloat16, so ``torch.compile`` could not trace the float32 and float16 kernels the CPU has."""
    return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


@_grouped_linear.register_fake
def _(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[-2])


@torch.library.custom_op("fusion_moe_experts::grouped_weight_grad", mutates_args=())
def _grouped_weight_grad(grad: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grad[group e].T @ rows[group e]`` per expert, ``[E, out, in]``: the weight gradient (2-D x 2-D grouped_mm)."""
    return F.grouped_mm(grad.t(), rows, offs=offsets)


@_grouped_weight_grad.register_fake
def _(grad: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(offsets.shape[0], grad.shape[1], rows.shape[1])


def _setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    rows, weight, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # grouped_mm refuses the expanded gradient of a sum()
    grad_rows = _grouped_linear(grad, weight.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_weight = _grouped_weight_grad(grad, rows, offsets) if ctx.needs_input_grad[1] else None
    return grad_rows, grad_weight, None


_grouped_linear.register_autograd(_backward, setup_context=_setup)


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch.nn.functional.grouped_mm`` (public from torch 2.10)."""
    return hasattr(F, "grouped_mm")


def per_expert_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """What :func:`grouped_linear` computes, one GEMM per expert on its rows: the kernel of a torch without
    ``grouped_mm``. Reading the group bounds syncs with the device once (a graph break under ``torch.compile``)."""
    ends = offsets.tolist()
    bounds = zip([0, *ends[:-1]], ends, strict=True)
    return torch.cat([rows[start:end] @ weight[expert].t() for expert, (start, end) in enumerate(bounds)])


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, routed: Routed) -> torch.Tensor:
    """``rows[j] @ weight[expert of row j].T`` for every sorted row: ``[N, in] x [E, out, in] -> [N, out]``."""
    if rows.dtype not in GROUPED_MM_DTYPES:
        return torch.bmm(weight[routed.expert], rows.unsqueeze(-1)).squeeze(-1)
    if not has_grouped_mm():
        return per_expert_linear(rows, weight, routed.offsets)
    return _grouped_linear(rows, weight, routed.offsets)


def native_bf16() -> bool:
    """Whether this CPU's GEMMs run bfloat16 natively (:func:`fusion_core.plugin.native_bf16_gemms`)."""
    return native_bf16_gemms()


def upcasts(x: torch.Tensor, gate_up: torch.Tensor, routed: Routed) -> bool:
    """The kernel rule's exception (see the module docs): float32 GEMMs on upcast bfloat16 expert weights."""
    if torch.compiler.is_compiling() or gate_up.dtype is not torch.bfloat16 or gate_up.device.type != "cpu":
        return False
    if not has_grouped_mm():
        return False  # its float32 GEMMs are grouped_mm's
    if torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad):
        return False  # the buffers are reused in place: no autograd through them
    return routed.token.shape[0] >= UPCAST_ROWS_PER_EXPERT * gate_up.shape[0] and not native_bf16()


def upcast_expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: torch.nn.Module,
                          routed: Routed) -> torch.Tensor:
    """What :func:`expert_outputs` computes, in float32 GEMMs on :data:`UPCAST_CHUNK` experts' weights at a time;
    the GEMM outputs are rounded to ``x``'s dtype where the bfloat16 GEMMs round them."""
    rows = x[routed.token]
    out = rows.new_empty(rows.shape[0], down.shape[1])
    ends = routed.offsets.tolist()
    experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up_buffer = torch.empty((UPCAST_CHUNK, *gate_up.shape[1:]), dtype=torch.float32, device=x.device)
    down_buffer = torch.empty((UPCAST_CHUNK, *down.shape[1:]), dtype=torch.float32, device=x.device)
    for first in range(0, experts, UPCAST_CHUNK):
        last = min(experts, first + UPCAST_CHUNK)
        start, stop = (ends[first - 1] if first else 0), ends[last - 1]
        if stop == start:
            continue  # no row routed to these experts: nothing to convert
        count, offsets = last - first, routed.offsets[first:last] - start
        weight = gate_up_buffer[:count].copy_(gate_up[first:last])
        hidden = F.grouped_mm(rows[start:stop].float(), weight.transpose(-2, -1), offs=offsets).to(x.dtype)
        inner = act(hidden[:, :width]) * hidden[:, width:]
        weight = down_buffer[:count].copy_(down[first:last])
        out[start:stop] = F.grouped_mm(inner.float(), weight.transpose(-2, -1), offs=offsets)
    return out


def expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: torch.nn.Module,
                   routed: Routed) -> torch.Tensor:
    """``down_e(act(gate_e(x)) * up_e(x))`` for every sorted (token, slot) row, unweighted: ``[N, H]``."""
    if upcasts(x, gate_up, routed):
        return upcast_expert_outputs(x, gate_up, down, act, routed)
    return grouped_expert_outputs(x, gate_up, down, act, routed)


def grouped_expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: torch.nn.Module,
                           routed: Routed) -> torch.Tensor:
    """What :func:`expert_outputs` computes, in two grouped GEMMs of ``x``'s dtype (the default kernel)."""
    hidden = grouped_linear(x[routed.token], gate_up, routed)
    width = hidden.shape[-1] // 2
    return grouped_linear(act(hidden[:, :width]) * hidden[:, width:], down, routed)
