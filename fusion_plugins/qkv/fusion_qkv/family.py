"""``qkv``: attention modules run their ``q_proj``/``k_proj``/``v_proj`` as one merged GEMM.

An attention module whose three projections are plain ``nn.Linear`` s reading the same hidden
states computes ``x @ [Wq; Wk; Wv]^T (+ [bq; bk; bv])`` once instead of three GEMMs
(grouped-query shapes, where k and v are narrower than q, included). The family does not copy
any architecture's attention ``forward``: the fused class keeps the original one, and its
``fusion_finalize`` replaces the three projection children by slices of one merged projection
(see :mod:`fusion_core.merged`). The q/k/v calls on the same input tensor share one GEMM; any
other call is answered from that projection's own rows, so the module computes what it
computed before, on every architecture and every code path (eager, sdpa, with or without a
cache).

Checkpoint layout: ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight`` are concatenated
along dim 0 into ``qkv_proj.weight`` on load and split back on save; the biases likewise when
all three have one. Everything else (``o_proj``, ``q_norm``, ...) is untouched.

Refused (``is_fusable`` is False), so they keep their original class:

- cross-attention: a module flagged ``is_cross_attention``, a class named ``*CrossAttention``,
  a module at a cross-attention path (``encoder_attn``, ``cross_attn``, ...; never even offered:
  :data:`CROSS_ATTENTION_PATHS` is always in ``exclude_modules``), or k/v projections that read
  a different width than q;
- projections that are not plain ``nn.Linear`` (a subclass with its own ``forward``: quantised,
  LoRA, ``Conv1D``), or that are shared between q, k and v;
- tensors of different dtypes, or a bias on some of the three projections but not all;
- modules that already have a ``qkv_proj`` (a single fused projection, as in the Qwen2-VL
  vision tower's ``qkv``, is not matched in the first place: it has no ``q_proj``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from torch import nn

from fusion_core import Concat, FamilyOptions, FusionFamily, WeightTransform
from fusion_core.merged import MergedProjectionsMixin, is_plain_linear, merge_refusal
from fusion_core.parallel.rules import PackedColwise

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
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



def refusal(module: nn.Module) -> str | None:
    """Why ``module`` cannot run a merged q/k/v projection exactly and usefully; None when it can."""
    children = [module._modules.get(name) for name in PROJECTIONS]
    if any(child is None for child in children):
        return "no q_proj/k_proj/v_proj children"
    if getattr(module, "is_cross_attention", False) is True or "crossattention" in type(module).__name__.lower():
        return "cross-attention: q and k/v read different inputs"
    if not all(is_plain_linear(child) for child in children):
        return "a projection is not a plain nn.Linear"
    if len({id(child) for child in children}) != 3 or len({id(child.weight) for child in children}) != 3:
        return "projections share a module or a weight"
    if len({child.in_features for child in children}) != 1:
        return "k/v read a different width than q (cross-attention)"
    biases = [child.bias for child in children]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return "a bias on some projections but not all"
    return merge_refusal(module, children, MERGED)


class QkvMixin(MergedProjectionsMixin):
    """The fused behaviour mixed into an attention subclass: q/k/v share one merged GEMM."""

    projections = PROJECTIONS
    container = MERGED


class QkvFamily(FusionFamily[QkvOptions]):
    """Attention q_proj/k_proj/v_proj run as one merged projection (one GEMM instead of three)."""

    name = "qkv"
    options_model = QkvOptions
    fused_mixin = QkvMixin
    #: Under a tensor-parallel plan with q_proj/k_proj/v_proj colwise, each rank merges its own heads.
    tensor_parallel = PackedColwise(PROJECTIONS, MERGED, unit="head_dim")
    target_modules_patterns = ()

    def is_fusable(self, module: nn.Module, options: QkvOptions) -> bool:
        return refusal(module) is None

    def refusal(self, module: nn.Module, options: QkvOptions) -> str | None:
        """The reason for a module with the projections this family merges; None for the rest."""
        return refusal(module) if all(name in module._modules for name in PROJECTIONS) else None

    def make_transforms(self, config: Any, options: QkvOptions) -> list[WeightTransform]:
        return [
            WeightTransform(tuple(f"{p}.weight" for p in PROJECTIONS), (f"{MERGED}.weight",), Concat(n=3, dim=0)),
            WeightTransform(
                tuple(f"{p}.bias" for p in PROJECTIONS), (f"{MERGED}.bias",), Concat(n=3, dim=0), optional=True
            ),
        ]
