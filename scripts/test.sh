#!/usr/bin/env bash
# Runs every check CI runs: ruff and mypy, the whole suite on transformers 4.57.x and on the newest
# 5.x (torch 2.13.0, CPU; the docs build is one of its tests), the quantizer tests on both lines
# (QUANT_SPEC in _env.sh), and the range subset on the minors in between (RANGE_SPECS in _env.sh;
# RANGE_TESTS in checks.py: every shipped family loaded, run, saved and reloaded, the compat
# fallbacks, the transformers entry points, PEFT, in-place fuse/unfuse, pickling, tensor parallelism).
# The environments are created on first use; the independent chains run side by side, one per
# core (scripts/checks.py), and a table of every stage's wall time closes the run, then one line
# "tests: N passed, N failed, N skipped". Exits non-zero when any check or test fails.
#
#   bash scripts/test.sh                  # everything (CI)
#   bash scripts/test.sh --quick          # ruff, mypy and the core suite on the newest line (edit-test loop)
#   bash scripts/test.sh -- -k pipeline   # arguments after -- go to every pytest run
#   FUSION_CORE_SKIP_RANGE=1 bash scripts/test.sh   # leave the range subset out
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" scripts/checks.py "$@"
