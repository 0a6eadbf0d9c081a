"""The benchmark suite runs (``benchmarks/run.py --quick``), so it cannot rot. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _on_benchmark_path() -> None:
    """The benchmark scripts import each other as top-level modules (each runs as a script from benchmarks/)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.slow
@pytest.mark.once
def test_quick_benchmark_runs_and_prints_its_tables(tmp_path: Path) -> None:
    """~2.5 min on a 2-core CI machine (every section at toy sizes, compiled rows too): once, on the newest line."""
    results, markdown = tmp_path / "results.json", tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--json", str(results),
         "--markdown", str(markdown)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**os.environ, "FUSION_BENCH_CHECKPOINTS": str(tmp_path / "checkpoints")},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for title in ("Runtime: patch_embeddings", "Load:", "Save:", "Start-up", "Machine and run",
                  "End to end: greedy generate", "End to end: prefill forward", "tower (depth",
                  "fused speed vs plain, side by side", "Decode: bytes read per token",
                  "where the patch embedding fusion can gain", "Operators run per decoded token"):
        assert title in proc.stdout, f"{title!r} table missing from the output:\n{proc.stdout[-4000:]}"
    report = json.loads(results.read_text())
    assert set(report["sections"]) == {"runtime", "e2e", "explain", "load", "save", "startup"}
    assert report["sections"]["runtime"]["data"]["patch_embeddings"], "no patch_embeddings row measured"
    for row in report["sections"]["runtime"]["data"]["patch_embeddings"]:
        assert row["max_abs_diff"] < (1e-3 if row["dtype"] == "fp32" else 0.1), row  # numbers, not timings
    assert "| shape |" in markdown.read_text()
    _check_end_to_end(report["sections"]["e2e"]["data"], report["sections"]["explain"]["data"])


def _check_end_to_end(e2e: dict, explain: dict) -> None:
    """What the end-to-end rows computed agrees with the plain model; the operator counts show the fusion."""
    rows = e2e["rows"]
    seen = {(r["workload"], r["dtype"], r["mode"]) for r in rows}
    for workload in ("generate", "prefill", "tower"):
        for dtype in ("fp32", "bf16"):
            assert (workload, dtype, "eager") in seen, (workload, dtype, sorted(seen))
        assert (workload, "bf16", "compiled") in seen, (workload, sorted(seen))
    control = "plain, 2nd load"  # bench_e2e.CONTROL: the plain model loaded again, timed like a fused one
    for workload in ("generate", "prefill", "tower"):
        for dtype in ("fp32", "bf16"):
            assert any(r["families"] == control for r in rows
                       if (r["workload"], r["dtype"], r["mode"]) == (workload, dtype, "eager")), (workload, dtype)
    for row in rows:
        if row["families"] == control and row["workload"] != "generate":
            assert row["rel_diff"] == 0, row  # the same weights give the same output
        speed = row["speed"]
        assert speed["n"] == row["rounds"] and speed["min"] <= speed["median"] <= speed["max"], row["speed"]
        if row["workload"] == "generate" and row["dtype"] == "fp32":
            assert row["same_tokens"], f"fused greedy tokens differ from plain: {row['families']} {row['mode']}"
        if row["workload"] in ("prefill", "tower"):
            assert row["rel_diff"] < (1e-4 if row["dtype"] == "fp32" else 3e-2), row["rel_diff"]
    # Merged projections run fewer GEMMs per decoded token than the plain model, family by family.
    decode = e2e["op_counts"]["decode eager bf16"]
    layers = e2e["plan"]["text_layers"]
    saved = {"qkv": 2 * layers, "gate_up": layers, "qkv+gate_up": 3 * layers}
    for family, expected in saved.items():
        if family in decode:
            assert decode["plain"]["gemm"] - decode[family]["gemm"] == expected, (family, decode)
    flops = explain["tower_flops"]
    assert flops["patch_embed"] == flops["analytic_patch_embed"], flops
    assert 0 < flops["share"] < 1, flops
    assert {(g["family"], g["tokens"]) for g in explain["merged_gemms"]} >= {("qkv", 1), ("gate_up", 1)}


