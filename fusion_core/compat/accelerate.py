"""The private part of accelerate that fusion-core relies on: where a dispatch hook keeps the module's forward.

``accelerate.hooks.add_hook_to_module`` (checked on accelerate 1.16.0) binds the module's ``forward`` at the time
the hook is added and keeps it as ``module._old_forward``; the hooked forward calls that, and
``remove_hook_from_module`` puts it back. transformers adds the hooks while it loads with a ``device_map``, when a
fused module's class is already in place, so a module left unfused after the load must have that binding moved
back to its original class.
"""

from __future__ import annotations

import itertools
from types import MethodType

import torch
from torch import nn

from fusion_core.compat.transformers import release


def rebind_hooked_forward(module: nn.Module) -> None:
    """Point an accelerate hook's kept forward at the module's current class (no-op for a module without one)."""
    kept = module.__dict__.get("_old_forward")
    if isinstance(kept, MethodType) and kept.__self__ is module:
        module.__dict__["_old_forward"] = MethodType(type(module).forward, module)


def onloaded_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's ``state_dict`` with each offloaded tensor read back from the offload, on transformers 4.57; None
    elsewhere, or where nothing is offloaded.

    transformers 4.57's ``save_pretrained`` of a model with offloaded modules maps each key to the deepest module
    whose ``state_dict`` holds it and asks accelerate (``get_state_dict_from_offload``) for it under that module's
    name, which assumes keys lie under their module's path: a fused module presents ``q_proj.weight`` and has no
    ``q_proj`` child, so that save fails (``ValueError: Key ... expected torch.Tensor but received <class 'str'>``).
    Handing it this ``state_dict`` takes the path every other save takes; offloaded modules are left unfused at
    load, so each is asked under its own name. transformers 5.x saves such models through its own path.
    """
    placed = set((getattr(model, "hf_device_map", None) or {}).values())
    if release() >= (5, 0) or not placed & {"cpu", "disk"} or len(placed) < 2:  # 4.57's condition for that path
        return None
    state = model.state_dict()  # may hold non-tensors (torch.ao's packed parameters keep a dtype)
    if not any(isinstance(value, torch.Tensor) and value.is_meta for value in state.values()):
        return None
    from accelerate.utils.modeling import get_state_dict_from_offload

    for name, module in model.named_modules():
        held = [key for key, tensor in itertools.chain(module._parameters.items(), module._buffers.items())
                if tensor is not None and tensor.is_meta]
        if held and name:
            state = get_state_dict_from_offload(module, f"{name}.{held[0]}", state)
    return state
