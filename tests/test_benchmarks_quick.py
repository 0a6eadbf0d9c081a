"""The benchmark suite runs (``benchmarks/run.py --quick``), so it cannot rot. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_benchmark_runs_and_prints_its_tables(tmp_path: Path) -> None:
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
    for row in rows:
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
