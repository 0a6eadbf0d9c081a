"""A public building block for families: one GEMM shared by projections that read the same input.

``qkv`` (``q_proj``/``k_proj``/``v_proj``) and ``gate_up`` (``gate_proj``/``up_proj``) are built
from it: a :class:`MergingFamily` (how to find an instance's projections, when to refuse, the
transforms) and a :class:`MergedProjectionsMixin` (the fused class). A new family that merges
sibling ``nn.Linear`` s with fixed names needs little more::

    class ABMixin(MergedProjectionsMixin):
        projections = ("a_proj", "b_proj")   # the children, in the order their rows are concatenated
        container = "ab_proj"                # where the merged tensors live (``ab_proj.weight``)

    class ABFamily(MergingFamily[FamilyOptions]):
        name, fused_mixin = "ab", ABMixin
        projections, container = ABMixin.projections, ABMixin.container
        def parts(self, module): return self.projections if self.candidate(module) else None
        def candidate(self, module): return all(n in module._modules for n in self.projections)
        def module_refusal(self, module): ...  # is_plain_linear, merge_refusal, the family's own checks

**How it computes.** The fused parent keeps its original ``forward``. Its projection children
are replaced by :class:`MergedSlice` modules that all read one merged weight, owned by the
merged container, a :class:`MergedProjection` (``parent.qkv_proj``: an ``nn.Linear`` of all the
parts' rows). In eager mode, the first slice
called with an input computes the whole merged GEMM once and keeps the output; a sibling
called with the *same* tensor (same object, same version counter, same grad mode) gets its
columns of that output, a view, without another GEMM. Any other input is answered from the
slice's own rows of the weight, so the result is always the projection the original
``nn.Linear`` computed, whatever order or inputs the parent uses. The cache is dropped once every
sibling has taken its part; a group whose merged output is ever left partly unused
(cross-attention, layers reusing another layer's keys and values) stops merging for good.
Whether the merged GEMM is used at all for a given kind of call is decided by
:mod:`fusion_core.merge_policy`: by default it is measured once against one GEMM per part, and
the faster runs (a wide GEMM is not always faster than the narrow ones it replaces).

**Under torch.compile and torch.export** every slice computes its own rows
(``linear(x, weight[rows], bias[rows])``): the input-identity cache is Python state that dynamo
would have to guard and break on, while the per-slice GEMM traces into the graph like the
original ``nn.Linear`` did, so a fused model compiles with ``fullgraph=True`` and the same
graph breaks as the unfused one. A container with no rows to run per part (replaced by a
quantizer's module, or holding its weight in an opaque packed layout) runs the merged GEMM once for
the siblings reading one traced input (:meth:`MergedLinear._traced_through`).

**One place for the split.** The part sizes live in :attr:`MergedLinear.sizes` (and the row
ranges derived from them in :attr:`MergedLinear.bounds`), nothing else hard-codes them, and the
merged tensors are ordinary parameters of the container module: a variant that holds only one
rank's rows of every part (tensor parallelism) changes the sizes and the transforms, not the
slices.

**Quantizers.** The container is an ``nn.Linear``, so quantizers that pick modules with
``isinstance(m, nn.Linear)`` (torchao's ``quantize_``, quanto's ``quantize``) quantize the merged
weight as one layer, the way they quantize the parts on the unfused model: for per-output-channel
schemes the merged quantized weight is exactly the parts' quantized data and scales, concatenated.
A container whose weight is a quantizer's tensor, or that a quantizer replaced by its own module,
is called as a module (its quantized kernel, one merged GEMM) and sliced; nothing is run per part.

**Adapters and copies.** A slice is deliberately not an ``nn.Linear`` (initialisers and
quantisers that match ``isinstance(m, nn.Linear)`` would write a new tensor over a view, and
the merged weight would not see it); the PEFT integration (``fusion-peft``) gives PEFT a LoRA
layer for it. ``copy.deepcopy`` and pickling keep the slices tied to the copied container.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.nn import functional as F

from fusion_core import merge_policy
from fusion_core.compat.torch import version_counter
from fusion_core.spec import FusedModule, FusionFamily, OptionsT
from fusion_core.transforms import Concat, TransformOp, WeightTransform
from fusion_core.wrapped import row_slice

#: Input shapes whose decision kind a merged projection remembers (a cap: prompt lengths vary).
_MEMO_SIZE = 64

#: Set on a merged container (``qkv_proj``): the names of the projections it holds (read: :func:`container_parts`).
_PARTS_ATTRIBUTE = "fusion_merged_parts"

LinearKernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""What :attr:`MergedLinear.kernel` holds: ``kernel(input, weight, bias)``, computing ``F.linear(input, weight,
bias)``."""


