"""The attention of a decode step (one new token a sequence) with the fewest operators: the queries, keys and values
with their rotary embedding (one call of :mod:`fusion_linear_kernels.projection_kernel` where the ``qkv`` family or the
checkpoint merged them and their kind runs the GEMV kernel; else the layer's own projections and torch operators), the
cache's own ``update``, one call of a C++ kernel over the cache (:mod:`fusion_linear_kernels.attention_kernel`;
torch's ``scaled_dot_product_attention`` where it cannot take the call) and the output projection (the GEMV kernel on
its weight where the layer's MLP would run it, else the module).

transformers' attention module runs about thirty operators and several Python wrappers around its two GEMVs at a
decode step (views and transposes of each projection, ``rotate_half`` twice, the attention interface's lookup and
checks, a ``contiguous`` copy), and torch's flash kernel runs a single query row as it runs a prompt. Measured on the
2-core AMD EPYC (AVX2; transformers 5.25.0, bf16, Qwen2-0.5B with every family on; ``benchmarks/bench_decode.py``'s
``(no decode attention)`` contender side by side, docs/benchmarks.md, "The decode step's own attention"): 38.8
against 40.9 ms a token at 16 to 48 cached tokens, 55.7 against 84.9 at 1024. A switched decoder layer's decode step
(:mod:`fusion_linear_kernels.decode_layer`) calls :meth:`AttentionForm.run` in place of its attention module where the
attention's form verified at load, and the module itself where ``run`` declines.

**Which attentions.** A module with ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` children (and a merged projection
of the ``qkv`` family's, which the parts read), or with ``qkv_proj`` and ``o_proj`` where the checkpoint holds q, k and
v merged (Phi-3's: :data:`MERGED_PROJECTIONS`), and RMSNorms of the queries and keys or not (:data:`NORMS`: Qwen3's and
Gemma 3's over each head, OLMo 2's over all), no other children, parameters or buffers, an integer ``head_dim`` and
``layer_idx``, a float ``scaling`` and a forward that takes ``position_embeddings``, ``attention_mask`` and the cache
(``cache``, or ``past_key_values`` before transformers 5.x renamed it). Names are only the pre-filter: each form is
verified once per load (:func:`verified`) on its real weights against the module's own forward, with a cache
transformers builds: the cache's new keys and values bit for bit (the rotary embedding rounds as transformers'
``apply_rotary_pos_emb`` does: ``x * cos + rotate_half(x) * sin``, each product rounded to the dtype; with norms of the
queries and keys, the keys within the bound, as the projection kernel's norms sum in another order than torch's), the
output within the bound (:func:`~fusion_linear_kernels.layer_forms.tolerance`: the kernel sums in another order than
torch's), on cached keys of two scales (:data:`_SPREAD`, :data:`_SATURATING`: the larger saturates a cap on the scores).
Sinks (a parameter of the attention's own) are refused by name; a rotary embedding over part of the head or interleaved
(GLM) fails the keys' check. Their attention runs as the module.

**Implementations and soft caps.** A form is verified under the attention implementation its model runs, ``sdpa`` or
``eager`` (:data:`IMPLEMENTATIONS`), and runs under that one only. Where the attention soft-caps its scores as Gemma
2's does (``cap * tanh(score / cap)``, the cap read from :data:`SOFTCAP`; transformers 5.x runs Gemma 2 under
``eager``, as ``sdpa`` cannot cap), the kernel caps them too; verification on the larger scale of keys proves the cap
(a step without it differs from the forward by far more than the bound: ``test_decode_attention.py``). Where the
forward does not cap after all (``sdpa`` ignored the cap until transformers 5.x refused it: Gemma 2 ran ``sdpa`` by
default on 4.57 to 5.16 at least), the form verified is the uncapped one.

**When it runs.** Besides what the layer's step requires: one new token a sequence (``[batch, 1, hidden]``), the
rotation's cosines and sines of the shape verified (``[batch or 1, 1, head_dim]``, the dtype's), no attention mask
or one of one query row a sequence that leaves each sequence a key (:func:`_scores_bias`: boolean, as ``sdpa`` takes
it, or added to the scores, as ``eager`` adds it; padding hides keys, and the kernel neither reads nor weighs a key a
boolean mask hides), the attention implementation verified, a ``DynamicCache`` whose layer holds keys already in a
``DynamicLayer`` or a sliding window's ``DynamicSlidingWindowLayer`` (not offloaded, not quantized), the verified
module types in place, no hooks on the attention module, no arguments but those listed in :data:`KNOWN`
(``output_attentions`` false). Any other call runs the module.

**Sliding windows.** A sliding window's attention (Mistral's, Gemma 3's local layers, Qwen2's upper layers) computes as
a full one over the keys its cache layer hands back: the window lives in the cache (it keeps the window's last keys) and
in the mask (which, at a one-token step, hides none of them), while ``sdpa`` ignores the module's ``sliding_window``. So
the step runs it as it runs any other: the cache's ``update`` (its growth in a buffer,
:mod:`fusion_linear_kernels.cache_growth`, where it can), then attention over what that returns. Before, such a layer
ran as its module at every step, though a prompt inside the window passes no mask (a tiny Mistral of the default
4096-token window, 5.25.0: 47 of 47 steps' attentions).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusion_core.plugin import merged_projection
from fusion_linear_kernels import attention_kernel, cache_growth, compat, projection_kernel, row_dot, step_kernel
from fusion_linear_kernels.choice import generation
from fusion_linear_kernels.layer_forms import epsilon, norm_kind, relative, tolerance
from fusion_linear_kernels.row_dot import stand_in
from fusion_linear_kernels.step_blocks import block, module_block, undecided

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The children a verified attention computes with (with a hook on any of them, all are called as modules)."""
NORMS = ("q_norm", "k_norm")
"""The RMSNorms of the queries and the keys an attention may hold besides its projections (Qwen3's and Gemma 3's
over each head, OLMo 2's over all of them), applied to the projections' outputs before the rotary embedding."""
MERGED_PROJECTIONS = ("qkv_proj", "o_proj")
"""The children of an attention whose checkpoint holds q, k and v merged (Phi-3's): the queries', then the keys', then
the values' rows, as many key as value heads (the attention's ``num_key_value_heads``)."""
CACHE_NAMES = ("cache", "past_key_values")
"""The names of the attention forward's cache argument: transformers 5.x's, then 4.x's (5.x still accepts it)."""
KNOWN = frozenset({"position_embeddings", "attention_mask", *CACHE_NAMES, "cache_position", "position_ids",
                   "use_cache", "output_attentions", "output_router_logits", "logits_to_keep"})
