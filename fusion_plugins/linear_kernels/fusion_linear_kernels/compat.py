"""The private names fusion-linear-kernels uses: torch's oneDNN prepacked linear weight, torch's int8
weight-only GEMM, and the fields of torchao's int8 weight-only tensor that GEMM reads; nothing else.

torch ships oneDNN's prepacked linear for its own compiler (Inductor's CPU weight freezing) under
``torch.ops.mkldnn``, without a public name:

- ``torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)`` returns the ``[out, in]`` weight
  reordered into the blocked layout oneDNN's GEMM reads: a ``torch.Tensor`` with layout
  ``torch._mkldnn`` (``tensor.is_mkldnn``), the same shape, dtype and device, no storage that Python
  can see (no ``data_ptr``, no pickling), ``to_dense()`` giving the original bytes back;
- ``torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")`` computes
  ``F.linear(input, weight, bias)`` from it, without reordering the weight on every call (what
  ``F.linear`` does for bfloat16 on CPU, and what makes it slower at few rows).

Checked on torch 2.13.0+cpu (the one build this project installs). Where the operators are missing
(a build without oneDNN) :func:`available` is False and nothing is packed: every layer keeps its
dense weight and ``F.linear``.

``torch._weight_int8pack_mm(input, int8_weight, scales)`` computes ``input @ (int8_weight * scales[:, None]).T``
for an ``[out, in]`` int8 weight with one scale per output row (a CPU kernel; the scales in the input's
dtype). torchao's int8 weight-only quantization (``Int8WeightOnlyConfig``; torchao 0.18's ``Int8Tensor``)
holds exactly that: ``qdata`` (``[out, in]`` int8), ``scale`` (``[out, 1]`` float32), ``block_size``
``[1, in]`` (one scale per row), a zero point of zeros and no activation quantization (``act_quant_kwargs``
None), while its own CPU ``F.linear`` dispatch is slower at one row (``benchmarks/bench_decode.py
--quantize int8wo`` measures both). :func:`int8_rows` reads those fields by name and returns None for
anything else (a nonzero zero point, another block size, quantized activations).

The experts' packed stacks (:class:`fusion_linear_kernels.packed_experts.PackedExperts`) are a tensor subclass
without storage of their own, built the way torch documents for wrapper subclasses: :func:`wrapper_tensor` calls
``torch.Tensor._make_wrapper_subclass``, and :data:`NO_TORCH_FUNCTION` is ``torch._C._disabled_torch_function_impl``
(the subclass handles operators in ``__torch_dispatch__`` only). The view a packed layer's ``weight`` gives
(:mod:`fusion_linear_kernels.dense_view`) is another such subclass: it reads an operator's schema
(``OpOverload._schema``: which arguments it writes, whether it returns a view) with :func:`writes_and_views`,
and maps its arguments with ``torch.utils._pytree.tree_map`` (:func:`tree_map`), as torch's own wrapper
subclasses do.

A custom operator's kernel runs with autograd's dispatch keys excluded from the thread's dispatch state, so
autograd records nothing inside it. The backward of the packed experts' operator recomputes the experts under
autograd inside another operator (a traced backward must not look inside): :func:`recording_inside_an_operator`
clears the excluded keys for that block with ``torch._C._ForceDispatchKeyGuard`` (the thread's include set
kept, nothing excluded), as torch's own ``torch._C._AutoDispatchBelowAutograd`` guard sets them.

The GEMV kernel (:mod:`fusion_linear_kernels.row_dot`: the row-dot, blocked-rows and both few-rows candidates) is C++
of its own, written with torch's vector types (``at::vec``), which :func:`cpp_kernel` builds with the toolchain and
flags Inductor builds its own kernels with (``torch._inductor.codecache.CppPythonBindingsCodeCache.load_pybinding``:
a Python binding that takes tensors as pointers and integers, cached on disk by the source's hash). A later process
loads that binding's file directly (:func:`load_kernel`, reading the environment variable Inductor's binding reads
when it initialises), where the file :func:`library_of` gave is stored for the machine. Its calls are
no operator of torch's, so the profiler sees them only where they label themselves, which they do while
:func:`profiling` (torch's own flag, ``torch.autograd.profiler._is_profiler_enabled``) is set.

A decoder layer's decode step (:mod:`fusion_linear_kernels.decode_layer`) computes its norms and MLP without calling
those modules, so it must see whether a forward hook would have seen those calls: :func:`forward_hooks` reads each
module's ``_forward_hooks`` and ``_forward_pre_hooks`` and the global ones in ``torch.nn.modules.module`` (where
``register_forward_hook`` and ``register_module_forward_hook`` keep them; torch has no public way to ask). Its
attention (:mod:`fusion_linear_kernels.decode_attention`) replaces the module's call where the model attends with
``sdpa``, which :func:`attention_implementation` reads from the module's config (transformers'
``config._attn_implementation``, which ``set_attn_implementation`` writes and its attention modules read at each call;
transformers has no public getter on the config of 4.57).

One private method of ``nn.Module`` is overridden, not called from here: the fused class's
``_apply`` (what ``.to()``, ``.half()``, ``.cuda()`` call on every module; unchanged since torch 1.0)
unpacks the weight before ``nn.Module._apply`` runs and packs it again only where it still may be
(:class:`fusion_linear_kernels.family.LinearKernelsMixin`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.autograd.profiler
from torch import nn
from torch.nn.modules import module as torch_module


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (and oneDNN is enabled)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018  (resolving the name loads the op or raises)
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``, dense, on the CPU) in oneDNN's blocked layout for few-row GEMMs."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
    return packed


def packed_linear(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for ``packed = pack(weight)``; no autograd (see :mod:`.packing`)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(input.contiguous(), packed, bias, "none", [], "")
    return out


#: :func:`int8_rows` by tensor object (``id``), dropped when the tensor is: it is asked at every call of a layer.
_INT8_ROWS: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(int8 [out, in], scales [out])`` of an int8 weight-only tensor with one scale per output row and no zero
    point (torchao's ``Int8Tensor`` from ``Int8WeightOnlyConfig``), on the CPU; None for any other weight.

    Read once per tensor object: it is asked at every call of the layer, and reading a tensor subclass's fields
    (and its zero point's values) costs more than a dictionary lookup."""
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return None
    key = id(weight)
    if key not in _INT8_ROWS:
        _INT8_ROWS[key] = _read_int8_rows(weight)
        weakref.finalize(weight, _INT8_ROWS.pop, key, None)
    return _INT8_ROWS[key]


