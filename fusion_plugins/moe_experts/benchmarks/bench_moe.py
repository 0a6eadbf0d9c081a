"""Plain vs fused transformers 4.57 sparse MoE blocks, interleaved over rounds, and the kernel alternatives.

Builds one OLMoE block at OLMoE-1B-7B's widths (hidden 2048, 64 experts of width 1024, top-8;
``--arch`` picks another 4.57 block at the same widths), fuses a copy with ``moe_experts``, and
times both, interleaved round by round (so a noisy machine slows both alike), at 1, 16 and 128
tokens. Prints the median time per call of each, the ratio plain/fused (>1: fused is faster) with
its range over rounds, and the largest difference of the outputs. ``--kernels`` also times the
dispatch kernels the family chooses between on the same sorted rows: ``grouped_mm`` in the block's
dtype, gathering each row's expert weight for one ``bmm``, and for bfloat16 the float32 upcasts
(all experts' weights upcast per call into fresh tensors, or into float32 buffers kept between
calls: measured, not applied; and the applied one, a few experts at a time into buffers reused
within the call), and prints which one the kernel rule picks (``dispatch.upcasts``)::

    python fusion_plugins/moe_experts/benchmarks/bench_moe.py --rounds 5 --kernels
    python fusion_plugins/moe_experts/benchmarks/bench_moe.py --quick --kernels   # toy widths: the harness runs
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from fusion_moe_experts import MoeExpertsFamily
from fusion_moe_experts.dispatch import Routed, grouped_expert_outputs, upcast_expert_outputs, upcasts

from fusion_core.testing import kit

WIDTHS = dict(hidden_size=2048, intermediate_size=1024, moe_intermediate_size=1024, num_hidden_layers=1,
              num_attention_heads=16, num_key_value_heads=16, vocab_size=256, num_experts_per_tok=8)
EXPERTS = 64
#: ``--quick``: the same block at toy widths, to check the harness runs (its timings mean nothing).
QUICK_WIDTHS = dict(WIDTHS, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=4, num_experts_per_tok=2)
QUICK_EXPERTS = 8
EXPERT_COUNT = {"olmoe": "num_experts", "qwen3_moe": "num_experts", "mixtral": "num_local_experts"}
ARCHS = {"olmoe": ("OlmoeConfig", {}), "qwen3_moe": ("Qwen3MoeConfig", dict(norm_topk_prob=False)),
         "mixtral": ("MixtralConfig", {})}
BLOCK = {"mixtral": "block_sparse_moe"}


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _block(arch: str, dtype: torch.dtype, widths: dict[str, int], experts: int) -> tuple[torch.nn.Module, object]:
    class_name, extra = ARCHS[arch]
    config = getattr(transformers, class_name)(**widths, **extra, **{EXPERT_COUNT[arch]: experts})
    with torch.device("meta"):
        layer_cls = type(transformers.AutoModelForCausalLM.from_config(config).model.layers[0])
    torch.manual_seed(0)
    layer = layer_cls(config, 0)
    block = getattr(layer, BLOCK.get(arch, "mlp")).to(dtype).eval()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    return block, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="olmoe")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--kernels", action="store_true",
                        help="also time grouped_mm against gather + bmm and the fp32 upcasts")
    parser.add_argument("--quick", action="store_true", help="toy widths and one round: checks the harness runs")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    widths, num_experts = (QUICK_WIDTHS, QUICK_EXPERTS) if args.quick else (WIDTHS, EXPERTS)
    rounds = 1 if args.quick else args.rounds
    hidden, top_k = widths["hidden_size"], widths["num_experts_per_tok"]
    plain, config = _block(args.arch, dtype, widths, num_experts)
    fused = kit.fuse_module(copy.deepcopy(plain), MoeExpertsFamily(), config=config)
    print(f"{args.arch} block, hidden {hidden}, {num_experts} experts x {widths['intermediate_size']}, top-{top_k}, "
          f"{args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds")
    header = f"{'tokens':>6} {'plain ms':>9} {'fused ms':>9} {'ratio':>6} {'range':>12} {'max diff':>9}"
    if args.kernels:
        header += f" {'grouped ms':>10} {'gather ms':>10} {'upcast ms':>10} {'kept ms':>10} {'chunked ms':>10} rule"
    print(header)
    for tokens in args.tokens:
        x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        repeats = max(1, 64 // tokens)
        plain_times, fused_times, grouped, gathered, upcast, kept, chunked = [], [], [], [], [], [], []
        with torch.no_grad():
            diff = (plain(x)[0].float() - fused(x)[0].float()).abs().max().item()
            rows = x.view(-1, hidden)
            _, selected = torch.topk(fused.gate(rows).float().softmax(-1), top_k, dim=-1)
            routed = Routed(selected, num_experts)
            experts = fused.experts
            act = experts[0].act_fn
            stacked = (rows, experts.gate_up_proj, experts.down_proj, act, routed)
            grouped_call = functools.partial(grouped_expert_outputs, *stacked)
            chunked_call = functools.partial(upcast_expert_outputs, *stacked)
            rule = "upcast" if upcasts(rows, experts.gate_up_proj, routed) else "grouped"
            gather_call = functools.partial(_gather_bmm, rows, experts, act, routed)
            buffers = (torch.empty(experts.gate_up_proj.shape), torch.empty(experts.down_proj.shape))
            upcast_call = functools.partial(_upcast, rows, experts, act, routed, None)
            kept_call = functools.partial(_upcast, rows, experts, act, routed, buffers)
            for _ in range(rounds):
                plain_times.append(_time(functools.partial(plain, x), repeats))
                fused_times.append(_time(functools.partial(fused, x), repeats))
                if args.kernels:
                    grouped.append(_time(grouped_call, repeats))
                    gathered.append(_time(gather_call, repeats))
                    upcast.append(_time(upcast_call, repeats))
                    kept.append(_time(kept_call, repeats))
                    chunked.append(_time(chunked_call, repeats))
        ratios = [p / f for p, f in zip(plain_times, fused_times, strict=True)]
        plain_ms, fused_ms = statistics.median(plain_times) * 1e3, statistics.median(fused_times) * 1e3
        line = (f"{tokens:>6} {plain_ms:>9.2f} {fused_ms:>9.2f} {statistics.median(ratios):>5.2f}x "
                f"{min(ratios):>5.2f}-{max(ratios):.2f}x {diff:>9.1e}")
        if args.kernels:
            line += "".join(f" {statistics.median(times) * 1e3:>10.2f}"
                            for times in (grouped, gathered, upcast, kept, chunked)) + f" {rule}"
        print(line)


def _gather_bmm(rows: torch.Tensor, experts: torch.nn.Module, act: torch.nn.Module, routed: Routed) -> torch.Tensor:
    """The alternative kernel: each sorted row's expert weights gathered, then one batched matmul per projection."""
    hidden = torch.bmm(experts.gate_up_proj[routed.expert], rows[routed.token].unsqueeze(-1)).squeeze(-1)
    width = hidden.shape[-1] // 2
    inner = act(hidden[:, :width]) * hidden[:, width:]
    return torch.bmm(experts.down_proj[routed.expert], inner.unsqueeze(-1)).squeeze(-1)


def _upcast(rows: torch.Tensor, experts: torch.nn.Module, act: torch.nn.Module, routed: Routed,
            buffers: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The float32 alternative: expert weights upcast (fresh tensors, or copied into ``buffers`` kept between
    calls), float32 grouped GEMMs, the result cast back."""
    if buffers is None:
        gate_up, down = experts.gate_up_proj.float(), experts.down_proj.float()
    else:
        gate_up, down = buffers[0].copy_(experts.gate_up_proj), buffers[1].copy_(experts.down_proj)
    return grouped_expert_outputs(rows.float(), gate_up, down, act, routed).to(rows.dtype)


if __name__ == "__main__":
    main()
