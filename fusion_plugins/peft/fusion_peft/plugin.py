"""fusion-core's PEFT integration: the plugin module its entry point names.

It registers the integration ``peft`` and implements three lifecycle hooks: a module fused on a
real device switches the LoRA support on (:func:`fusion_peft.lora.activate`: now if PEFT is
imported, right after its import otherwise), and the in-place verbs refuse what adapters make
inexact (fusing a model that already carries adapter layers; unfusing a module with adapter
layers inside it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from torch import nn

from fusion_core import Integration, ModulePlan, hookimpl
from fusion_peft.lora import activate, reset, tuner_layer_paths

INTEGRATION = Integration("peft", "PEFT LoRA on fused models, targeting the original module names")


@hookimpl
def register_fusion_integrations(register: Callable[[Integration], None]) -> None:
    register(INTEGRATION)


@hookimpl
def fusion_module_fused(module: nn.Module, plan: ModulePlan) -> None:
    tensors = itertools.chain(module.parameters(), module.buffers())
    if any(not t.is_meta for t in tensors):  # discovery's rehearsal on the meta device installs nothing
        activate()


@hookimpl
def fusion_fuse_refusal(model: nn.Module) -> str | None:
    adapters = tuner_layer_paths(model)
    if not adapters:
        return None
    listed = ", ".join(adapters[:3]) + (", ..." if len(adapters) > 3 else "")
    return (f"carries adapter layers ({listed}); fuse the model first and attach the adapters afterwards (they "
            "target the original module names)")


@hookimpl
def fusion_unfuse_refusal(module: nn.Module, plan: ModulePlan) -> str | None:
    adapters = tuner_layer_paths(module)
    if not adapters:
        return None
    return f"carries adapter layers ({', '.join(adapters)}); merge_and_unload() or unload() them before unfusing"


@hookimpl
def fusion_reset_state() -> None:
    reset()
