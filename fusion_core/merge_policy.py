"""Whether one merged GEMM is faster than one GEMM per part, decided by measuring it on this machine.

A merged projection saves GEMM calls (a launch or a dispatch each), but a GEMM library is free to
run one wide GEMM more slowly than the narrow ones it replaces: on a 2-core AVX-512 CPU, one fp32
``896 -> 9728`` GEMM runs at 0.84x of two ``896 -> 4864`` ones over 16 tokens and 0.94x over 256
(the bare-GEMM table of docs/benchmarks.md), while in bf16, or at one token, it is about as fast
or faster. No rule of thumb predicts that across
backends, dtypes and shapes, so by default (policy ``"measure"``) the first eager call of each
kind decides (:mod:`fusion_core.decisions`, topic ``"merge"``: measured once per kind, remembered
per machine and software, :func:`fusion_core.reset_state` forgets it in memory):

- a *kind* is the device (an accelerator with its model), the dtype, the merged weight's shape, the
  part sizes, whether there is a bias, the input's row count rounded up to a power of two (1 = a
  decode step, 16 and 256 = prompts of those lengths) and the weight's tensor class (torch's, or a
  quantizer's such as torchao's ``Int8Tensor``, whose kernel may scale differently:
  ``benchmarks/bench_quantized.py`` prints the decisions, and its int8 gate/up ran per part where fp32
  at one row merged); every layer of a model shares its kinds, so a 24-layer model measures each kind
  once, in its first layer;
- a measurement times both ways on the real input over a pass of copies of the weight (read from
  memory, as a decode step reads every layer's), under ``torch.no_grad``; the merged GEMM is kept
  unless one GEMM per part was faster by more than the facility's margin (fewer operators are dispatched);
- both ways compute the same projection (tests compare each against the original
  ``nn.Linear``); only the speed differs. Where the two are equally fast, either may be chosen.

``"always"`` merges without measuring (reproducible GEMM counts, what the test suite uses),
``"never"`` runs one GEMM per part (the unfused model's operators). The environment variable
``FUSION_CORE_MERGE`` sets the policy a process starts with; :func:`set_merge_policy` changes it.
Compiled code is not affected: under ``torch.compile`` every part runs its own GEMM (see
:mod:`fusion_core.merged`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

import torch
from torch.nn import functional as F

from fusion_core.decisions import Decisions, device_key, distinct_copies
from fusion_core.wrapped import is_torch_tensor, row_slice

MergePolicy = Literal["measure", "always", "never"]
"""How an eager merged projection chooses between the merged GEMM and one GEMM per part."""

ENV_VARIABLE = "FUSION_CORE_MERGE"
_POLICIES: tuple[str, ...] = get_args(MergePolicy)

#: A kind of call: (device, dtype, merged weight shape, part sizes, has bias, row-count bucket, weight class).
Kind = tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], bool, int, str]

DECISIONS: Decisions[Kind, bool] = Decisions("merge")
"""The decisions measured or stored (True: the merged GEMM runs), by kind."""


def _checked(policy: str, source: str) -> MergePolicy:
    if policy not in _POLICIES:
        raise ValueError(f"{source}: unknown merge policy {policy!r}; expected one of {', '.join(_POLICIES)}")
    return policy  # type: ignore[return-value]


def _from_environment() -> MergePolicy:
    raw = os.environ.get(ENV_VARIABLE, "").strip().lower()
    return _checked(raw, f"environment variable {ENV_VARIABLE}") if raw else "measure"


_POLICY: list[MergePolicy] = [_from_environment()]


def merge_policy() -> MergePolicy:
    """The policy in force: ``"measure"`` (default), ``"always"`` or ``"never"``."""
    return _POLICY[0]


def set_merge_policy(policy: MergePolicy) -> MergePolicy:
    """Set the process-wide policy; returns the previous one. Measured decisions are kept."""
    previous = _POLICY[0]
    _POLICY[0] = _checked(policy, "set_merge_policy")
    return previous


@contextmanager
def merge_policy_set_to(policy: MergePolicy) -> Iterator[None]:
    """``with merge_policy_set_to("never"): ...``: the policy for a block, restored afterwards."""
    previous = set_merge_policy(policy)
    try:
        yield
    finally:
        set_merge_policy(previous)


def merge_decisions() -> dict[Kind, bool]:
    """The decisions of this process (True: the merged GEMM runs), by kind."""
    return dict(DECISIONS)


def clear_merge_decisions() -> None:
    """Forget every decision, here and stored for this machine: the next call of each kind measures again."""
    DECISIONS.forget()


def reset_merge_policy() -> None:
    """The policy read again from ``FUSION_CORE_MERGE`` (``"measure"`` when unset)."""
    _POLICY[0] = _from_environment()


def kind_of(input: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...], has_bias: bool) -> Kind:
    """The kind of a call: what its decision is filed under."""
    rows = input.numel() // max(int(input.shape[-1]), 1)
    return (device_key(input.device), input.dtype, tuple(weight.shape), sizes, has_bias, max(rows - 1, 0).bit_length(),
            "torch" if is_torch_tensor(weight) else f"{type(weight).__module__}.{type(weight).__qualname__}")


def merge_pays(kind: Kind, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               bounds: tuple[tuple[int, int], ...]) -> bool:
    """Whether a call of ``kind`` runs the merged GEMM, under the policy in force.

    Under ``"measure"`` the first call of a kind that can be timed decides for the kind; a call
    that cannot (meta tensors, a CUDA graph being captured) merges and decides nothing.
    """
    policy = _POLICY[0]
    if policy != "measure":
        return policy == "always"
    decision = DECISIONS.get(kind)
    if decision is None:
        if not _measurable(input):
            return True
        decision = DECISIONS.decide(kind, lambda: _merged_is_faster(input, weight, bias, bounds))
    return decision


def _measurable(input: torch.Tensor) -> bool:
    """Real data on a device that can be timed now (not meta, not inside a CUDA graph capture)."""
    device = input.device
    if device.type == "meta":
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _merged_is_faster(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      bounds: tuple[tuple[int, int], ...]) -> bool:
    """Time the merged GEMM against one GEMM per part on the real input, over a pass of copies of the weight."""
    x = input.detach()
    with torch.no_grad():
        weights = distinct_copies(weight)  # no detach: a quantizer's weight may refuse it in inference mode
        parts = [(row_slice(w, start, stop), None if bias is None else bias[start:stop])
                 for w in weights for start, stop in bounds]

        def merged() -> None:
            for w in weights:
                F.linear(x, w, bias)

        def separate() -> None:
            for part_weight, part_bias in parts:
                F.linear(x, part_weight, part_bias)

        # The merged GEMM is the first way: a tie keeps it, as it dispatches fewer operators.
        return DECISIONS.fastest((merged, separate), input.device) == 0
