"""The GEMV kernel reading several weight rows side by side: one wide row (``blocked-rows``), and two to eight rows
(``few-rows``, ``few-rows-blocked``).

The row-dot candidate (:mod:`fusion_linear_kernels.row_dot`) reads one weight row at a time and loads the input
again for every row. Where a row is wide (a down projection's 8192 or 11008 elements), that input no longer sits in
the core's first-level cache next to the streaming weight, and the GEMV falls below the memory's bandwidth.
``blocked-rows`` runs the same kernel (:func:`~fusion_linear_kernels.row_dot.gemv`) over eight rows at once: each
slice of the input is loaded and widened to float32 once, then multiplied into eight accumulators, one per row
(eight independent streams, which the CPU's prefetchers follow). Measured on a 2-core AMD EPYC (avx512_bf16), one
row, bfloat16, over a pass of copies read from memory, against a float32 sum of the weights' own bytes in the same
run: 2048x11008 29.5 GB/s (Inductor's one-row reduction 21.0, the sum 27.6), 2048x8192 28.5 (24.1; 28.0),
3584x18944 30.4 (22.9; 28.1). It is a candidate at every width, and the choice measures it against the others
(:mod:`fusion_linear_kernels.choice`): before the paired dot products it was slower on narrow rows there (151936x896
17.6 against 37.9), and for a while was tried only on rows wider than 2048; with them, on a 2-core Xeon (AMX-BF16)
where ``torch.mv`` read faster than row-dot, it read 896x896 at 19.4 GB/s (``mv`` 15.5, row-dot 16.8) and 1152x896
at 19.5 (17.4, 15.3), and 151936x896 at 22.6 against ``mv``'s 24.5.

**Two to eight input rows** (a batch of sequences, beams, the draft tokens a step of assisted generation checks:
``few-rows`` and ``few-rows-blocked``). ``F.linear`` there runs a GEMM that reads the weight at half the memory's
speed or less, and the one-row candidates do not apply. The kernel reads each weight row once and multiplies it into
every input row's accumulator, so a step of a few rows reads the weights once, as a one-row step does: one weight row
at a time (``few-rows``) or four side by side (``few-rows-blocked``). Which is faster depends on the width, the
number of rows and the CPU, so both are candidates and the choice measures them (no width rule): on a 2-core AMD
EPYC (avx512_bf16), bfloat16, over a pass of copies, two input rows, 8192x2048 read 37.5 GB/s one at a time and
26.7 four at a time, 2048x8192 21.2 and 36.2, ``F.linear`` 19.3 and 20.2; eight input rows, 151936x896 23.8 one at a
time against ``F.linear``'s 13.1, 2048x8192 24.4 four at a time against 15.7.

All three sum in float32 in another order than ``F.linear``'s GEMM, so they are candidates within the bound only
(:mod:`fusion_linear_kernels.tolerance`), never in exact mode.
"""

from __future__ import annotations

import torch

from fusion_linear_kernels import row_dot

ROWS = 8
"""Weight rows a single input row reads side by side (``blocked-rows``)."""
FEW_ROWS_BLOCK = 4
"""Weight rows ``few-rows-blocked`` reads side by side for two or more input rows."""


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``blocked-rows`` can run this call: one input row (see :func:`~fusion_linear_kernels.row_dot.input_rows`
    for the rest)."""
    return input.numel() == input.shape[-1] and row_dot.input_rows(input, weight, bias) == 1


def applies_to_few_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``few-rows`` and ``few-rows-blocked`` can run this call: two to
    :data:`~fusion_linear_kernels.row_dot.MAX_INPUTS` input rows, on rows of any width."""
    return row_dot.input_rows(input, weight, bias) > 1


def run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for a one-row input, :data:`ROWS` weight rows side by side (``F.linear``
    where there is no kernel, or for more rows)."""
    return row_dot.gemv(input, weight, bias, ROWS)


def run_few_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for two to :data:`~fusion_linear_kernels.row_dot.MAX_INPUTS` input rows,
    each weight row read once for all of them, one at a time (``F.linear`` where there is no kernel, or for more
    rows)."""
    return row_dot.gemv(input, weight, bias, 1)


def run_few_rows_blocked(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`run_few_rows` with :data:`FEW_ROWS_BLOCK` weight rows read side by side."""
    return row_dot.gemv(input, weight, bias, FEW_ROWS_BLOCK)
