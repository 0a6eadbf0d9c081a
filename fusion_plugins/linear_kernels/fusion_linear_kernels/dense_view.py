"""What ``layer.weight`` gives for a packed layer: a stand-in that reads and writes the weight as the dense tensor.

A packed weight is oneDNN's opaque tensor, which supports a packed GEMM and ``to_dense()`` and nothing else. Code
that reads ``layer.weight`` directly expects the dense ``[out, in]`` tensor: transformers'
``resize_token_embeddings`` (an untied LM head: ``old_lm_head.weight.data.to(torch.float32)``, then rows of it),
``init_weights`` / ``_init_weights`` (``init.normal_(module.weight)``), accelerate's offloading hooks
(``.to("meta")``), a user's ``lm_head.weight.norm()``. On the packed tensor each failed with torch's ``MkldnnCPU``
error where the original layer works; a dense copy would read right but drop every write.

So ``weight`` read from outside the layer (:attr:`fusion_linear_kernels.LinearKernelsMixin.weight`) is a
:class:`DenseView` of it: a tensor of the weight's shape, dtype and device, holding no data.

- Reading its metadata (``.shape``, ``.dtype``, ``.device``, ``.requires_grad``: what PEFT and accelerate look
  at) costs nothing and leaves the layer as it is.
- An operator on it runs on the dense weight (``to_dense()``, the original bytes).
- An operator that writes it (``normal_``, ``copy_``, ``zero_``, an ``out=``) writes the dense weight, which is
  packed again in its place: the write lands and the layer keeps its packed kernel.
- A view of it (``weight[:, :2]``, ``weight.data[0]``, ``weight.t()``) is a view too: it replays the view
  operators that made it on the dense weight, so ``weight[:n] = rows`` writes where it would on the original.
- ``.data = tensor`` stores the tensor's values as the weight (packed again); ``requires_grad`` set on it, and any
  other attribute (transformers marks a loaded parameter
  ``_is_hf_initialized``, and its ``_init_weights`` leaves such a one alone), is the parameter's.

The layer's own forward, copies, saves and ``.to()`` read the parameter itself (the packed tensor), and
``named_parameters()`` / ``state_dict()`` are unchanged. What it does not give: the parameter's identity
(``layer.weight is layer.weight`` is False, and an optimizer built from ``[layer.weight]`` holds the view: build it
from ``parameters()``), and gradients (a packed weight cannot be trained:
:func:`fusion_linear_kernels.packing.refusal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fusion_linear_kernels import compat
from fusion_linear_kernels.packing import unpack


class PackedLayer(Protocol):
    """The layer a view reads: its parameters, and how it packs a dense weight again."""

    _parameters: dict[str, Any]

    def store_dense_weight(self, dense: torch.Tensor) -> None: ...


ViewStep = tuple[Any, tuple[Any, ...], dict[str, Any], int | None]
"""A view operator applied to the weight: (operator, its other arguments, its keyword arguments, which output)."""


class DenseView(torch.Tensor):
    """``layer.weight`` of a packed layer, read as the dense weight (see the module docs); ``steps`` are the view
    operators that made a view of it."""

    layer: PackedLayer
    steps: tuple[ViewStep, ...]

    @staticmethod
    def __new__(cls, layer: PackedLayer, steps: tuple[ViewStep, ...] = (), like: torch.Tensor | None = None,
                ) -> DenseView:
        like = layer._parameters["weight"] if like is None else like
        view = compat.wrapper_tensor(cls, tuple(like.shape), like.dtype)
        view.layer, view.steps = layer, steps  # type: ignore[attr-defined]
        return view  # type: ignore[return-value]

    @property  # type: ignore[override]
    def requires_grad(self) -> bool:
        return bool(self.layer._parameters["weight"].requires_grad)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.layer._parameters["weight"].requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> DenseView:
        self.layer._parameters["weight"].requires_grad_(requires_grad)
        return self

    @property  # type: ignore[override]
    def data(self) -> DenseView:
        return DenseView(self.layer, self.steps, self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``layer.weight.data = tensor``: the layer holds ``tensor``'s values as its weight (packed again)."""
        if self.steps or tuple(value.shape) != tuple(self.shape):
            raise RuntimeError(f"linear_kernels: .data of a part of a packed weight, or with another shape "
                               f"({tuple(value.shape)} for {tuple(self.shape)}), cannot be set; set the layer's "
                               "weight to a new nn.Parameter instead")
        self.layer.store_dense_weight(value.detach().to(self.dtype).clone())

    def __getattr__(self, name: str) -> Any:
        # Attributes libraries keep on a parameter (transformers' ``_is_hf_initialized``, which its weight
        # initialisation reads to leave loaded weights alone) are the parameter's.
        if name in ("layer", "steps"):
            raise AttributeError(name)
        return getattr(self.layer._parameters["weight"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("layer", "steps") or isinstance(getattr(DenseView, name, None), property):
            super().__setattr__(name, value)  # the view's own, and its properties (``data``, ``requires_grad``)
        else:
            setattr(self.layer._parameters["weight"], name, value)

    def dense(self) -> torch.Tensor:
        """The dense values this view shows: new memory, the packed tensor's bytes."""
        return _replay(unpack(self.layer._parameters["weight"].detach()), self.steps)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DenseView of a prepacked weight:\n{self.dense()!r}"

    __torch_function__ = compat.NO_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        positions, is_view = compat.writes_and_views(func)
        written = _written(positions, args, kwargs)
        if isinstance(first, DenseView) and not written and is_view:
            rest = tuple(args[1:])
            out = func(first.dense(), *rest, **kwargs)  # for the views' shapes and dtypes
            if isinstance(out, torch.Tensor):
                return DenseView(first.layer, (*first.steps, (func, rest, kwargs, None)), out)
            return type(out)(DenseView(first.layer, (*first.steps, (func, rest, kwargs, index)), part)
                             for index, part in enumerate(out))
        bases: dict[int, torch.Tensor] = {}  # one dense weight per layer, shared by its views in this call
        shown: dict[int, torch.Tensor] = {}

        def substitute(value: Any) -> Any:
            if not isinstance(value, DenseView):
                return value
            if id(value) not in shown:
                layer = value.layer
                if id(layer) not in bases:
                    bases[id(layer)] = unpack(layer._parameters["weight"].detach())
                shown[id(value)] = _replay(bases[id(layer)], value.steps)
            return shown[id(value)]

        out = func(*compat.tree_map(substitute, tuple(args)), **compat.tree_map(substitute, kwargs))
        stored: set[int] = set()
        for view in written:
            if id(view.layer) not in stored:
                stored.add(id(view.layer))
                view.layer.store_dense_weight(bases[id(view.layer)])
        back = {id(shown[id(view)]): view for view in written}  # an in-place operator returns what it wrote
        return compat.tree_map(lambda value: back.get(id(value), value), out)


def _replay(tensor: torch.Tensor, steps: Sequence[ViewStep]) -> torch.Tensor:
    """``tensor`` seen through ``steps``: a view of it, so a write to it writes ``tensor``."""
    for func, rest, kwargs, index in steps:
        out = func(tensor, *rest, **kwargs)
        tensor = out if index is None else out[index]
    return tensor


def _written(positions: Sequence[str | int], args: Sequence[Any], kwargs: dict[str, Any]) -> list[DenseView]:
    """The views among the arguments an operator writes (an in-place self, an ``out=``), at ``positions``
    (:func:`fusion_linear_kernels.compat.writes_and_views`)."""
    found: list[DenseView] = []
    for where in positions:
        value = (args[where] if where < len(args) else None) if isinstance(where, int) else kwargs.get(where)
        if isinstance(value, DenseView) and all(value is not seen for seen in found):
            found.append(value)
    return found
