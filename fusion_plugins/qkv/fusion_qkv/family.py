"""``qkv``: attention modules run their three q/k/v projections as one merged GEMM.

An attention module whose three projections are plain ``nn.Linear`` s reading the same hidden
states computes ``x @ [Wq; Wk; Wv]^T (+ [bq; bk; bv])`` once instead of three GEMMs
(grouped-query shapes, where k and v are narrower than q, included). The projections are found
by structure, not by a list of architectures (:mod:`fusion_qkv.recognition`): three ``nn.Linear``
children named alike but for the role word (``q_proj``/``k_proj``/``v_proj``,
``query``/``key``/``value``, ``q_lin``/``k_lin``/``v_lin``, ``q``/``k``/``v``, ...), of one input
width, that the class's ``forward`` applies to the same tensor. The family does not copy any
architecture's attention ``forward``: the fused class keeps the original one, and its
``fusion_finalize`` replaces the three projection children by slices of one merged projection
(see :class:`fusion_core.plugin.MergedProjectionsMixin`), under their original names (PEFT targets them as before). The
q/k/v calls on the same input tensor share one GEMM; any other call is answered from that
projection's own rows, so the module computes what it computed before, on every architecture and
every code path (eager, sdpa, with or without a cache).

Checkpoint layout: the three ``.weight`` s are concatenated along dim 0 into ``qkv_proj.weight``
on load and split back on save; the biases into ``qkv_proj.bias``. A projection without a bias
next to ones with a bias (Whisper's ``k_proj``) gets zero rows in the merged bias
(:class:`ZeroFilledConcat`), which adds exactly nothing, and saving writes no bias for it: the
saved checkpoint is the source, byte for byte. Everything else (``o_proj``, ``q_norm``, ...) is
untouched.

Refused (``is_fusable`` is False), so they keep their original class:

- cross-attention: a module flagged ``is_cross_attention``, a class named ``*CrossAttention``,
  a ``forward`` that applies q and k/v to different inputs (BERT's ``BertCrossAttention``), a
  module at a cross-attention path (``encoder_attn``, ``cross_attn``, ...; never even offered:
  :data:`CROSS_ATTENTION_PATHS` is always in ``exclude_modules``), or k/v projections that read
  a different width than q;
- no triple, or more than one; a ``forward`` whose source cannot be read or that does not call
  the three projections itself;
- projections that are not plain ``nn.Linear`` (a subclass with its own ``forward``: quantised,
  LoRA, ``Conv1D``), or that are shared between q, k and v; tensors of different dtypes;
- modules that already have a ``qkv_proj`` (a single fused projection, as in the Qwen2-VL
  vision tower's ``qkv``, is not matched in the first place: it is no triple).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from pydantic import Field, field_validator
from torch import nn

from fusion_core import FamilyOptions, TransformOp
from fusion_core.plugin import (
    MergedProjectionsMixin,
    MergingFamily,
    PackedColwise,
    concat,
    is_plain_linear,
    merge_refusal,
)
from fusion_qkv.recognition import input_refusal, projection_triples

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
"""The names of the projections that transformers' tensor-parallel plans shard (``PackedColwise``)."""
MERGED = "qkv_proj"

#: Module paths never considered: the decoder's attention over encoder states in encoder-decoder
#: models (BART ``encoder_attn``, T5-style ``EncDecAttention``, ``cross_attn``, ``crossattention``).
#: Always part of ``exclude_modules`` (RE2 syntax: module-path patterns run in linear time).
CROSS_ATTENTION_PATHS = r"(?i)(?:encoder_attn|encdecattention|cross_?attn|cross_?attention)(?:\.|$)"


