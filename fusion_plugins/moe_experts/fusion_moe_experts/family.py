"""``moe_experts``: sparse MoE blocks that loop over ``nn.ModuleList`` experts run them as grouped GEMMs.

On transformers 4.57 a sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE,
DeepSeek-V2, DeepSeek-V3, Ernie 4.5 MoE, Hunyuan-V1-MoE, Jamba, and the blocks that copy their
code) keeps one small gated MLP per expert and runs them in a Python loop, one to three GEMMs per
expert per layer; OLMoE and PhiMoE visit every expert even when no token was routed to it. The
fused block keeps the original router module, top-k, normalisation, jitter, shared expert and its
gate, and output (``(hidden, router_logits)`` where the original returns it), and replaces only the
loop: the experts' weights live stacked as ``experts.gate_up_proj`` ``[E, 2I, H]`` and
``experts.down_proj`` ``[E, H, I]`` (transformers 5.x's own leaf names and shapes), and
:mod:`fusion_moe_experts.dispatch` runs them in two grouped GEMMs.

**What is recognised, exactly.** A block is fusable when the code of its methods is one of the
:data:`TEMPLATES` (by fingerprint, :mod:`fusion_moe_experts.recognise`: a copy under another
name is recognised, a changed statement is not), its experts are the gated MLPs of
:data:`EXPERT_FORWARDS` with plain bias-free ``nn.Linear`` projections of one shape and dtype, and
one activation. Everything else is refused, and :func:`refusal` says why.

**Checkpoint layout.** ``experts.{e}.{gate,up}.weight`` (``gate_proj``/``up_proj``, or Mixtral's
``w1``/``w3``) -> ``experts.gate_up_proj`` by :class:`~fusion_moe_experts.ops.StackPairs` (the shipped
``Stack`` and ``Concat`` composed); ``experts.{e}.{down_proj,w2}.weight`` -> ``experts.down_proj`` by
:class:`~fusion_moe_experts.ops.StackExperts` (the shipped ``Stack``, whose inverse also unstacks a
stack FSDP2 sharded along the experts). Saving runs the inverse: the per-expert tensors, byte for byte.

**The per-expert modules stay.** After loading, every expert projection is an
:class:`ExpertProjection`, a view of its rows of the stacked weight that computes what the
``nn.Linear`` computed (``block.experts[3](x)`` still works, and unfused code that inspects
``experts[3].gate_proj.weight`` sees the tensor). A LoRA adapter or a quantiser written into one
expert would not reach the stacked weight the block runs, so the stand-in refuses them by name
instead of letting them train an adapter the forward never uses or leave the experts silently
unquantised: it is an ``nn.Linear`` to ``isinstance`` (so every tool that looks for linear layers
-- torchao's ``quantize_``, PEFT's LoRA dispatch and ``"all-linear"``, ``torch.ao`` dynamic
quantisation, quanto -- finds it, as it finds the unfused experts), but replacing its ``weight``
or reading ``in_features`` / ``out_features`` (what such a tool does to build its own layer) raises
:class:`ExpertProjectionError` naming the module and the ways out.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from fusion_core import FamilyOptions, FusedModule, FusionFamily, WeightTransform
from fusion_core.plugin import fused_subclass
from fusion_moe_experts.dispatch import Routed, expert_outputs
from fusion_moe_experts.ops import StackExperts, StackPairs
from fusion_moe_experts.recognise import method_fingerprints

GATE_UP = "gate_up_proj"
DOWN = "down_proj"
#: Expert projection names, (gate, up, down), by naming scheme.
NAMES: dict[str, tuple[str, str, str]] = {"gate_proj": ("gate_proj", "up_proj", "down_proj"), "w1": ("w1", "w3", "w2")}
#: Where a text config keeps the number of routed experts, by architecture.
EXPERT_COUNT_ATTRIBUTES = ("num_local_experts", "num_experts", "n_routed_experts")

#: Fingerprints of the gated expert MLP forwards this family reproduces (``down(act(gate(x)) * up(x))``),
#: with their naming scheme. Checked on transformers 4.57.6 (tests/test_moe_experts.py).
EXPERT_FORWARDS: dict[str, str] = {
    "6f8ea681646fa37f": "w1",        # MixtralBlockSparseTop2MLP, PhimoeBlockSparseTop2MLP, MiniMax's
    "92f836a144251e0e": "gate_proj",  # Qwen2MoeMLP
    "ddc6573590c67a46": "gate_proj",  # Qwen3MoeMLP, OlmoeMLP, DeepseekV2MLP, DeepseekV3MLP, FlexOlmo's, Qwen3-Next's
}

#: Activation classes accepted: the elementwise activations of transformers and torch.
_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")


@dataclass(frozen=True)
class Template:
    """One recognised block forward: its method fingerprints and the mixin that reproduces it."""

    name: str
    fingerprints: dict[str, str]
    mixin: type
    children: tuple[str, ...]
    """The child modules its forward calls besides ``experts``."""
    router: str = "gate"
    """The child that computes the routing (called as a module, as the original forward calls it)."""
    router_module: bool = False
    """Whether the router is the model's own router module, of any class, rather than a plain ``nn.Linear``."""