def _read_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if weight.dim() != 2:
        return None
    data, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if not (isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor)) or data.dtype != torch.int8:
        return None
    out, inn = weight.shape
    if tuple(data.shape) != (out, inn) or scale.numel() != out or data.device.type != "cpu":
        return None
    if list(getattr(weight, "block_size", ())) != [1, inn] or getattr(weight, "act_quant_kwargs", None) is not None:
        return None
    zero_point = getattr(weight, "zero_point", None)  # symmetric: none, or all zeros (torchao keeps a zero tensor)
    if zero_point is not None and (not isinstance(zero_point, torch.Tensor) or bool(zero_point.any())):
        return None
    return data, scale.reshape(out)


def int8_linear(input: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``F.linear(input, data * scale[:, None])`` by torch's int8 weight-only GEMM (no bias)."""
    rows = input.reshape(-1, input.shape[-1]).contiguous()
    out: torch.Tensor = torch._weight_int8pack_mm(rows, data, scale.to(input.dtype))
    return out.view(*input.shape[:-1], data.shape[0])


@contextlib.contextmanager
def recording_inside_an_operator() -> Iterator[None]:
    """Autograd records again inside a custom operator's kernel (see the module docs), gradients enabled."""
    nothing_excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), nothing_excluded), \
            torch.enable_grad():
        yield


NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
"""A wrapper subclass's ``__torch_function__``: none of its own (operators reach ``__torch_dispatch__``)."""


def wrapper_tensor(cls: type[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An instance of the wrapper subclass ``cls`` of ``shape`` and ``dtype`` on the CPU, without storage."""
    tensor: torch.Tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"))
    return tensor


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of nested lists, tuples and dicts (``torch.utils._pytree.tree_map``)."""
    from torch.utils._pytree import tree_map as torch_tree_map

    return torch_tree_map(fn, tree)


def writes_and_views(func: Any) -> tuple[list[str | int], bool]:
    """For an ATen operator: its arguments it writes (by position, or by name past the positional ones it is given
    as keywords: both are listed) and whether it returns a view of its first argument without writing it."""
    arguments, returns = func._schema.arguments, func._schema.returns
    written: list[str | int] = []
    for index, argument in enumerate(arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += [index, argument.name]
    alias = arguments[0].alias_info if arguments else None
    return written, alias is not None and not alias.is_write and any(r.alias_info is not None for r in returns)


def profiling() -> bool:
    """Whether torch's profiler is recording (``torch.autograd.profiler._is_profiler_enabled``, the flag its
    ``profile`` context sets): a kernel called outside torch's operators labels its calls only then. Read at every
    such call: the module is imported once, with this one."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def forward_hooks(modules: Iterable[nn.Module]) -> bool:
    """Whether a forward hook could see a call of one of ``modules``: one of their own (``_forward_hooks``,
    ``_forward_pre_hooks``) or one registered for every module (``register_module_forward_hook`` and its pre-hook
    keep them in ``nn.modules.module._global_forward_hooks`` and ``_global_forward_pre_hooks``). A decode step that
    runs these modules' computation without calling them (:mod:`fusion_linear_kernels.decode_layer`) reads this at
    every call, and gives way where it is true."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def attention_implementation(attention: nn.Module) -> str | None:
    """The attention function a transformers attention module calls (``"sdpa"``, ``"eager"``, ...), from its config,
    or None where it has none."""
    implementation = getattr(getattr(attention, "config", None), "_attn_implementation", None)
    return implementation if isinstance(implementation, str) else None


def cpp_kernel(argtypes: list[str], source: str) -> Callable[..., None]:
    """The C++ function ``kernel`` of ``source``, built by Inductor's C++ toolchain and bound for Python: it takes
    one argument per C++ type of ``argtypes`` (a tensor for a pointer, an int for an integer) and returns None."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    kernel: Callable[..., None] = CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
    return kernel


def library_of(kernel: Callable[..., None]) -> str | None:
    """The file of the extension module :func:`cpp_kernel`'s function came from (Inductor's cache), if it says."""
    found = getattr(getattr(kernel, "__self__", None), "__file__", None)
    return found if isinstance(found, str) else None


def load_kernel(library: str) -> Callable[..., None]:
    """The function ``kernel`` of an extension module :func:`cpp_kernel` built before, loaded from its file without
    importing Inductor (importing ``torch._inductor.codecache`` and its lookup took about 2.5 s on a 2-core AMD EPYC;
    this takes milliseconds). Inductor's binding reads, when its module initialises, the address of torch's function
    that gives a tensor's data pointer from the environment variable ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``
    (``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr``), and its initialiser is
    ``PyInit_kernel``; Inductor's own loader (``CppPythonBindingsCodeCache._load_library_inner``) does the same."""
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    name = "fusion_linear_kernels_built_" + Path(library).stem.replace(".", "_")
    spec = importlib.util.spec_from_file_location(f"{name}.kernel", library)  # its initialiser: PyInit_kernel
    if spec is None or spec.loader is None:
        raise ImportError(f"no extension module at {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel: Callable[..., None] = module.kernel
    return kernel
