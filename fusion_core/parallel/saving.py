"""Saving a fused model from every rank of a process group: one writer, full tensors.

Under tensor parallelism or FSDP2 the parameters are DTensor shards: every rank must take part in
gathering them, and only one may write the directory. :func:`gathered_save_kwargs` gathers the
model's ``state_dict()`` (already presented in the original layout by the fused modules) to full
tensors on every rank and hands it to transformers' ``save_pretrained``, which then writes it as
it writes any checkpoint; :func:`rank_zero_directory` lets rank 0 alone replace the target
directory atomically, and returns on every rank once the directory is in place.
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
    """
    if not _distributed():
        with atomic_directory(target) as staging:
            yield staging
        return
    if torch.distributed.get_rank() == 0:
        with atomic_directory(target) as staging:
            yield staging
    else:
        scratch = Path(tempfile.mkdtemp(prefix=".fusion-rank-save-"))
        try:
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    torch.distributed.barrier()
