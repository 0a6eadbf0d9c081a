"""Running the routed experts of a block on stacked weights, without a Python loop over experts.

The tokens' (token, slot) pairs are sorted by expert once; then every expert's rows are
contiguous, and two grouped GEMMs (``[N, H] x [E, H, 2I]`` and ``[N, I] x [E, I, H]``, groups
delimited by the cumulative row counts) compute all experts at once. Every step has a shape fixed
by the input (no ``.item()``, no data-dependent size), so it traces under ``torch.compile``.

**Kernel rule** (measured, fusion_plugins/moe_experts/README.md "Speed"): ``torch.nn.functional.grouped_mm``
for float32, bfloat16 and float16, the dtypes it accepts, at every token count. The measured
alternative, gathering each row's expert weight for one ``bmm``, copies ``N x 2I x H`` weight
elements per call and was slower at every measured token count; it is kept only for the dtypes
``grouped_mm`` refuses (float64), where it is the one loop-free kernel that still computes exactly.
Upcasting bfloat16 expert weights to float32 for the GEMM (for CPUs without native bf16) was
measured too and is not applied: slower with fresh tensors at every row count, 1.4x at 16 rows per
expert only with kept 1.6 GB float32 buffers, slower at 2 rows (``bench_moe.py --kernels``; README
"End to end").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

#: What ``grouped_mm`` accepts (torch 2.13: "Float32, BFloat16 or Float16").
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, routed: Routed) -> torch.Tensor:
    """``rows[j] @ weight[expert of row j].T`` for every sorted row: ``[N, in] x [E, out, in] -> [N, out]``."""
    if rows.dtype in GROUPED_MM_DTYPES:
        return _grouped_linear(rows, weight, routed.offsets)
    return torch.bmm(weight[routed.expert], rows.unsqueeze(-1)).squeeze(-1)


def expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: torch.nn.Module,
                   routed: Routed) -> torch.Tensor:
    """``down_e(act(gate_e(x)) * up_e(x))`` for every sorted (token, slot) row, unweighted: ``[N, H]``."""
    hidden = grouped_linear(x[routed.token], gate_up, routed)
    width = hidden.shape[-1] // 2
    return grouped_linear(act(hidden[:, :width]) * hidden[:, width:], down, routed)
