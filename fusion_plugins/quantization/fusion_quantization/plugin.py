"""fusion-core's quantization integration: the plugin module its entry point names.

After a fused load, a quantizer that picks ``nn.Linear`` modules (torchao's ``quantize_``, quanto's
``quantize``) quantizes a merged projection's container like the parts on the unfused model (see
:mod:`fusion_core.merged`). What cannot be quantized exactly is refused by name, never left
unquantized without a word: a load that quantizes (``quantization_config=...``, or a pre-quantized
checkpoint) when a family would fuse ``nn.Linear`` tensors, before any weight is read (the
quantizer would run on the original projections, before they are fused); ``fusion_core.fuse`` of a
model that is quantized already; a fused tensor a quantizer left alone while it quantized the rest
of the model because it could not see them (:mod:`fusion_quantization.guard`), on the first forward
and on save; ``unfuse`` of a
container a quantizer replaced by its own module. Families that move no ``nn.Linear`` tensor
(``patch_embeddings``: a ``Conv3d``) load, fuse and quantize as the unfused model does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, MutableMapping, MutableSequence
from typing import Any

from torch import nn

from fusion_core.errors import FusionLoadError, SaveError
from fusion_core.hookspecs import hookimpl
from fusion_core.integration import Integration
from fusion_core.integration_needs import load_quantization
from fusion_core.transforms import FusionPlan, ModulePlan
from fusion_quantization.detect import QUANTIZER_PACKAGES, package_of, quantization_method, quantizer_of
from fusion_quantization.guard import attach_guard, containers, fused_linears, guard_of, refusal_message

INTEGRATION = Integration(
    "quantization",
    "quantizers on fused models: refused by name wherever fused weights would stay unquantized",
)


@hookimpl
def register_fusion_integrations(register: Callable[[Integration], None]) -> None:
    register(INTEGRATION)


@hookimpl
def fusion_load_planned(plan: FusionPlan, config: Any, load_kwargs: Mapping[str, Any]) -> None:
    quantization = load_quantization(load_kwargs, config)
    fused = fused_linears(plan.modules)
    if quantization is None or not fused:
        return
    raise FusionLoadError(refusal_message(
        fused, f"the load quantizes with {quantization_method(quantization)}", "the fused model",
        "fused, and a quantizing load quantizes the original layers before fusion-core fuses them (merging quantized "
        "tensors at load is not implemented yet)",
    ))


@hookimpl(wrapper=True)
def fusion_convert_loaded(
    model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]]
) -> Generator[None, None, None]:
    plans = [plan for _, plan in built]
    result = yield
    attach_guard(model, plans)
    return result


@hookimpl
def fusion_fuse_refusal(model: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or "base_layer" in module._modules:
            quantizer = quantizer_of(module)
            if quantizer is not None:
                return (f"is quantized ({quantizer}: {name!r}); fusion-core cannot fuse quantized weights yet: fuse "
                        "the unquantized model, or leave the families that merge nn.Linear layers out")
    return None


@hookimpl
def fusion_unfuse_refusal(module: nn.Module, plan: ModulePlan) -> str | None:
    for container in containers(plan):
        held = module.get_submodule(container) if container else module
        if held is not module and package_of(type(held)) in QUANTIZER_PACKAGES:
            return (f"its merged {container!r} was replaced by {type(held).__qualname__} ({package_of(type(held))}); "
                    "a module a quantizer replaced cannot be split back into the original ones")
    return None


@hookimpl
def fusion_save_kwargs(model: nn.Module, save_kwargs: MutableMapping[str, Any]) -> None:
    guard = guard_of(model)
    reason = guard.refusal(model, "this save") if guard is not None else None
    if reason is not None:
        raise SaveError(reason)