class MoeExpertsOptions(FamilyOptions):
    """Options of ``moe_experts``: the common ``target_modules`` / ``exclude_modules`` / ``required``."""


class ExpertProjectionError(ValueError):
    """A tool tried to replace, quantise or adapt one expert's projection of a fused block."""


class ExpertProjection(nn.Linear):
    """Stands where one expert's ``nn.Linear`` was: rows of the block's stacked weight (a view).

    Not a parameter holder (the stacked tensors belong to ``experts``), and ``nn.Linear`` only to
    ``isinstance``: its ``__init__`` is ``nn.Module``'s, reading the weight works and computes what
    the ``nn.Linear`` computed, but assigning ``weight`` / ``bias`` or reading ``in_features`` /
    ``out_features`` raises :class:`ExpertProjectionError` (see the module docs).
    """

    def __init__(self, experts: nn.Module, stacked: str, index: int, rows: slice, name: str,
                 block: nn.Module | None = None) -> None:
        nn.Module.__init__(self)
        self.__dict__["_experts"] = experts  # not a sub-module: the ModuleList owns the tensors
        self.__dict__["_block"] = block  # for the path in refusals
        self.stacked, self.index, self.rows, self.name = stacked, index, rows, name

    @property  # type: ignore[override]
    def weight(self) -> torch.Tensor:
        weight: torch.Tensor = self._experts._parameters[self.stacked][self.index, self.rows]
        return weight

    bias = None  # type: ignore[assignment]

    def _refuse(self, what: str) -> ExpertProjectionError:
        from fusion_core.plugin import module_plan

        plan = module_plan(self.__dict__["_block"]) if self.__dict__.get("_block") is not None else None
        block = plan.path if plan is not None else "the fused block"
        path = f"{block}.experts.{self.index}.{self.name}" if plan is not None else f"experts.{self.index}.{self.name}"
        return ExpertProjectionError(
            f"{path} is expert {self.index}'s {self.name} inside {block}, a sparse MoE block fused by moe_experts "
            f"(ExpertProjection(experts.{self.index}.{self.name}): a view of rows of the stacked "
            f"experts.{self.stacked}); {what} is refused: a tensor or layer made for one expert would not reach "
            "the stacked weight the block runs. "
            "Quantising or adapting individual experts is not supported on a fused block: load the model without "
            "moe_experts (or call fusion_core.unfuse(model) first), or leave the experts out (torchao: "
            "quantize_(model, config, filter_fn=lambda m, fqn: type(m) is torch.nn.Linear); PEFT: target_modules "
            "naming other modules)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("weight", "bias"):
            raise self._refuse(f"assigning its {name} (what a quantiser such as torchao's quantize_ does)")
        super().__setattr__(name, value)

    @property
    def in_features(self) -> int:  # type: ignore[override]
        raise self._refuse("reading in_features (what a quantiser or PEFT does to build its own layer)")

    @property
    def out_features(self) -> int:  # type: ignore[override]
        raise self._refuse("reading out_features (what a quantiser or PEFT does to build its own layer)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight)

    def extra_repr(self) -> str:
        return (f"experts.{self.index}.{self.name}: rows {self.rows.start}:{self.rows.stop} of expert {self.index} "
                f"of the stacked experts.{self.stacked} of a moe_experts block; LoRA and quantisers cannot target "
                "one expert of it (load the model without moe_experts for that)")


def _original_class(fused: type) -> type:
    return next(c for c in fused.__mro__ if not issubclass(c, FusedModule))


class StackedExpertsMixin(FusedModule):
    """What every fused block shares: the stacked tensors, the expert stand-ins, the dispatch."""

    def fusion_finalize(self) -> None:
        """Check the stacked tensors cover every expert, and put an :class:`ExpertProjection` in each projection."""
        experts = self.experts
        gate_up, down = experts._parameters.get(GATE_UP), experts._parameters.get(DOWN)
        if gate_up is None or down is None or gate_up.shape[0] != len(experts) or down.shape[0] != len(experts):
            shapes = [None if t is None else tuple(t.shape) for t in (gate_up, down)]
            raise RuntimeError(
                f"{type(self).__name__}: moe_experts stacked experts.{GATE_UP}/{DOWN} of shapes {shapes} for "
                f"{len(experts)} experts (the config's expert count, {EXPERT_COUNT_ATTRIBUTES}, is not the block's)"
            )
        width = down.shape[-1]
        originals = {}
        for index, expert in enumerate(experts):
            names = _names(expert)
            for name, stacked, rows in zip(names, (GATE_UP, GATE_UP, DOWN),
                                           (slice(0, width), slice(width, 2 * width), slice(None)), strict=True):
                originals[(index, name)] = expert._modules[name]
                expert._modules[name] = ExpertProjection(experts, stacked, index, rows, name, self)
        self.__dict__["_fusion_expert_linears"] = originals

    def fusion_unfinalize(self) -> None:
        """Put the original (emptied) ``nn.Linear`` s back; fusion-core restores their weights."""
        for (index, name), linear in self.__dict__.pop("_fusion_expert_linears").items():
            self.experts[index]._modules[name] = linear

    def _fusion_experts(self, x: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, Routed]:
        """Unweighted outputs of every (token, slot) in expert order, and the dispatch that sorted them."""
        experts = self.experts
        gate_up, down = experts._parameters[GATE_UP], experts._parameters[DOWN]
        routed = Routed(selected, gate_up.shape[0])
        return expert_outputs(x, gate_up, down, experts[0].act_fn, routed), routed

    def _fusion_combine(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_k w_k * expert_k(x)`` accumulated in ``x``'s dtype, expert after expert (the loop's order)."""
        outputs, routed = self._fusion_experts(x, selected)
        weighted = outputs * weights.reshape(-1)[routed.order, None]
        return torch.zeros_like(x).index_add(0, routed.token, weighted.to(x.dtype))


def _softmax_top_k(logits: torch.Tensor, top_k: int, normalise: bool, dtype: torch.dtype) -> tuple[Any, Any]:
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, selected = torch.topk(weights, top_k, dim=-1)
    if normalise:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), selected


class MixtralStyleMixin(StackedExpertsMixin):
    """Mixtral's block: softmax router, top-k renormalised, input jitter in training."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(x)
        weights, selected = _softmax_top_k(router_logits, self.top_k, True, x.dtype)
        out = self._fusion_combine(x, selected, weights)
        return out.reshape(batch_size, sequence_length, hidden_dim), router_logits


class TopKStyleMixin(StackedExpertsMixin):
    """Qwen3-MoE's and OLMoE's block: softmax router, top-k renormalised when ``norm_topk_prob``."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        x = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(x)
        weights, selected = _softmax_top_k(router_logits, self.top_k, self.norm_topk_prob, x.dtype)
        out = self._fusion_combine(x, selected, weights)
        shared = self._fusion_shared(x)
        if shared is not None:
            out = out + shared
        return out.reshape(batch_size, sequence_length, hidden_dim), router_logits

    def _fusion_shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The term added to the routed experts' sum; none in Qwen3-MoE and OLMoE."""
        return None


class SharedExpertStyleMixin(TopKStyleMixin):
    """Qwen2-MoE's block: Qwen3-MoE's plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    def _fusion_shared(self, x: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class PhimoeStyleMixin(StackedExpertsMixin):
    """PhiMoE's block: input jitter in training, routing by its module's own ``sparsemixer``."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.input_jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(
                1.0 - self.input_jitter_noise, 1.0 + self.input_jitter_noise)
        x = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(x)
        sparsemixer = importlib.import_module(_original_class(type(self)).__module__).sparsemixer
        weights, selected = sparsemixer(router_logits, jitter_eps=self.router_jitter_noise, training=self.training)
        out = self._fusion_combine(x, selected, weights)
        return out.reshape(batch_size, sequence_length, hidden_dim), router_logits


class DeepseekV2StyleMixin(StackedExpertsMixin):
    """DeepSeek-V2's block: its gate module routes; top-k combined in the weights' dtype; shared experts added."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        x = hidden_states.view(-1, hidden_states.shape[-1])
        outputs, routed = self._fusion_experts(x, topk_indices)
        unsorted = torch.empty_like(outputs).index_copy(0, routed.order, outputs)
        combined = (unsorted.view(*topk_indices.shape, -1).type(topk_weights.dtype) * topk_weights.unsqueeze(-1)
                    ).sum(dim=1).type(unsorted.dtype)
        return combined.view(*orig_shape) + self.shared_experts(residuals)


class DeepseekV3StyleMixin(StackedExpertsMixin):
    """DeepSeek-V3's block (GLM-4-MoE's, dots1's): its gate module routes (group-limited, bias-corrected sigmoid,
    run as it is); each expert's weighted outputs are accumulated in the weights' dtype, expert after expert."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        x = hidden_states.view(-1, hidden_states.shape[-1])
        outputs, routed = self._fusion_experts(x, topk_indices)
        weighted = outputs * topk_weights.reshape(-1)[routed.order, None]
        combined = torch.zeros_like(x, dtype=topk_weights.dtype).index_add(0, routed.token, weighted)
        return combined.type(x.dtype).view(*orig_shape) + self.shared_experts(residuals)


