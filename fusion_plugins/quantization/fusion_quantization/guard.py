"""Noticing a quantizer that ran on a fused model after fusion-core fused it.

A ``quantize_`` call fusion-core does not see leaves the merged projections unquantized: they are
not ``nn.Linear`` modules. What it does quantize are the model's other ``nn.Linear`` modules (an
attention's ``o_proj``, an MLP's ``down_proj``, the LM head), so a few of them are kept as
*sentinels* when the model is fused; the model's first forward after a quantizer touched one, and
any save, then raise :class:`~fusion_core.errors.FusionError` naming the families, a module, the
quantizer and the way out, instead of running or writing fused weights left unquantized.

The guard is plain data on the model (sentinel paths, no module references) and the check a
module-level function, so a guarded model still pickles and deep-copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fusion_core.errors import FusionError
from fusion_core.transforms import ModulePlan
from fusion_quantization.detect import quantizer_of

GUARD_ATTRIBUTE = "fusion_quantization_guard"
_SENTINELS = 4


@dataclass(frozen=True)
class Guard:
    """Which fused modules a quantizer would have quantized, and the sentinels that tell it ran."""

    sentinels: tuple[str, ...]
    fused: tuple[tuple[str, str, tuple[str, ...]], ...]
    """(family, module path, its moved nn.Linear children) of every fused module holding ex-Linear tensors."""

    def refusal(self, model: nn.Module, action: str) -> str | None:
        for path in self.sentinels:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                continue
            quantizer = quantizer_of(module)
            if quantizer is not None:
                return refusal_message(self.fused, f"{quantizer} quantized {path!r} after the model was fused", action)
        return None


def refusal_message(fused: Sequence[tuple[str, str, tuple[str, ...]]], what: str, action: str) -> str:
    families = sorted({family for family, _, _ in fused})
    family, path, linears = fused[0]
    parts = ", ".join(linear or "itself" for linear in linears)
    leave_out = ", ".join(f"{name!r}: False" for name in families)
    return (
        f"{what}; {action} would use fused weights it did not quantize: family {family!r}, module {path!r} "
        f"holds the nn.Linear tensors of {parts} merged (families {families}, {len(fused)} module(s)). fusion-core "
        f"does not quantize fused weights yet: quantize the unfused model, or leave the families out "
        f"(fusion_config={{{leave_out}}})"
    )


def fused_linears(plans: Sequence[ModulePlan]) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """The fused modules whose plans move ``nn.Linear`` tensors (what a Linear quantizer would have seen)."""
    return tuple((p.family, p.path, p.moved_linears) for p in plans if p.moved_linears)


def attach_guard(model: nn.Module, plans: Sequence[ModulePlan]) -> None:
    """Keep sentinels on ``model`` and check them before every forward (cheap: a few dict lookups)."""
    fused = fused_linears(plans)
    if not fused or GUARD_ATTRIBUTE in model.__dict__:
        return
    inside = tuple(f"{p.path}.{name}" if name else p.path for p in plans for name in p.moved_linears)
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
    guard = guard_of(model)
    if guard is None:
        return
    reason = guard.refusal(model, "this forward")
    if reason is not None:
        raise FusionError(reason)