class QkvOptions(FamilyOptions):
    """Options of ``qkv``: the common ``target_modules`` / ``exclude_modules`` scoping.

    ``exclude_modules`` always includes :data:`CROSS_ATTENTION_PATHS`, whatever else is given.
    """

    exclude_modules: tuple[str, ...] = Field(
        default=(CROSS_ATTENTION_PATHS,),
        description="Regexes; module paths matching any of them are left alone (cross-attention paths always are).",
    )

    @field_validator("exclude_modules")
    @classmethod
    def _always_exclude_cross_attention(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        return patterns if CROSS_ATTENTION_PATHS in patterns else (*patterns, CROSS_ATTENTION_PATHS)


@dataclass(frozen=True)
class ZeroFilledConcat(TransformOp):
    """The biases of the parts at ``present`` -> one bias of ``sizes`` rows, zero where a part has none.

    A part without a bias computes ``x @ W^T``; zero rows in the merged bias add exactly nothing, so
    the merged GEMM stays exact. Inverse: the present parts' rows (copies); zero rows belong to no
    checkpoint tensor and are dropped, and rows that are no longer zero (trained) are refused, as
    the original layout has no tensor to hold them.
    """

    sizes: tuple[int, ...] = ()
    present: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.present or len(set(self.present)) != len(self.present) or not all(
            0 <= i < len(self.sizes) for i in self.present
        ):
            raise ValueError(f"present={self.present} must name distinct parts of sizes={self.sizes}")

    @property
    def arity(self) -> tuple[int, int]:  # type: ignore[override]
        return (len(self.present), 1)

    def forward_shapes(self, shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
        expected = [(self.sizes[i],) for i in self.present]
        if [tuple(shape) for shape in shapes] != expected:
            raise ValueError(f"bias shapes {[tuple(s) for s in shapes]} are not {expected}")
        return ((sum(self.sizes),),)

    def slices(self, shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, int, int], ...]:
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        return tuple((0, starts[i], self.sizes[i]) for i in self.present)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        given = dict(zip(self.present, tensors, strict=True))
        first = tensors[0]
        parts = [given[i] if i in given else first.new_zeros(size) for i, size in enumerate(self.sizes)]
        return (concat(parts, 0),)

    def inverse(
        self, tensors: Sequence[torch.Tensor], source_shapes: Sequence[tuple[int, ...]]
    ) -> tuple[torch.Tensor, ...]:
        (merged,) = tensors
        parts, start = {}, 0
        for index, size in enumerate(self.sizes):
            parts[index] = merged.narrow(0, start, size)
            start += size
        for index, part in parts.items():
            if index not in self.present and not part.is_meta and bool(part.ne(0).any()):
                raise ValueError(
                    f"rows of part {index} of the merged bias are not zero, but that projection has no bias in the "
                    "original layout: the values cannot be saved (was the merged bias trained?)"
                )
        return tuple(parts[i].clone() for i in self.present)


def projections(module: nn.Module) -> tuple[str, str, str] | None:
    """The names of ``module``'s q/k/v projection children, when it has exactly one such triple."""
    triples = projection_triples(module)
    return triples[0] if len(triples) == 1 else None


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` cannot run a merged q/k/v projection exactly and usefully; None when it can."""
    triples = projection_triples(module)
    if not triples:
        return "no q/k/v projection children (q_proj/k_proj/v_proj, query/key/value, q_lin/k_lin/v_lin, ...)"
    if len(triples) > 1:
        return f"several q/k/v projection triples: {triples}"
    names = triples[0]
    children = [cast(nn.Linear, module._modules[name]) for name in names]
    if getattr(module, "is_cross_attention", False) is True or "crossattention" in type(module).__name__.lower():
        return "cross-attention: q and k/v read different inputs"
    if not all(is_plain_linear(child) for child in children):
        return "a projection is not a plain nn.Linear"
    if len({id(child) for child in children}) != 3 or len({id(child.weight) for child in children}) != 3:
        return "projections share a module or a weight"
    if len({child.in_features for child in children}) != 1:
        return "k/v read a different width than q (cross-attention)"
    if hasattr(module, "num_random_blocks"):
        return ("block-sparse attention (BigBird): the model rebuilds it from its q/k/v children when an input is "
                "shorter than its blocks, so it stays unfused")
    return input_refusal(type(module), names) or merge_refusal(module, children, MERGED)


class QkvMixin(MergedProjectionsMixin):
    """The fused behaviour mixed into an attention subclass: q/k/v share one merged GEMM."""

    container = MERGED

    def merged_parts(self) -> tuple[str, ...] | None:
        """The instance's own q/k/v children, whatever their names."""
        return projections(self)


class QkvFamily(MergingFamily[QkvOptions]):
    """Attention q/k/v projections run as one merged projection (one GEMM instead of three)."""

    name = "qkv"
    options_model = QkvOptions
    fused_mixin = QkvMixin
    projections = PROJECTIONS
    container = MERGED
    #: Under a tensor-parallel plan with q_proj/k_proj/v_proj colwise, each rank merges its own heads.
    tensor_parallel = PackedColwise(PROJECTIONS, MERGED, unit="head_dim")
    target_modules_patterns = ()

    def parts(self, module: nn.Module) -> tuple[str, ...] | None:
        return projections(module)

    def candidate(self, module: nn.Module) -> bool:
        """A module with q/k/v-named projections."""
        return bool(projection_triples(module))

    def module_refusal(self, module: nn.Module) -> str | None:
        return refusal(module)

    def partial_bias(self, sizes: tuple[int, ...]) -> Callable[[tuple[int, ...]], TransformOp]:
        """Zero rows in the merged bias for a projection without one (Whisper's ``k_proj``)."""
        return lambda present: ZeroFilledConcat(sizes, present)