def test_end_to_end_rows_pair_each_round_and_rotate_the_order() -> None:
    """A row's speed is the median of per-round ratios (not a ratio of medians); who runs first rotates."""
    _on_benchmark_path()
    import bench_e2e

    order: list[str] = []

    def contender(name: str, seconds: list[float]) -> Callable[[], dict[str, float]]:
        values = iter(seconds)

        def call() -> dict[str, float]:
            order.append(name)
            return {"total": next(values)}

        return call

    # warm-up (9 s each), then rounds: plain 2, 4, 6 s; fused 1, 4, 3 s -> per-round speeds 2, 1, 2.
    samples, first = bench_e2e.paired_rounds(
        {"plain": contender("plain", [9, 2, 4, 6]), "fused": contender("fused", [9, 1, 4, 3])}, rounds=3, warmup=1
    )
    assert order == ["plain", "fused", "plain", "fused", "fused", "plain", "plain", "fused"]
    assert set(first) == {"plain", "fused"}
    speed = bench_e2e.speed(samples, "fused", "total")
    assert (speed.median, speed.min, speed.max, speed.n) == (2.0, 1.0, 2.0, 3)  # the ratio of medians is 4/3


_STEPS_PROBE = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
sys.path.insert(0, sys.argv[1])
import bench_scale
steps = {}
bench_scale.step_timers(steps)
import fusion_core
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128)
LlamaForCausalLM(config).save_pretrained(sys.argv[2])
fusion_core.from_pretrained(AutoModelForCausalLM, sys.argv[2], fusion_config={"qkv": True, "gate_up": True})
print(json.dumps(steps))
"""


def test_the_step_timers_of_bench_scale_time_every_step_of_a_fused_load(tmp_path: Path) -> None:
    """``bench_scale.py --steps`` wraps fusion-core functions by name: a renamed one must fail here, not at size."""
    proc = subprocess.run([sys.executable, "-c", _STEPS_PROBE, str(ROOT / "benchmarks"), str(tmp_path / "tiny")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _on_benchmark_path()
    import bench_scale

    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(steps) == set(bench_scale.STEPS) and all(seconds > 0 for seconds in steps.values()), steps


@pytest.mark.slow
@pytest.mark.once
def test_training_step_benchmark_runs_and_its_fused_steps_match_plain(tmp_path: Path) -> None:
    """``bench_train.py`` end to end on a toy Qwen2 (~1 min on 2 cores: eight fresh processes), fp32, one round.

    No memory or time is asserted; the fused loss and gradients must match the plain model's, and the A/A
    control (plain against plain) must match exactly.
    """
    pytest.importorskip("peft")
    pytest.importorskip("fusion_linear_cross_entropy")
    results = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--model", "tiny", "--tokens", "64",
         "--rounds", "1", "--dtype", "fp32", "--setting", "lora-gc", "full-gc", "--with-merged", "--fp32-reference",
         "--json", str(results)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "FUSION_BENCH_CHECKPOINTS": str(tmp_path / "checkpoints")},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for title in ("Training step, tiny (2 layers), lora-gc, fp32", "Training step, tiny (2 layers), full-gc, fp32",
                  "Budgets"):
        assert title in proc.stdout, f"{title!r} table missing from the output:\n{proc.stdout[-4000:]}"
    report = json.loads(results.read_text())
    assert [(run["setting"], run["tokens"]) for run in report["runs"]] == [("lora-gc", 64), ("full-gc", 64)]
    for run in report["runs"]:
        samples = run["samples"]
        assert set(samples) == {"plain", "linear_cross_entropy", "linear_cross_entropy+qkv+gate_up", "plain (A/A)"}
        for name, (sample,) in samples.items():
            assert sample["step_peak_mb"] > 0 and sample["step_s"] > 0, (name, sample)
            assert sample["compared_tensors"] > 0 and not sample["unmatched"], (name, sample)
            assert sample["grad_norm"] > 0, (name, sample)  # zero gradients would compare equal to anything
            limit = 0.0 if name.startswith("plain") else 1e-5  # the fp32 budget; plain vs plain is bit for bit
            assert sample["loss_rel"] <= limit and sample["grad_rel"] <= limit, (run["setting"], name, sample)
            # the float32 reference is plain itself here (an fp32 run): every contender as close to it as to plain
            assert sample["grad_rel_fp32"] <= max(limit, 1e-5), (run["setting"], name, sample)


def test_the_decode_split_books_every_built_kernels_calls_under_a_kernel() -> None:
    """A built kernel's calls are no torch operators: ``linear_kernels`` labels them (a module's ``PROFILER_LABEL``),
    and ``bench_decode.py --profile`` must book each label as a GEMV, a decode step's call or attention, never as
    "other operators", which would hide a kernel's time among the small operators."""
    pytest.importorskip("fusion_linear_kernels")
    import importlib
    import pkgutil

    import fusion_linear_kernels

    _on_benchmark_path()
    from decode_split import group_of

    labels = {name: module.PROFILER_LABEL for name, module in (
        (info.name, importlib.import_module(f"fusion_linear_kernels.{info.name}"))
        for info in pkgutil.iter_modules(fusion_linear_kernels.__path__)) if hasattr(module, "PROFILER_LABEL")}
    assert {"row_dot", "layer_kernel", "attention_kernel", "projection_kernel"} <= labels.keys()
    for name, label in labels.items():
        group = group_of(f"{label} 1152x896", [])
        assert group.startswith(("GEMV", "decode step", "attention")), (name, group)


