"""quanto's ``quantize`` (and ``freeze``) run on a fused model: saved in the unfused model's layout, or refused.

After a fused load (or ``fusion_core.fuse``), quanto's ``quantize`` replaces each merged projection's
container (``qkv_proj``, an ``nn.Linear``) by its ``QLinear``, as it replaces the parts on the
unfused model. The core presents the plan's own tensors as the parts' (``qkv_proj.weight`` before
``freeze``, ``qkv_proj.bias``); the rest of what the ``QLinear`` saves it cannot name: the frozen
weight's inner tensors (``weight._data``, ``weight._scale``) and the activation scales
(``input_scale``, ``output_scale``). A ``state_dict`` hook on each fused module
(:func:`present_parts`, attached when the module is fused, after the core's) writes them as the
unfused model's ``QLinear`` parts write them, in their order: 8-bit rows (qint8, qfloat8) and their
per-row scales sliced by part, and each activation scale copied into every part. The copies are
the unfused model's while activations are not quantized: quanto initialises every layer's scales
to one, and only the calibration of quantized activations changes them.

What cannot be written so is refused by name before a save writes anything (:func:`save_refusal`):
quantized activations (the merged layer has one ``output_scale``, calibrated over every part's
outputs, where each unfused part calibrates its own, and the fused forward quantizes with it),
frozen weights whose rows are packed in groups (qint4, qint2), and any entry this module does not
know. A plain ``state_dict()`` of such a model keeps the merged container's entries as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn

from fusion_core.plugin import (
    is_torch_tensor,
    module_plan,
    presenting_fused,
    remove_state_dict_post_hooks,
    take_own_block,
)
from fusion_quantization.compat import (
    QUANTO_SAVE_ORDER,
    QUANTO_SAVED,
    QUANTO_SAVED_SCALES,
    quanto_activations,
    quanto_part_entries,
    read_quanto,
)
from fusion_quantization.quanto_bytes import is_quanto_linear
from fusion_quantization.replaced import PartsLayout, weight_rows

_KNOWN = frozenset({"weight", "bias", *QUANTO_SAVED, *QUANTO_SAVED_SCALES})
"""What a ``QLinear`` with 8-bit or unfrozen weights saves: the core splits ``weight`` and ``bias``, this module
the rest."""


def refusal(layer: nn.Module) -> str | None:
    """Why the parts' entries cannot be written from quanto's ``QLinear`` over a merged container, or None."""
    activations = quanto_activations(layer)
    if activations is not None:
        return (f"it quantizes activations too ({activations}): the merged layer has one output_scale, calibrated "
                "over every part's outputs, where each unfused part calibrates its own")
    weight = layer._parameters.get("weight")
    if weight is not None and not is_torch_tensor(weight):
        read = read_quanto(layer)
        if read is None:
            return (f"its frozen weight is a {type(weight).__name__}, which fusion-core does not split back into "
                    "the parts (it splits 8-bit weights, qint8 and qfloat8, and any weights before freeze; qint4 and "
                    "qint2 pack rows in groups)")
        if read.axis != 0 or read.scale.shape != (read.data.shape[0], 1):
            return "its weight's scales are not one per output row"
    unknown = sorted(_saved(layer) - _KNOWN)
    if unknown:
        return f"it saves entries fusion-core does not split back into the parts ({unknown})"
    return None


def _saved(layer: nn.Module) -> set[str]:
    """The entries ``layer`` saves, named from its tensors (its own ``state_dict`` would run its hooks: the at-load
    merge's writes its entries as the parts')."""
    saved = {name for name, tensor in (*layer._parameters.items(), *layer._buffers.items()) if tensor is not None}
    weight = layer._parameters.get("weight")
    if weight is not None and not is_torch_tensor(weight) and hasattr(weight, "__tensor_flatten__"):
        saved.discard("weight")
        saved |= {f"weight.{name}" for name in weight.__tensor_flatten__()[0]}
    return saved


def save_refusal(model: nn.Module) -> str | None:
    """Why saving ``model`` in the original layout would not write what the unfused quanto model writes, or None."""
    for module in model.modules():
        plan = module_plan(module)
        if plan is None:
            continue
        for layout in weight_rows(plan):
            layer = module._modules.get(layout.container)
            reason = refusal(layer) if layer is not None and is_quanto_linear(layer) else None
            if reason is not None:
                return (f"family {plan.family!r}, module {plan.path!r}: quanto's QLinear replaced its merged "
                        f"{layout.container!r} (the parts {list(layout.parts)}), and {reason}; this save would not "
                        "write the unfused model's layout: quantize the unfused model, quantize the fused one's "
                        "weights only (qint8, qfloat8), or save the fused layout (save_original_format=False)")
    return None


def attach(module: nn.Module, layouts: tuple[PartsLayout, ...]) -> None:
    """Present the parts' entries of every quanto ``QLinear`` that will replace one of ``layouts``' containers
    (idempotent; a module-level function with its tensor-free layouts bound, so the module still pickles)."""
    detach(module)
    module.register_state_dict_post_hook(functools.partial(present_parts, layouts))  # type: ignore[no-untyped-call]


def detach(module: nn.Module) -> None:
    """Remove what :func:`attach` installed (``fusion_core.unfuse``)."""
    remove_state_dict_post_hooks(module, present_parts)


def present_parts(layouts: tuple[PartsLayout, ...], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Mapping[str, Any]) -> None:
    """Write each quanto container's entries as its parts', in the order the unfused model's ``QLinear`` parts
    write theirs (the fused module's block of keys, at the end of the dict, is taken off and put back in order)."""
    if presenting_fused():
        return
    split = [layout for layout in layouts if _splits(module, layout, state_dict, prefix)]
    if not split:
        return
    block = take_own_block(state_dict, prefix)
    for layout in split:
        _split(layout, block)
    # The parts, and the module's other quanto layers (o_proj): the core orders the entries it does not know (a
    # flattened weight's) after the ones it does (bias), where QLinear writes them before.
    layers = {*(part for layout in split for part in layout.parts),
              *(name for name, child in module._modules.items() if child is not None and is_quanto_linear(child))}
    children = {name: i for i, name in enumerate(module._modules)}
    rank = {name: i for i, name in enumerate(QUANTO_SAVE_ORDER)}

    def position(item: tuple[int, str]) -> tuple[int, int]:
        # As nn.Module.state_dict goes: own tensors, then each child's in module order; within a quanto layer,
        # QLinear's order (weight, bias, the activation scales).
        index, leaf = item
        child, _, rest = leaf.partition(".")
        if not rest:
            return (-1, index)
        layer = next((name for name in layers if leaf.startswith(f"{name}.")), None)
        ranked = index if layer is None else rank.get(leaf[len(layer) + 1:].partition(".")[0], len(rank))
        return (children.get(child, len(children)), ranked)

    for _, leaf in sorted(enumerate(block), key=position):
        state_dict[prefix + leaf] = block[leaf]


def _splits(module: nn.Module, layout: PartsLayout, state_dict: Mapping[str, Any], prefix: str) -> bool:
    """Whether quanto's ``QLinear`` holds ``layout``'s container, its entries are still the container's (the
    at-load merge writes its own as the parts', :func:`fusion_quantization.quanto_bytes.present_parts`), and
    they can be written as the parts'."""
    layer = module._modules.get(layout.container)
    return (layer is not None and is_quanto_linear(layer)
            and f"{prefix}{layout.container}.{QUANTO_SAVED_SCALES[0]}" in state_dict and refusal(layer) is None)


def _split(layout: PartsLayout, block: dict[str, Any]) -> None:
    """Replace the container's entries in ``block`` (leaf -> tensor) by each part's."""
    container = f"{layout.container}."
    entries = {leaf[len(container):]: block.pop(leaf) for leaf in [key for key in block if key.startswith(container)]}
    weight = [entries.pop(name) for name in QUANTO_SAVED if name in entries]  # frozen: 8-bit rows, per-row scales
    for part, start, stop in layout.ranges():
        if weight:
            rows, scales = (tensor[start:stop].clone() for tensor in weight)
            for name, value in quanto_part_entries(rows, scales).items():
                block[f"{part}.{name}"] = value
        for name, value in entries.items():  # the activation scales: one per layer, the same in every part
            block[f"{part}.{name}"] = value.clone()