class Ernie45StyleMixin(StackedExpertsMixin):
    """Ernie 4.5 MoE's block: float32 softmax router, top-k chosen on the scores plus its ``moe_statics`` correction
    bias (called as a module) but weighted by the uncorrected ones, renormalised with a floor; optional shared
    experts added."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        x = hidden_states.view(-1, hidden_dim)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        device_type = x.device.type if x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):  # the original routes in float32
            router_logits = self.gate(x.float())
            scores = F.softmax(router_logits, dim=1, dtype=torch.float)
            _, selected = torch.topk(self.moe_statics(scores), self.top_k, dim=-1)
            weights = torch.gather(scores, dim=-1, index=selected)
            weights = (weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)).to(x.dtype)
        out = self._fusion_combine(x, selected, weights)
        if shared is not None:
            out = out + shared
        return out.reshape(batch_size, sequence_length, hidden_dim), router_logits


class HunYuanStyleMixin(StackedExpertsMixin):
    """Hunyuan-V1-MoE's block: its ``gate`` module gives the logits (float32 when its weight is), softmax, top-k
    renormalised; ``shared_mlp`` of the input added; no router logits returned."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        shared = self.shared_mlp(hidden_states)
        router_logits = self.gate(hidden_states)
        x = hidden_states.view(-1, hidden_dim)
        weights, selected = _softmax_top_k(router_logits, self.top_k, True, x.dtype)
        out = self._fusion_combine(x, selected, weights)
        return out.reshape(batch_size, sequence_length, hidden_dim) + shared


