"""Every check of ``scripts/test.sh`` as timed stages on parallel lanes, and the table of their times.

CI has 90 minutes on a 2-core machine. The checks are independent chains (create an environment,
then run pytest in it), each essentially single-threaded, so they run on as many lanes as the
machine has cores, longest chain first, each test process pinned to one thread so that two never
fight over the cores. Every stage's output is kept in a log and printed whole when the stage ends,
so the CI log reads stage by stage, not interleaved.

The closing summary is one table, a row per stage (environment creations, ruff, mypy, each pytest
run) with its lane, its wall time and its test counts (the deselected ones are the checks marked
``once``, which run on the newest line only), each lane's total beside the run's wall time, then
one line ``tests: N passed, N failed, N skipped`` over all pytest runs.

``python3 scripts/checks.py [--quick] [--lanes N] [-- PYTEST-ARGS...]``; ``scripts/test.sh`` is
the entry point that the README and CI call.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import test_summary  # scripts/ is this script's directory, first on sys.path

ROOT = Path(__file__).resolve().parent.parent
ENV_SH = ROOT / "scripts" / "_env.sh"

# The range subset: every shipped family loaded, run, saved and reloaded, the compat fallbacks, the
# transformers entry points, PEFT, in-place fuse/unfuse, pickling, tensor parallelism at world 2.
RANGE_TESTS = [
    "tests/test_pipeline.py", "tests/test_text_families.py", "tests/test_compat.py", "tests/test_routing.py",
    "tests/test_streaming.py", "tests/test_weight_sources.py",
    "tests/test_interop_peft.py", "tests/test_interop_inplace.py", "tests/test_interop_pickle.py",
    "tests/test_distributed.py::test_tensor_parallel_fused_load_runs_generates_trains_and_saves",
    "fusion_plugins",
]
# What the quantizer environments run: every test that needs a quantizer installed.
QUANT_TESTS = [
    "tests/test_quantization.py", "tests/test_integrations.py", "fusion_plugins/linear_kernels/tests/test_int8.py",
    "fusion_plugins/moe_experts/tests/test_moe_experts.py::"
    "test_torchao_quantize_refuses_an_expert_by_name_and_quantizes_the_rest_when_told_to",
    "fusion_plugins/moe_experts/tests/test_moe_experts.py::"
    "test_a_torchao_quantizing_load_is_refused_before_any_weight_is_read",
]
# What runs with the oldest PEFT fusion-peft supports ($PEFT_OLDEST), beside 4.57, in an environment of its own.
PEFT_TESTS = ["tests/test_interop_peft.py",
              "fusion_plugins/linear_kernels/tests/test_packing.py::test_lora_on_packed_layers_trains_like_plain",
              "fusion_plugins/linear_kernels/tests/test_packing.py::test_pissa_rewrites_packed_base_weights"]
# The edit-test loop (--quick): the core suite on the newest line, without the multi-process,
# docs-build and benchmark-smoke tests (marked `slow`) that the full runs keep.
QUICK_ARGS = ["-m", "not slow"]
# Checks whose result does not depend on the transformers line run on the newest line only.
ONCE_ARGS = ["-m", "not once"]


@dataclass
class Stage:
    """One timed step: a shell command run in the repository root, its output kept in a log."""

    name: str
    command: list[str]
    junit: Path | None = None
    seconds: float = 0.0
    returncode: int | None = None
    lane: int = 0
    blocking: bool = False  # a failure ends its chain (an environment that could not be set up)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Chain:
    """Stages that must run in order (an environment, then what runs in it); chains are independent."""

    stages: list[Stage]
    weight: float  # expected seconds, to start the longest chains first


def ensure_env(name: str, tf_spec_var: str, tools: str = "") -> Stage:
    """The stage creating (or checking) environment ``name``; its python is ``.venvs/NAME/bin/python``."""
    return env_stage(name, f'"${tf_spec_var}"', f'"{tools}"' if tools else "")


def env_stage(name: str, *ensure_env_args: str) -> Stage:
    """``ensure_env NAME ARGS...`` from _env.sh (its arguments as shell words: variables of _env.sh expand)."""
    command = f"source {shlex.quote(str(ENV_SH))} && ensure_env {name} {' '.join(ensure_env_args)} >/dev/null"
    return Stage(f"env {name}", ["bash", "-c", command], blocking=True)


def env_python(name: str) -> str:
    return str(ROOT / ".venvs" / name / "bin" / "python")


def pytest_stage(name: str, env: str, args: list[str], reports: Path) -> Stage:
    junit = reports / f"{name}.xml"
    return Stage(f"pytest {name}", [env_python(env), "-m", "pytest", "-q", f"--junitxml={junit}", *args], junit=junit)


def range_specs() -> list[str]:
    out = subprocess.run(["bash", "-c", f'source {shlex.quote(str(ENV_SH))} && printf "%s\\n" "${{RANGE_SPECS[@]}}"'],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


def range_env_name(spec: str) -> str:
    """``transformers>=5.8,<5.9`` -> ``tf5.8``: the range environment's name."""
    return "tf" + spec.removeprefix("transformers>=").split(",")[0]


