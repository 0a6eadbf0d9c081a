"""Telling a quantized ``nn.Linear`` from a plain one, whatever quantizer made it.

Quantizers that pick modules with ``isinstance(m, nn.Linear)`` either replace the module by one of
their own classes (bitsandbytes' ``Linear8bitLt`` / ``Linear4bit``, quanto's ``QLinear``) or keep it
and replace its weight by a tensor subclass (torchao's ``quantize_``) or by integer storage. A
module counts as quantized when its class or its weight's class comes from a quantization library,
or when its weight holds an integer or 8-bit float type; torch's own quantized layers
(``torch.ao.nn.quantized``) count as the quantizer ``torch.ao.quantization``. Wrappers that keep the original module as
``base_layer`` (PEFT's tuner layers) are looked through.
"""

from __future__ import annotations

import torch
from torch import nn

#: Top-level packages whose module or tensor classes mean "quantized".
QUANTIZER_PACKAGES = frozenset({
    "torchao", "bitsandbytes", "optimum", "quanto", "hqq", "awq", "gptqmodel", "auto_gptq", "compressed_tensors",
    "fp_quant", "vptq", "aqlm", "spqr", "eetq", "fbgemm_gpu",
})
_QUANTIZED_DTYPES = frozenset({
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
})


#: Module packages of torch's own quantized layers (``torch.ao.quantization.quantize_dynamic`` and the
#: eager-mode workflows swap ``nn.Linear`` for these), named as one quantizer.
TORCH_AO_MODULES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized", "torch.nn.quantized")
TORCH_AO = "torch.ao.quantization"


def package_of(cls: type) -> str:
    """The top-level package a class comes from (``torchao``, ``optimum``, ...)."""
    return cls.__module__.split(".", 1)[0]


def unwrapped(module: nn.Module) -> nn.Module:
    """``module`` with every ``base_layer`` wrapper (PEFT) looked through."""
    while isinstance(module._modules.get("base_layer"), nn.Module):
        module = module._modules["base_layer"]  # type: ignore[assignment]
    return module


def quantizer_of(module: nn.Module) -> str | None:
    """The quantization library (or ``"an unknown quantizer"``) that quantized ``module``; None when plain."""
    module = unwrapped(module)
    if package_of(type(module)) in QUANTIZER_PACKAGES:
        return package_of(type(module))
    if type(module).__module__.startswith(TORCH_AO_MODULES):
        return TORCH_AO
    weight = module._parameters.get("weight")
    if weight is None:
        return None
    if package_of(type(weight)) in QUANTIZER_PACKAGES:
        return package_of(type(weight))
    if weight.dtype in _QUANTIZED_DTYPES:
        return "an unknown quantizer"
    return None


def quantization_method(quantization_config: object) -> str:
    """A load's quantizer, for messages: ``BitsAndBytesConfig (bitsandbytes)``."""
    if isinstance(quantization_config, dict):
        return f"quant_method {quantization_config.get('quant_method', '?')!r}"
    method = getattr(quantization_config, "quant_method", None)
    method = getattr(method, "value", method)
    return f"{type(quantization_config).__name__} ({method})" if method else type(quantization_config).__name__