"""The arguments a decoder layer passes its attention that :meth:`AttentionForm.run` reads or may ignore at a decode
step (positions are in the rotary embedding already; the dynamic cache appends whatever the position; a mixture of
experts' layer passes on its router's flag, and some models pass ``generate``'s ``logits_to_keep`` down to every layer:
the attention's forward ignores both)."""
IMPLEMENTATIONS = ("sdpa", "eager")
"""The attention implementations a form may be verified under (transformers' ``_attn_implementation``). A call under
another than the one verified runs the module: implementations compute otherwise (5.x's Gemma 2 soft-caps its scores
under ``eager`` and refuses ``sdpa``)."""
SOFTCAP = "attn_logit_softcapping"
"""The attention's attribute holding the soft cap of its scores (Gemma 2's: ``cap * tanh(score / cap)`` before the
softmax), None for none; verification proves the step caps them as the forward does."""
_PRIOR = 3
"""The tokens verification puts in the cache before its decode step."""
_SPREAD = 16.0
"""The scale of the cached keys and values verification draws: scores and outputs far from zero, so that what a
forward does to large values (a cap on its output: ``test_decode_attention.py``) shows beyond the bound."""
_SATURATING = 1024.0
"""The scale of the cached keys and values of verification's second call: scores far beyond any soft cap's (Gemma 2's
50), where a capped softmax spreads its weight over the keys at the cap and an uncapped one takes the largest, so a
forward that caps them and a step that does not (or the other way) differ (:func:`_differs`)."""