def plan(quick: bool, pytest_args: list[str], reports: Path) -> list[Chain]:
    """The chains, heaviest first; the weights are seconds measured on a 2-core CI machine."""
    lint = [Stage("ruff", [env_python("tf5"), "-m", "ruff", "check", "."]),
            Stage("mypy", [env_python("tf5"), "-m", "mypy"])]
    if quick:
        return [Chain([ensure_env("tf5", "TF5_SPEC"), *lint,
                       pytest_stage("quick-tf5", "tf5", [*QUICK_ARGS, *pytest_args], reports)], 1)]
    chains = [
        Chain([ensure_env("tf5", "TF5_SPEC"), *lint, pytest_stage("full-tf5", "tf5", pytest_args, reports)], 700),
        Chain([ensure_env("tf4", "TF4_SPEC"), pytest_stage("full-tf4", "tf4", [*ONCE_ARGS, *pytest_args], reports)],
              650),
    ]
    for line, spec_var in (("tf5", "TF5_SPEC"), ("tf4", "TF4_SPEC")):
        env = f"quant-{line}"
        chains.append(Chain([ensure_env(env, spec_var, "$TEST_SPEC $QUANT_SPEC"),
                             pytest_stage(env, env, [*QUANT_TESTS, *pytest_args], reports)], 200))
    chains.append(Chain([ensure_env("peft-oldest", "TF4_SPEC", "$TEST_SPEC $PEFT_OLDEST"),
                         pytest_stage("peft-oldest", "peft-oldest", [*PEFT_TESTS, *pytest_args], reports)], 150))
    if os.environ.get("FUSION_CORE_SKIP_RANGE", "0") != "1":
        for spec in range_specs():
            env = range_env_name(spec)
            chains.append(Chain([env_stage(env, shlex.quote(spec), '"$TEST_SPEC"'),
                                 pytest_stage(f"range-{env}", env, [*RANGE_TESTS, *pytest_args], reports)], 300))
    return sorted(chains, key=lambda chain: -chain.weight)


class Runner:
    """Runs chains on ``lanes`` threads; a stage that fails ends its chain, the others go on."""

    def __init__(self, chains: list[Chain], lanes: int, logs: Path) -> None:
        self.pending = list(chains)
        self.lanes = lanes
        self.logs = logs
        self.lock = threading.Lock()

    def run(self) -> None:
        threads = [threading.Thread(target=self._lane, args=(lane + 1,)) for lane in range(self.lanes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _next(self) -> Chain | None:
        with self.lock:
            return self.pending.pop(0) if self.pending else None

    def _lane(self, lane: int) -> None:
        while (chain := self._next()) is not None:
            for stage in chain.stages:
                self._run_stage(stage, lane)
                if stage.returncode != 0 and stage.blocking:
                    break  # an environment that could not be set up: its tests cannot run

    def _run_stage(self, stage: Stage, lane: int) -> None:
        log = self.logs / f"{stage.name.replace(' ', '-')}.log"
        env = dict(os.environ)
        if self.lanes > 1:
            # One core per lane: torch's intra-op pool would otherwise take both on each lane.
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        start = time.monotonic()
        with log.open("w") as out:
            stage.returncode = subprocess.run(stage.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, stdin=subprocess.DEVNULL).returncode
        stage.seconds = time.monotonic() - start
        stage.lane = lane
        if stage.junit is not None:
            stage.counts = junit_counts(stage.junit)
            if stage.counts:
                stage.counts["deselected"] = deselected(log.read_text(errors="replace"))
        with self.lock:
            verdict = "ok" if stage.returncode == 0 else f"FAILED (exit {stage.returncode})"
            print(f"== {stage.name} [lane {lane}, {stage.seconds:.0f} s]: {verdict}", flush=True)
            sys.stdout.write(log.read_text(errors="replace"))
            sys.stdout.flush()


def junit_counts(path: Path) -> dict[str, int]:
    return dict(test_summary.counts(ET.parse(path).getroot())) if path.exists() else {}


def deselected(pytest_output: str) -> int:
    """How many tests pytest's closing line says it deselected (``-m "not once"`` on the older line)."""
    found = re.findall(r"(\d+) deselected", pytest_output)
    return int(found[-1]) if found else 0


def print_table(stages: list[Stage], lanes: int, wall: float) -> None:
    print("\n== stages (wall seconds; the lanes run side by side, each lane's stages one after another)")
    print(f"{'stage':<26} {'lane':>4} {'seconds':>8}  {'result':<8} {'passed':>6} {'failed':>6} {'skipped':>7} "
          f"{'deselected':>10}")
    for stage in stages:
        result = "-" if stage.returncode is None else ("ok" if stage.returncode == 0 else "FAILED")
        c = stage.counts
        counts = f"{c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} {c['deselected']:>10}" if c else ""
        print(f"{stage.name:<26} {stage.lane:>4} {stage.seconds:>8.0f}  {result:<8} {counts}")
    for lane in range(1, lanes + 1):
        total = sum(stage.seconds for stage in stages if stage.lane == lane)
        print(f"{'lane ' + str(lane) + ' total':<26} {lane:>4} {total:>8.0f}")
    print(f"{'wall (whole run)':<26} {'':>4} {wall:>8.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ruff, mypy and the core suite on the newest line")
    parser.add_argument("--lanes", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for every pytest run (after --)")
    args = parser.parse_args()
    start = time.monotonic()
    # Stage logs (printed whole as each stage ends) and JUnit reports: read before the folder is removed.
    with tempfile.TemporaryDirectory(prefix="fusion-checks-") as scratch:
        work = Path(scratch)
        base = Stage("env _torch (shared torch)", ["bash", "-c", f"source {shlex.quote(str(ENV_SH))} && ensure_base"],
                     blocking=True)
        Runner([Chain([base], 0)], 1, work).run()
        chains = plan(args.quick, args.pytest_args, work)
        if base.returncode == 0:
            Runner(chains, args.lanes, work).run()
        stages = [base, *(stage for chain in chains for stage in chain.stages)]
        print_table(stages, args.lanes, time.monotonic() - start)
        reports = [str(stage.junit) for stage in stages if stage.junit is not None and stage.junit.exists()]
        summary = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_summary.py"), *reports])
    failed = any(stage.returncode != 0 for stage in stages) or summary.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