class JambaStyleMixin(StackedExpertsMixin):
    """Jamba's block: ``router`` (nn.Linear), softmax, top-k not renormalised."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        x = hidden_states.view(-1, hidden_dim)
        router_logits = self.router(x)
        weights, selected = _softmax_top_k(router_logits, self.top_k, False, x.dtype)
        out = self._fusion_combine(x, selected, weights)
        return out.reshape(batch_size, sequence_length, hidden_dim), router_logits


#: The recognised block forwards (fingerprints of transformers 4.57.6's code).
TEMPLATES: tuple[Template, ...] = (
    Template("mixtral", {"forward": "77d0e5eaa3b5a611"}, MixtralStyleMixin, ("gate",)),  # Mixtral, MiniMax
    Template("qwen2_moe", {"forward": "f22333b1f606189e"}, SharedExpertStyleMixin,  # Qwen2-MoE, Qwen3-Next
             ("gate", "shared_expert", "shared_expert_gate")),
    Template("qwen3_moe", {"forward": "cb5e8eb91edba315"}, TopKStyleMixin, ("gate",)),
    Template("olmoe", {"forward": "0ad5eefe377fa1f0"}, TopKStyleMixin, ("gate",)),  # OLMoE, FlexOlmo
    Template("phimoe", {"forward": "98138e0745b938cb"}, PhimoeStyleMixin, ("gate",)),
    Template("deepseek_v2", {"forward": "fa8619a31437a423", "moe": "e7b317f10cd8ebf7"}, DeepseekV2StyleMixin,
             ("gate", "shared_experts"), router_module=True),
    Template("deepseek_v3", {"forward": "4dc47bf6568977b9", "moe": "6b6916c0a00750e5"}, DeepseekV3StyleMixin,
             ("gate", "shared_experts"), router_module=True),  # DeepSeek-V3, GLM-4-MoE, GLM-4.5V's text, dots1
    Template("ernie4_5_moe", {"forward": "a61014d03d9f8c09"}, Ernie45StyleMixin, ("gate", "moe_statics")),
    Template("hunyuan_v1_moe", {"forward": "1731962f37ee63ee"}, HunYuanStyleMixin, ("gate", "shared_mlp"),
             router_module=True),
    Template("jamba", {"forward": "c4b5494715ec3d00"}, JambaStyleMixin, ("router",), router="router"),
)

_template_cache: dict[type, Template | None] = {}


def template_for(cls: type) -> Template | None:
    """The template whose code ``cls`` runs, or None."""
    if cls not in _template_cache:
        fingerprints = method_fingerprints(cls, nn.Module)
        _template_cache[cls] = next((t for t in TEMPLATES if fingerprints == t.fingerprints), None)
    return _template_cache[cls]


def _names(expert: nn.Module) -> tuple[str, str, str]:
    scheme = EXPERT_FORWARDS.get(method_fingerprints(type(expert), nn.Module).get("forward") or "")
    if scheme is None or set(method_fingerprints(type(expert), nn.Module)) != {"forward"}:
        raise ValueError(f"{type(expert).__qualname__} is not a gated expert MLP this family recognises")
    return NAMES[scheme]


def _expert_refusal(experts: nn.ModuleList) -> str | None:
    shapes: set[tuple[Any, ...]] = set()
    activations: set[tuple[type, str]] = set()
    for index, expert in enumerate(experts):
        try:
            names = _names(expert)
        except ValueError as exc:
            return f"expert {index}: {exc}"
        projections = [expert._modules.get(name) for name in names]
        if not all(type(p) is nn.Linear for p in projections):
            return f"expert {index}: its {'/'.join(names)} are not all plain nn.Linear"
        if any(p.bias is not None for p in projections):  # type: ignore[union-attr]
            return f"expert {index}: a projection has a bias (the stacked layout holds weights only)"
        gate, up, down = (p.weight for p in projections)  # type: ignore[union-attr]
        if gate.shape != up.shape or down.shape != gate.shape[::-1]:
            shapes_seen = [tuple(t.shape) for t in (gate, up, down)]
            return f"expert {index}: gate/up/down shapes {shapes_seen} are not a gated MLP"
        act = getattr(expert, "act_fn", None)
        if not isinstance(act, nn.Module) or type(act).__module__ not in _ACTIVATION_MODULES:
            return f"expert {index}: activation {type(act).__qualname__} is not an activation of transformers or torch"
        shapes.add((tuple(gate.shape), gate.dtype, gate.device, up.dtype, down.dtype))
        activations.add((type(act), repr(act)))
    if len(shapes) != 1:
        return "the experts differ in shape, dtype or device (they are stacked into one tensor)"
    if len(activations) != 1:
        return "the experts use different activations (one runs for all)"
    return None


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not a sparse MoE block this family computes exactly; None when it is."""
    experts = module._modules.get("experts")
    if not isinstance(experts, nn.ModuleList):
        return (f"no experts ModuleList (transformers 5.x blocks hold their experts stacked already; this block's "
                f"experts is a {type(experts).__qualname__})")
    template = template_for(type(module))
    if template is None:
        return f"the forward of {type(module).__qualname__} is not one this family reproduces (see TEMPLATES)"
    if len(experts) == 0:
        return "no experts"
    missing = [name for name in template.children if module._modules.get(name) is None]
    if missing:
        return f"no {'/'.join(missing)} child (the original forward calls it)"
    if not template.router_module and type(module._modules[template.router]) is not nn.Linear:
        return f"the router {template.router} is not a plain nn.Linear"
    if template.name == "deepseek_v2" and (getattr(module, "ep_rank", None) != 0
                                           or getattr(module, "experts_per_rank", None) != len(experts)):
        return "expert parallelism (ep_rank / experts_per_rank) is not supported"
    if template.name == "hunyuan_v1_moe" and not isinstance(getattr(getattr(module, "config", None), "num_experts",
                                                                    None), int):
        return "num_experts is a per-layer list in the config (the stacked layout takes one expert count)"
    if GATE_UP in experts._parameters or DOWN in experts._parameters:
        return "the experts already hold stacked tensors"
    return _expert_refusal(experts)


