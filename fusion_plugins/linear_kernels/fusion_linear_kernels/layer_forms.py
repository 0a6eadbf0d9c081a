"""The forms of decoder layer the decode step knows (:mod:`fusion_linear_kernels.decode_layer`), and how they are told
apart: the norms' kind and the activation's on inputs of their own, the composition with stand-ins for the attention
and the MLP (:class:`StandIn`, :func:`composed`), the arithmetic within :func:`tolerance`.

Two compositions: Llama's pre-norm layer (``r = h + attn(norm(h))``, then ``r + mlp(norm(r))``) and the sandwich of
Gemma 2 and 3 and of GLM-4 (the attention's and the MLP's outputs normed before each residual: two more norms, named
as :data:`SANDWICHES` lists).
Two RMSNorms: Llama's (the normalised input rounded to the dtype, times the weight) and Gemma's (times 1 + the weight
in float32, rounded once). Two activations: SiLU and GELU's tanh approximation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""The children a layer must have to be considered (the pre-filter; the form is verified on the weights)."""
Sandwich = tuple[str, str, str]
"""The norms of a sandwich form by name: the attention output's, the MLP input's and the MLP output's."""
SANDWICHES: tuple[Sandwich, ...] = (
    ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),  # Gemma 2 and 3
    ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),  # GLM-4
)
"""The sandwich forms' names (the composition is verified on the layer, whatever the names say)."""


def sandwich_of(layer: nn.Module) -> Sandwich | None:
    """The first of :data:`SANDWICHES` whose norms are all children of ``layer``, or None (a pre-norm layer)."""
    modules = layer._modules
    return next((names for names in SANDWICHES if all(isinstance(modules.get(name), nn.Module) for name in names)),
                None)


def composed(layer: nn.Module, hidden: torch.Tensor, attention: torch.Tensor,
             sandwich: Sandwich | None) -> torch.Tensor:
    """What the verified form computes after the attention, by the layer's own modules: ``r = h + attention`` (the
    attention's output normed first in a sandwich form), then ``r + mlp(norm(r))`` (the MLP's output normed)."""
    modules = layer._modules
    if sandwich is not None:
        attention_out, mlp_in, mlp_out = sandwich
        residual = hidden + modules[attention_out](attention)
        return residual + modules[mlp_out](modules["mlp"](modules[mlp_in](residual)))
    residual = hidden + attention
    return residual + modules["mlp"](modules["post_attention_layernorm"](residual))


def epsilon(norm: nn.Module) -> float | None:
    """The epsilon a norm holds (``variance_epsilon`` or ``eps``), or None."""
    for name in ("variance_epsilon", "eps"):
        value = norm.__dict__.get(name)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return None


def norm_kind(norm: nn.Module, dtype: torch.dtype, eps: float, width: int) -> bool | None:
    """Whether ``norm`` is Gemma's RMSNorm (times 1 + the weight in float32; True) or Llama's (the normalised input
    rounded, times the weight; False), by its output on a random input; None for neither."""
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    weight = norm._parameters["weight"]
    try:
        with torch.no_grad():
            got = norm(x)
            wide = x.float()
            normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
            references = {False: weight * normed.to(dtype), True: (normed * (1.0 + weight.float())).to(dtype)}
    except Exception:  # a norm that cannot run on a plain input is neither
        return None
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return None
    return next((kind for kind, reference in references.items()
                 if relative(reference, got) <= tolerance(dtype)), None)


def activation(act: nn.Module, dtype: torch.dtype) -> str | None:
    """``"silu"`` or ``"gelu"`` (the tanh approximation) where ``act`` gives that function's bits on inputs across
    its range (what the kernel computes), else None."""
    z = torch.linspace(-12.0, 12.0, 2049).to(dtype)
    functions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": torch.nn.functional.silu, "gelu": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}
    try:
        with torch.no_grad():
            got = act(z)
            return next((name for name, function in functions.items() if torch.equal(got, function(z))), None)
    except Exception:  # an activation that cannot run on a vector is neither
        return None


class Marker:
    """An argument the verification passes the layer, to see that it reaches the attention as it is."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<argument {self.name}>"


class StandIn(nn.Module):
    """Stands in for a layer's attention or MLP while its form is verified: returns a fixed function of its input (its
    features reversed, times a power of two: exact in every dtype), alone or as the attention's pair, and records what
    it was passed."""

    def __init__(self, scale: float, pair: bool) -> None:
        super().__init__()
        self.scale, self.pair = scale, pair
        self.calls: list[dict[str, Any]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(hidden, torch.Tensor):
            raise TypeError("no hidden states reached the stand-in")
        self.calls.append({**dict(enumerate(args)), **kwargs, "hidden_states": hidden.clone()})
        out = hidden.flip(-1) * self.scale
        return (out, None) if self.pair else out


def tolerance(dtype: torch.dtype) -> float:
    """The largest difference from the original allowed at verification, relative to the largest element: two
    steps of the dtype's precision (a last-bit difference of a norm carried through the down GEMV)."""
    return max(2 * torch.finfo(dtype).eps, 1e-5)


@contextlib.contextmanager
def swapped(layer: nn.Module, **children: nn.Module) -> Iterator[None]:
    """``layer``'s children replaced by ``children`` for the block (restored whatever happens)."""
    saved = {name: layer._modules[name] for name in children}
    layer._modules.update(children)
    try:
        yield
    finally:
        layer._modules.update(saved)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between ``a`` and ``b``, relative to ``a``'s largest element."""
    return float((a.float() - b.float()).abs().max()) / (float(a.float().abs().max()) or 1.0)
