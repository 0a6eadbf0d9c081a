"""End to end: plain transformers 4.57 vs ``moe_experts``-fused 4.57, with transformers 5.x as the anchor.

OLMoE-1B-7B's config (``transformers.OlmoeConfig``: hidden 2048, expert width 1024, 64 experts,
top-8, 16 heads / 16 k-v heads, vocabulary 50304, no ``norm_topk_prob``) at 8 of its 16 layers,
random weights, bfloat16, batch 1. One round of a model is a 128-token prefill (``use_cache``,
last logits only), whose greedy token is the first of 32, then 31 single-token decode steps on the
cache (a plain greedy loop, the same code on every release, so ``generate``'s own overhead does not
enter). Reported: prefill seconds and decode milliseconds per token.

The checkpoint is saved once (safetensors) to a temporary directory and every model loads from
it. Never more than two full-size models are held at once (about 7 GB each):

1. **plain vs fused**: the plain 4.57 model and the fused one (``fusion_core.from_pretrained(...,
   fusion_config={"moe_experts": True})``) in this process, rounds interleaved (plain, fused,
   plain, fused, ...), so a busy machine slows both alike;
2. **fused vs anchor**: the plain model is freed, and transformers 5.x (``--anchor-python``, by
   default the repository's ``.venvs/tf5/bin/python``) loads the same directory in a subprocess
   with its own stacked experts and ``grouped_mm`` dispatch; rounds interleave again (anchor,
   fused, ...), the subprocess running one round per request on stdin.

Speed-ups are per round (the other model's time / the fused model's time of the same round, > 1:
fused is faster), median and [min-max] over rounds. The greedy tokens of each model are compared
with the plain model's (random weights in bfloat16: a near tie may flip a token; the table says)::

    .venvs/tf4/bin/python fusion_plugins/moe_experts/benchmarks/bench_moe_e2e.py            # full size, 5 rounds
    .venvs/tf4/bin/python fusion_plugins/moe_experts/benchmarks/bench_moe_e2e.py --quick    # tiny config, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_ANCHOR = ROOT / ".venvs" / "tf5" / "bin" / "python"

#: OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924) at 8 of its 16 layers.
FULL = dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, num_attention_heads=16,
            num_key_value_heads=16, vocab_size=50304, num_hidden_layers=8, max_position_embeddings=4096,
            rope_theta=10000.0, norm_topk_prob=False, clip_qkv=None, tie_word_embeddings=False,
            pad_token_id=1, bos_token_id=None, eos_token_id=50279)
QUICK = dict(FULL, hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=256, num_hidden_layers=2, max_position_embeddings=128, eos_token_id=2)


# -- one round, the same code in both processes --------------------------------------------------
def run_round(model: Any, ids: torch.Tensor, tokens: int) -> dict[str, Any]:
    """Prefill ``ids`` (its greedy token is the first of ``tokens``), then ``tokens - 1`` decode steps."""
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        prefilled = time.perf_counter()
        cache, generated = out.past_key_values, [int(token)]
        for _ in range(tokens - 1):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            generated.append(int(token))
        end = time.perf_counter()
    return {"prefill": prefilled - start, "decode": (end - prefilled) / max(1, tokens - 1), "tokens": generated}


def prompt(vocab: int, length: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def serve(directory: str, prompt_length: int, tokens: int) -> None:
    """The anchor: load ``directory`` with this interpreter's transformers, one round per stdin line."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    experts = model.model.layers[0].mlp.experts
    implementation = getattr(model.config, "_experts_implementation", None)
    ids = prompt(model.config.vocab_size, prompt_length)
    run_round(model, ids[:, :8], 2)  # warm-up
    print(json.dumps({"ready": True, "transformers": transformers.__version__, "experts": type(experts).__name__,
                      "implementation": implementation}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        print(json.dumps(run_round(model, ids, tokens)), flush=True)


class Anchor:
    """transformers 5.x in a subprocess, on the same directory."""

    def __init__(self, python: Path, directory: Path, prompt_length: int, tokens: int) -> None:
        command = [str(python), __file__, "--serve", str(directory), "--prompt", str(prompt_length),
                   "--tokens", str(tokens)]
        env = dict(os.environ, PYTHONPATH="")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the anchor process ended (rc {self.process.wait()}); see its stderr above")
        result: dict[str, Any] = json.loads(line)
        return result

    def round(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("stop\n")
        self.process.stdin.close()
        self.process.wait(timeout=120)


# -- the run ---------------------------------------------------------------------------------------
def summary(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    scaled = [v * scale for v in values]
    return f"{statistics.median(scaled):.{digits}f} [{min(scaled):.{digits}f}-{max(scaled):.{digits}f}]"


def speedups(others: list[dict[str, Any]], fused: list[dict[str, Any]], key: str) -> list[float]:
    return [o[key] / f[key] for o, f in zip(others, fused, strict=True)]


def same_tokens(a: list[int], b: list[int]) -> str:
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return "yes" if agree == len(a) else f"no (first {agree} of {len(a)} equal)"


def save_checkpoint(config_kwargs: dict[str, Any], directory: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.OlmoeConfig(**config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(directory)  # safetensors
    del model
    gc.collect()


def load(directory: Path, fused: bool) -> Any:
    import transformers

    import fusion_core

    if fused:
        model = fusion_core.from_pretrained(transformers.AutoModelForCausalLM, directory,
                                            fusion_config={"moe_experts": True}, torch_dtype=torch.bfloat16)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny OLMoE config, 2 rounds (checks the harness)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per pair (default 5, --quick 2)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt length (default 128, --quick 16)")
    parser.add_argument("--tokens", type=int, default=None, help="greedy tokens (default 32, --quick 4)")
    parser.add_argument("--anchor-python", type=Path, default=DEFAULT_ANCHOR,
                        help="the interpreter of a transformers 5.x environment with this plugin's requirements")
    parser.add_argument("--no-anchor", action="store_true", help="leave out the transformers 5.x anchor")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the plain/fused rounds, print the N costliest operators of one prefill and of "
                             "4 decode steps of each (torch.profiler, self CPU time)")
    parser.add_argument("--keep", type=Path, help="save the checkpoint here (kept) instead of a temporary directory")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    prompt_length = args.prompt or (16 if args.quick else 128)
    tokens = args.tokens or (4 if args.quick else 32)
    if args.serve:
        return serve(args.serve, prompt_length, tokens)

    import transformers

    transformers.logging.set_verbosity_error()
    config_kwargs = QUICK if args.quick else FULL
    directory = args.keep or Path(tempfile.mkdtemp(prefix="bench-moe-e2e-"))
    try:
        started = time.perf_counter()
        save_checkpoint(config_kwargs, directory)
        print(f"checkpoint saved in {time.perf_counter() - started:.1f} s: {directory}", flush=True)
        ids = prompt(config_kwargs["vocab_size"], prompt_length)
        results = measure(directory, ids, tokens, rounds, None if args.no_anchor else args.anchor_python,
                          args.profile)
    finally:
        if args.keep is None:
            shutil.rmtree(directory, ignore_errors=True)
    results.update(config=config_kwargs, prompt=prompt_length, tokens=tokens, rounds=rounds,
                   torch=torch.__version__, threads=torch.get_num_threads(), transformers=transformers.__version__)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def profile(name: str, model: Any, ids: torch.Tensor, top: int) -> None:
    """The ``top`` costliest operators (self CPU time) of one prefill and of 4 decode steps."""
    from torch.profiler import ProfilerActivity, profile as profiler

    with torch.inference_mode():
        with profiler(activities=[ProfilerActivity.CPU]) as prefill:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        token, cache = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values
        with profiler(activities=[ProfilerActivity.CPU]) as decode:
            for _ in range(4):
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)[:, None]
    for phase, prof in (("prefill", prefill), ("4 decode steps", decode)):
        print(f"\n{name}, {phase}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40))


def measure(directory: Path, ids: torch.Tensor, tokens: int, rounds: int, anchor_python: Path | None,
            top: int = 0) -> dict[str, Any]:
    from fusion_moe_experts import StackedExpertsMixin

    plain, fused = load(directory, fused=False), load(directory, fused=True)
    blocks = sum(isinstance(m, StackedExpertsMixin) for m in fused.modules())
    if blocks != len(fused.model.layers):
        raise RuntimeError(f"{blocks} fused MoE blocks in {len(fused.model.layers)} layers")
    for model in (plain, fused):
        run_round(model, ids[:, :8], 2)  # warm-up
    pair: dict[str, list[dict[str, Any]]] = {"plain": [], "fused": []}
    for index in range(rounds):
        pair["plain"].append(run_round(plain, ids, tokens))
        pair["fused"].append(run_round(fused, ids, tokens))
        print(f"round {index + 1}/{rounds}: plain {pair['plain'][-1]['prefill']:.3f} s + "
              f"{pair['plain'][-1]['decode'] * 1e3:.1f} ms/token, fused {pair['fused'][-1]['prefill']:.3f} s + "
              f"{pair['fused'][-1]['decode'] * 1e3:.1f} ms/token", flush=True)
    if top:
        for name, model in (("plain", plain), ("fused", fused)):
            profile(name, model, ids, top)
    del plain
    gc.collect()
    results: dict[str, Any] = {"pair": pair, "anchor": None}
    if anchor_python is None:
        return results
    if not anchor_python.exists():
        results["anchor_missing"] = str(anchor_python)
        return results
    anchor = Anchor(anchor_python, directory, ids.shape[1], tokens)
    against: dict[str, list[dict[str, Any]]] = {"anchor": [], "fused": []}
    try:
        for index in range(rounds):
            against["anchor"].append(anchor.round())
            against["fused"].append(run_round(fused, ids, tokens))
            print(f"round {index + 1}/{rounds}: anchor {against['anchor'][-1]['prefill']:.3f} s + "
                  f"{against['anchor'][-1]['decode'] * 1e3:.1f} ms/token, fused {against['fused'][-1]['prefill']:.3f}"
                  f" s + {against['fused'][-1]['decode'] * 1e3:.1f} ms/token", flush=True)
    finally:
        anchor.close()
    results["anchor"] = dict(against, info=anchor.info)
    return results


def print_table(results: dict[str, Any]) -> None:
    config, pair, anchor = results["config"], results["pair"], results["anchor"]
    print()
    print(f"OLMoE config: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"{config['num_experts']} experts x {config['intermediate_size']}, top-{config['num_experts_per_tok']}, "
          f"vocab {config['vocab_size']}; bfloat16, batch 1, {results['prompt']}-token prefill + "
          f"{results['tokens']} greedy tokens; torch {results['torch']}, {results['threads']} threads, "
          f"transformers {results['transformers']}; {results['rounds']} rounds, median [min-max]")
    if anchor is not None:
        info = anchor["info"]
        print(f"anchor: transformers {info['transformers']}, experts {info['experts']} "
              f"(implementation {info['implementation']}), in a subprocess on the same checkpoint")
    print()
    print("| model | prefill s | decode ms/token | greedy tokens equal plain |")
    print("|---|---|---|---|")
    reference = pair["plain"][0]["tokens"]
    rows = [("plain 4.57", pair["plain"]), ("fused 4.57 (plain/fused rounds)", pair["fused"])]
    if anchor is not None:
        rows += [("5.x anchor", anchor["anchor"]), ("fused 4.57 (anchor/fused rounds)", anchor["fused"])]
    for name, runs in rows:
        print(f"| {name} | {summary([r['prefill'] for r in runs], digits=3)} | "
              f"{summary([r['decode'] for r in runs], 1e3, 1)} | {same_tokens(runs[0]['tokens'], reference)} |")
    print()
    print("| speed-up of fused (other / fused, per round) | prefill | decode |")
    print("|---|---|---|")
    ratios = [("fused vs plain 4.57", pair["plain"], pair["fused"])]
    if anchor is not None:
        ratios.append(("fused vs 5.x anchor", anchor["anchor"], anchor["fused"]))
    for name, other, fused in ratios:
        print(f"| {name} | {summary(speedups(other, fused, 'prefill'))}x | "
              f"{summary(speedups(other, fused, 'decode'))}x |")
    if anchor is None and "anchor_missing" in results:
        print(f"\n(no anchor: {results['anchor_missing']} does not exist)")
    tokens_equal = all(r["tokens"] == reference for r in pair["fused"])
    print(f"\nfused greedy tokens equal plain: {tokens_equal}")


if __name__ == "__main__":
    main()