@functools.cache
def _cache_types() -> tuple[type, tuple[type, ...]] | None:
    """transformers' ``DynamicCache`` and the layer classes a dynamic cache appends to (``DynamicLayer``, and
    ``DynamicSlidingWindowLayer``: a sliding window's layer, which keeps the window's last keys and hands the caller of
    its ``update`` those and the new ones), or None where this transformers has no cache layers (before 4.56)."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return None
    from transformers import cache_utils

    sliding = getattr(cache_utils, "DynamicSlidingWindowLayer", None)
    return DynamicCache, (DynamicLayer,) if sliding is None else (DynamicLayer, sliding)


def _scores_bias(mask: object, batch: int) -> tuple[bool, torch.Tensor | None]:
    """Whether a one-token step of ``batch`` rows takes its attention mask, and what the mask adds to the scores of the
    keys the cache hands back, as the attention kernel adds it (float32 ``[batch or 1, length]``, ``-inf`` hiding a
    key), or None where it hides none.

    The step takes no mask (transformers passes none where no position is hidden), and a mask of one query row a
    sequence (``[batch or 1, 1, 1, length]``) that leaves each sequence a key: boolean (``sdpa``'s: false hides a key,
    as padding does, and a full sliding window's is true throughout), or added to the scores (``eager``'s: its minimum
    hides a key, zeros none). Any other mask (one a head, one hiding every key of a sequence) is the module's to run."""
    if mask is None:
        return True, None
    if not (type(mask) is torch.Tensor and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
            and mask.shape[0] in (1, batch)):
        return False, None
    if mask.dtype is torch.bool:
        if bool(mask.all()):
            return True, None
        visible = mask.reshape(mask.shape[0], -1)
        if not bool(visible.any(dim=-1).all()):
            return False, None
        return True, torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))
    if not mask.is_floating_point():
        return False, None
    if not bool(mask.any()):
        return True, None
    bias = mask.reshape(mask.shape[0], -1).float()
    return bool((bias > float("-inf")).any(dim=-1).all()), bias