@pytest.mark.parametrize("families", [None, {"qkv": True, "gate_up": True, "linear_kernels": True}])
def test_the_decode_split_finds_every_weight_kind_a_step_reads(llama: Path, families: dict[str, bool] | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_decode.py --profile`` names GEMVs by the operators torch runs (``mm``, ``mv``, oneDNN's packed
    ``_linear_pointwise``): an operator it does not know would land in "other operators" and hide a GEMV kind.
    The fused model has its layers packed: its packing decision finds packing faster, and nothing is stored."""
    pytest.importorskip("fusion_linear_kernels")
    import torch
    from fusion_linear_kernels import packing
    from torch import nn
    from transformers import AutoModelForCausalLM

    import fusion_core
    from fusion_core.plugin import Decisions

    _on_benchmark_path()
    from decode_split import decode_split

    clock = Decisions.times
    monkeypatch.setenv("FUSION_CORE_DECISIONS", "off")  # measured now, never stored
    monkeypatch.setattr(Decisions, "times", lambda table, ways, device: (
        [1.0] + [0.5] * (len(ways) - 1) if table.topic == "linear_kernels.packing" else clock(table, ways, device)))
    packing.clear_pack_decisions()

    model = (AutoModelForCausalLM.from_pretrained(llama) if families is None
             else fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=families)).eval()
    split = decode_split(model, torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0)), 4)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    if families is None:  # every nn.Linear runs
        kinds = {f"GEMV {m.weight.shape[0]}x{m.weight.shape[1]}" for m in model.modules() if isinstance(m, nn.Linear)}
    else:  # the merged projections and the head
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
        kinds = {f"GEMV {qkv}x{config.hidden_size}", f"GEMV {2 * config.intermediate_size}x{config.hidden_size}",
                 f"GEMV {config.vocab_size}x{config.hidden_size}"}
    packed = any(p.is_mkldnn for p in model.parameters())
    packing.clear_pack_decisions()
    assert packed == (families is not None)  # the fused step runs oneDNN's packed kernel
    assert kinds <= set(split), sorted(split)
    assert {"other operators", "outside operators"} <= set(split) and all(s >= 0 for s in split.values())


def test_decode_measures_the_shape_of_any_config_json(tmp_path: Path) -> None:
    """``bench_decode.py --config``: the class is the one the file's ``model_type`` names, ``--layers`` cuts the depth
    (and a per-layer list such as Gemma 2's ``layer_types`` with it), and a missing file says so."""
    from transformers import Gemma2Config

    _on_benchmark_path()
    from bench_decode import config_from_file

    Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=6, vocab_size=256).save_pretrained(tmp_path)
    whole = config_from_file(tmp_path / "config.json", None)
    assert type(whole) is Gemma2Config and (whole.hidden_size, whole.num_hidden_layers) == (64, 6)
    cut = config_from_file(tmp_path / "config.json", 2)
    assert cut.num_hidden_layers == 2 and len(cut.layer_types) == 2
    with pytest.raises(SystemExit, match="no such file"):
        config_from_file(tmp_path / "missing.json", None)


def test_the_floors_built_read_reads_every_word() -> None:
    """``bench_decode.built_read`` is the floor's read where it builds: a loop that ORs every 32-bit word of the
    buffer, vectors at a time and the rest one by one, so a bit set in any single word, the last included, is in its
    result."""
    import torch

    _on_benchmark_path()
    from bench_decode import built_read

    read = built_read()
    if read is None:
        pytest.skip("no C++ toolchain builds the floor's read here")
    words = 1000 + 37  # not a multiple of any vector width
    for place in (0, 517, words - 1):
        buffer, out = torch.zeros(words, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        buffer[place] = 1 << (place % 31)
        read(buffer, out, words)
        assert int(out) == 1 << (place % 31), place


def test_a_timed_generate_makes_every_token_though_the_model_ends_its_text_at_once() -> None:
    """``bench_e2e.generate_call`` times exactly the tokens it asks for, as the decode rows assume, without
    ``min_new_tokens`` (its logits processors are no part of a plain ``generate``): here the head makes the
    end-of-sequence token the likeliest at every step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _on_benchmark_path()
    from bench_e2e import generate_call

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64, eos_token_id=5, bos_token_id=1)
    model = LlamaForCausalLM(config).eval()
    model.lm_head.register_forward_hook(lambda module, args, out: out + 100.0 * (torch.arange(64) == 5))
    call, outputs = generate_call(model, torch.tensor([[1, 2, 3]]), 6, "cpu")
    times = call()
    assert outputs == [[5] * 6], outputs
    assert times["decode"] >= 0 and times["total"] >= times["prefill"]


def test_a_timed_generate_runs_between_its_decode_steps_off_its_clock() -> None:
    """``generate_call``'s ``between`` (``bench_decode.py --floor-between-steps`` reads the floor there) runs once
    between every two decode steps it times, and its time stays off the decode's and the total's."""
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _on_benchmark_path()
    from bench_e2e import generate_call

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64)
    model = LlamaForCausalLM(config).eval()
    runs: list[float] = []
    call, _ = generate_call(model, torch.tensor([[1, 2, 3]]), 6, "cpu", between=lambda: (runs.append(0.0),
                                                                                          time.sleep(0.05)))
    start = time.perf_counter()
    times = call()
    wall = time.perf_counter() - start
    assert len(runs) == 5  # between the six new tokens' five timed steps
    assert times["between"] >= 5 * 0.05 and times["decode"] < 5 * 0.05  # the sleeps on the clock would pass 0.25 s
    assert times["total"] <= wall - times["between"] + 1e-3


def _census() -> Any:
    _on_benchmark_path()
    import census

    return census


def test_the_census_shrinks_configs_nested_in_sub_configs() -> None:
    """A sub-config's own sub-configs (PaliGemma's text and vision configs inside ColPali's ``vlm_config``, an
    OCR model's vision encoder inside its vision config) are shrunk too: left at their defaults, one tiny model of
    the census took 18 GB and the whole run was killed for memory."""
    census = _census()

    def nested(config: Any, depth: int) -> Iterator[tuple[int, Any]]:
        yield depth, config
        for _, sub in census._sub_configs(config):
            yield from nested(sub, depth + 1)

    checked = 0
    for model_type in ("colpali", "qwen2_5_omni"):  # on every line CI runs; each nests configs two deep
        for depth, config in nested(census.tiny_config(model_type), 0):
            for name in ("hidden_size", "num_hidden_layers"):
                value = vars(config).get(name)
                if depth >= 2 and isinstance(value, int):
                    assert value <= census.SHRINK[name], (model_type, type(config).__name__, name, value)
                    checked += 1
    assert checked >= 4


def test_the_census_refuses_to_build_a_tiny_model_that_is_not_tiny(llama: Path) -> None:
    """A config part the census does not shrink is reported for that model type, before any weight is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    census = _census()
    small = AutoConfig.from_pretrained(llama)
    census.refuse_large(AutoModelForCausalLM, small)
    large = AutoConfig.from_pretrained(llama, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                       num_key_value_heads=8, head_dim=128)
    refused = r"would have 437M parameters \(the census builds at most 50M\): .* does not shrink"
    with pytest.raises(ValueError, match=refused):
        census.refuse_large(AutoModelForCausalLM, large)


def test_the_census_counts_a_model_plain_transformers_reloads_with_weights_missing_as_plain_failing(
        llama: Path, tmp_path: Path) -> None:
    """Plain transformers initialises a missing weight anew, so a fused load that refuses it by name is not a row
    against fusion-core: the census says plain fails, naming the weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    census = _census()
    assert census.load_plain(AutoModelForCausalLM, llama) is not None
    checkpoint = shutil.copytree(llama, tmp_path / "llama")
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"with 1 weights missing, e.g. \['model.layers.1.mlp.up_proj.weight'\]"):
        census.load_plain(AutoModelForCausalLM, checkpoint)


def test_the_census_runs_a_forward_that_draws_noise_the_same_way_each_time() -> None:
    """ViT-MAE masks random patches and VITS draws its durations even in eval mode: plain and fused runs must draw
    the same noise, or the census reports a silent difference fusion-core did not make."""
    import torch

    census = _census()

    class Noisy(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids + torch.rand(input_ids.shape)

    inputs = {"input_ids": torch.zeros(2, 3)}
    first = census._run(Noisy(), inputs)
    torch.rand(5)  # whatever ran in between
    assert torch.equal(census._run(Noisy(), inputs), first)


def test_the_training_census_tells_rounding_noise_from_a_wrong_gradient(tmp_path: Path) -> None:
    """A gradient that is zero in exact arithmetic (OPT's key bias: softmax ignores a shift of a query's scores) is
    float32 rounding noise, which another summation order reshuffles: the census passes it (below its floor, or
    judged against a float64 step). A gradient off by 0.1%, or noise far above plain's own, is still reported."""
    from transformers import AutoModelForCausalLM

    census = _census()
    census.build_checkpoint(AutoModelForCausalLM, "opt", tmp_path / "opt")
    plain = census.load_plain(AutoModelForCausalLM, tmp_path / "opt")
    inputs = {k: v for k, v in census._inputs(plain).items() if k in ("input_ids", "attention_mask")}
    loss, expected = census._training_step(plain, inputs)
    bias, weight = "model.decoder.layers.0.self_attn.k_proj.bias", "model.decoder.layers.0.self_attn.q_proj.weight"
    assert float(expected[bias].norm()) < 1e-6 * float(expected[weight].norm())  # noise: its exact value is 0

    def verdict(name: str, value: Any) -> list[str]:
        return census.gradient_problems(plain, inputs, loss, expected, {**expected, name: value})

    assert census.relative_l2(expected[bias], -expected[bias]) > census.TRAINING_BOUND
    assert verdict(bias, -expected[bias]) == []  # as far from exact as plain's own rounding
    assert census._beyond_rounding(plain, inputs, loss, expected, {**expected, bias: -expected[bias]}, [bias]) == []
    assert verdict(bias, expected[bias] + 1e-4)  # a real difference, though small next to the weights'
    assert verdict(weight, expected[weight] * 1.001)


def test_a_decode_contenders_suffix_names_its_families_and_turns_its_part_off() -> None:
    """``bench_decode.py``'s contender suffixes keep the base contender's families, and `` (projections as modules)``
    hooks every attention's output projection (a hook that changes nothing), so the step's own attention gives that
    child its call and runs the projections as modules."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _on_benchmark_path()
    from bench_decode import CONTENDERS, PROJECTIONS_AS_MODULES, SUFFIXES, _families_of, as_named

    base = "qkv+gate_up+linear_kernels"
    assert all(_families_of(base + suffix) == CONTENDERS[base] for suffix in SUFFIXES)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=256))
    assert as_named(model, base + PROJECTIONS_AS_MODULES) is model
    assert all(len(layer.self_attn.o_proj._forward_hooks) == 1 for layer in model.model.layers)
    assert not any(module._forward_hooks for name, module in model.named_modules() if not name.endswith("o_proj"))
