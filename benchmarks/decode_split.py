"""Where a decode step's time goes: the GEMVs by kind, attention, and the rest, from ``torch.profiler``.

``bench_decode.py --profile`` runs this for each contender after the timed rounds. Two greedy ``generate`` calls
are profiled, one with ``tokens`` new tokens and one with a single new token; their difference over
``tokens - 1`` is one decode step without the prefill. Each operator's self CPU time goes to one group:

- ``GEMV <weight>``: a matrix product (``aten::mm``, ``addmm``, ``mv``, ``matmul``'s kernels, oneDNN's packed
  ``_linear_pointwise``, ``_weight_int8pack_mm``) by the shape of the weight it reads;
- ``decode step: MLP <hidden>x<intermediate>`` and ``decode step: input norm``: the calls of ``linear_kernels``'
  decode step (the MLP's call holds its three GEMVs, with the norms and residuals around them);
- ``decode step: q/k/v <weight>``: the calls of its projection kernel (the merged q/k/v GEMV, with the norms of the
  queries and keys and the rotary embedding);
- ``attention``: ``scaled_dot_product_attention`` and its kernels, the batched products of eager attention, and the
  attention kernel of ``linear_kernels``' decode step (``fusion::decode_attention``);
- ``other operators``: norms, RoPE, casts, argmax, the KV cache's copies, ...;
- ``outside operators``: the step's wall time not spent inside any operator (Python, dispatch, generate's loop).

Each group is reported in ms per token and as a share of the floor, so what remains between the step and the floor
is visible group by group.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from bench_common import FIXED_LENGTH_GREEDY

#: Operators that read a weight matrix: (name, index of the weight among the input shapes, transposed).
GEMM_WEIGHTS: dict[str, tuple[int, bool]] = {
    "aten::mm": (1, True), "aten::addmm": (2, True), "aten::mv": (0, False), "aten::addmv": (1, False),
    "aten::addmv_": (1, False), "aten::_weight_int8pack_mm": (1, False),
    "mkldnn::_linear_pointwise": (1, False), "aten::mkldnn_linear": (1, False), "aten::linear": (1, False),
}
#: How the profiler names a call of code Inductor compiled: under ``--compile``, every compiled region.
COMPILED = "## Call CompiledFxGraph"
#: How ``linear_kernels``' GEMV kernel labels its calls (``fusion_linear_kernels.row_dot.gemv``: the row-dot,
#: blocked-rows and few-rows candidates), with the weight's shape after it.
BUILT_GEMV = "fusion::gemv"
#: How ``linear_kernels``' decode step labels its kernel's calls (``fusion_linear_kernels.layer_kernel``): ``input
#: norm``, or ``MLP`` and the widths (the gate, up and down GEMVs with the norms and residuals around them).
DECODE_LAYER = "fusion::decode_layer"
#: How the decode step's projection kernel labels its calls (``fusion_linear_kernels.projection_kernel``), with the
#: merged q/k/v weight's shape after it.
DECODE_PROJECTIONS = "fusion::decode_projections"
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "aten::bmm", "aten::baddbmm",
             "fusion::decode_attention")


def group_of(name: str, shapes: list[Any]) -> str:
    """The group an operator's self time goes to (see the module docs)."""
    if any(marker in name for marker in ATTENTION):
        return "attention"
    if name.startswith(COMPILED):
        return "compiled code (--compile)"
    if name.startswith(DECODE_LAYER):
        return f"decode step: {name[len(DECODE_LAYER):].strip()} (linear_kernels' layer kernel)"
    if name.startswith(DECODE_PROJECTIONS):
        return f"decode step: q/k/v {name[len(DECODE_PROJECTIONS):].strip()} (linear_kernels' projection kernel)"
    if name.startswith(BUILT_GEMV):
        return f"GEMV {name[len(BUILT_GEMV):].strip()} (linear_kernels' GEMV kernel)"
    found = GEMM_WEIGHTS.get(name)
    if found is not None:
        index, transposed = found
        shape = shapes[index] if index < len(shapes) and shapes[index] else None
        if shape:
            dims = list(shape[::-1] if transposed else shape)
            return f"GEMV {'x'.join(map(str, dims))}"
        return f"GEMV ({name})"
    return "other operators"


def profiled(call: Callable[[], Any]) -> tuple[Counter[str], float]:
    """Self CPU seconds by group, and the wall seconds, of one ``call()`` under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        call()
        wall = time.perf_counter() - start
    groups: Counter[str] = Counter()
    for event in prof.key_averages(group_by_input_shape=True):
        groups[group_of(event.key, event.input_shapes)] += event.self_cpu_time_total / 1e6
    return groups, wall


def decode_split(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> dict[str, float]:
    """Seconds per decode step by group (see the module docs), ``outside operators`` included."""
    mask = torch.ones_like(prompt)

    def generate(new: int) -> Callable[[], Any]:
        def call() -> Any:
            with torch.inference_mode():
                return model.generate(prompt, attention_mask=mask, max_new_tokens=new, **FIXED_LENGTH_GREEDY)
        return call

    generate(2)()  # warm
    long_groups, long_wall = profiled(generate(tokens))
    short_groups, short_wall = profiled(generate(1))
    steps = tokens - 1
    # A group the long run has stays, at 0 when the difference is noise (a tiny GEMV can time below it).
    split = {group: max(0.0, (long_groups[group] - short_groups.get(group, 0.0)) / steps) for group in long_groups}
    split["outside operators"] = max(0.0, (long_wall - short_wall) / steps - sum(split.values()))
    return split


def split_rows(split: dict[str, float], floor_s: float, top: int = 8) -> list[list[str]]:
    """Table rows (group, ms/token, share of the floor): the ``top`` largest GEMV kinds, the rest grouped."""
    gemv = sorted(((g, s) for g, s in split.items() if g.startswith(("GEMV", "decode step"))),
                  key=lambda item: -item[1])
    kept = dict(gemv[:top])
    if gemv[top:]:
        kept["GEMV (other kinds)"] = sum(s for _, s in gemv[top:])
    for group in ("attention", "other operators", "outside operators"):
        if group in split:
            kept[group] = split[group]
    total = sum(split.values())
    rows = [[group, f"{seconds * 1e3:.2f}", f"{seconds / floor_s:.2f}"] for group, seconds in kept.items()]
    rows.append(["step (sum)", f"{total * 1e3:.2f}", f"{total / floor_s:.2f}"])
    return rows
