"""fusion-core's quantization integration: the plugin module its entry point names.

After a fused load, a quantizer that picks ``nn.Linear`` modules (torchao's ``quantize_``, quanto's
``quantize``) quantizes a merged projection's container like the parts on the unfused model (see
:class:`fusion_core.plugin.MergedProjectionsMixin`). A load that quantizes (or a checkpoint pre-quantized) is
merged exactly unless :func:`at_load_refusal` says why not, and when every fused module only concatenates rows:
torchao through the conversion's concatenation of tensor subclasses (:func:`fusion_core.plugin.concat`);
bitsandbytes and quanto, whose modules hold state the conversion cannot carry, by taking the parts' state out before
it and installing the quantizer's module over the merged state after it
(:mod:`fusion_quantization.bnb_int8`, :mod:`~fusion_quantization.bnb_4bit`,
:mod:`~fusion_quantization.quanto_bytes`). What cannot be quantized exactly is refused by name,
never left unquantized without a word: any other quantizing load, before any weight is read
(:func:`at_load_refusal` says why), and one whose quantizer would replace an ``nn.Linear`` a family fuses by class
(:func:`replaced_under`); ``fusion_core.fuse`` of a model that is quantized already; a
fused tensor a quantizer left alone while it quantized the rest of the model because it could not
see them (:mod:`fusion_quantization.guard`), on the first forward and on save; ``unfuse`` of a
container a quantizer replaced by its own module. quanto's ``QLinear`` over a merged container saves the
parts' entries, or the save is refused by name before anything is written
(:mod:`fusion_quantization.quanto_split`). Families that move no ``nn.Linear`` tensor
(``patch_embeddings``: a ``Conv3d``) load, fuse and quantize as the unfused model does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, NoReturn

from torch import nn

from fusion_core import Concat, FusionLoadError, FusionPlan, Integration, ModulePlan, SaveError, hookimpl
from fusion_core.plugin import load_quantization, presenting_fused
from fusion_quantization.bnb_4bit import BLOCKSIZE, fills_whole_blocks, install as install_4bit, take_packed
from fusion_quantization.bnb_int8 import collect as collect_int8, install as install_int8
from fusion_quantization.compat import bnb_loads_in
from fusion_quantization.detect import (
    QUANTIZER_PACKAGES,
    TORCH_AO_MODULES,
    package_of,
    quantization_method,
    quantizer_of,
)
from fusion_quantization.guard import attach_guard, containers, fused_linears, guard_of, refusal_message
from fusion_quantization.quanto_bytes import (
    MERGED_WEIGHTS as QUANTO_MERGED_WEIGHTS,
    install as install_quanto,
    take_rows,
)
from fusion_quantization.quanto_split import (
    attach as attach_quanto_split,
    detach as detach_quanto_split,
    save_refusal as quanto_save_refusal,
)
from fusion_quantization.replaced import quantized_parts, weight_rows
from fusion_quantization.schemes import SKIPPED, config_field, part_schemes

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
    if quantization is None:
        return
    by_class = [p for p in plan.modules if replaced_under(p, quantization)]
    if by_class:
        first = by_class[0]
        raise FusionLoadError(
            f"the load quantizes with {quantization_method(quantization)}, which replaces each nn.Linear it quantizes "
            "with a layer of its own (and, on some transformers releases, passes over a subclass of nn.Linear); "
            f"family {first.family!r} fuses {len(by_class)} nn.Linear layer(s) by class, module {first.path!r} "
            "first, and each would be replaced under the family or left unquantized: leave the family out "
            f"(fusion_config={{{first.family!r}: False}}), or keep those layers out of the family (its "
            "exclude_modules) or out of the quantizer (its skip list)"
        )
    planned = [p for p in plan.modules if p.moved_linears]
    if not planned:
        return

    def refuse(modules: Sequence[ModulePlan], reason: str) -> NoReturn:
        raise FusionLoadError(refusal_message(fused_linears(modules), f"the load quantizes with "
                                              f"{quantization_method(quantization)}", "the fused model", reason))

    refusal = at_load_refusal(quantization)
    if refusal is not None:
        refuse(planned, f"fused, and {refusal}")
    mixed = [(p, found) for p in planned if (found := mismatched_parts(p, quantization)) is not None]
    if mixed:
        described = ", ".join(f"{part}: {scheme}" for part, scheme in mixed[0][1])
        refuse([p for p, _ in mixed], f"fused, and the load would quantize those parts differently ({described}), "
                                      "which one merged layer cannot hold")
    unmerged = [p for p in planned if not concatenates_rows(p)]
    if unmerged:
        refuse(unmerged, "by ops other than a concatenation of rows, which quantized tensors do not go through")
    partial = [p for p in planned if not fills_whole_blocks(p, BLOCKSIZE)] if bnb_loads_in(quantization, 4) else []
    if partial:
        refuse(partial, f"fused, and a part does not fill whole 4-bit blocks of {BLOCKSIZE} elements, so the merged "
                        "layer's blocks would span parts")


def replaced_under(plan: ModulePlan, quantization: Any) -> bool:
    """Whether ``plan`` fuses an ``nn.Linear`` by class alone (it moves no tensor: ``linear_kernels``' layers) that
    this load's quantizer would replace with a layer of its own.

    transformers builds the model with the fused class already in place, then the quantizer swaps the layers it
    quantizes: bitsandbytes, quanto and HQQ by ``isinstance`` (the fused layer is then gone), transformers 5.x's
    bitsandbytes only where ``type(module) is nn.Linear`` (the fused layer then stays in float, unquantized, with
    no word). torchao keeps the module and quantizes its weight in place, which the fused layer runs with the
    quantizer's kernel; a layer the load leaves unquantized (a skip list) is the family's as in any load.
    """
    if plan.transforms or not issubclass(plan.original_class, nn.Linear):
        return False
    method = config_field(quantization, "quant_method")
    if getattr(method, "value", method) == "torchao":
        return False
    return part_schemes(quantization, [plan.path]) != [SKIPPED]


def at_load_refusal(quantization: Any) -> str | None:
    """Why the conversion cannot merge what this load quantizes (or a checkpoint holds pre-quantized), or None.

    Merged: torchao's tensor subclasses, concatenated through their inner tensors by the conversion, exactly or
    refused (:func:`fusion_core.plugin.concat`); bitsandbytes LLM.int8 and 4-bit (nf4, fp4) and quanto's 8-bit weights,
    whose modules hold state the conversion cannot carry, merged by this integration
    (:mod:`fusion_quantization.bnb_int8`, :mod:`~fusion_quantization.bnb_4bit`,
    :mod:`~fusion_quantization.quanto_bytes`). Refused: what they cannot merge exactly, and other quantizers.
    """
    method = config_field(quantization, "quant_method")
    method = getattr(method, "value", method)
    if method == "torchao":
        return None
    if method == "quanto":
        weights, activations = config_field(quantization, "weights"), config_field(quantization, "activations")
        if activations is not None:
            return f"quanto quantizes activations too (activations={activations!r}), with calibrated per-layer scales"
        if weights not in QUANTO_MERGED_WEIGHTS:
            return (f"quanto's weights={weights!r} packs rows in groups fusion-core does not merge (merged: "
                    f"{sorted(QUANTO_MERGED_WEIGHTS)})")
        return None
    if method != "bitsandbytes":
        return ("this quantizer replaces the original layers in a form fusion-core does not merge; at load it merges "
                "torchao's tensors (TorchAoConfig, or a checkpoint torchao pre-quantized), bitsandbytes "
                "(BitsAndBytesConfig, or a checkpoint bitsandbytes pre-quantized) and quanto (QuantoConfig) only")
    if bnb_loads_in(quantization, 4) and config_field(quantization, "bnb_4bit_use_double_quant"):
        return ("bitsandbytes double quantization (bnb_4bit_use_double_quant) quantizes each layer's block scales "
                "around their mean, so a merged layer's nested scales would span parts; load with "
                "bnb_4bit_use_double_quant=False")
    if bnb_loads_in(quantization, 4) or bnb_loads_in(quantization, 8):
        return None
    return "this BitsAndBytesConfig quantizes nothing fusion-core knows (neither load_in_8bit nor load_in_4bit)"


def mismatched_parts(plan: ModulePlan, quantization: Any) -> list[tuple[str, str]] | None:
    """The parts of one of ``plan``'s weight concatenations that the load would quantize differently (a skip list
    naming some of them, per-module torchao configs), as (part, scheme); None when every concatenation is uniform."""
    for bound in plan.transforms:
        parts = [spec.name.rpartition(".")[0] for spec in bound.sources if spec.name.endswith(".weight")]
        schemes = part_schemes(quantization, [plan.full_key(part) for part in parts])
        if len(set(schemes)) > 1:
            return list(zip(parts, schemes, strict=True))
    return None


def concatenates_rows(plan: ModulePlan) -> bool:
    """Whether every transform of ``plan`` concatenates rows (``Concat`` along dim 0): q/k/v, gate/up."""
    return all(isinstance(bound.op, Concat) and bound.op.dim == 0 for bound in plan.transforms)


@hookimpl(wrapper=True, trylast=True)  # it completes the conversion: the innermost wrapper (see the hookspec)
def fusion_convert_loaded(
    model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]]
) -> Generator[None, None, None]:
    plans = [plan for _, plan in built]
    # What the conversion cannot carry: LLM.int8's scales, 4-bit packed bytes (not of the plan's shape), quanto's
    # tensors (they record their own size).
    taken = []
    for module, plan in built:
        found = quantized_parts(module, plan)
        if found:
            taken.append((module, collect_int8(found), take_packed(found), take_rows(found)))
    result = yield
    for module, int8, packed, rows in taken:
        install_int8(module, int8)
        install_4bit(module, packed)
        install_quanto(module, rows)
    attach_guard(model, plans)
    return result


@hookimpl
def fusion_module_fused(module: nn.Module, plan: ModulePlan) -> None:
    layouts = weight_rows(plan)
    if layouts:  # quanto's quantize may replace the merged containers later: their entries are saved as the parts'
        attach_quanto_split(module, layouts)


@hookimpl
def fusion_module_unfused(module: nn.Module, plan: ModulePlan) -> None:
    detach_quanto_split(module)


@hookimpl
def fusion_fuse_refusal(model: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if (isinstance(module, nn.Linear) or "base_layer" in module._modules
                or type(module).__module__.startswith(TORCH_AO_MODULES)):
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
    if reason is None and not presenting_fused():  # the fused layout is saved as it is
        reason = quanto_save_refusal(model)
    if reason is not None:
        raise SaveError(reason)
