"""Saving a fused model from every rank of a process group: one writer, full tensors.

Under tensor parallelism or FSDP2 the parameters are DTensor shards: every rank must take part in
gathering them, and only one may write the directory. :func:`gathered_save_kwargs` gathers the
model's ``state_dict()`` (already presented in the original layout by the fused modules) to full
tensors on every rank and hands it to transformers' ``save_pretrained``, which then writes it as
it writes any checkpoint; :func:`rank_zero_directory` lets rank 0 alone replace the target
directory atomically, and returns on every rank once the directory is in place, or raises on
every rank when any rank failed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion_core.checkpoint import atomic_directory
from fusion_core.errors import SaveError
from fusion_core.parallel.rules import is_dtensor


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and (
        torch.distributed.get_world_size() > 1
    )


def is_writer() -> bool:
    """Whether this process writes checkpoints: rank 0 of a process group, or a process outside one."""
    return not _distributed() or torch.distributed.get_rank() == 0


def gathered_save_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``save_pretrained``, with a gathered full ``state_dict`` when the model holds DTensors.

    Every rank must call this (the gathers are collectives). A model without DTensor parameters,
    or a call that passes its own ``state_dict``, gets ``kwargs`` unchanged.
    """
    if "state_dict" in kwargs or not _distributed() or not any(is_dtensor(p) for p in model.parameters()):
        return kwargs
    state = model.state_dict()
    full = {key: value.full_tensor() if is_dtensor(value) else value for key, value in state.items()}
    return {**kwargs, "state_dict": {key: value.detach().cpu().contiguous() for key, value in full.items()}}


@contextmanager
def rank_zero_directory(target: Path) -> Iterator[Path]:
    """:func:`~fusion_core.checkpoint.atomic_directory` on rank 0; a scratch directory on the other ranks.

    Outside a process group this is ``atomic_directory``. Inside one, every rank runs the block
    (so collectives in it match), the other ranks' output is discarded, and all ranks wait until
    rank 0 has put the new directory in place.

    All or nothing on every rank: when the block raises on any rank, or rank 0 cannot put the
    directory in place, rank 0 leaves the old directory as it was, the rank that failed raises its
    own exception, and every other rank raises :class:`~fusion_core.errors.SaveError` naming the
    ranks that failed, instead of waiting for them forever or reporting a save that did not happen.
    (A rank that fails *before* a collective of the block still leaves the others waiting inside
    that collective, until the process group's timeout.)
    """
    if not _distributed():
        with atomic_directory(target) as staging:
            yield staging
        return
    agreement = _Agreement(target)
    with agreement.after("putting the directory in place"):
        directory = atomic_directory(target) if torch.distributed.get_rank() == 0 else _scratch_directory()
        # The inner agreement raises inside atomic_directory: a failure on any rank puts nothing in place.
        with directory as staging, agreement.after("writing"):
            yield staging


@contextmanager
def _scratch_directory() -> Iterator[Path]:
    """A temporary directory for a rank whose output is discarded, removed on leaving."""
    scratch = Path(tempfile.mkdtemp(prefix=".fusion-rank-save-"))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _Agreement:
    """The ranks' agreement on one save: after each stage, whether it failed on any rank.

    Each stage ends in one collective that every rank reaches, on success and on failure alike, so
    no rank is left waiting; a rank that failed before a stage began (rank 0's ``atomic_directory``
    refusing the target, say) reports its failure for that stage too, so every rank takes part in
    every stage, in the order of :attr:`STAGES`.
    """

    STAGES = ("writing", "putting the directory in place")

    def __init__(self, target: Path) -> None:
        self._target = target
        self._agreed = 0  # how many stages every rank has agreed on

    @contextmanager
    def after(self, stage: str) -> Iterator[None]:
        """Run the block, then agree on ``stage``: a rank that failed re-raises; the others raise :class:`SaveError`."""
        try:
            yield
        except BaseException as exc:
            self._agree_until(stage, f"{type(exc).__name__}: {exc}")
            raise
        self._agree_until(stage, None)

    def _agree_until(self, stage: str, failure: str | None) -> None:
        while self._agreed <= self.STAGES.index(stage):
            current = self.STAGES[self._agreed]
            self._agreed += 1
            reports: list[str | None] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(reports, failure)
            failed = {rank: reason for rank, reason in enumerate(reports) if reason is not None}
            if failed and failure is None:
                reasons = "; ".join(f"rank {rank}: {reason}" for rank, reason in failed.items())
                raise SaveError(
                    f"saving {self._target} failed on rank(s) {sorted(failed)} while {current} ({reasons}); the "
                    "directory was not replaced"
                )