class AttentionForm:
    """What a verified attention's decode step reads: its layer index in the cache, the head width, the softmax scale,
    the name of its forward's cache argument and the types of the modules it calls (verified once per load)."""

    __slots__ = ("_kept", "cache_name", "head_dim", "implementation", "layer_idx", "norms", "scaling", "sizes",
                 "softcap", "types")

    def __init__(self, layer_idx: int, head_dim: int, scaling: float, cache_name: str,
                 types: tuple[type, ...], sizes: tuple[int, int, int] | None = None,
                 norms: tuple[float, bool] | None = None, softcap: float | None = None,
                 implementation: str = "sdpa") -> None:
        self.layer_idx, self.head_dim, self.scaling = layer_idx, head_dim, scaling
        self.cache_name, self.types, self.sizes, self.norms = cache_name, types, sizes, norms
        self.softcap, self.implementation = softcap, implementation
        self._kept: dict[int, tuple[int, tuple[int | None, int | None]]] = {}  # rows -> (generation, blocks)

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.layer_idx, self.head_dim, self.scaling, self.cache_name, self.types, self.sizes, self.norms,
                self.softcap, self.implementation)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def key(self, dtype: torch.dtype, width: int) -> tuple[Any, ...]:
        """What two attentions of one verdict share, for inputs of ``dtype`` and ``width``."""
        return self.types, self.head_dim, self.scaling, self.cache_name, dtype, width

    @staticmethod
    def types_of(attention: nn.Module) -> tuple[type, ...]:
        """The attention's type and its children's, in order: what a call checks is still in place."""
        return (type(attention), *(type(child) for child in attention._modules.values()))

    @classmethod
    def of(cls, attention: nn.Module) -> AttentionForm | str:
        """The form of ``attention`` as it is now, or why it has none (before verification)."""
        children = attention._modules
        merged = merged_projection(attention)
        names = MERGED_PROJECTIONS if merged is None and "qkv_proj" in children else PROJECTIONS
        normed = all(name in children for name in NORMS)
        others = [name for name in children if name not in names and not (normed and name in NORMS)
                  and not (merged is not None and children[name] is merged.owner)]
        if not all(isinstance(children.get(name), nn.Module) for name in names) or others:
            return f"not an attention of q/k/v/o projections alone, nor of qkv and o (children {list(children)})"
        if attention._parameters or attention._buffers:
            return "the attention holds parameters or buffers of its own (sinks, scales)"
        values = attention.__dict__
        layer_idx, head_dim, scaling = values.get("layer_idx"), values.get("head_dim"), values.get("scaling")
        if not (type(layer_idx) is int and type(head_dim) is int and head_dim % 2 == 0 and type(scaling) is float):
            return "no integer layer_idx and even head_dim, or no float scaling"
        parameters = inspect.signature(type(attention).forward).parameters
        cache_name = next((name for name in CACHE_NAMES if name in parameters), None)
        if cache_name is None or not {"position_embeddings", "attention_mask"} <= parameters.keys():
            return "its forward takes no position_embeddings, attention_mask and cache"
        sizes = None
        if names is MERGED_PROJECTIONS:
            rows, kv_heads = getattr(children["qkv_proj"], "out_features", None), values.get("num_key_value_heads")
            if not (type(rows) is int and type(kv_heads) is int and rows > 2 * kv_heads * head_dim):
                return "its merged qkv_proj has no out_features, or the attention no num_key_value_heads"
            sizes = (rows - 2 * kv_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        norms = _norms(children["q_norm"], children["k_norm"], head_dim) if normed else None
        if isinstance(norms, str):
            return norms
        implementation = compat.attention_implementation(attention)
        if implementation not in IMPLEMENTATIONS:
            return f"its attention implementation is {implementation!r}, not one of {IMPLEMENTATIONS}"
        softcap = values.get(SOFTCAP)
        if softcap is not None and not (type(softcap) in (int, float) and softcap > 0):
            return f"its {SOFTCAP} is {softcap!r}, not a positive number"
        return cls(layer_idx, head_dim, scaling, cache_name, cls.types_of(attention), sizes, norms,
                   None if softcap is None else float(softcap), implementation)

    def run(self, attention: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The attention's output for ``hidden`` (its input, normed) at a decode step, or None where the call is not
        one the step runs (see the module docs): the caller then calls the module."""
        taken = self._taken(attention, hidden, kwargs)
        return None if taken is None else self._attend(attention, hidden, *taken)

    def in_one_call(self, attention: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What the layer's one-call step (:mod:`fusion_linear_kernels.step_kernel`) reads of this attention for a
        decode step of ``hidden`` (the layer's input: the normed input's shape and dtype), or None where the step's
        attention would not run its kernels throughout (a projection as a module, torch's attention, the layer's own
        ``update``): the tensors, then the floats and the integers the kernel takes after the layer's. Where not None,
        the cache already holds the new token's keys and values as views over room the kernel fills, and the caller
        must run the kernel at once."""
        cache = next((kwargs[name] for name in CACHE_NAMES if kwargs.get(name) is not None), None)
        layers = cache.__dict__.get("layers") if cache is not None else None
        if not (isinstance(layers, list) and len(layers) > self.layer_idx
                and cache_growth.grows(type(layers[self.layer_idx]))):
            return None  # first, as the step's attention then checks the call again: a layer of its own update
        taken = self._taken(attention, hidden, kwargs)
        dtype = hidden.dtype
        if taken is None or step_kernel.kernel(dtype) is None:
            return None
        cos, sin, cache, mask, bias = taken
        blocks = self._blocks(attention, hidden)
        merged = self._merged(attention) if blocks is not None and None not in blocks else None
        o_proj = attention._modules["o_proj"]
        if (merged is None or not self._kernel_reads(attention, merged, dtype) or not _read(o_proj, dtype)
                or (mask is not None and mask.shape[-1] != cache.layers[self.layer_idx].keys.shape[-2] + 1)):
            return None
        (owner, sizes), width, batch = merged, self.head_dim, hidden.shape[0]
        weight, qkv_bias = owner._parameters["weight"], owner._parameters.get("bias")
        o_weight, o_bias = o_proj._parameters["weight"], o_proj._parameters.get("bias")
        room = cache_growth.reserve(cache, self.layer_idx, (batch, sizes[1] // width, 1, width), dtype, hidden.device)
        if room is None:
            return None
        key_buffer, value_buffer, length = room
        modules = attention._modules
        q_norm, k_norm = ((modules["q_norm"]._parameters["weight"], modules["k_norm"]._parameters["weight"])
                          if self.norms is not None else (weight, weight))
        eps, plus_one = self.norms if self.norms is not None else (0.0, False)
        widths = (q_norm.numel(), k_norm.numel()) if self.norms is not None else (0, 0)
        return ((weight, stand_in(qkv_bias, weight), cos.contiguous(), sin.contiguous(), q_norm, k_norm, key_buffer,
                 value_buffer, stand_in(bias, hidden).contiguous(), o_weight, stand_in(o_bias, o_weight)),
                (eps, self.scaling, self.softcap or 0.0),
                (sizes[0] // width, sizes[1] // width, width, cos.numel() // width, qkv_bias is not None, blocks[0],
                 *widths, plus_one, length, key_buffer.stride(0), key_buffer.stride(1), bias is not None,
                 0 if bias is None or bias.shape[0] == 1 else length + 1, o_bias is not None, blocks[1]))

    def _taken(self, attention: nn.Module, hidden: torch.Tensor,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor | None,
                                                torch.Tensor | None] | None:
        """The rotation's cosines and sines, the cache, the mask and what it adds to the scores where the step takes
        this call (see the module docs), else None."""
        if (kwargs.keys() - KNOWN or kwargs.get("output_attentions") or hidden.dim() != 3 or hidden.shape[1] != 1
                or compat.forward_hooks((attention,)) or self.types_of(attention) != self.types):
            return None
        mask = kwargs.get("attention_mask")
        takes, bias = _scores_bias(mask, hidden.shape[0])  # after the checks above: it reduces the mask
        if not takes:
            return None
        caches = [kwargs[name] for name in CACHE_NAMES if kwargs.get(name) is not None]
        embeddings = kwargs.get("position_embeddings")
        types = _cache_types()
        if len(caches) != 1 or types is None or not isinstance(embeddings, tuple) or len(embeddings) != 2:
            return None
        (cache,), (cache_type, layer_types) = caches, types
        layers = cache.__dict__.get("layers") if type(cache) is cache_type else None
        if (not isinstance(layers, list) or len(layers) <= self.layer_idx or cache.__dict__.get("offloading")
                or type(layers[self.layer_idx]) not in layer_types or not layers[self.layer_idx].is_initialized
                or compat.attention_implementation(attention) != self.implementation):
            return None  # another implementation computes otherwise than the one verified
        cos, sin = embeddings
        if not (type(cos) is torch.Tensor and type(sin) is torch.Tensor and cos.dtype is hidden.dtype
                and sin.dtype is hidden.dtype and cos.shape == sin.shape and cos.dim() == 3
                and cos.shape[0] in (1, hidden.shape[0]) and cos.shape[1:] == (1, self.head_dim)):
            return None  # not [batch, 1, head_dim], as verified (multimodal rotations: one a section)
        return cos, sin, cache, mask, bias

    def _attend(self, attention: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Any, mask: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        modules = attention._modules
        batch, width = hidden.shape[0], self.head_dim
        blocks = self._blocks(attention, hidden)
        merged = self._merged(attention) if blocks is not None and blocks[0] is not None else None
        if merged is not None and self._kernel_reads(attention, merged, hidden.dtype):
            owner, sizes = merged
            norms = None
            if self.norms is not None:
                eps, plus_one = self.norms
                norms = projection_kernel.Norms(modules["q_norm"]._parameters["weight"],
                                                modules["k_norm"]._parameters["weight"], eps, plus_one)
            query, key, value = projection_kernel.project(
                hidden.reshape(batch, -1).contiguous(), owner._parameters["weight"], owner._parameters.get("bias"),
                cos.contiguous(), sin.contiguous(), sizes[0] // width, sizes[1] // width, width, blocks[0], norms)
            keys, values = cache_growth.append(cache, self.layer_idx, key, value)
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            parts = list(modules["qkv_proj"](hidden).split(self.sizes, dim=-1) if self.sizes is not None
                         else (modules[name](hidden) for name in PROJECTIONS[:3]))
            if self.norms is not None:  # each over a head (the module's input [batch, 1, heads, width]) or all
                parts[:2] = (norm(part.view(batch, 1, -1, width)) if norm.weight.numel() == width else norm(part)
                             for norm, part in zip((modules["q_norm"], modules["k_norm"]), parts, strict=False))
            query, key, value = (part.view(batch, 1, -1, width).transpose(1, 2) for part in parts)
            keys, values = cache_growth.append(cache, self.layer_idx, _rotated(key, cos, sin), value)
            query = _rotated(query, cos, sin)
        if mask is not None and mask.shape[-1] != keys.shape[-2]:  # not this cache's keys: the module's computation
            attended = None
        else:
            attended = attention_kernel.attend(query, keys, values, self.scaling, self.softcap, bias)
            mask = mask if bias is not None else None  # where it hides no key, torch's runs without it
        if attended is None:
            attended = self._torch_attention(query, keys, values, mask).transpose(1, 2).reshape(batch, 1, -1)
        o_proj = modules["o_proj"]
        if blocks is not None and blocks[1] is not None and _read(o_proj, hidden.dtype):
            return row_dot.gemv(attended, o_proj._parameters["weight"], o_proj._parameters.get("bias"), blocks[1])
        output: torch.Tensor = modules["o_proj"](attended)
        return output

    def _torch_attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
        """The attention where the kernel cannot take the call, computed as the implementation verified computes it:
        torch's ``scaled_dot_product_attention``, or ``eager``'s operators (transformers' ``eager_attention_forward``:
        the scores in the dtype, soft-capped where the attention caps them, plus the mask, a float32 softmax rounded
        to the dtype, then the values), so that the step gives the module's bits."""
        if self.implementation == "sdpa" and self.softcap is None:
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=query.shape[1] != keys.shape[1])
        group = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.matmul(query, keys.transpose(2, 3)) * self.scaling
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype is torch.bool else scores + mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, values)

    def _merged(self, attention: nn.Module) -> tuple[nn.Module, tuple[int, ...]] | None:
        """The module holding the attention's q/k/v projection merged, and the queries', keys' and values' widths in
        its rows: the checkpoint's ``qkv_proj``, or the ``qkv`` family's container while it runs merged; None where
        the projections are apart (or the widths are not whole heads, as many key as value heads)."""
        if self.sizes is not None:
            return attention._modules["qkv_proj"], self.sizes
        merged = merged_projection(attention)
        if (merged is None or not merged.merging or len(merged.sizes) != 3 or merged.sizes[1] != merged.sizes[2]
                or any(size % self.head_dim for size in merged.sizes)):
            return None
        return merged.owner, merged.sizes

    def _kernel_reads(self, attention: nn.Module, merged: tuple[nn.Module, tuple[int, ...]],
                      dtype: torch.dtype) -> bool:
        """Whether the projection kernel reads the merged projection's weight and bias (:func:`_read`) and the norms of
        the queries and keys (none, or dense weights of the dtype, each a head's width or its part's) as the modules
        hold them now: checked at every call, as the blocks are kept and a weight may be replaced after."""
        owner, sizes = merged
        if not _read(owner, dtype):
            return False
        if self.norms is None:
            return True
        weights = [attention._modules[name]._parameters.get("weight") for name in NORMS]
        return all(isinstance(weight, torch.Tensor) and _dense(weight) and weight.dtype is dtype
                   and weight.numel() in (self.head_dim, size) for weight, size in zip(weights, sizes, strict=False))

    def _blocks(self, attention: nn.Module, hidden: torch.Tensor) -> tuple[int | None, int | None] | None:
        """The GEMV blocks the step runs its merged q/k/v projection and its output projection with in C++, each None
        where that projection runs as its module; None where a child is hooked.

        The q/k/v projection runs in C++ (:mod:`fusion_linear_kernels.projection_kernel`) only where its module would
        run the same kernel (:func:`~fusion_linear_kernels.step_blocks.module_block`), so the cached keys and values
        are the module's bit for bit; the output projection wherever the layer's MLP would
        (:func:`~fusion_linear_kernels.step_blocks.block`). Kept per input rows for the decisions' generation once
        every kind is decided (until then the modules run, and their first calls decide)."""
        modules = attention._modules
        if compat.forward_hooks(modules.values()):
            return None
        rows, current = hidden.shape[0], generation()
        kept = self._kept.get(rows)
        if kept is not None and kept[0] == current:
            return kept[1]
        settled, qkv, output = True, None, None
        merged = self._merged(attention)
        if (merged is not None and projection_kernel.kernel(hidden.dtype) is not None
                and self._kernel_reads(attention, merged, hidden.dtype)):
            x = hidden.reshape(rows, -1)
            weight, bias = merged[0]._parameters["weight"], merged[0]._parameters.get("bias")
            settled, qkv = not undecided(x, weight, bias), module_block(x, weight, bias)
        o_proj = modules["o_proj"]
        if isinstance(o_proj, nn.Linear) and _read(o_proj, hidden.dtype):
            weight, bias = o_proj._parameters["weight"], o_proj._parameters.get("bias")
            # Its input is the attention's output, not at hand: a random one of its shape (where the one-row fallback
            # measures, it checks its candidates' outputs on this input, which zeros would not test).
            attended = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            settled, output = settled and not undecided(attended, weight, bias), block(attended, weight, bias)
        blocks = (qkv, output)
        if settled:
            self._kept[rows] = (current, blocks)
        return blocks


def _norms(query: nn.Module, key: nn.Module, width: int) -> tuple[float, bool] | str:
    """The epsilon of the norms of the queries and keys, and whether they multiply by 1 + the weight (Gemma's), or
    why they are not RMSNorms the step computes (one epsilon, one kind, each over a head or all the heads)."""
    epsilons = {epsilon(query), epsilon(key)}
    weights = [norm._parameters.get("weight") for norm in (query, key)]
    if None in epsilons or len(epsilons) != 1 or not all(isinstance(w, torch.Tensor) and w.dim() == 1 for w in weights):
        return "its norms of the queries and keys hold no 1-D weight and one epsilon (variance_epsilon or eps)"
    (eps,) = epsilons
    tensors = [w for w in weights if isinstance(w, torch.Tensor)]
    kinds = {norm_kind(norm, w.dtype, eps, w.numel()) for norm, w in zip((query, key), tensors, strict=True)}
    if None in kinds or len(kinds) != 1 or any(w.numel() % width for w in tensors):
        return "its norms of the queries and keys are not RMSNorms (Llama's or Gemma's) over heads, both alike"
    (plus_one,) = kinds
    return eps, bool(plus_one)


def _read(projection: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the GEMV kernel reads ``projection``'s weight and bias as they are now (checked at every call: the blocks
    are kept, and a weight may be replaced after they were worked out)."""
    weight, bias = projection._parameters.get("weight"), projection._parameters.get("bias")
    return (isinstance(weight, torch.Tensor) and row_dot.gemv_weight(weight) and weight.dtype is dtype
            and (bias is None or (_dense(bias) and bias.dtype is dtype)))


def _dense(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter) and tensor.is_cpu and tensor.is_contiguous()


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` (``[batch, heads, tokens, head_dim]``) with the halves of the head rotated, each
    product rounded to the dtype, as transformers' ``apply_rotary_pos_emb`` rounds."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def verified(attention: nn.Module, dtype: torch.dtype, width: int) -> AttentionForm | str:
    """The form of ``attention`` (on its loaded weights, in eval mode, inputs ``width`` wide) where its decode step
    gives the module's forward's keys and values bit for bit (the keys within the bound where the attention norms
    them: :mod:`~fusion_linear_kernels.projection_kernel`) and its output within the bound, or why not.

    Both run one token on a copy of one dynamic cache holding :data:`_PRIOR` random keys and values, on a random
    rotation. The cache is filled through its own ``update``, not the forward, so no GEMV of another row count than a
    decode step's is decided at load. The step runs once before, on a third copy: its first call runs the modules,
    whose kinds that decides, so the call verified runs the projections in C++ wherever decode will.
    """
    form = AttentionForm.of(attention)
    types = _cache_types()
    if isinstance(form, str) or types is None:
        return form if isinstance(form, str) else "this transformers has no dynamic cache layers"
    generator = torch.Generator().manual_seed(0)
    angles = torch.rand(1, 1, form.head_dim, generator=generator) * 6.0
    hidden = torch.randn(1, 1, width, generator=generator).to(dtype)
    step = {"position_embeddings": (angles.cos().to(dtype), angles.sin().to(dtype)), "attention_mask": None,
            "cache_position": torch.tensor([_PRIOR])}
    cache_type, _ = types
    try:
        with torch.no_grad():
            heads = (form.sizes[1] if form.sizes is not None
                     else attention._modules["k_proj"](hidden).shape[-1]) // form.head_dim
            prior = torch.randn(2, 1, heads, _PRIOR, form.head_dim, generator=generator)
    except Exception as exc:  # any failure means the form is not this one
        return f"its forward or the decode step's attention does not run on a dynamic cache ({exc!r:.120})"
    def why_not(candidate: AttentionForm) -> str | None:
        why = _differs(attention, candidate, hidden, step, (prior * _SPREAD).to(dtype), cache_type)
        if why is None:
            why = _differs(attention, candidate, hidden, step, (prior * _SATURATING).to(dtype), cache_type,
                           saturating=True)
        return why

    why = why_not(form)
    if why is not None and form.softcap is not None:
        uncapped = _toggled(form)
        if why_not(uncapped) is None:
            return uncapped  # the forward does not cap: sdpa ignored the attention's cap until 5.x refused it
    return form if why is None else why


def caches_for(attention: nn.Module, form: AttentionForm, dtype: torch.dtype, count: int,
               generator: torch.Generator) -> list[Any] | str:
    """``count`` dynamic caches holding the same :data:`_PRIOR` random keys and values of ``dtype`` (of
    :data:`_SPREAD`'s scale) at the attention's layer, for a check of a decode step on them; or why there are none
    (this transformers has no cache layers, the attention's q/k/v projection is not merged)."""
    types, merged = _cache_types(), form._merged(attention)
    if types is None or merged is None:
        return "this transformers has no dynamic cache layers, or the attention's q/k/v projection is not merged"
    heads = merged[1][1] // form.head_dim
    prior = (torch.randn(2, 1, heads, _PRIOR, form.head_dim, generator=generator) * _SPREAD).to(dtype)
    return _filled(types[0], prior, form.layer_idx, count)


def _filled(cache_type: type, prior: torch.Tensor, layer_idx: int, count: int) -> list[Any]:
    """``count`` caches of ``cache_type``, each holding a copy of ``prior``'s keys and values (``prior[0]``,
    ``prior[1]``) at ``layer_idx``, written through the cache's own ``update``."""
    caches = [cache_type() for _ in range(count)]
    for cache in caches:
        cache.update(prior[0].clone(), prior[1].clone(), layer_idx)
    return caches


def _differs(attention: nn.Module, form: AttentionForm, hidden: torch.Tensor, step: dict[str, Any],
             prior: torch.Tensor, cache_type: type, saturating: bool = False) -> str | None:
    """Why the step differs from the module's forward on a cache holding ``prior``'s keys and values, or None.

    ``saturating``: scores far beyond a soft cap's (:data:`_SATURATING`). There ``eager``'s scores, rounded to the
    dtype near the cap, may put the forward beyond the bound of a step that computes the same thing in float32 (2.1%
    of the largest element on a Gemma 2 of random weights, against a bound of 1.6%), so the output may instead be
    far closer to the step's than to the step's with the cap turned the other way (:func:`_toggled`): what this scale
    is there to tell apart."""
    forward, dtype = type(attention).forward, hidden.dtype
    try:
        with torch.no_grad():
            caches = _filled(cache_type, prior, form.layer_idx, 3)
            if not saturating:  # the first call: its modules decide their kinds ...
                form.run(attention, hidden, {**step, form.cache_name: caches[2]})
            result = forward(attention, hidden, **step, **{form.cache_name: caches[0]})
            got = form.run(attention, hidden, {**step, form.cache_name: caches[1]})  # ... so this runs what decode does
            other = _toggled(form).run(attention, hidden, {**step, form.cache_name: caches[2]}) if saturating else None
    except Exception as exc:  # any failure means the form is not this one
        return f"its forward or the decode step's attention does not run on a dynamic cache ({exc!r:.120})"
    expected = result[0] if isinstance(result, tuple) else result
    if got is None or not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return "the decode step's attention does not run on the verification's step"
    expected_layer, got_layer = (cache.layers[form.layer_idx] for cache in caches[:2])
    keys_match = (torch.equal(expected_layer.keys, got_layer.keys) if form.norms is None  # see projection_kernel
                  else relative(expected_layer.keys, got_layer.keys) <= tolerance(dtype))
    if not (keys_match and torch.equal(expected_layer.values, got_layer.values)):
        return "its cached keys or values differ (another rotary embedding, norms of the keys, another projection)"
    difference = relative(expected, got)
    if difference > tolerance(dtype) and not (other is not None and difference * 8 < relative(expected, other)):
        return f"the decode step's attention differs from the forward's by {difference:.3g} of its largest element"
    return None


def _toggled(form: AttentionForm) -> AttentionForm:
    """``form`` with its soft cap turned the other way: none where it caps, else one of 1 (which every score beyond a
    few units saturates, as any cap far below the scores does)."""
    other = copy.copy(form)
    other.softcap = None if form.softcap is not None else 1.0
    return other
