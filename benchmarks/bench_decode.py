"""Decode at the memory-bandwidth floor: plain vs fused with and without ``linear_kernels``, beside the floor.

Greedy decode reads every weight once per token, so its floor is the bytes a step reads over the
read bandwidth of this machine, measured in the same run (three ways: a read of a cold 1 GiB buffer
by a loop built for this CPU (:func:`built_read`; torch's reduction where none builds), the same on transparent huge
pages where the system lends them (:func:`reduction_buffers`), and one
``torch.mv`` over each of the plain model's own linear weights in turn, the decode's own read pattern; the floor
uses the fastest). Contenders, loaded from one checkpoint and run in
interleaved rounds whose order rotates (see :mod:`bench_common`):

- ``plain`` and ``plain (2nd load)`` (the A/A control: the same operators, so its ratio shows the noise);
- ``qkv+gate_up`` (the merged projections), ``linear_kernels`` alone, and ``qkv+gate_up+linear_kernels``;
- any of these followed by `` (no decode step)``: its decoder layers run their modules, not ``linear_kernels``'
  decode step (``fusion_linear_kernels.decode_layer``), so the step's gain is measured side by side; or by
  `` (no decode attention)``: the step calls each layer's attention module, not its own attention
  (``fusion_linear_kernels.decode_attention``); or by `` (projections as modules)``: the step's own attention calls
  its projection modules, not the projection kernel (``fusion_linear_kernels.projection_kernel``); or by
  `` (kernels one by one)``: each layer calls its kernels one at a time, not the whole layer in one call
  (``fusion_linear_kernels.step_kernel``).

Each round runs a greedy ``generate`` (``--prompt`` tokens, then ``--new-tokens``; decode ms/token is
first to last new token) and a ``--prefill``-token forward (logits of the last position). Speed is the
per-round ratio plain time / contender time, median [min-max]; ``vs qkv+gate_up`` is the same against
the merged-only model. The last tables list the kernel ``linear_kernels`` chose for each kind of call on a dense
weight, and which weight kinds it holds prepacked (oneDNN's layout) with the timings that decided it.

    python benchmarks/bench_decode.py --model qwen2-0.5b --dtype bf16 --rounds 5
    python benchmarks/bench_decode.py --compile --contenders plain,linear_kernels,qkv+gate_up+linear_kernels
    python benchmarks/bench_decode.py --profile --rounds 1   # also: each step split into GEMVs by kind, attention, rest
    python benchmarks/bench_decode.py --processes 5 --rounds 3   # 5 fresh processes: the median one and the worst
    python benchmarks/bench_decode.py --batch 2   # two sequences decoded together (the few-rows GEMV)
    python benchmarks/bench_decode.py --batch 4 --padding 8 --prompt 32   # prompts of 32, 24, 16 and 8 tokens
    python benchmarks/bench_decode.py --floor-between-steps   # also the floor read between the decode's own steps
    python benchmarks/bench_decode.py --as-loaded   # weights where each load put them (plain: the file mapping)
    python benchmarks/bench_decode.py --frozen      # parameters frozen (requires_grad_(False)), as PEFT leaves a base
    python benchmarks/bench_decode.py --config path/to/config.json   # any causal LM's shape, random weights
    .venvs/quant-tf5/bin/python benchmarks/bench_decode.py --quantize int8wo   # torchao int8 weight-only loads
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import Summary, Table, machine_info
from bench_e2e import allow_recompiles, compile_forward, generate_call, load, paired_rounds, prefill_call
from bench_models import QWEN2_05B, build_checkpoint
from decode_split import decode_split, split_rows
from torch import nn

from fusion_core.mapped_files import MappedFiles
from fusion_core.streaming import advise_huge_pages

#: Llama-3.2-1B's geometry (hidden 2048, 32/8 heads, MLP 8192, vocabulary 128256, tied embeddings).
LLAMA_32_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192,
                   rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001)
#: Qwen2.5-3B's geometry (hidden 2048, 16/2 heads, MLP 11008, vocabulary 151936, tied embeddings).
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
#: OLMoE-1B-7B's geometry (64 experts, 8 routed per token, MLP 1024 per expert, vocabulary 50304, untied).
OLMOE_1B_7B = dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16,
                   num_experts=64, num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096,
                   tie_word_embeddings=False)
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen2-0.5b": ("Qwen2Config", QWEN2_05B, 24),
    "llama-3.2-1b": ("LlamaConfig", LLAMA_32_1B, 16),
    "qwen2.5-3b": ("Qwen2Config", QWEN25_3B, 36),
    "olmoe-1b-7b": ("OlmoeConfig", OLMOE_1B_7B, 16),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CONTENDERS: dict[str, str | None] = {
    "plain": None,
    "qkv+gate_up": "qkv+gate_up",
    "linear_kernels": "linear_kernels",
    "qkv+gate_up+linear_kernels": "qkv+gate_up+linear_kernels",
    "plain (2nd load)": None,
}
NO_DECODE_STEP = " (no decode step)"
"""A contender name ending so is that contender with its decoder layers' decode step dropped (each layer runs its
modules, as before ``fusion_linear_kernels.decode_layer``): what the step buys, side by side."""
NO_DECODE_ATTENTION = " (no decode attention)"
"""A contender name ending so keeps its decode step, but each step calls the layer's attention module, as before
``fusion_linear_kernels.decode_attention``: what the step's own attention buys, side by side."""
PROJECTIONS_AS_MODULES = " (projections as modules)"
"""A contender name ending so keeps the step's own attention, but it calls the attention's projection modules (each
attention's output projection holds a forward hook that does nothing, and the step gives a hooked child its call), as
before ``fusion_linear_kernels.projection_kernel``: what the projection kernel buys, side by side. The hook itself costs
the contender a call a layer."""
ONE_BY_ONE = " (kernels one by one)"
"""A contender name ending so keeps the step's own attention, but each layer calls its kernels one at a time, as
before ``fusion_linear_kernels.step_kernel``: what the whole layer in one call buys, side by side."""
SUFFIXES = (NO_DECODE_STEP, NO_DECODE_ATTENTION, PROJECTIONS_AS_MODULES, ONE_BY_ONE)


