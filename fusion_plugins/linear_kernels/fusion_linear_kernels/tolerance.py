"""How far a candidate kernel's output may be from ``F.linear``'s on the same input, and still be taken.

Two correct kernels differ only in the order they sum the ``in_features`` products of each output
(and in where they add the bias). On CPU every floating dtype is accumulated in at least float32
(products of two bfloat16 or float16 values are exact in float32), then rounded once to the output
dtype. So for outputs ``a`` (candidate) and ``r`` (``F.linear``) of one row ``x`` and weight ``W``:

- *accumulation*: two float32 sums of the same ``K`` products differ by about
  ``sqrt(K) * eps_acc * sum_i |x_i W_ji|`` (the random-walk estimate of rounding errors, the
  worst case being ``K`` instead of ``sqrt(K)``), and ``sum_i |x_i W_ji| <= ||x|| ||W_j||``
  (Cauchy-Schwarz), which is cheap to bound without a copy of the weight;
- *rounding*: each result is then within half a unit in the last place of the output dtype, and
  a bias added after rounding (``addmv`` vs a fused epilogue) costs at most one more; a unit in the
  last place of ``v`` is at most ``eps * |v|``.

The bound taken is::

    max |a - r|  <=  2 * eps(dtype) * max |r|  +  2 * sqrt(K) * eps_acc * max_rows ||x|| * max_j ||W_j||

with ``eps_acc`` the epsilon of float32 (of float64 for float64 inputs). It is a property of the
real input, not a constant: a candidate is admitted or refused on the input it would run on. For a
bfloat16 ``896 -> 4864`` layer with unit-scale inputs it is a few hundredths of the output scale,
the size of bfloat16's own rounding; exact mode (``{"linear_kernels": {"exact": true}}``) admits
only outputs bit-identical to ``F.linear``'s instead.
"""

from __future__ import annotations

import math

import torch

from fusion_linear_kernels import compat


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype CPU kernels accumulate ``dtype`` in: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def admission_bound(input: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest elementwise difference from ``reference`` (``F.linear``'s output) a candidate may have."""
    acc = accumulation_dtype(input.dtype)
    rows = input.reshape(-1, input.shape[-1])
    x_norm = torch.linalg.vector_norm(rows, dim=-1, dtype=acc).max()
    int8 = compat.int8_rows(weight)  # a quantizer's int8 weight: the norms of the weight it stands for
    dense = weight if int8 is None else int8[0].to(acc) * int8[1].to(acc)[:, None]
    w_norm = torch.linalg.vector_norm(dense, dim=-1, dtype=acc).max()
    accumulation = math.sqrt(input.shape[-1]) * torch.finfo(acc).eps * float(x_norm * w_norm)
    rounding = torch.finfo(reference.dtype).eps * float(reference.abs().max())
    return 2 * rounding + 2 * accumulation


def admitted(output: torch.Tensor, reference: torch.Tensor, bound: float, exact: bool) -> bool:
    """Whether ``output`` may stand for ``reference``: bit-identical in exact mode, else within ``bound``.

    Shapes, dtypes and non-finite values must match exactly in both modes.
    """
    if output.shape != reference.shape or output.dtype != reference.dtype:
        return False
    if exact:
        return torch.equal(output, reference)
    finite = torch.isfinite(reference)
    if not torch.equal(finite, torch.isfinite(output)):
        return False
    if not finite.all() and not torch.equal(output[~finite], reference[~finite]):
        return False
    acc = accumulation_dtype(reference.dtype)
    difference = (output.to(acc) - reference.to(acc)).abs()[finite]
    return difference.numel() == 0 or float(difference.max()) <= bound
