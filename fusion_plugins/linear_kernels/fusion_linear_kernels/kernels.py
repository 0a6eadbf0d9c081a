"""The candidate kernels a linear layer may run at few rows, each computing ``F.linear(input, weight, bias)``.

Which GEMV kernel is fastest differs by shape, dtype and machine (``torch.mv`` beats ``F.linear``
on some AVX-512 CPUs at one row and loses on others), so nothing here is chosen by rule: each
candidate says only when it *applies*, and :mod:`fusion_linear_kernels.choice` measures the
applicable ones on the real input and keeps the fastest that stays within the numerical bound.

Every candidate reads the weight as the module holds it (an ``[out, in]`` tensor, the checkpoint's
layout, or a quantizer's int8 data and scales): none keeps a second copy, so memory stays the plain
model's. ``F.linear`` is always a candidate and is what runs wherever no other one is measured faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from fusion_linear_kernels import blocked_rows, compat, row_dot

_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: The input dtypes torch's int8 weight-only GEMM takes.
_INT8_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Candidate:
    """One way to compute a linear layer: ``run(input, weight, bias)``, usable where ``applies(...)`` is True."""

    name: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    applies: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], bool]
    exact: bool = True
    """Whether it may give ``F.linear``'s bits (False: a candidate within the bound only, not tried in exact mode)."""


def _always(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return True


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(input, weight, bias)


def _one_row(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """``torch.mv`` / ``torch.addmv`` take one vector: an input of exactly one row, and a weight of torch's own."""
    return input.numel() == input.shape[-1] and type(weight) in _PLAIN


def _int8_applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """An int8 weight-only weight with one scale per row (:func:`fusion_linear_kernels.compat.int8_rows`), read by
    a floating input of the weight's dtype."""
    return input.dtype in _INT8_INPUTS and input.dtype == weight.dtype and compat.int8_rows(weight) is not None


def _int8(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's int8 weight-only GEMM on the quantizer's own int8 data and scales (no dequantized copy)."""
    rows = compat.int8_rows(weight)
    if rows is None:
        raise TypeError(f"not an int8 weight-only tensor: {type(weight).__qualname__}")
    out = compat.int8_linear(input, *rows)
    return out if bias is None else out + bias


def _mv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A matrix-vector product: BLAS/oneDNN GEMV instead of a GEMM with one row (no batch dimension to fold)."""
    row = input.reshape(-1)
    out = torch.mv(weight, row) if bias is None else torch.addmv(bias, weight, row)
    return out.view(*input.shape[:-1], weight.shape[0])


LINEAR = Candidate("linear", _linear, _always)
"""The original kernel: what runs for prefill, training, compiled code and anything not measured."""

INT8 = Candidate("int8 weight-only", _int8, _int8_applies)
"""For a weight a quantizer already holds in int8 (one scale per row): torch's int8 GEMM instead of the quantizer's
``F.linear`` dispatch."""

ROW_DOT = Candidate("row-dot", row_dot.run, row_dot.applies, exact=False)
"""The GEMV kernel (:mod:`fusion_linear_kernels.row_dot`) on one input row, one dense weight row at a time, within
the bound only."""

BLOCKED_ROWS = Candidate("blocked-rows", blocked_rows.run, blocked_rows.applies, exact=False)
"""The GEMV kernel on one input row, eight wide dense rows at a time (:mod:`fusion_linear_kernels.blocked_rows`),
within the bound only."""

FEW_ROWS = Candidate("few-rows", blocked_rows.run_few_rows, blocked_rows.applies_to_few_rows, exact=False)
"""The GEMV kernel on two to eight input rows (a small batch, beams, draft tokens), each weight row read once for all
of them, one at a time (:mod:`fusion_linear_kernels.blocked_rows`), within the bound only."""

FEW_ROWS_BLOCKED = Candidate("few-rows-blocked", blocked_rows.run_few_rows_blocked, blocked_rows.applies_to_few_rows,
                             exact=False)
"""``few-rows`` with four weight rows read side by side (faster where the input rows are wide), within the bound
only."""

CANDIDATES: tuple[Candidate, ...] = (
    LINEAR,
    Candidate("mv", _mv, _one_row),
    INT8,
    ROW_DOT,
    BLOCKED_ROWS,
    FEW_ROWS,
    FEW_ROWS_BLOCKED,
)
"""The documented candidates, ``F.linear`` first (it wins ties: it is the original's kernel)."""