def config_of(model: str, layers: int | None) -> Any:
    import transformers

    class_name, geometry, depth = MODELS[model]
    return getattr(transformers, class_name)(num_hidden_layers=layers or depth, **geometry)


def config_from_file(path: Path, layers: int | None) -> Any:
    """The config a ``config.json`` describes (a released model's, read with ``AutoConfig``: its ``model_type`` names
    the class), with ``layers`` decoder layers where given. Only the shape is used: the weights are random."""
    import transformers

    if not path.is_file():
        raise SystemExit(f"--config {path}: no such file (give a model's config.json)")
    config = transformers.AutoConfig.from_pretrained(str(path))
    if layers is not None:
        if not hasattr(config, "num_hidden_layers"):
            raise SystemExit(f"--layers: {type(config).__name__} from {path} has no num_hidden_layers to set")
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):  # one per layer (sliding or full attention)
            config.layer_types = config.layer_types[:layers]
    return config


def bytes_per_token(model: nn.Module) -> int:
    """Bytes of the parameters one decode step reads: each tensor once (tied ones once), the embedding table
    only where it is the LM head too (otherwise a step reads one row of it), and of a mixture of experts only
    the routed share (``num_experts_per_tok`` of ``num_experts``: stacked 3-D experts, or per-expert layers)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    experts, routed = getattr(model.config, "num_experts", None), getattr(model.config, "num_experts_per_tok", None)
    seen: set[int] = set()
    total = 0.0
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or (param is embedding and not tied):
            continue
        seen.add(id(param))
        share = routed / experts if experts and routed and (param.dim() == 3 or ".experts." in name) else 1.0
        total += stored_bytes(param) * share
    return int(total)


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor's data occupies: a quantizer's int8 data and scales, or elements times their size."""
    inner = [getattr(tensor, n) for n in ("qdata", "scale", "zero_point") if isinstance(getattr(tensor, n, None),
                                                                                     torch.Tensor)]
    if inner and type(tensor) not in (torch.Tensor, nn.Parameter):
        return sum(t.numel() * t.element_size() for t in inner)
    return tensor.numel() * tensor.element_size()


