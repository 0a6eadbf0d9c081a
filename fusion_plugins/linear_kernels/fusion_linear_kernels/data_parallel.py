"""Packed weights and torch.distributed: a distributed job keeps weights dense; a wrapper that meets one refuses it.

Data-parallel wrappers work on a parameter's storage: DDP compares strides across ranks and broadcasts
views of it, FSDP2's ``fully_shard`` chunks it into shards. A weight held in oneDNN's prepacked layout
has no storage Python can see (:mod:`fusion_linear_kernels.compat`), and the packing decision is timed in
each process, so two ranks may hold different layouts of the same layer. Hence:

- **In a distributed job nothing is packed** (:func:`in_distributed_job`: a process group is up, or a
  launcher such as ``torchrun`` or ``accelerate launch`` started this process as one of several, which a
  model loaded before the process group is created still sees). Every layer keeps its dense weight and
  the measured kernel choice at few rows (:mod:`fusion_linear_kernels.choice`), so DDP, FSDP2 and tensor
  parallelism run as they do on the unfused model.
- **A wrapper applied to a model that packed weights anyway** (loaded in a single process, the process
  group created after) is refused by name: FSDP2 chunks each parameter with a strided view, which a
  packed tensor does not have; :func:`refuse_strided_view` is that view's kernel for oneDNN tensors
  (there is none in torch), and raises the ``NotImplementedError`` torch would, naming the family, the
  module (:func:`label`) and the two ways out. DDP fails earlier, inside its C++ checks, with torch's
  own message; the documentation names the same ways out.
"""

from __future__ import annotations

import os

import torch

from fusion_linear_kernels import compat

#: Set on a packed weight (a ``nn.Parameter``): the module path it belongs to, for :func:`refuse_strided_view`.
_MODULE_ATTRIBUTE = "_fusion_linear_kernels_module"


def in_distributed_job() -> bool:
    """Whether this process is one rank of several: a process group is up, or the launcher's ``WORLD_SIZE`` is > 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def label(weight: torch.Tensor, module_path: str) -> None:
    """Record on a packed ``weight`` the path of its module, which :func:`refuse_strided_view` names."""
    if isinstance(weight, torch.nn.Parameter):
        setattr(weight, _MODULE_ATTRIBUTE, module_path)


def refusal(tensor: torch.Tensor, held: str = "prepacked") -> str:
    """The message a strided view of a packed weight raises (``held``: how the weight is held)."""
    module = getattr(tensor, _MODULE_ATTRIBUTE, None)
    which = f"the weight of {module!r}" if module else "a weight"
    return (f"linear_kernels holds {which} {held} (oneDNN's opaque layout), which has no strided view, so it "
            "cannot be sharded or broadcast (FSDP2's fully_shard, DDP): load the model in the distributed job (after "
            "torch.distributed.init_process_group, or under torchrun), where linear_kernels keeps every weight dense, "
            "or call fusion_core.unfuse(model) before wrapping it")


def refuse_strided_view(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """``aten::as_strided`` for oneDNN tensors: always refused, by name (see the module docs)."""
    raise NotImplementedError(refusal(tensor))


def _register() -> torch.library.Library | None:
    """Register :func:`refuse_strided_view` where torch has no ``as_strided`` for oneDNN tensors (None elsewhere)."""
    if not compat.available():
        return None
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("as_strided", refuse_strided_view, "MkldnnCPU")
    except RuntimeError:  # a kernel is registered already (a later torch, or another library): leave it
        return None
    return library


_LIBRARY = _register()
