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
    for title in ("Runtime: patch_embeddings", "Load:", "Save:", "Start-up", "Machine and run"):
        assert title in proc.stdout, f"{title!r} table missing from the output:\n{proc.stdout[-4000:]}"
    report = json.loads(results.read_text())
    assert set(report["sections"]) == {"runtime", "load", "save", "startup"}
    assert report["sections"]["runtime"]["data"]["patch_embeddings"], "no patch_embeddings row measured"
    for row in report["sections"]["runtime"]["data"]["patch_embeddings"]:
        assert row["max_abs_diff"] < (1e-3 if row["dtype"] == "fp32" else 0.1), row  # numbers, not timings
    assert "| shape |" in markdown.read_text()
