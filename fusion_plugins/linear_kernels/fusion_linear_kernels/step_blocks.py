"""Which block of the GEMV kernel a decode step runs for a projection: the decoder layer's
(:mod:`fusion_linear_kernels.decode_layer`) and its attention's (:mod:`fusion_linear_kernels.decode_attention`) GEMVs
run inside C++ kernels of their own, not through the projection modules, so they read the decision the module's kind
took (:func:`~fusion_linear_kernels.choice.decided`) and run that kernel's block: the module's bits where the module
runs the kernel (:func:`module_block`), or one of the kernel's own one-row blocks, within the bound, where it chose
``torch.mv`` or ``F.linear`` at one row (:func:`block`)."""

from __future__ import annotations

import torch

from fusion_core.plugin import Decisions
from fusion_linear_kernels import row_dot
from fusion_linear_kernels.choice import Kind, choose, decided, folds, kind_of, rows_of, runs_original
from fusion_linear_kernels.kernels import BLOCKED_ROWS, FEW_ROWS, FEW_ROWS_BLOCKED, LINEAR, ROW_DOT, Candidate

BLOCKS = {ROW_DOT: 1, BLOCKED_ROWS: 8, FEW_ROWS: 1, FEW_ROWS_BLOCKED: 4}
"""The GEMV candidates the kernel runs, and the weight rows each reads side by side (see
:mod:`fusion_linear_kernels.blocked_rows`)."""


_ONE_ROW = (BLOCKED_ROWS, ROW_DOT)
"""The kernel's one-row candidates, the first kept on a tie (:func:`block`)."""
_DECISIONS: Decisions[Kind, Candidate] = Decisions(
    f"linear_kernels.decode_layer[{','.join(candidate.name for candidate in _ONE_ROW)}]",
    save=lambda candidate: candidate.name, code=row_dot.CODE_DIGEST,
    load=lambda name: next((candidate for candidate in (*_ONE_ROW, LINEAR) if candidate.name == name), None))
"""Which of :data:`_ONE_ROW` a step runs for a one-row kind decided for a kernel the step does not run (``F.linear``
where neither is admitted on the kind's input: the step then gives way)."""


def block(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The weight rows the step's GEMV of ``input`` by ``weight`` reads side by side: the block of the kernel its kind
    decided; or None where the kind is undecided, or decided at two to eight rows for one the step does not run.

    A one-row kind decided for ``torch.mv`` or ``F.linear`` takes the faster of the kernel's own one-row blocks
    admitted on its input, measured once per kind as the kind's decision was (:func:`~fusion_linear_kernels.choice.
    choose`, timed by :data:`_DECISIONS`). At one row every candidate reads the weight at about the
    memory's speed, so such a decision is won by a small margin, on a noisy moment as often as not; refusing the step
    for it costs the whole step. Measured on the 2-core Xeon VM (Qwen2-0.5B, every family on, bf16; a throwaway run,
    decisions measured afresh): a load whose down projection (896x4864) decided ``mv`` at 0.403 ms a call, where the
    kernel took about the same, ran none of its 24 layers' steps, which are worth about 9 ms a token there (54.4
    against 63.6 side by side, docs/benchmarks.md).
    At two to eight rows a decision for ``F.linear`` (oneDNN's GEMM, which can beat a GEMV there) stands.
    """
    candidate = decided(input, weight, bias)
    if (candidate is not None and candidate not in BLOCKS and rows_of(input) == 1
            and all(one.applies(input, weight, bias) for one in _ONE_ROW)):
        kind = kind_of(input, weight, bias, False)
        candidate = _DECISIONS.get(kind) or _DECISIONS.decide(kind, lambda: choose(
            input, weight, bias, False, _ONE_ROW, keep=_ONE_ROW[0], table=_DECISIONS))
    return None if candidate is None else BLOCKS.get(candidate)


def decisions() -> dict[Kind, str]:
    """The one-row block each kind's step runs where the kind decided a kernel the step does not run (:func:`block`),
    by name: measured in this process, or stored for this machine."""
    return {kind: candidate.name for kind, candidate in _DECISIONS.items()}


def clear_decisions() -> None:
    """Forget which one-row block each kind's step runs, here and stored for this machine (:data:`_DECISIONS`)."""
    _DECISIONS.forget()


def module_block(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The block of the kernel the kind of ``input`` by ``weight`` decided, or None where it decided none of the
    kernel's (undecided, ``torch.mv``, ``F.linear``, a packed weight): a GEMV whose output must be the module's bit for
    bit (the keys and values a decode step caches) runs only where the module itself would run the kernel."""
    candidate = decided(input, weight, bias)
    return None if candidate is None else BLOCKS.get(candidate)


def undecided(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kind of ``input`` by ``weight`` is still to be decided (its module's first call decides it): it is
    one that chooses (not one that runs ``F.linear`` without choosing), and no decision is filed for it."""
    return not runs_original(input, weight, bias) and folds(input) and decided(input, weight, bias) is None