def reduction_buffers(nbytes: int) -> dict[str, torch.Tensor]:
    """The float32 buffers of ``nbytes`` the floor's read (:func:`read_once`) reads, each named by the way it is read:
    torch's own memory (small pages), and where the system lends them, memory on transparent huge pages.

    A weight read from huge pages reads faster: on the 2-core Xeon VM (its host maps the guest's memory again, so
    every miss of the small-page TLB walks two page tables) a reduction over 942 MB read 21-26 GB/s on small pages
    and 35-36 GB/s on huge ones (a throwaway probe). The floor is the machine's best read, so both are measured and the
    faster is taken, whether or not a contender's weights lie on huge pages.
    """
    way = "built read" if built_read() is not None else "reduction"
    buffers = {way: torch.ones(nbytes // 4, dtype=torch.float32)}
    huge = torch.empty(nbytes // 4, dtype=torch.float32)  # nothing written yet: the advice comes before the pages
    if advise_huge_pages(huge):
        buffers[f"{way} on huge pages"] = huge.fill_(1.0)
    return buffers


_READ_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
// Reads n 32-bit words once, four vectors of the CPU's width at a time (the last n % step one by one), and stores
// their bitwise OR in out[0]: nothing but loads and one cheap operation per load, so the reads are bound by the
// memory alone.
extern "C" void kernel(const int32_t* p, int32_t* out, const int64_t n) {
    using V = at::vec::Vectorized<int32_t>;
    constexpr int64_t step = 4 * V::size();
    int32_t total = 0;
    #pragma omp parallel reduction(|:total)
    {
        V a(0), b(0), c(0), d(0);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n / step; ++i) {
            const int32_t* q = p + i * step;
            a = a | V::loadu(q);
            b = b | V::loadu(q + V::size());
            c = c | V::loadu(q + 2 * V::size());
            d = d | V::loadu(q + 3 * V::size());
        }
        int32_t lanes[V::size()];
        ((a | b) | (c | d)).store(lanes);
        for (int64_t l = 0; l < V::size(); ++l) total |= lanes[l];
    }
    for (int64_t i = n - n % step; i < n; ++i) total |= p[i];
    out[0] = total;
}
"""


@functools.cache
def built_read() -> Callable[..., None] | None:
    """A read of a buffer built for this CPU (:data:`_READ_SOURCE`, by linear_kernels' toolchain, stored per machine
    like its kernels), or None where it cannot be built.

    torch's reductions are not the fastest reads on every CPU: on a 2-core Xeon with AVX-512 (Ice Lake) the int16
    maximum of :func:`read_once` read 15.5-17.7 GB/s, while linear_kernels' own GEMV kernel read the weights of a
    decode at 18-22 GB/s, so decode ran below its "floor" (0.89x in one round). The floor is the machine's best read,
    so it must not be slower than a contender's."""
    try:
        from fusion_linear_kernels.row_dot import built_kernel

        return built_kernel("bench_decode.read", ["const int32_t*", "int32_t*", "const int64_t"], _READ_SOURCE)
    except Exception as error:  # no compiler, no plugin: torch's reduction alone measures the floor
        print(f"   note: no built read for the floor ({type(error).__name__}: {error}); torch's reduction alone")
        return None


def read_once(buffer: torch.Tensor) -> None:
    """Read every byte of ``buffer`` once: by :func:`built_read` where it was built, else the maximum of its bytes as
    16-bit integers, the fastest of torch's reductions tried on the Xeon VM (942 MB, GB/s, small / huge pages: this
    25.1 / 35.7, a float32 sum 23.9 / 30.0, a float32 maximum 19.0 / 36.0; a throwaway probe)."""
    read = built_read()
    if read is None:
        buffer.view(torch.int16).max()
    else:
        words = buffer.view(torch.int32)
        read(words, torch.empty(1, dtype=torch.int32), words.numel())


def read_bandwidth(model: nn.Module, rounds: int = 3) -> dict[str, float]:
    """Bytes per second read from memory, three ways (see the module docs); best of ``rounds`` each."""
    buffers = reduction_buffers(1 << 30)  # 1 GiB, far beyond any cache
    weights = [m.weight for m in model.modules()  # torch's own weights (a quantizer's do not run torch.mv)
               if isinstance(m, nn.Linear) and type(m.weight) in (torch.Tensor, nn.Parameter)]
    vectors = {w.shape[1]: torch.randn(w.shape[1], dtype=w.dtype) for w in weights}
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    best = {name: float("inf") for name in (*buffers, "mv over the weights")}
    with torch.inference_mode():
        for _ in range(rounds + 1):
            for name, buffer in buffers.items():
                start = time.perf_counter()
                read_once(buffer)
                best[name] = min(best[name], time.perf_counter() - start)
            start = time.perf_counter()
            for w in weights:
                torch.mv(w, vectors[w.shape[1]])
            best["mv over the weights"] = min(best["mv over the weights"], time.perf_counter() - start)
    measured = {name: (1 << 30) / best[name] for name in buffers}
    del buffers
    if weights:
        measured["mv over the weights"] = weight_bytes / best["mv over the weights"]
    return measured


def round_floor(per_token: int) -> Callable[[], dict[str, float]]:
    """A pseudo-contender that measures the floor again in its place in every round: the buffer reads of
    :func:`read_bandwidth` (:func:`read_once`), best of three each, over 512 MiB buffers (still far beyond any
    cache). The read bandwidth of a shared machine moves from minute to minute (on the 2-core AMD EPYC of
    docs/benchmarks.md, 25 to 67 GB/s within an hour), so the run's best moment alone sets a floor that rounds taken at
    slower moments cannot reach; each round's decode is also set against the floor of its own moment."""
    buffers = list(reduction_buffers(1 << 29).values())

    def call() -> dict[str, float]:
        best = float("inf")
        for _ in range(3):
            for buffer in buffers:
                start = time.perf_counter()
                read_once(buffer)
                best = min(best, time.perf_counter() - start)
        return {"decode": per_token * best / (1 << 29), "prefill": float("nan")}

    return call


def floor_between_steps(bandwidth: dict[str, float]) -> tuple[Callable[[], None], int]:
    """A read of the floor's fastest buffer (512 MiB, the way :func:`read_bandwidth` found fastest) to run between
    every two decode steps, and the bytes it reads.

    Why: the read bandwidth of a shared machine moves within seconds, all of its memory at once (on the 2-core AMD EPYC
    (AVX512-BF16), four 512 MiB buffers on huge pages read 30-36 GB/s together, then 45-57 together for two or three
    seconds; a throwaway probe). A floor read in its own slot of a round meets other moments than the decode beside it
    (that EPYC: a round's floor 39 ms a token, the next's 67, while the fused decode stayed at 58-66), so a decode over
    its round's floor moves with them. Read between the decode's own steps, the floor meets the same moments."""
    buffers = reduction_buffers(1 << 29)
    way = max((name for name in buffers if name in bandwidth), key=bandwidth.__getitem__, default=next(iter(buffers)))
    buffer = buffers[way]
    return (lambda: read_once(buffer)), buffer.numel() * buffer.element_size()


def load_contender(path: Any, families: str | None, dtype: torch.dtype, quantize: str | None) -> nn.Module:
    """A contender loaded as users load it: plain or fused, and with ``--quantize``, torchao int8 weight-only at load
    (transformers quantizes each weight as it reads it; a fused model merges the quantized parts)."""
    if quantize is None:
        return load("AutoModelForCausalLM", path, families, dtype, "cpu")
    import transformers
    from torchao.quantization import Int8WeightOnlyConfig

    import fusion_core

    kwargs = {"dtype": dtype, "quantization_config": transformers.TorchAoConfig(Int8WeightOnlyConfig())}
    if families is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    else:
        model = fusion_core.from_pretrained(transformers.AutoModelForCausalLM, path,
                                            fusion_config={f: True for f in families.split("+")}, **kwargs)
    return model.eval()


def as_named(model: nn.Module, name: str) -> nn.Module:
    """``model`` as the contender called ``name`` runs it: every decoder layer's decode step dropped, or the step's own
    attention, or its projections run as modules, or its kernels called one by one, where ``name`` ends so (see
    :data:`SUFFIXES`)."""
    if name.endswith(NO_DECODE_STEP):
        from fusion_linear_kernels.decode_layer import drop_decode_steps

        drop_decode_steps(model)
    elif name.endswith(NO_DECODE_ATTENTION):
        from fusion_linear_kernels.decode_layer import drop_decode_attention

        drop_decode_attention(model)
    elif name.endswith(ONE_BY_ONE):
        from fusion_linear_kernels.decode_layer import drop_one_call

        drop_one_call(model)
    elif name.endswith(PROJECTIONS_AS_MODULES):
        for module in model.modules():
            output = module._modules.get("o_proj")
            if isinstance(output, nn.Module):
                output.register_forward_hook(lambda module, args, output: None)
    return model


def _families_of(name: str) -> str | None:
    """The families of the contender named ``name`` (a "+"-joined list where it is no contender above)."""
    base = name
    for suffix in SUFFIXES:
        base = base.removesuffix(suffix)
    return CONTENDERS.get(base, base)


def own_memory(model: nn.Module) -> nn.Module:
    """Copy every parameter out of the checkpoint's memory map into the process's own memory.

    A plain load may leave weights as views of the mapped safetensors file; on a VM that reclaims cold
    file-backed pages (this benchmark's 2-core Firecracker guest does), a decode step then times disk
    reads for the plain model but not for a fused one whose merged tensors are new memory, and on the
    2-core Xeon VM ``torch.mv`` reads mapped weights at 20 GB/s against 24.5 GB/s for copies
    (``fusion_linear_kernels.residence``, which moves the weights ``linear_kernels`` runs itself).
    Copying every contender's parameters (tied ones stay tied: the shared Parameter is copied once)
    compares kernels; ``--as-loaded`` skips it and compares what users get.
    """
    files = MappedFiles.snapshot()
    with torch.no_grad():
        for param in model.parameters():
            # A prepacked weight (linear_kernels) or a quantizer's tensor is the process's own memory already, and so
            # is a weight linear_kernels moved there (on huge pages, which a copy would lose).
            if not param.is_mkldnn and type(param.data) is torch.Tensor and files.file_extent(param.data) is not None:
                param.data = param.data.clone()
    return model


FLOOR = "floor (per round)"
"""The pseudo-contender :func:`round_floor` in the rounds' samples."""


def against_round_floor(samples: dict[str, list[dict[str, float]]], name: str) -> Summary:
    """Per round, the contender's decode time over the floor measured in that round."""
    return Summary.of([s["decode"] / f["decode"] for s, f in zip(samples[name], samples[FLOOR], strict=True)])


def speed(samples: dict[str, list[dict[str, float]]], name: str, against: str, metric: str) -> Summary:
    return Summary.of([a[metric] / b[metric] for a, b in zip(samples[against], samples[name], strict=True)])


def fresh_processes_table(argv: list[str], processes: int, log: Callable[[str], None]) -> Table:
    """Run this script ``processes`` times (each a fresh process, ``argv`` without ``--processes``) and tabulate
    each contender's median process next to its worst one: speed vs plain, ms/token, x floor."""
    own = [a for i, a in enumerate(argv) if a != "--processes" and (i == 0 or argv[i - 1] != "--processes")
           and not a.startswith("--processes=")]
    runs: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(processes):
            out = Path(scratch) / f"{number}.json"
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *own, "--json", str(out)], check=True,
                           stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text()))
            log(f"  fresh process {number + 1}/{processes}: " + ", ".join(
                f"{name} {run['vs_plain']:.2f}x" for name, run in runs[-1].items()))
    table = Table(f"Decode in {processes} fresh processes (each: the per-round median of its rounds)",
                  ["contender", "vs plain, median process", "vs plain, worst process", "worst / median",
                   "ms/token median [worst]", "x floor median [worst]", "x its round's floor median [worst]"])
    for name in runs[0]:
        speeds = [run[name]["vs_plain"] for run in runs]
        times = [run[name]["decode_ms"] for run in runs]
        floors = [run[name]["decode_ms"] / run[name]["floor_ms"] for run in runs]
        round_floors = [run[name]["x_round_floor"] for run in runs]
        middle = statistics.median(speeds)
        table.rows.append([name, f"{middle:.2f}", f"{min(speeds):.2f}", f"{min(speeds) / middle:.2f}",
                           f"{statistics.median(times):.1f} [{max(times):.1f}]",
                           f"{statistics.median(floors):.2f} [{max(floors):.2f}]",
                           f"{statistics.median(round_floors):.2f} [{max(round_floors):.2f}]"])
    table.notes.append("worst: the slowest process's figure; worst / median is what the budget 'the worst fresh "
                       "process at least 0.9x the median's speed' reads")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2-0.5b")
    parser.add_argument("--config", type=Path, default=None, metavar="CONFIG_JSON",
                        help="decode at the shape of this config.json (any causal LM's, e.g. a released model's) "
                        "instead of --model's, with random weights")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the released model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences decoded together (a step then makes this many tokens and reads the weights "
                        "once: ms/token is per step; the prefill row stays one sequence, and 'same tokens' "
                        "compares the first sequence's)")
    parser.add_argument("--padding", type=int, default=0, metavar="P",
                        help="a padded batch: each sequence after the first starts with P more padding tokens than "
                        "the one before (hidden by the attention mask, as generate pads a batch of prompts of "
                        "different lengths on the left)")
    parser.add_argument("--floor-between-steps", action="store_true",
                        help="also read the floor's fastest buffer once between every two decode steps, untimed "
                        "by the decode's clock, and set each contender's decode against that read: the floor of the "
                        "very moments its steps ran (a column of its own; see floor_between_steps)")
    parser.add_argument("--quantize", choices=["int8wo"], default=None,
                        help="load every contender with TorchAoConfig(Int8WeightOnlyConfig()) (needs torchao)")
    parser.add_argument("--compile", action="store_true",
                        help="model.forward = torch.compile(model.forward) for every contender (Inductor)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, from: "
                        + ", ".join(CONTENDERS) + f" (any with{NO_DECODE_STEP!r} after it: its decoder layers "
                        f"without linear_kernels' decode step; with{NO_DECODE_ATTENTION!r}: the step calls the "
                        f"attention module; with{PROJECTIONS_AS_MODULES!r}: the step's attention calls its "
                        "projection modules)")
    parser.add_argument("--processes", type=int, default=None, metavar="N",
                        help="run the whole measurement in N fresh processes, one after another, and report each "
                        "contender's median process next to its worst (a load's decisions hold for its process)")
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)  # a --processes worker's result
    parser.add_argument("--as-loaded", action="store_true",
                        help="leave each contender's weights where its load put them (plain: views of the checkpoint's "
                        "file mapping, as transformers leaves a checkpoint loaded in its stored dtype) instead of "
                        "copying every contender's into the process's own memory first (see own_memory)")
    parser.add_argument("--frozen", action="store_true",
                        help="every contender's parameters frozen (requires_grad_(False)), as PEFT leaves a base "
                        "model: torch's F.linear then runs the LM head's prefill slice (hidden_states[:, -1:, :]) "
                        "as a batched GEMM over a transposed copy of the head (fusion_linear_kernels.choice)")
    parser.add_argument("--profile", action="store_true",
                        help="also split each contender's decode step into GEMVs by kind, attention and the rest "
                        "(torch.profiler; see decode_split.py), in ms and as a share of the floor")
    args = parser.parse_args(argv)
    log: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    info = machine_info()
    log(f"{info['cpu']} {info['cpu_flags']}, {info['torch_threads']} threads, torch {info['torch']}, "
        f"transformers {info['transformers']}")
    if args.processes:
        log(fresh_processes_table(argv if argv is not None else sys.argv[1:], args.processes, log).text())
        return

    dtype = DTYPES[args.dtype]
    config = config_from_file(args.config, args.layers) if args.config else config_of(args.model, args.layers)
    shape = str(args.config) if args.config else args.model
    path = build_checkpoint(config, "AutoModelForCausalLM",
                            f"decode-{config.model_type if args.config else args.model}-{args.layers or 'all'}", log)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    # A name that is no contender above is a "+"-joined list of families (moe_experts, moe_experts+linear_kernels).
    models = {name: as_named(load_contender(path, _families_of(name), dtype, args.quantize), name)
              for name in names}
    if not args.as_loaded:
        models = {name: own_memory(model) for name, model in models.items()}
    if args.frozen:
        models = {name: model.requires_grad_(False) for name, model in models.items()}
    plain = models["plain"]
    per_token = bytes_per_token(plain)
    bandwidth = read_bandwidth(plain)
    if args.compile:
        # Every contender compiles the same forward code: past dynamo's recompile limit a later contender would
        # silently run eager (measured: the third one did).
        allow_recompiles()
        for model in models.values():
            compile_forward(model, "inductor")
    floor_ms = per_token / max(bandwidth.values()) * 1e3

    generator = torch.Generator().manual_seed(0)
    vocab = plain.config.vocab_size
    prompt = torch.randint(3, vocab, (args.batch, args.prompt), generator=generator)
    padded = torch.arange(args.prompt) < (torch.arange(args.batch) * args.padding)[:, None]
    if not bool(padded[:, -1].logical_not().all()):
        parser.error(f"--padding {args.padding}: the last sequence would be padding alone; lengthen --prompt")
    prompt[padded] = plain.config.pad_token_id if plain.config.pad_token_id is not None else 0
    long_prompt = torch.randint(3, vocab, (1, args.prefill), generator=generator)
    calls, tokens = {}, {}
    between = floor_between_steps(bandwidth) if args.floor_between_steps else None
    for name, model in models.items():
        decode, tokens[name] = generate_call(model, prompt, args.new_tokens, "cpu", (~padded).long(),
                                             between[0] if between is not None else None)
        prefill, _ = prefill_call(model, long_prompt, "cpu")

        def call(decode: Callable[[], dict[str, float]] = decode,
                 prefill: Callable[[], dict[str, float]] = prefill) -> dict[str, float]:
            out = decode()
            steps = args.new_tokens - 1
            floor = per_token * out["between"] / (steps * between[1]) if between is not None else float("nan")
            return {"decode": out["decode"] / steps, "prefill": prefill()["total"], "floor between steps": floor}

        calls[name] = call
    calls[FLOOR] = round_floor(per_token)
    samples, first = paired_rounds(calls, args.rounds, warmup=2)
    del calls[FLOOR], first[FLOOR]

    mode = ("compiled" if args.compile else "eager") + (f", {args.quantize}" if args.quantize else "") + (
        ", weights as loaded" if args.as_loaded else "") + (", weights frozen" if args.frozen else "")
    padding = f" padded by {args.padding} a sequence" if args.padding else ""
    table = Table(f"Decode and prefill, {shape} ({getattr(config, 'num_hidden_layers', '?')} layers), {args.dtype}, "
                  f"{mode}, batch {args.batch}{padding}",
                  ["contender", "decode ms/token", "x floor", "x its round's floor", "decode vs plain",
                   "decode vs qkv+gate_up", f"prefill {args.prefill} ms", "prefill vs plain", "same tokens"]
                  + (["x the floor read between its steps"] if between is not None else []))
    for name in names:
        decode = Summary.of([s["decode"] for s in samples[name]])
        prefill = Summary.of([s["prefill"] for s in samples[name]])
        merged = speed(samples, name, "qkv+gate_up", "decode").fmt_range() if "qkv+gate_up" in samples else "-"
        table.rows.append([
            name, decode.fmt_range(1e3), f"{decode.median * 1e3 / floor_ms:.2f}",
            against_round_floor(samples, name).fmt_range(),
            speed(samples, name, "plain", "decode").fmt_range(), merged,
            prefill.fmt_range(1e3, 1), speed(samples, name, "plain", "prefill").fmt_range(),
            str(tokens[name] == tokens["plain"]),
        ] + ([Summary.of([s["decode"] / s["floor between steps"] for s in samples[name]]).fmt_range()]
             if between is not None else []))
    table.notes += [
        f"floor {floor_ms:.1f} ms/token: {per_token / 1e9:.3f} GB read per token over "
        + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items())
        + "; the floor takes the fastest, measured in this run",
        "x its round's floor: each round's decode over the floor measured in that round (its read, its place in "
        "the rotation like a contender's; see round_floor), median [min-max]; that floor per round (ms/token): "
        + ", ".join(f"{s['decode'] * 1e3:.1f}" for s in samples[FLOOR]),
        *(["x the floor read between its steps: each round's decode over the floor read between its own steps "
           "(see floor_between_steps), median [min-max]"] if between is not None else []),
        f"{args.rounds} interleaved rounds; prompt {args.prompt}, {args.new_tokens} new tokens; first calls (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in first.items()),
    ]
    log(table.text())
    if args.json is not None:
        args.json.write_text(json.dumps({name: {
            "decode_ms": Summary.of([x["decode"] for x in samples[name]]).median * 1e3,
            "vs_plain": speed(samples, name, "plain", "decode").median,
            "floor_ms": floor_ms,
            "x_round_floor": against_round_floor(samples, name).median,
        } for name in names}))
    if args.profile:
        for name, model in models.items():
            split = Table(f"Where {name}'s decode step goes (torch.profiler, {args.new_tokens} tokens minus 1)",
                          ["group", "ms/token", "x floor"])
            split.rows = split_rows(decode_split(model, prompt, args.new_tokens), floor_ms / 1e3)
            split.notes.append("outside operators: wall time not inside any operator (Python, dispatch, generate's "
                               "loop); the profiler's own overhead inflates every row a little")
            log(split.text())
    try:
        from fusion_linear_kernels import decisions
    except ImportError:
        return
    chosen = Table("linear_kernels decisions (kind -> kernel)", ["dtype", "weight", "bias", "rows", "exact", "kernel"])
    for (_, kind_dtype, shape, _, bias, rows, exact, _), kernel in sorted(decisions().items(), key=str):
        chosen.rows.append([str(kind_dtype)[6:], "x".join(map(str, shape)), str(bias), str(rows), str(exact), kernel])
    log(chosen.text())
    from fusion_linear_kernels import pack_decisions

    packed = Table("linear_kernels packing (kind -> layout)", ["dtype", "weight", "exact", "layout", "measured"])
    for (shape, kind_dtype, exact), (is_packed, why) in sorted(pack_decisions().items(), key=str):
        packed.rows.append([str(kind_dtype)[6:], "x".join(map(str, shape)), str(exact),
                            "prepacked" if is_packed else "dense", why])
    log(packed.text())
    from fusion_linear_kernels.decode_layer import (
        ATTENTION_KEY,
        FORM_KEY,
        ONE_CALL_KEY,
        DecodeLayerMixin,
        ModulesForm,
        candidates,
        refusal,
    )
    from fusion_linear_kernels.step_blocks import decisions as step_decisions

    steps = Table("linear_kernels decode step (decoder layers: norms and MLP in one kernel call each side of the "
                  "attention)", ["contender", "layers with the step", "of them with its attention",
                                "of them verified in one call", "of them with norms and MLP as modules",
                                "why not (the first other layer)"])
    for name, model in models.items():
        if "linear_kernels" in name:
            switched = [module for module in model.modules() if isinstance(module, DecodeLayerMixin)]
            others = [layer for _, layer in candidates(model)]
            taking = sum(FORM_KEY in layer.__dict__ for layer in switched)
            attending = sum(ATTENTION_KEY in layer.__dict__ for layer in switched)
            one_call = sum(ONE_CALL_KEY in layer.__dict__ for layer in switched)
            as_modules = sum(isinstance(layer.__dict__.get(FORM_KEY), ModulesForm) for layer in switched)
            steps.rows.append([name, f"{taking} of {len(switched) + len(others)}", str(attending), str(one_call),
                               str(as_modules),
                               (refusal(others[0]) or "-") if others else "-"])
    steps.notes.append("verified in one call: the whole layer's step in one call of the step kernel where its "
                       "attention runs its kernels throughout (a sliding window's cache layer included); a cache layer "
                       "that runs its own update keeps the calls one by one")
    for (_, _, shape, _, bias, rows, _, _), block in sorted(step_decisions().items(), key=str):
        steps.notes.append(f"{'x'.join(map(str, shape))} (bias {bias}, {rows} row): the step runs {block} (its kind "
                           "decided a kernel the step does not run)")
    log(steps.text())
    from fusion_linear_kernels.experts import decisions as experts_decisions

    if experts_decisions():
        routed = Table("linear_kernels experts (kind -> transformers experts implementation)",
                       ["dtype", "weights", "rows", "top k", "configured", "exact", "implementation"])
        for (_, kind_dtype, shapes, rows, top_k, configured, exact), name in sorted(experts_decisions().items(),
                                                                                     key=str):
            routed.rows.append([str(kind_dtype)[6:], " ".join("x".join(map(str, s)) for s in shapes), str(rows),
                                str(top_k), configured, str(exact), name])
        log(routed.text())
    from fusion_linear_kernels.packed_experts import decisions as packed_experts_decisions

    if packed_experts_decisions():
        held = Table("linear_kernels experts layout (kind -> layout)",
                     ["class", "dtype", "weights", "top k", "configured", "exact", "layout", "measured"])
        for (cls, shapes, kind_dtype, exact, top_k, configured), (is_packed, why) in sorted(
                packed_experts_decisions().items(), key=str):
            held.rows.append([cls.__name__, str(kind_dtype)[6:], " ".join(f"{n} {'x'.join(map(str, s))}"
                                                                          for n, s in shapes),
                              str(top_k), configured, str(exact), "prepacked per expert" if is_packed else "dense",
                              why])
        log(held.text())
    models.clear()
    gc.collect()


if __name__ == "__main__":
    main()