class MergedLinear:
    """The merged projection of one fused module: weight owner, part sizes and the eager output cache.

    ``sizes`` are the parts' row counts in concatenation order and ``bounds`` their row ranges
    in ``owner.weight``; ``merged_gemms`` / ``own_gemms`` count the GEMMs run in eager mode (a
    test can see whether calls were merged), and ``merging`` turns False for good once a merged
    output was left partly unused.

    A plain object (not an ``nn.Module``), so it adds nothing to ``state_dict``, ``parameters``
    or ``named_modules``; it reads the tensors from ``owner`` (the fused module's ``qkv_proj`` /
    ``gate_up_proj`` container) at every call, so ``.to()``, ``load_state_dict`` and device maps
    that replace the parameters are seen at once.
    """

    _traced: tuple[torch.Tensor, list[torch.Tensor], int] | None = None
    """:meth:`_traced_through`'s cache (input, columns, parts still owed), set only while tracing."""
    kernel: LinearKernel | None = None
    """The extension point for the eager GEMMs of a plain container: None runs ``F.linear``; a family that picks
    faster kernels (``linear_kernels``) sets a picklable callable computing the same projection. Never called
    under ``torch.compile`` (see :attr:`traced_kernel`), nor for a container a quantizer replaced by its own module."""
    traced_kernel: LinearKernel | None = None
    """The extension point for a plain container under ``torch.compile``: None runs each part's own ``F.linear`` on
    its rows; a family may set a picklable callable that dynamo can trace (operators with fake implementations),
    computing ``F.linear(input, weight, bias)``: the traced code calls it once on the merged weight and gives each
    part its columns (as :meth:`_traced_through` does for a replaced container)."""

    def __init__(self, owner: nn.Module, sizes: tuple[int, ...], parent: nn.Module | None = None,
                 container: str | None = None) -> None:
        self._owner = owner
        self._parent, self._container = parent, container
        self.sizes = tuple(sizes)
        starts = [0]
        for size in self.sizes[:-1]:
            starts.append(starts[-1] + size)
        self.bounds = tuple((start, start + size) for start, size in zip(starts, self.sizes, strict=True))
        self.merging = True
        self.merged_gemms = 0
        self.own_gemms = 0
        self._all = (1 << len(self.sizes)) - 1  # a bit per part: the parts a cached output still owes
        self._cache: list[Any] | None = None
        self._traced = None  # an instance attribute from the start: dynamo guards on whether the dict holds it
        self._kinds: dict[tuple[Any, ...], merge_policy.Kind] = {}
        self.originals: dict[str, nn.Module] = {}
        """The emptied original projection modules, by child name (what :func:`unmerge_children` restores)."""

    @property
    def owner(self) -> nn.Module:
        """The merged container, read from the parent at every call: a quantizer may have replaced it."""
        if self._parent is not None and self._container is not None:
            current = self._parent._modules.get(self._container)
            if current is not None:
                return current
        return self._owner

    @property
    def weight(self) -> torch.Tensor:
        weight = self.owner._parameters.get("weight")
        return weight if weight is not None else cast(torch.Tensor, self.owner.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        parameters = self.owner._parameters
        if "bias" in parameters:  # merge_children registers a missing bias as None, as nn.Linear does
            return parameters["bias"]
        bias: torch.Tensor | None = getattr(self.owner, "bias", None)
        return bias

    def rows(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """Rows of part ``index`` of a merged weight or bias: a view, no copy.

        A weight held in an opaque runtime layout (not strided: ``linear_kernels`` packs a merged container's
        weight for oneDNN, and the container then runs the merged GEMM itself) has no rows to view: its rows are
        those of what the container gives as its ``weight`` where that is strided (``linear_kernels`` gives a view
        that reads and writes the dense weight, so ``q_proj.weight.data.normal_()`` lands), else of a dense copy,
        for code that reads ``q_proj.weight`` (writing to a copy changes nothing).
        """
        start, stop = self.bounds[index]
        if tensor.layout != torch.strided:
            shown = getattr(self.owner, "weight", None) if tensor is self.owner._parameters.get("weight") else None
            tensor = shown if isinstance(shown, torch.Tensor) and shown.layout == torch.strided else tensor.to_dense()
        return row_slice(tensor, start, stop)

    def part(self, tensor: torch.Tensor | None, index: int) -> torch.Tensor | None:
        """:meth:`rows`, passing None through (a projection without bias)."""
        return None if tensor is None else self.rows(tensor, index)

    def __call__(self, index: int, input: torch.Tensor) -> torch.Tensor:
        """Part ``index`` of the merged projection of ``input``: what the original projection computed."""
        owner = self.owner
        if torch.compiler.is_compiling():
            # Traced code gets the original projection's own GEMM: no Python state to guard on (a
            # container a quantizer replaced is called as the module it now is).
            if type(owner) is not MergedProjection:
                return self._traced_through(owner, index, input)
            traced = self.traced_kernel
            if traced is not None:  # one call of the family's kernel on the merged weight, its columns for the parts
                return self._traced_columns(index, input, lambda: traced(input, self.weight, self.bias))
            return F.linear(input, self.rows(self.weight, index), self.part(self.bias, index))
        if not _runs_plain(owner):
            return self._through(owner, index, input)
        cache = self._cache
        if cache is not None:
            cached_input, version, grad, parts, pending = cache
            if cached_input is input and grad == torch.is_grad_enabled() and version == version_counter(input):
                pending &= ~(1 << index)
                if pending:
                    cache[4] = pending
                else:
                    self._cache = None
                part: torch.Tensor = parts[index]
                return part
            # A merged output left partly unused: merging does not pay for this module.
            self._cache = None
            self.merging = False
        weight, bias = self.weight, self.bias
        linear = self.kernel or F.linear
        if not (self.merging and self._merge_pays(input, weight, bias)):
            self.own_gemms += 1
            return linear(input, self.rows(weight, index), self.part(bias, index))
        output = linear(input, weight, bias)
        self.merged_gemms += 1
        grad = torch.is_grad_enabled()
        # Without autograd one split makes every part's view in one operator. With autograd, each
        # part is its own view: the views of one split may not be written in place, and a parent
        # may write a projection's output in place (it could with the original nn.Linear's).
        parts = (torch.split_with_sizes(output, self.sizes, dim=-1) if not grad
                 else [output.narrow(-1, start, stop - start) for start, stop in self.bounds])
        pending = self._all & ~(1 << index)
        if pending:
            self._cache = [input, version_counter(input), grad, parts, pending]
        return parts[index]

    def _through(self, owner: nn.Module, index: int, input: torch.Tensor) -> torch.Tensor:
        """A container a quantizer replaced by its own module: its forward (the quantizer's kernel), one merged
        GEMM, sliced (the parts' own GEMMs are not known to exist for its weight)."""
        cache = self._cache
        if cache is not None:
            cached_input, version, grad, parts, pending = cache
            if cached_input is input and grad == torch.is_grad_enabled() and version == version_counter(input) and (
                pending >> index
            ) & 1:
                pending &= ~(1 << index)
                self._cache = [cached_input, version, grad, parts, pending] if pending else None
                cached: torch.Tensor = parts[index]
                return cached
        output = cast(torch.Tensor, owner(input))
        self.merged_gemms += 1
        columns = [output.narrow(-1, lo, hi - lo) for lo, hi in self.bounds]
        pending = self._all & ~(1 << index)
        self._cache = [input, version_counter(input), torch.is_grad_enabled(), columns, pending] if pending else None
        return columns[index]

    def _traced_through(self, owner: nn.Module, index: int, input: torch.Tensor) -> torch.Tensor:
        """:meth:`_through` as traced code: a replaced container has no rows to run per part (a quantizer's module, a
        weight in an opaque packed layout), so it runs once for the siblings (:meth:`_traced_columns`)."""
        return self._traced_columns(index, input, lambda: cast(torch.Tensor, owner(input)))

    def _traced_columns(self, index: int, input: torch.Tensor, merged: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Part ``index`` as traced code, from one merged call (``merged()``) for the siblings that read the same
        traced input: its columns answer them.

        Without this each sibling would run the whole merged call, and nothing in the compiled graph merges identical
        calls of an opaque kernel. The cache holds traced tensors within one traced forward only (dynamo replays the
        attribute writes; the last sibling empties it); unlike :meth:`_through`, it cannot see an in-place write to
        the input between two siblings, which no attention or MLP forward makes."""
        cache = self._traced
        if cache is not None and cache[0] is input and (cache[2] >> index) & 1:
            pending = cache[2] & ~(1 << index)
            self._traced = (input, cache[1], pending) if pending else None
            cached: torch.Tensor = cache[1][index]
            return cached
        output = merged()
        columns = [output.narrow(-1, start, stop - start) for start, stop in self.bounds]
        pending = self._all & ~(1 << index)
        self._traced = (input, columns, pending) if pending else None
        return columns[index]

    def _merge_pays(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this call runs the merged GEMM (:mod:`fusion_core.merge_policy`); kinds memoised by shape."""
        key = (input.shape, input.dtype, input.device)
        kind = self._kinds.get(key)
        if kind is None:
            if len(self._kinds) >= _MEMO_SIZE:
                self._kinds.clear()
            kind = self._kinds[key] = merge_policy.kind_of(input, weight, self.sizes, bias is not None)
        return merge_policy.merge_pays(kind, input, weight, bias, self.bounds)

    def clear(self) -> None:
        """Drop a cached output (it is dropped by itself once all parts were taken)."""
        self._cache = None

    def __getstate__(self) -> dict[str, Any]:
        # A cached output is transient: copies and pickles never carry one.
        return {**self.__dict__, "_cache": None, "_traced": None, "_kinds": {}}


def _runs_plain(owner: nn.Module) -> bool:
    """Whether the container is still fusion-core's own ``MergedProjection`` holding a weight (torch's tensor, a
    DTensor, or a quantizer's tensor subclass such as torchao's, which ``F.linear`` and row slices dispatch to),
    not a module a quantizer put in its place."""
    return type(owner) is MergedProjection and owner._parameters.get("weight") is not None


class MergedProjection(nn.Linear):
    """The merged container (``qkv_proj``): an ``nn.Linear`` holding every part's rows, in order.

    Being an ``nn.Linear`` is what lets quantizers and tools that pick ``isinstance(m, nn.Linear)``
    treat the merged weight as the one layer it is (see the module docs). It is built by
    :func:`merge_children` from the container that holds the concatenated tensors, never by
    ``__init__``; the fused parent calls it through :class:`MergedLinear`, not directly.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("MergedProjection is made by fusion_core.merged.merge_children, not constructed")


class MergedSlice(nn.Module):
    """Stands where one original projection ``nn.Linear`` was; computes exactly what it computed.

    ``weight`` and ``bias`` are views of the merged tensors (read-only properties, not
    parameters: the merged container owns them), so code that inspects ``proj.weight.dtype``
    keeps working. It is deliberately not an ``nn.Linear``: initialisers that match
    ``isinstance(m, nn.Linear)`` must not write into the merged weight through a view.
    """

    merged: MergedLinear

    def __init__(self, merged: MergedLinear, index: int, in_features: int) -> None:
        """Part ``index`` of ``merged``; ``in_features`` is the width every part reads."""
        super().__init__()
        self.__dict__["merged"] = merged  # not a sub-module: the fused parent owns the tensors
        self.index = index
        self.in_features = in_features
        self.out_features = merged.sizes[index]

    @property
    def weight(self) -> torch.Tensor:
        return self.merged.rows(self.merged.weight, self.index)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.merged.part(self.merged.bias, self.index)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.merged(self.index, input)

    def extra_repr(self) -> str:
        start, stop = self.merged.bounds[self.index]
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.merged.bias is not None}, rows={start}:{stop} of the merged projection"
        )


def merge_children(parent: nn.Module, names: tuple[str, ...], container: str) -> MergedLinear:
    """Replace ``parent``'s children ``names`` by slices of ``parent.<container>``'s merged tensors.

    Called from ``fusion_finalize`` after fusion-core concatenated the children's tensors into
    the container. The children's sizes come from the (now empty) original ``nn.Linear`` s, or
    from existing slices when the module is finalised again.
    """
    owner = parent._modules.get(container)
    weight = owner._parameters.get("weight") if owner is not None else None
    if owner is None or weight is None:
        raise RuntimeError(f"{type(parent).__name__}: no merged {container}.weight to run {names} from")
    children: list[Any] = [parent._modules[name] for name in names]
    sizes = tuple(int(child.out_features) for child in children)
    in_features = int(children[0].in_features)
    if sum(sizes) != weight.shape[0] or weight.shape[-1] != in_features:
        raise RuntimeError(
            f"{type(parent).__name__}: merged {container}.weight has shape {tuple(weight.shape)}, "
            f"expected ({sum(sizes)}, {in_features}) for {dict(zip(names, sizes, strict=True))}"
        )
    if "bias" not in owner._parameters and "bias" not in owner._buffers:
        owner.register_parameter("bias", None)  # what nn.Linear(bias=False) has: a fast, uniform lookup
    if type(owner) is nn.Module:
        owner.__class__ = MergedProjection
        owner.__dict__["in_features"], owner.__dict__["out_features"] = in_features, sum(sizes)
    merged = MergedLinear(owner, sizes, parent, container)
    for index, name in enumerate(names):
        parent._modules[name] = MergedSlice(merged, index, in_features)
    merged.originals = dict(zip(names, children, strict=True))
    owner.__dict__[_PARTS_ATTRIBUTE] = tuple(names)
    return merged


def unmerge_children(parent: nn.Module, merged: MergedLinear) -> None:
    """Undo :func:`merge_children`: put the original (emptied) projection modules back in place.

    Their tensors are restored afterwards by :func:`fusion_core.layout.unfuse_instance` from the
    merged tensors; here only the module tree goes back to what the original class built.
    """
    for name, original in merged.originals.items():
        if not isinstance(parent._modules.get(name), MergedSlice):
            raise RuntimeError(
                f"{type(parent).__name__}.{name} is a {type(parent._modules.get(name)).__name__}, not the merged "
                "slice fusion put there (an adapter still attached?)"
            )
        parent._modules[name] = original
    owner = merged.owner
    if type(owner) is MergedProjection:
        owner.__class__ = nn.Module  # type: ignore[assignment]  # back to the plain holder it was
        del owner.__dict__["in_features"], owner.__dict__["out_features"]
    if "bias" in owner._parameters and owner._parameters["bias"] is None:
        del owner._parameters["bias"]  # the placeholder merge_children registered: an empty container is dropped
    owner.__dict__.pop(_PARTS_ATTRIBUTE, None)


def container_parts(module: nn.Module) -> tuple[str, ...] | None:
    """The names of the projections a merged container (``qkv_proj``) holds, in row order; None for any other module."""
    parts: tuple[str, ...] | None = module.__dict__.get(_PARTS_ATTRIBUTE)
    return parts


def merged_projection(module: nn.Module) -> MergedLinear | None:
    """The merged projection a fused module's parts share (``qkv``, ``gate_up``), or None for any other module."""
    merged = module.__dict__.get("_fusion_merged")
    return merged if isinstance(merged, MergedLinear) else None


def is_plain_linear(module: Any) -> bool:
    """An ``nn.Linear`` (or a subclass keeping its forward) with a 2-D weight parameter."""
    return (
        isinstance(module, nn.Linear)
        and type(module).forward is nn.Linear.forward
        and isinstance(module._parameters.get("weight"), nn.Parameter)
        and module.weight.dim() == 2
    )


def merge_refusal(module: nn.Module, projections: Sequence[nn.Linear], container: str) -> str | None:
    """The checks every merging family shares; the reason a merge is impossible, or None.

    The projections' tensors must share one dtype and device (they are concatenated), and the
    module must not already have an attribute called ``container``.
    """
    tensors = [t for p in projections for t in (p.weight, p.bias) if t is not None]
    if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
        return "projection tensors differ in dtype or device"
    if container in module._modules or container in module._parameters or hasattr(module, container):
        return f"the module already has a {container!r}"
    return None


class MergedProjectionsMixin(FusedModule):
    """Fused behaviour for a module whose ``projections`` children share one merged GEMM.

    A family's mixin subclasses this and sets ``projections`` (the children's names, in the
    order their tensors are concatenated) and ``container`` (where the merged tensors live).
    """

    projections: ClassVar[tuple[str, ...]]
    container: ClassVar[str]

    def merged_parts(self) -> tuple[str, ...] | None:
        """This instance's projection children, in concatenation order (default: ``projections``); None: none."""
        return self.projections

    def fusion_finalize(self) -> None:
        """Replace the projection children by slices of the merged container's tensors."""
        names = self.merged_parts()
        if names is None:
            raise RuntimeError(f"{type(self).__name__}: no single set of projections to merge into {self.container}")
        self.__dict__["_fusion_merged"] = merge_children(self, names, self.container)

    def fusion_unfinalize(self) -> None:
        """Put the original projection children back (their tensors are restored by the caller)."""
        unmerge_children(self, self.__dict__.pop("_fusion_merged"))

    @property
    def fused_projection(self) -> MergedLinear:
        """The merged projection (its counters show whether calls were merged)."""
        merged: MergedLinear = self.__dict__["_fusion_merged"]
        return merged


def merged_transforms(names: Sequence[str], container: str, biased: Sequence[bool],
                      partial_bias: Callable[[tuple[int, ...]], TransformOp] | None = None) -> list[WeightTransform]:
    """The transforms that concatenate ``names``' weights (and biases) along dim 0 into ``container``.

    Biases: all present, one ``Concat`` too; none, weights only; some, ``partial_bias(present indices)``
    gives the op (``qkv``: zero rows where a projection has none), and without it the merge is impossible.
    """
    n = len(names)
    weights = WeightTransform(tuple(f"{p}.weight" for p in names), (f"{container}.weight",), Concat(n=n, dim=0))
    present = tuple(i for i, has in enumerate(biased) if has)
    if not present:
        return [weights]
    if len(present) == n:
        op: TransformOp = Concat(n=n, dim=0)
    elif partial_bias is None:
        raise ValueError(f"a bias on some of {list(names)} but not all: they cannot be merged")
    else:
        op = partial_bias(present)
    return [weights, WeightTransform(tuple(f"{names[i]}.bias" for i in present), (f"{container}.bias",), op)]


class MergingFamily(FusionFamily[OptionsT]):
    """The family side of a merge, what ``qkv`` and ``gate_up`` share (their mixins: :class:`MergedProjectionsMixin`).

    A subclass says how to find an instance's projections (:meth:`parts`), whether a module looks like
    a candidate at all (:meth:`candidate`: its refusals are reported, the rest of the model's are not)
    and why a candidate cannot merge (:meth:`module_refusal`); ``projections`` and ``container`` name the
    usual children and the merged one (what tensor-parallel plans and :meth:`make_transforms` name).
    """

    projections: ClassVar[tuple[str, ...]]
    container: ClassVar[str]

    def parts(self, module: nn.Module) -> tuple[str, ...] | None:
        """The names of ``module``'s projections to merge, in concatenation order; None without one set."""
        raise NotImplementedError(f"family {self.name!r} must implement parts")

    def candidate(self, module: nn.Module) -> bool:
        """Whether ``module`` has projections of the kind the family merges (merging them or not)."""
        raise NotImplementedError(f"family {self.name!r} must implement candidate")

    def module_refusal(self, module: nn.Module) -> str | None:
        """Why ``module`` cannot run its projections as one merged GEMM exactly and usefully; None when it can."""
        raise NotImplementedError(f"family {self.name!r} must implement module_refusal")

    def partial_bias(self, sizes: tuple[int, ...]) -> Callable[[tuple[int, ...]], TransformOp] | None:
        """The op merging the biases when only some projections (of ``sizes`` rows) have one; None: refused."""
        return None

    def is_fusable(self, module: nn.Module, options: OptionsT) -> bool:
        return self.module_refusal(module) is None

    def refusal(self, module: nn.Module, options: OptionsT) -> str | None:
        """The reason for a candidate module; None for the rest of the model."""
        return self.module_refusal(module) if self.candidate(module) else None

    def make_transforms(self, config: Any, options: OptionsT) -> list[WeightTransform]:
        """The transforms of the usual ``projections`` (what tensor-parallel plans name); every fused module
        gets its own from :meth:`module_transforms`."""
        concat = Concat(n=len(self.projections), dim=0)
        return [WeightTransform(tuple(f"{p}.{leaf}" for p in self.projections), (f"{self.container}.{leaf}",), concat,
                                optional=leaf == "bias") for leaf in ("weight", "bias")]

    def module_transforms(self, module: nn.Module, config: Any, options: OptionsT) -> list[WeightTransform]:
        """The transforms of this module's projections, under its own names and with its own biases."""
        names = self.parts(module)
        if names is None:
            raise ValueError(f"{type(module).__name__} has no single set of projections for {self.name!r}")
        children = [cast(nn.Linear, module._modules[name]) for name in names]
        return merged_transforms(names, self.container, [c.bias is not None for c in children],
                                 self.partial_bias(tuple(int(c.out_features) for c in children)))
