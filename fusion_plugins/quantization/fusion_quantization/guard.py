"""Noticing a quantizer that ran on a fused model and could not see some fused weights.

Quantizers pick ``nn.Linear`` modules that hold a ``weight``. A merged projection's container is
one (:class:`fusion_core.plugin.MergedProjection`), and ``moe_experts`` keeps ``nn.Linear`` stand-ins
of its experts that refuse a quantizer by name; for those, a quantizer sees what it sees on the
unfused model, and what it quantizes or skips (a ``filter_fn``) is the user's choice, as there
(torch's own ``quantize_dynamic`` is the exception: it looks classes up by exact type, so it sees
neither, and is refused the same way as the families below). A
family built otherwise (a fused class without a ``weight``, tensors moved into a plain module)
leaves fused weights no quantizer can see: quantizing the rest of the model would leave them
unquantized without a word. To notice that, a few of the model's other ``nn.Linear`` modules (an
attention's ``o_proj``, an MLP's ``down_proj``, the LM head) are kept as *sentinels* when the model
is fused: once a quantizer touched one, the model's first forward and any save raise
:class:`~fusion_core.FusionError` naming such a family, the module, the quantizer and the way
out.

The guard is plain data on the model (sentinel paths, no module references) and the check a
module-level function, so a guarded model still pickles and deep-copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion_core import FusionError, ModulePlan
from fusion_quantization.detect import TORCH_AO, quantizer_of, unwrapped

GUARD_ATTRIBUTE = "fusion_quantization_guard"
FusedEntry = tuple[str, str, tuple[str, ...], tuple[str, ...]]
"""(family, module path, its moved nn.Linear children, the containers of its fused tensors)."""
_SENTINELS = 4


@dataclass(frozen=True)
class Guard:
    """Which fused modules a quantizer would have quantized, and the sentinels that tell it ran."""

    sentinels: tuple[str, ...]
    fused: tuple[FusedEntry, ...]
    """Every fused module holding ex-Linear tensors."""

    def refusal(self, model: nn.Module, action: str) -> str | None:
        for path in self.sentinels:
            module = _child(model, path)
            if module is None or _plain_linear(module):
                continue
            quantizer = quantizer_of(module)
            if quantizer is None:
                continue
            hidden = [entry for entry in self.fused if not _visible(model, entry, quantizer)]
            if hidden:
                where = ("in modules whose class torch.ao.quantization's exact-type lookup skips"
                         if quantizer == TORCH_AO else "in modules no nn.Linear quantizer sees")
                return refusal_message(hidden, f"{quantizer} quantized {path!r} after the model was fused", action,
                                       where)
            return None
        return None


def _child(model: nn.Module, path: str) -> nn.Module | None:
    """The sub-module at ``path``, walked through ``_modules`` (cheaper than ``get_submodule`` on every forward)."""
    module: nn.Module | None = model
    for part in path.split("."):
        module = module._modules.get(part) if module is not None else None
    return module


def _plain_linear(module: nn.Module) -> bool:
    """The common case, answered without :func:`quantizer_of`: a plain ``nn.Linear`` with a plain float weight."""
    weight = module._parameters.get("weight") if type(module) is nn.Linear else None
    return type(weight) is nn.Parameter and weight.is_floating_point() and weight.element_size() > 1


def _seen_by(module: nn.Module, quantizer: str) -> bool:
    """What ``quantizer`` would see (or has quantized): most pick ``nn.Linear`` modules with a ``weight``
    (``isinstance``); torch's own (``quantize_dynamic``) looks classes up by exact type, so it skips every
    subclass, a merged projection's container and a MoE expert stand-in among them."""
    if quantizer_of(module) is not None:
        return True
    if quantizer == TORCH_AO:
        return type(unwrapped(module)) is nn.Linear
    try:
        return isinstance(module, nn.Linear) and isinstance(module.weight, torch.Tensor)
    except AttributeError:
        return False


def _visible(model: nn.Module, entry: FusedEntry, quantizer: str) -> bool:
    """Whether ``quantizer`` sees the fused module's tensors: in its containers, or at the original Linears' paths."""
    _, path, linears, holders = entry
    for names in (holders, linears):
        try:
            if all(_seen_by(model.get_submodule(f"{path}.{n}" if n else path), quantizer) for n in names):
                return True
        except AttributeError:
            continue
    return False


def refusal_message(fused: Sequence[FusedEntry], what: str, action: str, where: str) -> str:
    families = sorted({entry[0] for entry in fused})
    family, path, linears, _ = fused[0]
    parts = ", ".join(linear or "itself" for linear in linears)
    leave_out = ", ".join(f"{name!r}: False" for name in families)
    return (
        f"{what}; {action} would not be quantized exactly: family {family!r}, module {path!r} "
        f"holds the nn.Linear tensors of {parts} {where} (families {families}, {len(fused)} module(s)): quantize "
        f"the unfused model, or leave the families out (fusion_config={{{leave_out}}})"
    )


def fused_linears(plans: Sequence[ModulePlan]) -> tuple[FusedEntry, ...]:
    """The fused modules whose plans move ``nn.Linear`` tensors (what a Linear quantizer would have seen)."""
    return tuple((p.family, p.path, p.moved_linears, containers(p)) for p in plans if p.moved_linears)


def containers(plan: ModulePlan) -> tuple[str, ...]:
    """Module-relative paths of the modules holding the plan's fused tensors (``qkv_proj``)."""
    return tuple(dict.fromkeys(t.name.rpartition(".")[0] for b in plan.transforms for t in b.targets))


def attach_guard(model: nn.Module, plans: Sequence[ModulePlan]) -> None:
    """Keep sentinels on ``model`` and check them before every forward (cheap: a few dict lookups)."""
    fused = fused_linears(plans)
    if not fused or GUARD_ATTRIBUTE in model.__dict__:
        return
    inside = tuple(f"{p.path}.{name}" if name else p.path
                   for p in plans for name in (*p.moved_linears, *containers(p)))
    candidates = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name
                  and not name.startswith(tuple(f"{path}." for path in inside)) and name not in inside]
    if not candidates:
        return
    step = max(len(candidates) // _SENTINELS, 1)
    sentinels = tuple(dict.fromkeys([*candidates[::step][: _SENTINELS - 1], candidates[-1]]))
    model.__dict__[GUARD_ATTRIBUTE] = Guard(sentinels, fused)
    model.register_forward_pre_hook(check_before_forward)


def guard_of(model: nn.Module) -> Guard | None:
    guard = model.__dict__.get(GUARD_ATTRIBUTE)
    return guard if isinstance(guard, Guard) else None


def check_before_forward(model: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():  # Python state: checked by the eager calls, never traced
        return
    guard = guard_of(model)
    if guard is None:
        return
    reason = guard.refusal(model, "this forward")
    if reason is not None:
        raise FusionError(reason)
