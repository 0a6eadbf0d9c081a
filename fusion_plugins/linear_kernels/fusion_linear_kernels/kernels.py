"""The candidate kernels a linear layer may run at few rows, each computing ``F.linear(input, weight, bias)``.

Which GEMV kernel is fastest differs by shape, dtype and machine (``torch.mv`` beats ``F.linear``
on some AVX-512 CPUs at one row and loses on others), so nothing here is chosen by rule: each
candidate says only when it *applies*, and :mod:`fusion_linear_kernels.choice` measures the
applicable ones on the real input and keeps the fastest that stays within the numerical bound.

Every candidate reads the weight as the module holds it (an ``[out, in]`` tensor, the checkpoint's
layout): none keeps a second copy, so memory stays the plain model's. ``F.linear`` is always a
candidate and is what runs wherever no other one is measured faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class Candidate:
    """One way to compute a linear layer: ``run(input, weight, bias)``, usable where ``applies(...)`` is True."""

    name: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    applies: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], bool]


def _always(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return True


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(input, weight, bias)


def _one_row(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """``torch.mv`` / ``torch.addmv`` take one vector: an input of exactly one row."""
    return input.numel() == input.shape[-1]


def _mv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A matrix-vector product: BLAS/oneDNN GEMV instead of a GEMM with one row (no batch dimension to fold)."""
    row = input.reshape(-1)
    out = torch.mv(weight, row) if bias is None else torch.addmv(bias, weight, row)
    return out.view(*input.shape[:-1], weight.shape[0])


LINEAR = Candidate("linear", _linear, _always)
"""The original kernel: what runs for prefill, training, compiled code and anything not measured."""

CANDIDATES: tuple[Candidate, ...] = (
    LINEAR,
    Candidate("mv", _mv, _one_row),
)
"""The documented candidates, ``F.linear`` first (it wins ties: it is the original's kernel)."""
