"""fusion-core's quantization integration: the plugin module its entry point names.

Quantizing fused weights exactly is not implemented yet, so this integration makes sure it never
happens silently: a load that quantizes (``quantization_config=...``, or a pre-quantized
checkpoint) is refused before any weight is read when a family would fuse ``nn.Linear`` tensors;
``fusion_core.fuse`` refuses a model that is quantized already; and a quantizer that runs on a
fused model afterwards (``torchao.quantization.quantize_``, ``optimum.quanto.quantize``, ...) is
caught on the first forward and on save (:mod:`fusion_quantization.guard`). Families that move no
``nn.Linear`` tensor (``patch_embeddings``: a ``Conv3d``) load, fuse and quantize as before: the
quantizers leave their modules alone on the unfused model too.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, MutableMapping, MutableSequence
from typing import Any

from torch import nn

from fusion_core.errors import FusionLoadError, SaveError
from fusion_core.hookspecs import hookimpl
from fusion_core.integration import Integration
from fusion_core.transforms import FusionPlan, ModulePlan
from fusion_quantization.detect import quantization_method, quantizer_of
from fusion_quantization.guard import attach_guard, fused_linears, guard_of, refusal_message

INTEGRATION = Integration(
    "quantization",
    "quantizers on fused models: refused by name wherever fused weights would stay unquantized",
)


@hookimpl
def register_fusion_integrations(register: Callable[[Integration], None]) -> None:
    register(INTEGRATION)


def load_quantization(config: Any, load_kwargs: Mapping[str, Any]) -> Any:
    """The quantization a load applies: its ``quantization_config`` keyword, or the checkpoint's own."""
    explicit = load_kwargs.get("quantization_config")
    return explicit if explicit is not None else getattr(config, "quantization_config", None)


@hookimpl
def fusion_load_planned(plan: FusionPlan, config: Any, load_kwargs: Mapping[str, Any]) -> None:
    quantization = load_quantization(config, load_kwargs)
    fused = fused_linears(plan.modules)
    if quantization is None or not fused:
        return
    raise FusionLoadError(refusal_message(fused, f"the load quantizes with {quantization_method(quantization)}",
                                          "the fused model"))


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
def fusion_save_kwargs(model: nn.Module, save_kwargs: MutableMapping[str, Any]) -> None:
    guard = guard_of(model)
    reason = guard.refusal(model, "this save") if guard is not None else None
    if reason is not None:
        raise SaveError(reason)
