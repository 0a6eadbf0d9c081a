"""Every internal name of bitsandbytes, optimum-quanto and torchao, and the private fields of transformers'
``BitsAndBytesConfig``, that fusion-quantization reads, calls or writes.

Merging quantized layers exactly means reading what the quantizers keep outside their public API:
bitsandbytes' per-row int8 scales (``SCB``) and outlier threshold, its 4-bit ``QuantState`` (block
scales ``absmax``, code book, block size, ...) and the internal arguments of ``Params4bit`` /
``Int8Params``; quanto's ``WeightQBytesTensor`` rows and scales (``_data``, ``_scale``) and its
constructor; torchao's per-module config table. Nothing else in the package reaches them
(``tests/test_private_names.py`` walks it), so when a release moves one, this module is the one
place to change. Each entry was checked on :data:`CHECKED_RELEASES` (the releases CI pins). On a
release that lacks one, reading it raises ImportError naming the library, the installed release,
the missing name and the releases checked (:func:`missing`), instead of an AttributeError deep in a
load or a save.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch
from torch import nn

BNB = "bitsandbytes"
QUANTO = "optimum-quanto"
TORCHAO = "torchao"

CHECKED_RELEASES: Mapping[str, tuple[str, ...]] = {BNB: ("0.50.2",), QUANTO: ("0.2.7",), TORCHAO: ("0.18.0",)}
"""The releases (distribution names) every entry below was checked on: the ones CI pins."""


def release(library: str) -> str:
    """The installed release of the distribution ``library`` (``"(not installed)"`` when it is not)."""
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def missing(library: str, name: str) -> ImportError:
    """The error for a name the installed ``library`` lacks: the library, its release, the name, the releases
    checked and the way out."""
    return ImportError(
        f"{library} {release(library)} has no {name}, which fusion-quantization reads to merge quantized layers "
        f"exactly; it was checked on {library} {', '.join(CHECKED_RELEASES[library])}: install that release, or load "
        "without the families that merge nn.Linear layers"
    )


def _read(library: str, owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise missing(library, f"{type(owner).__qualname__}.{name}") from None


def _imported(library: str, module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise missing(library, f"{module}.{name}") from None


def _call(library: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, after checking its signature takes them (an internal argument a release
    dropped is named instead of failing as a TypeError inside it)."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        arguments = ", ".join([*(f"<{type(a).__name__}>" for a in args), *(f"{k}=" for k in kwargs)])
        raise missing(library, f"{function.__qualname__}({arguments})") from None
    return function(*args, **kwargs)


# -- transformers' BitsAndBytesConfig ------------------------------------------------------------
def bnb_loads_in(quantization: Any, bits: int) -> bool:
    """Whether a bitsandbytes config (the object, or the dict a checkpoint stores) loads in ``bits`` (4 or 8).

    The public ``load_in_4bit`` / ``load_in_8bit``, or the private ``_load_in_4bit`` / ``_load_in_8bit``
    that ``BitsAndBytesConfig`` keeps them in and ``to_dict`` writes beside them (every release in
    the core's checked transformers releases, docs/compatibility.md); a dict with only the private key still counts.
    """
    names = (f"load_in_{bits}bit", f"_load_in_{bits}bit")
    if isinstance(quantization, dict):
        return any(bool(quantization.get(name)) for name in names)
    return any(bool(getattr(quantization, name, None)) for name in names)


# -- bitsandbytes LLM.int8 ------------------------------------------------------------------------
INT8_SAVED = ("SCB", "weight_format")
"""The entries ``Linear8bitLt`` saves beside its weight: the per-row scales and the weight format (0: row-major)."""


def int8_scales(layer: nn.Module) -> torch.Tensor | None:
    """A ``Linear8bitLt``'s per-row scales: ``Int8Params.SCB``, else ``MatmulLtState.SCB``; None when not
    quantized (a weight that is not ``Int8Params`` has none)."""
    weight = layer.weight
    scales: torch.Tensor | None = _read(BNB, weight, "SCB") if type(weight).__name__ == "Int8Params" else None
    return scales if scales is not None else _read(BNB, _read(BNB, layer, "state"), "SCB")


def int8_settings(layer: nn.Module) -> tuple[float, bool]:
    """A ``Linear8bitLt``'s outlier threshold, and whether it keeps float weights (``has_fp16_weights``)."""
    state = _read(BNB, layer, "state")
    return float(_read(BNB, state, "threshold")), bool(_read(BNB, state, "has_fp16_weights"))


def int8_linear(rows: torch.Tensor, scales: torch.Tensor, threshold: float, bias: bool) -> nn.Module:
    """A frozen ``Linear8bitLt`` over int8 ``rows`` and their per-row ``scales``."""
    linear_cls = _imported(BNB, "bitsandbytes.nn", "Linear8bitLt")
    params_cls = _imported(BNB, "bitsandbytes.nn", "Int8Params")
    new = _call(BNB, linear_cls, rows.shape[1], rows.shape[0], bias=bias, has_fp16_weights=False,
                threshold=threshold, device=rows.device)
    new.weight = _call(BNB, params_cls, rows, requires_grad=False, has_fp16_weights=False, CB=rows,
                       SCB=scales.to(rows.device))
    return new  # type: ignore[no-any-return]


def int8_part_entries(scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """What an unfused ``Linear8bitLt`` with these row scales saves beside its weight (:data:`INT8_SAVED`)."""
    return {"SCB": scales, "weight_format": torch.tensor(0, dtype=torch.uint8)}


# -- bitsandbytes 4-bit -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Packed4bit:
    """What a quantized ``Linear4bit`` holds: its packed bytes, its weight's ``QuantState`` and its dtypes."""

    packed: torch.Tensor
    shape: tuple[int, int]
    absmax: torch.Tensor
    code: torch.Tensor
    blocksize: int
    quant_type: str
    dtype: torch.dtype
    nested: bool
    """Double quantization: the block scales are quantized again (``state2``, ``offset``)."""
    repacked_for_cpu: bool
    """bitsandbytes' avx512-bf16 CPU kernel repacked the weight (at the first forward without gradients)."""
    quant_storage: torch.dtype
    compute_dtype: torch.dtype | None


def read_4bit(layer: nn.Module) -> Packed4bit | None:
    """A ``Linear4bit``'s packed state, read from its ``Params4bit`` weight; None when its weight is not a
    quantized ``Params4bit``."""
    weight: Any = layer.weight
    if type(weight).__name__ != "Params4bit":
        return None
    state = _read(BNB, weight, "quant_state")
    if state is None:
        return None
    shape = _read(BNB, state, "shape")
    return Packed4bit(
        weight.data, (int(shape[0]), int(shape[1])), _read(BNB, state, "absmax"), _read(BNB, state, "code"),
        int(_read(BNB, state, "blocksize")), str(_read(BNB, state, "quant_type")), _read(BNB, state, "dtype"),
        bool(_read(BNB, state, "nested")),
        bool(getattr(state, "packing_format_for_cpu", False)),  # set only once repacked (bitsandbytes' own read)
        _read(BNB, weight, "quant_storage"), _read(BNB, layer, "compute_dtype"))


def _quant_state(absmax: torch.Tensor, shape: tuple[int, int], like: Packed4bit, code: torch.Tensor) -> Any:
    state_cls = _imported(BNB, "bitsandbytes.functional", "QuantState")
    return _call(BNB, state_cls, absmax, shape=torch.Size(shape), code=code, blocksize=like.blocksize,
                 quant_type=like.quant_type, dtype=like.dtype)


def linear_4bit(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], like: Packed4bit,
                bias: bool) -> nn.Module:
    """A quantized ``Linear4bit`` of ``shape`` (out, in) over ``packed`` bytes and block scales ``absmax``, quantized
    as ``like`` (quant type, code book, block size, dtypes), without double quantization."""
    linear_cls = _imported(BNB, "bitsandbytes.nn", "Linear4bit")
    params_cls = _imported(BNB, "bitsandbytes.nn", "Params4bit")
    new = _call(BNB, linear_cls, shape[1], shape[0], bias=bias, compute_dtype=like.compute_dtype,
                compress_statistics=False, quant_type=like.quant_type, quant_storage=like.quant_storage,
                device=packed.device)
    state = _quant_state(absmax, shape, like, like.code)
    new.weight = _call(BNB, params_cls, packed, requires_grad=False, quant_state=state, blocksize=like.blocksize,
                       compress_statistics=False, quant_type=like.quant_type, quant_storage=like.quant_storage,
                       module=new, bnb_quantized=True)
    new.quant_state = state
    return new  # type: ignore[no-any-return]


def part_block_scales(merged: Packed4bit, start: int, stop: int) -> torch.Tensor:
    """The block scales of rows ``[start, stop)`` of a 4-bit layer, whose rows' elements fill whole blocks.

    A slice of the flat ``absmax`` (one scale per block, row-major), or, once bitsandbytes' avx512-bf16
    CPU kernel has repacked the weight and the layer's ``_save_to_state_dict`` undone it, the rows'
    columns of the (blocks per row, rows) bfloat16 table that bitsandbytes 0.50.2's inverse repacking
    leaves ``absmax`` as: what the unfused layers save then too.
    """
    if merged.absmax.dim() == 2:
        return merged.absmax[:, start:stop].contiguous()
    width = merged.shape[1]
    return merged.absmax[start * width // merged.blocksize:stop * width // merged.blocksize].clone()


def state_4bit_entries(absmax: torch.Tensor, shape: tuple[int, int], like: Packed4bit) -> dict[str, torch.Tensor]:
    """The entries an unfused ``Linear4bit`` of ``shape`` with block scales ``absmax`` saves beside its weight
    (``absmax``, ``quant_map``, ``quant_state.bitsandbytes__nf4``, ...), as ``QuantState.as_dict(packed=True)``
    writes them (the code book is a copy)."""
    return dict(_read(BNB, _quant_state(absmax, shape, like, like.code.clone()), "as_dict")(packed=True))


# -- quanto -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantoBytes:
    """A frozen ``QLinear``'s 8-bit weight (``WeightQBytesTensor``): its rows, scales, axis and type, and the
    layer's activation type (None: activations not quantized)."""

    data: torch.Tensor
    scale: torch.Tensor
    axis: int | None
    qtype: Any
    qtype_name: str
    activation_type: Any


QUANTO_SAVED = ("weight._data", "weight._scale")
"""The entries a frozen ``QLinear`` saves for its ``WeightQBytesTensor`` (its inner tensors, by attribute name)."""
QUANTO_SAVED_SCALES = ("input_scale", "output_scale")
"""The activation-scale buffers a ``QLinear`` saves (per layer, not per row)."""
QUANTO_SAVE_ORDER = ("weight", "bias", *QUANTO_SAVED_SCALES)
"""The order ``QModuleMixin._save_to_state_dict`` writes a ``QLinear``'s entries in (``weight`` and, once frozen,
its inner tensors ``weight._data``, ... first)."""


def read_quanto(layer: nn.Module) -> QuantoBytes | None:
    """A frozen ``QLinear``'s 8-bit weight; None when its weight is not a ``WeightQBytesTensor`` (not frozen, or
    packed bits)."""
    weight = layer._parameters.get("weight")
    if type(weight).__name__ != "WeightQBytesTensor":
        return None
    qtype = _read(QUANTO, weight, "qtype")
    return QuantoBytes(_read(QUANTO, weight, "_data"), _read(QUANTO, weight, "_scale"), _read(QUANTO, weight, "axis"),
                       qtype, str(_read(QUANTO, qtype, "name")), _read(QUANTO, layer, "activation_qtype"))


def quanto_activations(layer: nn.Module) -> str | None:
    """The name of the type a ``QLinear`` quantizes its activations to (``"qint8"``, ...), or None when it leaves
    them in floating point."""
    qtype = _read(QUANTO, layer, "activation_qtype")
    return None if qtype is None else str(_read(QUANTO, qtype, "name"))


def quanto_linear(data: torch.Tensor, scale: torch.Tensor, qtype: Any, bias: bool) -> nn.Module:
    """A frozen ``QLinear`` whose weight holds 8-bit ``data`` rows with one ``scale`` per row (axis 0)."""
    linear_cls = _imported(QUANTO, "optimum.quanto.nn", "QLinear")
    tensor_cls = _imported(QUANTO, "optimum.quanto.tensor.weights.qbytes", "WeightQBytesTensor")
    size = data.shape
    new = _call(QUANTO, linear_cls, size[1], size[0], bias=bias, device=data.device, dtype=scale.dtype, weights=qtype)
    weight = _call(QUANTO, tensor_cls, qtype, 0, size, (size[1], 1), data, scale, None)
    new.weight = nn.Parameter(weight, requires_grad=False)
    return new  # type: ignore[no-any-return]


def quanto_part_entries(data: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """What an unfused frozen ``QLinear`` with these rows and scales saves for its weight (:data:`QUANTO_SAVED`)."""
    return dict(zip(QUANTO_SAVED, (data, scale), strict=True))


# -- torchao ----------------------------------------------------------------------------------------
TORCHAO_PATTERN_PREFIX = "re:"
"""A key of torchao's per-module table that is a regular expression (full match on the module or parameter path)."""
TORCHAO_DEFAULT = "_default"
"""The key of torchao's per-module table that applies where no other key does."""


def torchao_module_table(quant_type: Any) -> dict[str, Any] | None:
    """torchao's per-module config table (``FqnToConfig.fqn_to_config``; ``module_fqn_to_config`` on
    ``ModuleFqnToConfig``, the name torchao 0.18 keeps for compatibility), or None when the config is not per
    module."""
    table = getattr(quant_type, "fqn_to_config", None) or getattr(quant_type, "module_fqn_to_config", None)
    return table if isinstance(table, dict) else None
