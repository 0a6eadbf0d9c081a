"""The private parts of torch that fusion-core relies on, and the torch floor.

The floor in ``pyproject.toml`` (``torch>=2.6``) is the lowest release with every public API
the code calls: ``torch.accelerator.synchronize`` (2.6; the merge policy's timing on an
accelerator), ``torch.distributed.tensor`` with ``DTensor.from_local(..., shape=, stride=)``
(public from 2.5; tensor parallelism), ``nn.Module.register_state_dict_post_hook`` and
``register_load_state_dict_pre_hook`` (2.5; the original layout), ``torch.compiler.is_compiling``
(2.3). Only torch 2.13.0 is tested (the one build this project can install); the floor is read
from the code.

Beyond that, fusion-core reads and writes ``nn.Module._parameters`` / ``_buffers`` / ``_modules``
directly, as torch's own ``__setattr__``, accelerate and PEFT do: the storage every module has
had since torch 1.0. The other private names are below.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn


@functools.cache
def native_bf16_gemms() -> bool:
    """Whether this CPU's GEMMs run bfloat16 natively: oneDNN's own check (AVX-512-BF16 or AMX),
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` (no public equivalent in torch 2.13). True where it
    cannot be asked (a build without oneDNN), so callers keep their default kernels."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def remove_layout_hooks(module: nn.Module, state_dict_post: Callable[..., Any], load_pre: Callable[..., Any]) -> None:
    """Remove the state-dict post-hooks calling ``state_dict_post`` and load pre-hooks calling ``load_pre``.

    Hooks are found by the function they call, in ``nn.Module._state_dict_hooks`` and
    ``_load_state_dict_pre_hooks`` (torch wraps a load pre-hook in an object whose ``hook`` is the
    function; checked on 2.13): a handle of a deep-copied or unpickled module would still point at
    the original module's table.
    """
    for table, hook in ((module._state_dict_hooks, state_dict_post), (module._load_state_dict_pre_hooks, load_pre)):
        for key in [k for k, h in table.items() if getattr(h, "hook", h) is hook]:
            del table[key]


def remove_state_dict_post_hooks(module: nn.Module, function: Callable[..., Any]) -> None:
    """Remove the state-dict post-hooks of ``module`` that call ``function``, directly or as a
    ``functools.partial`` of it (a plugin's hook bound to its data), found in ``nn.Module._state_dict_hooks``
    as :func:`remove_layout_hooks` finds them."""
    table = module._state_dict_hooks
    for key in [k for k, h in table.items() if getattr(h, "func", h) is function]:
        del table[key]


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor``'s storage has had (``Tensor._version``, every torch since 0.4; no
    public equivalent in 2.13): a cached result computed from it is stale when the count moved. -1 for an
    inference tensor, which has no counter (it can only be written inside inference mode)."""
    return -1 if tensor.is_inference() else int(tensor._version)


def end_gloo_rank_process() -> NoReturn:
    """End a spawned torch.distributed rank process now, after its process group is destroyed, without the
    interpreter's teardown: with torch 2.13.0 and gloo a rank was seen to abort there ("terminate called without an
    active exception", SIGABRT) after all its work was done and reported, failing a job whose checks had passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
