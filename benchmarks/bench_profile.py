"""Operator counts from ``torch.profiler``: what one call runs, independent of how fast the machine is.

A fused model should run fewer operators (one GEMM where there were three, a ``linear`` where
there was a ``conv3d`` and its reshapes). Counting them per decoded token and per tower forward,
plain vs fused, shows what fusion removes on any hardware; compiled, the count of compiled
regions entered per call exposes graph breaks, and the kernel count what the compiler emitted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

#: Matrix products and convolutions (a fused patch embedding trades a convolution for a GEMM).
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution")


def per_call_difference(few: dict[str, int], more: dict[str, int], calls: int) -> dict[str, float]:
    """Counts per extra call: (counts of a run with ``calls`` more repetitions - counts of the shorter) / calls."""
    return {k: (more[k] - few[k]) / calls for k in few}


def enable_kernel_events() -> None:
    """Make inductor's C++ kernels visible to the profiler (must be set before compiling)."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.cpp, "enable_kernel_profile"):
        inductor_config.cpp.enable_kernel_profile = True


def count_ops(fn: Callable[[], Any], device: str) -> dict[str, int]:
    """Operators one call of ``fn`` runs.

    ``aten_top``: aten operators not nested in another one (what the model's Python code
    dispatched); ``aten_all``: every aten operator; ``gemm``: matrix-multiply and convolution calls;
    ``graphs``: compiled regions entered (more than one per call means graph breaks);
    ``inductor_kernels``: C++/Triton kernels run by compiled graphs; on CUDA ``kernels``: every
    GPU kernel launched.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.inference_mode(), profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = list(prof.events())
    on_gpu = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in events if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA]
    aten = [e for e in cpu if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not str(e.cpu_parent.name).startswith("aten::")]
    names = Counter(e.name for e in cpu)
    counts = {
        "aten_top": len(top),
        "aten_all": len(aten),
        "gemm": sum(names[g] for g in GEMMS),
        "graphs": sum(n for k, n in names.items() if k.startswith("Torch-Compiled Region")),
        "inductor_kernels": sum(n for k, n in names.items() if "cpp_fused" in k or k.startswith("triton_")),
    }
    if cuda:
        counts["kernels"] = len(on_gpu)
    return counts
