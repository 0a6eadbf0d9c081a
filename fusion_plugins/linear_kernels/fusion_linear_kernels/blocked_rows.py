"""The GEMV kernel reading several weight rows side by side: one wide row (``blocked-rows``), two to four rows
(``few-rows``).

The row-dot candidate (:mod:`fusion_linear_kernels.row_dot`) reads one weight row at a time and loads the input
again for every row. Where a row is wide (a down projection's 8192 or 11008 elements), that input no longer sits in
the core's first-level cache next to the streaming weight, and the GEMV falls below the memory's bandwidth.
``blocked-rows`` runs the same kernel (:func:`~fusion_linear_kernels.row_dot.gemv`) over eight rows at once: each
slice of the input is loaded and widened to float32 once, then multiplied into eight accumulators, one per row
(eight independent streams, which the CPU's prefetchers follow). Measured on a 2-core AMD EPYC (avx512_bf16), one
row, bfloat16, over a pass of copies read from memory, against a float32 sum of the weights' own bytes in the same
run: 2048x11008 29.5 GB/s (Inductor's one-row reduction 21.0, the sum 27.6), 2048x8192 28.5 (24.1; 28.0),
3584x18944 30.4 (22.9; 28.1); on rows of 2048 or fewer it was slower (151936x896 17.6 against 37.9), so for one
row it is a candidate only for rows wider than :data:`MIN_WIDTH`, and the choice measures it against the others
(:mod:`fusion_linear_kernels.choice`).

**Two to four input rows** (a batch of two to four sequences, beams, a few tokens at once: ``few-rows``).
``F.linear`` there runs a GEMM that reads the weight at half the memory's speed or less, and the one-row
candidates do not apply. The kernel reads each weight row once and multiplies it into every input row's
accumulator, so a step of a few rows reads the weights once, as a one-row step does: four weight rows side by
side on rows of 2048 or more, one at a time on narrower rows (:func:`block_of`). Same machine, two input rows:
151936x896 24-25 GB/s against ``F.linear``'s 13; 9728x896 25-28 against 11-12; 2048x8192 21-28 against 16-17;
four input rows 15-19 against 11-16. Qwen2-0.5B decode at a batch of two came from 1.00x plain (every one of its
layers ran ``F.linear``) to 1.70x (docs/benchmarks.md).

Both sum in float32 in another order than ``F.linear``'s GEMM, so they are candidates within the bound only
(:mod:`fusion_linear_kernels.tolerance`), never in exact mode.
"""

from __future__ import annotations

import torch

from fusion_linear_kernels import row_dot

ROWS = 8
"""Weight rows a single input row reads side by side (``blocked-rows``)."""
MIN_WIDTH = 2048
"""``blocked-rows`` is tried on rows wider than this; narrower rows read faster one at a time (row-dot)."""
FEW_ROWS_WIDE_FROM = 2048
"""From this width on, two to four input rows read four weight rows side by side (:func:`block_of`)."""
FEW_ROWS_BLOCKS = (1, 4)
"""The weight rows read side by side for two to four input rows: one on narrow rows, four on wide."""


def block_of(inputs: int, width: int) -> int:
    """How many weight rows the kernel reads side by side for ``inputs`` input rows on rows of ``width``: eight for
    one input row; for two to four, four on rows of :data:`FEW_ROWS_WIDE_FROM` or more and one on narrower rows,
    which then read as one stream. Measured on a 2-core AMD EPYC, bfloat16, over a pass of copies, two input rows:
    151936x896 23.4 GB/s one at a time (``F.linear`` 15.0); 9728x896 26.0 one at a time, 13.6 two at a time;
    8192x2048 21.5 four at a time, 13.1 one at a time, 17.3 eight at a time (``F.linear`` 17.6); 2048x8192 23.9 four
    at a time (``F.linear`` 16.8)."""
    if inputs == 1:
        return ROWS
    narrow, wide = FEW_ROWS_BLOCKS
    return wide if width >= FEW_ROWS_WIDE_FROM else narrow


def applies(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``blocked-rows`` can run this call: one input row, rows wider than :data:`MIN_WIDTH` (see
    :func:`~fusion_linear_kernels.row_dot.input_rows` for the rest)."""
    return input.numel() == input.shape[-1] > MIN_WIDTH and row_dot.input_rows(input, weight, bias) == 1


def applies_to_few_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``few-rows`` can run this call: two to four input rows, on rows of any width."""
    return row_dot.input_rows(input, weight, bias) > 1


def run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for an input of one to four rows, the weight rows read side by side as
    :func:`block_of` says (``F.linear`` where there is no kernel, or for more rows)."""
    width = weight.shape[1]
    return row_dot.gemv(input, weight, bias, block_of(max(1, input.numel() // width), width))
