"""A decoder layer's decode step (one to eight rows) with its norms, MLP and residuals in one kernel call each side of
the attention.

Eager decode pays for every operator and module call between the GEMVs in Python and torch's dispatch, once per layer
per token: transformers' pre-norm layer runs an RMSNorm (six operators), the attention, a residual add, a second
RMSNorm, the MLP (two or three projections, the activation, a product) and a second residual add. On a 2-core Xeon VM
(AMX-BF16, transformers 5.25.0, bf16) that was about 0.5 ms a layer around the kernels, a third of Qwen2-0.5B's step
with every family on. Here a layer ``linear_kernels`` recognises runs, at a step of one to eight rows (a token of one
to eight sequences, a short prompt, the draft tokens assisted generation checks):

1. one call of a C++ kernel for the input RMSNorm;
2. the attention: at a one-token step of an attention whose form verified at load, the step's own
   (:mod:`fusion_linear_kernels.decode_attention`: the layer's projections, the rotary embedding, the dynamic cache's
   ``update``, a C++ kernel over the cache); else the layer's attention module, called as the original forward calls
   it;
3. one call for the rest: the residual add, the MLP's input norm, the gate and up GEMVs, the activation and the
   product, the down GEMV and the second residual add (in the sandwich form, the attention's and the MLP's outputs
   normed before their residuals).

The GEMVs are the ones :mod:`fusion_linear_kernels.row_dot` builds (the same C++ templates, compiled into this kernel),
run with the block each projection's kind decided (:func:`~fusion_linear_kernels.choice.decided`: ``row-dot``,
``blocked-rows``, ``few-rows`` or ``few-rows-blocked``), so they give the bits the layer's own modules give (a one-row
kind decided for ``torch.mv`` or ``F.linear`` runs the faster of the kernel's one-row blocks:
:func:`~fusion_linear_kernels.step_blocks.block`). The norms, the activation and the residuals round to the model's
dtype where transformers' operators do (a float32 mean of squares; Llama's norm rounds the normalised input, then
multiplies by the weight, Gemma's multiplies by 1 + the weight in float32 and rounds once; the activation in float32
vectors with torch's own ``exp`` and ``tanh``, rounded, times ``up``); the mean sums in another order than torch's, so a
result may differ in its last bit: within the bound (:mod:`fusion_linear_kernels.tolerance`), and never in exact mode,
where no layer is switched.

**In one call.** Where the step's attention would run its kernels throughout (its projections in the projection kernel
and the GEMV kernel, a cache layer it appends to in its buffer, the attention kernel), the three steps above run as
one call of :mod:`fusion_linear_kernels.step_kernel`, the same C++ functions back to back: the Python and torch
operators between the five kernel calls ran from memory, as each weight stream evicts them from the CPU's caches. It
gives the bits of the calls one by one, verified once per form at load (:func:`_one_call_differs`); a layer whose call
differs keeps the calls one by one.

**Which layers.** A module with the children ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and
``mlp`` (and two more norms in the sandwich forms of Gemma 2 and 3 and of GLM-4, named in
:data:`~fusion_linear_kernels.layer_forms.SANDWICHES`), whose norms hold a 1-D weight and one epsilon
(``variance_epsilon`` or ``eps``), whose MLP has ``down_proj``, an activation (``act_fn`` or ``activation_fn``) and
either ``gate_proj`` and ``up_proj`` (plain ``nn.Linear`` layers), the ``gate_up`` family's merged projection, or a
``gate_up_proj`` the checkpoint holds merged (Phi-3's and GLM's: the gate's rows, then the up's), with dense weights the
GEMV kernel reads. Names are only the pre-filter: each form is verified once per load on its real weights
(:meth:`LayerForm.of` and :func:`refusal`): the norms' and the activation's kinds on inputs of their own, the
composition with stand-ins for the attention and the MLP (bit for bit, independent of the weights, and the attention
passed its arguments as they are), and the arithmetic within the bound.

**Layers whose norms or MLP the kernel does not compute** (a mixture of experts in place of the MLP: Mixtral, Qwen2-
and Qwen3-MoE, OLMoE on transformers 5.x; an MLP without a gate or of another activation; LayerNorms: Starcoder2) take
:class:`ModulesForm` instead, where their attention verifies: the step's own attention, with the norms, the MLP and the
residuals run as the layer's modules in the composition verified as above (stand-ins for the attention and the MLP,
bit for bit; then the layer's own MLP, whose output the forward must not unpack: 4.x's experts return their router's
logits too, and such a layer keeps its class), and where the model's rotary embedding gives the rotation the step's
attention verified (:func:`model_rotations`). Everything but the attention gives the original's bits. Before, such a
layer ran its attention as the module at every step: the projections' views, ``rotate_half`` twice and torch's
attention over the cache (measured in docs/benchmarks.md, "The step's attention for layers of other forms").
:func:`refusal` still says why the kernel does not compute a layer's norms and MLP.

A layer that verifies neither way (Granite's residual multipliers, Olmo 2's norms after the blocks, parallel blocks,
an attention of another form, a forward that returns a tuple) keeps its class.

**When it runs.** Only for a step of one to eight rows that the original would run the same way: grad mode off, not
traced, not training, no autocast, a contiguous CPU input of the weights' dtype, no positional arguments but the hidden
states, no forward hooks on the layer's norms and MLP (nor global ones), the verified module types in place (a LoRA
adapter or a quantizer's layer there, a packed weight, turns it off) and a kind decided for each GEMV (at two to eight
rows, for a kernel the step runs; see :func:`~fusion_linear_kernels.step_blocks.block`). A :class:`ModulesForm` layer
runs its step for one token a sequence only (what its attention's step takes), under the same guards but for the
GEMVs' kinds, which its modules decide as they run; its norms and MLP run as modules, so their hooks run too. Any other
call runs the original forward, which decides the kinds on its first call.

Measured on the 2-core Xeon VM (AMX-BF16), torch 2.13.0, transformers 5.25.0, bf16, every family on, side by side
with the layers' modules in one run (``benchmarks/bench_decode.py``'s ``(no decode step)`` contender;
docs/benchmarks.md, "A decode step for whole decoder layers"): Qwen2-0.5B 54.4 against 63.6 ms a token, Llama-3.2-1B
widths 105.2 against 111.3, Gemma-2-2B's config 240.1 against 264.0.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fusion_core import FusedModule, ModulePlan
from fusion_core.plugin import attached_plan, fuse_instance, fused_subclass, merged_projection
from fusion_linear_kernels import compat, decode_attention, layer_kernel, row_dot, step_kernel
from fusion_linear_kernels.choice import generation
from fusion_linear_kernels.layer_forms import (
    CHILDREN,
    Marker,
    StandIn,
    activation,
    composed,
    epsilon,
    norm_kind,
    relative,
    sandwich_of,
    swapped,
    tolerance,
)
from fusion_linear_kernels.layer_kernel import (
    DOWN_BIAS,
    GATE_UP_BIAS,
    GATE_UP_MERGED,
    GELU,
    MLP,
    PLUS_ONE,
    SANDWICH_FORM,
)
from fusion_linear_kernels.row_dot import stand_in
from fusion_linear_kernels.step_blocks import block

FORM_KEY = "_fusion_decode_form"
"""Where a switched layer keeps its verified :class:`LayerForm` (its ``__dict__``)."""
ONE_CALL_KEY = "_fusion_decode_one_call"
"""Where a switched layer keeps its attention's form where the whole layer's step verified in one call of the step
kernel (:mod:`fusion_linear_kernels.step_kernel`; its ``__dict__``)."""
ATTENTION_KEY = "_fusion_decode_attention"
"""Where a switched layer keeps its attention's verified :class:`~fusion_linear_kernels.decode_attention.
AttentionForm` (its ``__dict__``), if it verified."""

class LayerForm:
    """What a recognised layer's decode step reads: the widths, the norms' epsilon, the dtype, the form's flags
    (norms around the blocks, Gemma's norms, GELU), whether the MLP's gate and up are one merged projection, the types
    of the modules the step stands in for (verified once per load), and the GEMV blocks worked out from the decisions
    of their generation."""

    __slots__ = ("_blocks", "dtype", "eps", "flags", "hidden", "intermediate", "merged", "types")

    def __init__(self, hidden: int, intermediate: int, eps: float, dtype: torch.dtype, flags: int, merged: bool,
                 types: tuple[type, ...]) -> None:
        self.hidden, self.intermediate, self.eps, self.dtype = hidden, intermediate, eps, dtype
        self.flags, self.merged, self.types = flags, merged, types
        self._blocks: dict[int, tuple[int, tuple[int, int]]] = {}  # rows -> (decisions' generation, blocks)

    def __getstate__(self) -> tuple[Any, ...]:  # the blocks follow this process's decisions: worked out again
        return self.hidden, self.intermediate, self.eps, self.dtype, self.flags, self.merged, self.types

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def key(self) -> tuple[Any, ...]:
        """What two layers of one verdict share."""
        return (LayerForm, *self.__getstate__())

    @staticmethod
    def parts(layer: nn.Module) -> tuple[nn.Module, ...] | None:
        """The modules the step stands in for, or None where the layer has not that shape: its norms (the input's and
        the MLP's input's; in the sandwich form also the attention output's and the MLP output's), then the MLP, its
        gate, up and down projections (a merged gate/up container twice) and its activation."""
        modules = layer._modules
        if "self_attn" not in modules or not all(isinstance(modules.get(name), nn.Module) for name in CHILDREN):
            return None
        sandwich = sandwich_of(layer)
        if sandwich is not None:
            attention_out, mlp_in, mlp_out = sandwich
            norms = tuple(modules[name] for name in ("input_layernorm", mlp_in, attention_out, mlp_out))
        else:
            norms = (modules["input_layernorm"], modules["post_attention_layernorm"])
        mlp = modules["mlp"]
        children = mlp._modules
        down, act = children.get("down_proj"), children.get("act_fn", children.get("activation_fn"))
        merged = merged_projection(mlp)
        if merged is not None:
            container = merged.owner
            gate = up = container if len(merged.sizes) == 2 and merged.sizes[0] == merged.sizes[1] else None
        elif isinstance(children.get("gate_up_proj"), nn.Linear):  # merged in the checkpoint (Phi-3, GLM)
            gate = up = children["gate_up_proj"]
        else:
            gate, up = children.get("gate_proj"), children.get("up_proj")
        if gate is None or up is None or down is None or act is None:
            return None
        return (*norms, mlp, gate, up, down, act)

    @classmethod
    def of(cls, layer: nn.Module) -> LayerForm | str:
        """The form of ``layer`` as it is now, or why it has none."""
        parts = cls.parts(layer)
        if parts is None:
            return ("not a decoder layer with norms, an attention and a gated MLP (input_layernorm, self_attn, "
                    "post_attention_layernorm, mlp with gate, up and down projections and an activation)")
        norms, (_, gate, up, down, act) = parts[:-5], parts[-5:]
        epsilons = {epsilon(norm) for norm in norms}
        if None in epsilons or len(epsilons) != 1:
            return "its norms hold no epsilon (variance_epsilon or eps), or different ones"
        (eps,) = epsilons
        weights = [m._parameters.get("weight") for m in (*norms, gate, up, down)]
        if any(not isinstance(w, torch.Tensor) for w in weights):
            return "a norm or projection holds no weight tensor"
        dtype = weights[0].dtype  # type: ignore[union-attr]
        hidden, intermediate = down.weight.shape[0], down.weight.shape[1]
        if any(not isinstance(m, nn.Linear) for m in (gate, up, down)):
            return "its MLP projections are not nn.Linear layers (a quantizer's or an adapter's)"
        rows = 2 * intermediate if gate is up else intermediate
        shapes = [(hidden,)] * len(norms) + [(rows, hidden), (rows, hidden), (hidden, intermediate)]
        if [tuple(w.shape) for w in weights] != shapes:  # type: ignore[union-attr]
            return "its norm and projection weights are not of one hidden and one intermediate width"
        if not all(row_dot.gemv_weight(w) for w in weights[-3:]):  # type: ignore[arg-type]
            return f"its MLP's weights are not ones the GEMV kernel reads (dense {row_dot.MIN_BYTES} bytes or more)"
        kinds = {norm_kind(norm, dtype, eps, hidden) for norm in norms}
        if None in kinds or len(kinds) != 1:
            return "its norms are not RMSNorms times the weight (Llama's) or times 1 + the weight (Gemma's), all alike"
        act_kind = activation(act, dtype)
        if act_kind is None:
            return "its MLP's activation is neither SiLU nor GELU's tanh approximation"
        if layer_kernel.kernel(dtype) is None:
            return f"no decode layer kernel for {dtype} here"
        flags = ((SANDWICH_FORM if len(norms) == 4 else 0) | (PLUS_ONE if kinds == {True} else 0)
                 | (GELU if act_kind == "gelu" else 0))
        return cls(hidden, intermediate, eps, dtype, flags, gate is up, tuple(type(m) for m in parts))

    def arguments(self, layer: nn.Module, hidden: torch.Tensor) -> tuple[Any, ...] | None:
        """The tensors and flags of the kernel's calls for ``hidden`` on ``layer`` as it is now, or None where the
        step does not apply (see the module docs), or a kind is not decided yet."""
        rows = hidden.numel() // self.hidden
        if not (type(hidden) is torch.Tensor and hidden.dtype is self.dtype and hidden.shape[-1] == self.hidden
                and 0 < rows <= row_dot.MAX_INPUTS and hidden.is_cpu and hidden.is_contiguous()):
            return None
        parts = self.parts(layer)
        if parts is None or tuple(type(m) for m in parts) != self.types or compat.forward_hooks(parts):
            return None
        norms, (_, gate, up, down, _) = parts[:-5], parts[-5:]
        gate_weight, down_weight = gate._parameters["weight"], down._parameters["weight"]
        gate_bias, down_bias = gate._parameters.get("bias"), down._parameters.get("bias")
        up_weight, up_bias = (gate_weight, gate_bias) if self.merged else (up._parameters["weight"],
                                                                           up._parameters.get("bias"))
        norm_weights = [norm._parameters["weight"] for norm in norms]
        if len(norm_weights) == 2:  # no norms around the blocks: the MLP's input norm stands in their place, unread
            norm_weights += norm_weights[1:] * 2
        tensors = (*norm_weights, gate_weight, up_weight, down_weight)
        biases = (gate_bias, up_bias, down_bias)
        if any(not _dense(t, self.dtype) for t in tensors) or any(b is not None and not _dense(b, self.dtype)
                                                                  for b in biases):
            return None
        if (gate_bias is None) != (up_bias is None):
            return None
        blocks = self._decided_blocks(rows, hidden, gate_weight, gate_bias, down_weight, down_bias)
        if blocks is None:
            return None
        flags = (self.flags | MLP | (GATE_UP_BIAS if gate_bias is not None else 0)
                 | (DOWN_BIAS if down_bias is not None else 0) | (GATE_UP_MERGED if self.merged else 0))
        return tensors, biases, rows, flags, blocks

    def _decided_blocks(self, rows: int, hidden: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None,
                        down: torch.Tensor, down_bias: torch.Tensor | None) -> tuple[int, int] | None:
        """The weight rows read side by side that the gate/up and the down GEMVs' kinds decided at ``rows`` input
        rows (kept for the decisions' generation), or None where a kind is undecided or decided for a kernel this
        one does not run."""
        current = generation()
        kept = self._blocks.get(rows)
        if kept is not None and kept[0] == current:
            return kept[1]
        gate_up = block(hidden.reshape(rows, self.hidden), gate, gate_bias)
        # The down projection's input is the activation's product, not at hand: a random one of its shape (where the
        # one-row fallback measures, it checks its candidates' outputs on this input, which zeros would not test).
        product = torch.randn(rows, self.intermediate, generator=torch.Generator().manual_seed(0)).to(self.dtype)
        down_block = block(product, down, down_bias)
        if gate_up is None or down_block is None:
            return None
        blocks = (gate_up, down_block)
        self._blocks[rows] = (current, blocks)
        return blocks

    def run(self, layer: nn.Module, hidden: torch.Tensor, arguments: tuple[Any, ...],
            kwargs: dict[str, Any]) -> torch.Tensor:
        """The layer's output: the input norm, the layer's attention called as the original calls it, the rest."""
        (norm, mlp_norm, attention_norm, out_norm, gate, up, down), biases, rows, flags, blocks = arguments
        gate_bias, up_bias, down_bias = biases
        step = layer.__dict__.get(ONE_CALL_KEY)
        one_call = step.in_one_call(layer._modules["self_attn"], hidden, kwargs) if step is not None else None
        if one_call is not None:  # the whole layer in the step kernel, verified so (switch_layers)
            return self._in_one_call(hidden, arguments, one_call)
        compiled = layer_kernel.kernel(self.dtype)
        normed = torch.empty_like(hidden)
        row_dot.labelled_call(f"{layer_kernel.PROFILER_LABEL} input norm", compiled, hidden, hidden, norm, norm, norm,
                              gate, up, down, gate, up, down, normed, normed, normed, self.eps, self.hidden,
                              self.intermediate, rows, flags & ~MLP, *blocks)
        attention = _attention(layer, normed, kwargs)
        if not (type(attention) is torch.Tensor and attention.dtype is self.dtype
                and attention.shape == hidden.shape):  # not what verification saw: the verified form's modules
            return composed(layer, hidden, attention, sandwich_of(layer) if self.flags & SANDWICH_FORM else None)
        attention = attention.contiguous()
        gated = hidden.new_empty(2 * rows * self.intermediate)
        scratch, out = torch.empty_like(hidden), torch.empty_like(hidden)  # the attention may hold its input
        row_dot.labelled_call(f"{layer_kernel.PROFILER_LABEL} MLP {self.hidden}x{self.intermediate}", compiled,
                              hidden, attention, mlp_norm, attention_norm, out_norm, gate, up, down,
                              stand_in(gate_bias, gate), stand_in(up_bias, up), stand_in(down_bias, down), scratch,
                              gated, out, self.eps, self.hidden, self.intermediate, rows, flags, *blocks)
        return out

    def _in_one_call(self, hidden: torch.Tensor, arguments: tuple[Any, ...],
                     attention: tuple[Any, ...]) -> torch.Tensor:
        """The layer's output in one call of the step kernel, its attention's part ``attention`` (what
        :meth:`~fusion_linear_kernels.decode_attention.AttentionForm.in_one_call` gave)."""
        (norm, mlp_norm, attention_norm, out_norm, gate, up, down), biases, rows, flags, blocks = arguments
        gate_bias, up_bias, down_bias = biases
        tensors, floats, integers = attention
        heads, kv_heads, width = integers[:3]
        out = torch.empty_like(hidden)
        scratch = hidden.new_empty(step_kernel.scratch_size(rows, self.hidden, self.intermediate, heads, kv_heads,
                                                            width))
        row_dot.labelled_call(f"{step_kernel.PROFILER_LABEL} {self.hidden}x{self.intermediate}",
                              step_kernel.kernel(self.dtype), hidden, norm, mlp_norm, attention_norm, out_norm,
                              *tensors, gate, up, down, stand_in(gate_bias, gate), stand_in(up_bias, up),
                              stand_in(down_bias, down), scratch, out, self.eps, *floats, self.hidden,
                              self.intermediate, rows, flags, *blocks, *integers)
        return out


class ModulesForm:
    """What a recognised layer's decode step reads where the kernel does not compute its norms or its MLP (a mixture
    of experts, an MLP of another activation or without a gate, LayerNorms): the width, the dtype, the form's flags
    (norms around the blocks) and the types of the modules it calls. The step runs the layer's attention as the step's
    own (:mod:`fusion_linear_kernels.decode_attention`) and everything else as the layer's modules, in the order the
    verified composition gives; so a layer takes this form only where its attention verified (see the module docs)."""

    __slots__ = ("dtype", "flags", "hidden", "types")

    def __init__(self, hidden: int, dtype: torch.dtype, flags: int, types: tuple[type, ...]) -> None:
        self.hidden, self.dtype, self.flags, self.types = hidden, dtype, flags, types

    def key(self) -> tuple[Any, ...]:
        """What two layers of one verdict share (all of the form: it keeps nothing derived, so it pickles as it is)."""
        return ModulesForm, self.hidden, self.dtype, self.flags, self.types

    @staticmethod
    def parts(layer: nn.Module) -> tuple[nn.Module, ...] | None:
        """The modules the step calls besides the attention (its norms, as :meth:`LayerForm.parts` lists them, then
        the MLP), or None where the layer has not the children of :data:`CHILDREN`."""
        modules = layer._modules
        if not all(isinstance(modules.get(name), nn.Module) for name in CHILDREN):
            return None
        sandwich = sandwich_of(layer)
        names = ("input_layernorm", *(sandwich or ("post_attention_layernorm",)), "mlp")
        return tuple(modules[name] for name in names)

    @classmethod
    def of(cls, layer: nn.Module) -> ModulesForm | str:
        """The form of ``layer`` as it is now, or why it has none: the width and dtype are its attention's output
        projection's (a LayerNorm need hold no weight)."""
        parts = cls.parts(layer)
        o_proj = layer._modules["self_attn"]._modules.get("o_proj") if parts is not None else None
        weight = o_proj._parameters.get("weight") if isinstance(o_proj, nn.Module) else None
        if parts is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return f"not a decoder layer ({', '.join(CHILDREN)}) whose attention has an o_proj weight"
        return cls(weight.shape[0], weight.dtype, SANDWICH_FORM if len(parts) == 5 else 0,
                   tuple(type(m) for m in parts))

    def arguments(self, layer: nn.Module, hidden: torch.Tensor) -> tuple[Any, ...] | None:
        """``()`` where the step applies to ``hidden`` on ``layer`` as it is now (one token a sequence, the
        verified modules in place), else None."""
        if not (type(hidden) is torch.Tensor and hidden.dtype is self.dtype and hidden.dim() == 3
                and hidden.shape[1] == 1 and hidden.shape[-1] == self.hidden and hidden.is_cpu):
            return None
        parts = self.parts(layer)
        return () if parts is not None and tuple(type(m) for m in parts) == self.types else None

    def run(self, layer: nn.Module, hidden: torch.Tensor, arguments: tuple[Any, ...],
            kwargs: dict[str, Any]) -> torch.Tensor:
        """The layer's output: its input norm, the attention (the step's own where it takes the call), then the
        verified composition of its modules."""
        normed = layer._modules["input_layernorm"](hidden)
        return composed(layer, hidden, _attention(layer, normed, kwargs),
                        sandwich_of(layer) if self.flags & SANDWICH_FORM else None)


def _attention(layer: nn.Module, normed: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """The output of ``layer``'s attention for its normed input: the step's own where it verified and takes the call,
    else the module's, called as the original forward calls it."""
    module = layer._modules["self_attn"]
    step = layer.__dict__.get(ATTENTION_KEY)
    attention = step.run(module, normed, kwargs) if step is not None else None
    if attention is None:
        result = module(hidden_states=normed, **kwargs)
        attention = result[0] if isinstance(result, tuple) else result  # (output, weights), as the forward does
    return attention


def _dense(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return (type(tensor) in (torch.Tensor, nn.Parameter) and tensor.dtype is dtype and tensor.is_cpu
            and tensor.layout is torch.strided and tensor.is_contiguous())


class DecodeLayerMixin(FusedModule):
    """A decoder layer whose decode steps (one to eight rows) run its norms, MLP and residuals in one kernel call each
    side of the attention, or, in a :class:`ModulesForm` layer, its attention as the step's own
    (:mod:`fusion_linear_kernels.decode_layer`); every other call runs the original forward."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        form = self.__dict__.get(FORM_KEY)
        if (form is not None and not args and not torch.is_grad_enabled() and not self.training
                and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu")):
            arguments = form.arguments(self, hidden_states)
            if arguments is not None:
                return form.run(self, hidden_states, arguments, kwargs)
        return super().forward(hidden_states, *args, **kwargs)

    def extra_repr(self) -> str:
        if isinstance(self.__dict__.get(FORM_KEY), ModulesForm):
            return "decode step: the step's own attention, the norms and MLP as modules"
        return "decode step: norms and MLP in one kernel call each side of the attention"


def fused_layer_class(original_cls: type[nn.Module]) -> type[nn.Module]:
    """The switched class of a decoder layer class."""
    return fused_subclass(DecodeLayerMixin, original_cls)


def refusal(layer: nn.Module) -> str | None:
    """Why the kernel does not compute ``layer``'s norms and MLP at its decode step (on its loaded weights, in eval
    mode), or None (see the module docs; such a layer may still take the step's attention, :class:`ModulesForm`).

    Checks on a random one-row input, with the forward of the layer's original class (:meth:`LayerForm.of` checked the
    norms' and the activation's kinds on inputs of their own):

    - the composition, on no weights: with stand-ins for the attention and the MLP, the forward computes
      ``r = h + attn(norm(h))``, then ``r + mlp(norm(r))`` with the layer's own norms bit for bit (in the sandwich
      forms of Gemma 2 and 3 and of GLM-4, ``r = h + norm(attn(norm(h)))``, then ``r + norm(mlp(norm(r)))``), and
      passes the attention every argument it was given, as it is;
    - the arithmetic, on the loaded weights: with a stand-in attention, the step's output and its input norm are within
      two steps of the dtype's precision of the forward's (inputs small beside the MLP's output, which then dominates).

    It swaps the layer's children for stand-ins while it runs: not for a model another thread is running.
    """
    form = LayerForm.of(layer)
    return form if isinstance(form, str) else _unverified(layer, form)


def _unverified(layer: nn.Module, form: LayerForm | ModulesForm) -> str | None:
    """:func:`refusal` for a layer whose form is ``form``: why the forward does not verify against it, or None."""
    plan = attached_plan(layer, ModulePlan) if isinstance(layer, DecodeLayerMixin) else None
    forward = (plan.original_class if plan is not None else type(layer)).forward
    names = [name for name, p in list(inspect.signature(forward).parameters.items())[2:]  # self, hidden states
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    markers: dict[str, Any] = {name: Marker(name) for name in [*names, "fusion_probe"]}  # fusion_probe: **kwargs
    generator = torch.Generator().manual_seed(0)
    scale = 2.0**-6
    hidden = (torch.randn(1, 1, form.hidden, generator=generator) * scale).to(form.dtype)
    attention, mlp = StandIn(scale, pair=True), StandIn(0.5, pair=False)
    with torch.no_grad(), swapped(layer, self_attn=attention, mlp=mlp):
        try:
            output = forward(layer, hidden, **markers)
        except Exception as exc:  # any failure means the form is not this one
            return f"its forward does not run with the attention's arguments passed through ({exc!r:.120})"
        normed = layer._modules["input_layernorm"](hidden)
        reference = composed(layer, hidden, normed.flip(-1) * scale,
                             sandwich_of(layer) if form.flags & SANDWICH_FORM else None)
    if not isinstance(output, torch.Tensor):
        return f"its forward returns {type(output).__name__}, not the hidden states alone"
    if not torch.equal(output, reference):
        return ("its forward is not r = h + attn(norm(h)), then r + mlp(norm(r)), nor that with the blocks' outputs "
                "normed (other residuals, norms or outputs)")
    (passed,) = attention.calls
    passed.pop("hidden_states")
    if passed.keys() != markers.keys() or any(passed[key] is not markers[key] for key in markers):
        return "its forward does not pass the attention the arguments it was given, as they are"
    attention = StandIn(scale, pair=True)
    with torch.no_grad(), swapped(layer, self_attn=attention):
        expected = forward(layer, hidden, **markers)
        arguments = form.arguments(layer, hidden)  # the original forward decided each GEMV's kind
        if arguments is None:
            return "its MLP's GEMVs run kernels the decode step does not (F.linear, packed weights), or are hooked"
        try:
            got = form.run(layer, hidden, arguments, dict(markers))
        except Exception as exc:  # an MLP whose output the forward unpacks (4.x's experts: (output, router logits))
            return f"its forward does not compose its modules' outputs as the step does ({exc!r:.120})"
    for name, (a, b) in (("input norm", (attention.calls[0]["hidden_states"], attention.calls[1]["hidden_states"])),
                         ("output", (expected, got))):
        difference = relative(a, b)
        if difference > tolerance(form.dtype):
            return f"the decode step's {name} differs from the forward's by {difference:.3g} of its largest element"
    return None


def candidates(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules of ``model`` shaped like a pre-norm decoder layer (:data:`CHILDREN`), not switched by a family."""
    for path, module in model.named_modules():
        if all(name in module._modules for name in CHILDREN) and attached_plan(module, ModulePlan) is None:
            yield path, module


def read_by_steps(model: nn.Module) -> set[int]:
    """The ids of the modules whose weights a decoder layer's decode step would read in place of calling them, in the
    layers of ``model`` that may take the step (:func:`candidates`): every module of the layer's attention (its
    projections, a merged ``qkv_proj``), and where its MLP has the gated form (:meth:`LayerForm.parts`), the MLP's.

    ``linear_kernels`` holds these weights dense, never prepacked (:mod:`fusion_linear_kernels.packing`): the step reads
    dense weights only, so one packed projection turns its whole layer's step off, for a gain at one row that a
    GEMV read from memory leaves to chance. Measured on the 2-core AMD EPYC (AVX512-BF16, Gemma-2-2B's config, bf16,
    transformers 5.25.0): the packing decision for the 2304x9216 down projection timed the packed kernel 4% faster
    than row-dot over three copies (2.348 against 2.449 ms), so all 26 layers ran without the step; in that decode the
    packed down projections read at 25.7 GB/s, where the layers' row-dot gate and up read at 46. Kept dense, the decode
    ran 1.26x [1.14-1.36] faster (8 alternating rounds in one process)."""
    found: set[int] = set()
    for _, layer in candidates(model):
        attention, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        found.update(id(module) for module in attention.modules())
        if LayerForm.parts(layer) is not None:
            found.update(id(module) for module in mlp.modules())
    return found


def switch_layers(model: nn.Module, family: str) -> None:
    """Give each decoder layer of ``model`` whose form verifies (:func:`refusal`, once per form) the decode step, or,
    where the kernel does not compute its norms and MLP, whose attention and composition verify the step's attention
    alone (:class:`ModulesForm`): its class switched through a plan of ``family`` (so ``unfuse`` restores it)."""
    verdicts: dict[tuple[Any, ...], str | None] = {}
    attention_verdicts: dict[tuple[Any, ...], str | None] = {}
    one_call_verdicts: dict[tuple[Any, ...], str | None] = {}
    rotations: dict[torch.dtype, set[tuple[torch.dtype, int]] | None] = {}
    for path, layer in candidates(model):
        form: LayerForm | ModulesForm | str = LayerForm.of(layer)
        if isinstance(form, str):  # the norms and the MLP as modules: worth it only for the step's attention
            form = ModulesForm.of(layer)
            attention = None if isinstance(form, str) else _attention_form(layer._modules["self_attn"], form,
                                                                            attention_verdicts)
            if attention is None or isinstance(form, str) or not _rotated_as_verified(model, form, attention,
                                                                                     rotations):
                continue
        key = (type(layer), *form.key())
        if key not in verdicts:
            verdicts[key] = _unverified(layer, form)
        if verdicts[key] is not None:
            continue
        plan = ModulePlan(family=family, path=path, original_class=type(layer),
                          fused_class=fused_layer_class(type(layer)), transforms=())
        fuse_instance(layer, plan)
        layer.__dict__[FORM_KEY] = form
        attention = _attention_form(layer._modules["self_attn"], form, attention_verdicts)
        if attention is not None and _rotated_as_verified(model, form, attention, rotations):
            layer.__dict__[ATTENTION_KEY] = attention
            if isinstance(form, LayerForm):
                one_call_key = (*key, attention.key(form.dtype, form.hidden))
                if one_call_key not in one_call_verdicts:
                    one_call_verdicts[one_call_key] = _one_call_differs(layer, form, attention)
                if one_call_verdicts[one_call_key] is None:
                    layer.__dict__[ONE_CALL_KEY] = attention


def _one_call_differs(layer: nn.Module, form: LayerForm, attention: decode_attention.AttentionForm) -> str | None:
    """Why the whole layer's step in one call of the step kernel (:mod:`fusion_linear_kernels.step_kernel`) does not
    give what the step's calls one by one give (:meth:`LayerForm.run`, the step's own attention taking its call), bit
    for bit in the output and the cache, or None: one token on two copies of a dynamic cache holding a few random
    keys and values, on a random rotation. The layer must already hold its attention's form (``ATTENTION_KEY``), and
    not yet the one call's (``ONE_CALL_KEY``), so that :meth:`LayerForm.run` calls its kernels one by one."""
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, 1, form.hidden, generator=generator) * 2.0**-6).to(form.dtype)
    caches = decode_attention.caches_for(layer._modules["self_attn"], attention, form.dtype, 2, generator)
    if isinstance(caches, str):
        return caches
    angles = torch.rand(1, 1, attention.head_dim, generator=generator) * 6.0
    step = {"position_embeddings": (angles.cos().to(form.dtype), angles.sin().to(form.dtype)), "attention_mask": None}
    with torch.no_grad():
        arguments = form.arguments(layer, hidden)
        if arguments is None:
            return "a GEMV's kind is not decided"
        expected = form.run(layer, hidden, arguments, {**step, attention.cache_name: caches[0]})
        one_call = attention.in_one_call(layer._modules["self_attn"], hidden, {**step, attention.cache_name: caches[1]})
        if one_call is None:
            return "the step's attention does not run its kernels throughout on a dynamic cache"
        got = form._in_one_call(hidden, arguments, one_call)
    expected_layer, got_layer = (cache.layers[attention.layer_idx] for cache in caches)
    if not (torch.equal(expected, got) and torch.equal(expected_layer.keys, got_layer.keys)
            and torch.equal(expected_layer.values, got_layer.values)):
        return "the step kernel's output or cache differs from the step's calls one by one"
    return None


def model_rotations(model: nn.Module, dtype: torch.dtype) -> set[tuple[torch.dtype, int]] | None:
    """The dtype and width of the cosines each rotary embedding of ``model`` gives a step of ``dtype`` (its modules
    named ``rotary_emb``, called as a decoder calls them: an input of the dtype and position ids), or None where there
    is none or one is not called so.

    Why: verification runs the attention on a rotation of its own, of the dtype and the whole head, while a decoder
    hands its layers the rotation its rotary embedding computes, and the step's attention declines every call whose
    rotation is not of that form (OLMo's is float32; GLM-4-MoE's covers half the head). The step's attention would
    then pay for its guards at every step and gain nothing: a layer keeps no attention form, and a layer whose norms
    and MLP run as modules anyway (:class:`ModulesForm`) keeps its class."""
    found: set[tuple[torch.dtype, int]] = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "rotary_emb":
            continue
        try:
            with torch.no_grad():
                cos, _ = module(torch.zeros(1, 1, 1, dtype=dtype), torch.zeros(1, 1, dtype=torch.long))
        except Exception:  # another signature: the rotation is not known
            return None
        if not isinstance(cos, torch.Tensor):
            return None
        found.add((cos.dtype, cos.shape[-1]))
    return found or None


def _rotated_as_verified(model: nn.Module, form: LayerForm | ModulesForm, attention: decode_attention.AttentionForm,
                         rotations: dict[torch.dtype, set[tuple[torch.dtype, int]] | None]) -> bool:
    """Whether ``model``'s rotary embeddings give a rotation of the form ``attention`` verified (or are not known:
    :func:`model_rotations`, worked out once per dtype into ``rotations``)."""
    if form.dtype not in rotations:
        rotations[form.dtype] = model_rotations(model, form.dtype)
    given = rotations[form.dtype]
    return given is None or (form.dtype, attention.head_dim) in given


def _attention_form(attention: nn.Module, form: LayerForm | ModulesForm,
                    verdicts: dict[tuple[Any, ...], str | None]) -> decode_attention.AttentionForm | None:
    """The decode step's form of a switched layer's ``attention``, verified once per form
    (:func:`~fusion_linear_kernels.decode_attention.verified`), or None where it does not verify."""
    found = decode_attention.AttentionForm.of(attention)
    if isinstance(found, str):
        return None
    key = found.key(form.dtype, form.hidden)
    if key not in verdicts:
        checked = decode_attention.verified(attention, form.dtype, form.hidden)
        verdicts[key] = checked if isinstance(checked, str) else None
    return None if verdicts[key] is not None else found


def drop_decode_steps(model: nn.Module) -> None:
    """Every switched layer of ``model`` runs its modules again at every call (its form forgotten; the class stays,
    so ``unfuse`` still restores it): the step turned off, to compare or to rule it out."""
    for module in model.modules():
        module.__dict__.pop(FORM_KEY, None)
        module.__dict__.pop(ATTENTION_KEY, None)
        module.__dict__.pop(ONE_CALL_KEY, None)


def drop_decode_attention(model: nn.Module) -> None:
    """Every switched layer of ``model`` keeps its decode step but calls its attention module at each step (the
    step's own attention forgotten): to compare, or to rule it out."""
    for module in model.modules():
        module.__dict__.pop(ATTENTION_KEY, None)
        module.__dict__.pop(ONE_CALL_KEY, None)


def drop_one_call(model: nn.Module) -> None:
    """Every switched layer of ``model`` keeps its decode step and its own attention, called one kernel at a time (the
    step kernel, :mod:`fusion_linear_kernels.step_kernel`, forgotten): to compare, or to rule it out."""
    for module in model.modules():
        module.__dict__.pop(ONE_CALL_KEY, None)
