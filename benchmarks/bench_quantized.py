"""Quantized decode: int8 weight-only (torchao) fused vs unfused, and quantized vs fp32, side by side.

One Qwen2-0.5B-shaped checkpoint (see :mod:`bench_models`; ``--layers`` makes it shallower) is
loaded four times in fp32: plain, fused (``qkv`` + ``gate_up``), and a second plain and fused copy
that ``torchao.quantization.quantize_(model, Int8WeightOnlyConfig())`` quantizes after loading
(on the fused copy, each merged projection is quantized as one layer). Every round runs a greedy
``generate`` of each of the four, in an order that rotates from round to round; a streamer stamps
each token, so one call gives the prefill (time to first token) and the decode (tokens 1 to N).
Speed-ups are per round (other seconds / these seconds), median [min-max]. Needs torchao (the
``quant-tf5`` / ``quant-tf4`` environments of ``scripts/test.sh`` have it)::

    .venvs/quant-tf5/bin/python benchmarks/bench_quantized.py             # 24 layers, 5 rounds
    .venvs/quant-tf5/bin/python benchmarks/bench_quantized.py --quick     # a tiny Qwen2, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import Summary, Table, machine_info
from bench_e2e import generate_call, load, paired_rounds
from bench_models import QWEN2_05B_LAYERS, build_checkpoint, text_config

FAMILIES = "qkv+gate_up"
CONTENDERS = ("plain fp32", "fused fp32", "plain int8", "fused int8")
#: (name, numerator contender, denominator contender, budget or None): numerator seconds / denominator seconds.
RATIOS = (
    ("fused int8 vs plain int8", "plain int8", "fused int8", 0.98),
    ("plain int8 vs plain fp32", "plain fp32", "plain int8", None),
    ("fused int8 vs plain fp32", "plain fp32", "fused int8", None),
    ("fused fp32 vs plain fp32", "plain fp32", "fused fp32", None),
)


def _models(path: Path) -> dict[str, torch.nn.Module]:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    models = {}
    for name in CONTENDERS:
        model = load("AutoModelForCausalLM", path, FAMILIES if name.startswith("fused") else None, torch.float32, "cpu")
        if name.endswith("int8"):
            quantize_(model, Int8WeightOnlyConfig())
        models[name] = model
    return models


def run(quick: bool, layers: int, rounds: int, new_tokens: int, prompt_length: int) -> dict[str, Any]:
    config = text_config(quick, layers)
    path = build_checkpoint(config, "AutoModelForCausalLM", "qwen2-text", lambda m: print(m, flush=True))
    models = _models(path)
    prompt = torch.randint(3, config.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(0))
    calls, tokens = {}, {}
    for name, model in models.items():
        calls[name], tokens[name] = generate_call(model, prompt, new_tokens, "cpu")
    samples, _ = paired_rounds(calls, rounds, warmup=1)
    seconds = {name: {metric: Summary.of([s[metric] for s in samples[name]]) for metric in ("prefill", "decode")}
               for name in CONTENDERS}
    speedups = {}
    for label, numerator, denominator, _ in RATIOS:
        speedups[label] = {metric: Summary.of([a[metric] / b[metric] for a, b in
                                               zip(samples[numerator], samples[denominator], strict=True)])
                           for metric in ("prefill", "decode")}
    from fusion_core.merge_policy import merge_decisions

    decisions = [{"weight": list(kind[2]), "parts": list(kind[3]), "rows": 2 ** kind[5], "class": kind[6],
                  "merged": merged} for kind, merged in merge_decisions().items()]
    return {"layers": layers, "rounds": rounds, "new_tokens": new_tokens, "prompt": prompt_length,
            "seconds": seconds, "speedups": speedups, "merge_decisions": decisions,
            "tokens_equal": {name: tokens[name] == tokens["plain int8" if "int8" in name else "plain fp32"]
                             for name in CONTENDERS},
            "machine": machine_info()}


def tables(result: dict[str, Any]) -> list[Table]:
    decode_steps = result["new_tokens"] - 1
    times = Table(f"Greedy generate, {result['layers']} layers, prompt {result['prompt']} + {result['new_tokens']} "
                  f"tokens, {result['rounds']} rounds (median [min-max])",
                  ["model", "prefill ms", "decode ms/token", "greedy tokens equal (same dtype, plain)"])
    for name in CONTENDERS:
        s = result["seconds"][name]
        times.rows.append([name, s["prefill"].fmt_range(1e3, 1), s["decode"].fmt_range(1e3 / decode_steps, 1),
                           "yes" if result["tokens_equal"][name] else "no"])
    speed = Table("Speed-ups (per round, other / this; >1: faster)", ["comparison", "prefill", "decode", "budget"])
    for label, _, _, budget in RATIOS:
        s = result["speedups"][label]
        passed = budget is not None and s["decode"].median >= budget
        verdict = "-" if budget is None else f">= {budget}x decode: {'PASS' if passed else 'MISS'}"
        speed.rows.append([label, s["prefill"].fmt_range(1, 2) + "x", s["decode"].fmt_range(1, 2) + "x", verdict])
    policy = Table("Merge policy: what each fused kind measured faster (fusion_core.merge_policy)",
                   ["merged weight", "parts", "rows (bucket)", "weight class", "runs"])
    for row in result["merge_decisions"]:
        policy.rows.append([str(row["weight"]), str(row["parts"]), str(row["rows"]), row["class"],
                            "one merged GEMM" if row["merged"] else "one GEMM per part"])
    return [times, speed, policy]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny Qwen2, 2 rounds (checks the harness)")
    parser.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {QWEN2_05B_LAYERS})")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5, --quick 2)")
    parser.add_argument("--tokens", type=int, default=None, help="greedy tokens (default 32, --quick 4)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length (default 16)")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args()
    layers = args.layers or (2 if args.quick else QWEN2_05B_LAYERS)
    result = run(args.quick, layers, args.rounds or (2 if args.quick else 5), args.tokens or (4 if args.quick else 32),
                 args.prompt)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, torchao int8 weight-only")
    for table in tables(result):
        print(table.text())
        print()
    for table in tables(result):
        print(table.markdown())
        print()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=lambda o: o.__dict__))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