def expert_count(config: Any) -> int | None:
    """The number of routed experts in ``config`` (its text config), for the transforms; None for a
    config that names none (not a mixture-of-experts model)."""
    if config is None:
        raise ValueError("moe_experts reads the number of experts from the model config; the kit takes config=")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in EXPERT_COUNT_ATTRIBUTES:
        count = getattr(text, name, None)
        if isinstance(count, int) and count > 0:
            return count
    return None


class MoeExpertsFamily(FusionFamily[MoeExpertsOptions]):
    """Sparse MoE blocks with ModuleList experts run as grouped GEMMs on stacked expert weights."""

    name = "moe_experts"
    options_model = MoeExpertsOptions
    owns_submodules: ClassVar[bool] = True  # the experts' MLPs are ours: gate_up leaves them to this family
    target_modules_patterns: ClassVar[Sequence[str]] = ()

    def is_fusable(self, module: nn.Module, options: MoeExpertsOptions) -> bool:
        return refusal(module) is None

    def refusal(self, module: nn.Module, options: MoeExpertsOptions) -> str | None:
        """The reason for a module with an ``experts`` child (a MoE block, fusable or not); None for the rest."""
        return refusal(module) if "experts" in module._modules else None

    def make_fused_class(self, original_cls: type[nn.Module], options: MoeExpertsOptions) -> type[nn.Module]:
        """One mixin per recognised forward (the templates compute differently), mixed in as usual."""
        template = template_for(original_cls)
        if template is None:
            raise ValueError(f"{original_cls.__qualname__} runs no forward moe_experts reproduces")
        return fused_subclass(template.mixin, original_cls)

    def make_transforms(self, config: Any, options: MoeExpertsOptions) -> list[WeightTransform]:
        """Both naming schemes, optional: a block has exactly one of them (``is_fusable`` checked)."""
        count = expert_count(config)
        if count is None:  # no expert count, no MoE block: discovery then finds nothing to fuse, as for any family
            return []
        transforms = []
        for gate, up, down in NAMES.values():
            transforms += [
                WeightTransform(
                    tuple(f"experts.{e}.{gate}.weight" for e in range(count))
                    + tuple(f"experts.{e}.{up}.weight" for e in range(count)),
                    (f"experts.{GATE_UP}",), StackPairs(count), optional=True),
                WeightTransform(tuple(f"experts.{e}.{down}.weight" for e in range(count)), (f"experts.{DOWN}",),
                                StackExperts(count), optional=True),
            ]
        return transforms
