#!/usr/bin/env bash
# Runs the whole test suite on transformers 4.57.x and on the newest 5.x (torch 2.13.0, CPU),
# after ruff and mypy, then the range subset (RANGE_TESTS: every shipped family loaded, run, saved
# and reloaded, the compat fallbacks, the transformers entry points, PEFT, in-place fuse/unfuse,
# pickling, tensor parallelism) on the minors in between (RANGE_SPECS in _env.sh). The quantization
# tests run on both lines in environments with the quantizers installed (QUANT_SPEC in _env.sh).
# Creates the environments on first use. Extra arguments go to pytest.
# FUSION_CORE_SKIP_RANGE=1 leaves the range subset out (a quick local run).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"

TF5_PY="$(ensure_env tf5 "$TF5_SPEC")"
TF4_PY="$(ensure_env tf4 "$TF4_SPEC")"

echo "== ruff"
"$TF5_PY" -m ruff check .

echo "== mypy (strict on fusion_core, both transformers lines)"
"$TF5_PY" -m mypy
"$TF4_PY" -m mypy

echo "== docs (mkdocs, strict: a broken link or a bad reference fails)"
"$(dirname "$TF5_PY")/mkdocs" build --strict --site-dir "$(mktemp -d)" -q

RANGE_TESTS=(tests/test_pipeline.py tests/test_text_families.py tests/test_compat.py tests/test_routing.py
             tests/test_interop_peft.py tests/test_interop_inplace.py tests/test_interop_pickle.py
             tests/test_distributed.py::test_tensor_parallel_fused_load_runs_generates_trains_and_saves
             fusion_plugins)

status=0
reports="$(mktemp -d)"
run_pytest() {  # run_pytest PYTHON NAME PYTEST-ARGS...
    local py="$1" name="$2"
    shift 2
    echo "== pytest ($name) with $("$py" -c 'import transformers, torch; print(f"transformers {transformers.__version__}, torch {torch.__version__}")')"
    "$py" -m pytest -q --junitxml="$reports/$name.xml" "$@" || status=$?
}
run_pytest "$TF5_PY" "full-tf5" "$@"
run_pytest "$TF4_PY" "full-tf4" "$@"
QUANT_TESTS=(tests/test_quantization.py tests/test_integrations.py
             fusion_plugins/moe_experts/tests/test_moe_experts.py::test_torchao_quantize_refuses_an_expert_by_name_and_quantizes_the_rest_when_told_to
             fusion_plugins/moe_experts/tests/test_moe_experts.py::test_a_torchao_quantizing_load_is_refused_before_any_weight_is_read)
run_pytest "$(ensure_env quant-tf5 "$TF5_SPEC" "$TEST_SPEC $QUANT_SPEC")" "quant-tf5" "${QUANT_TESTS[@]}" "$@"
run_pytest "$(ensure_env quant-tf4 "$TF4_SPEC" "$TEST_SPEC $QUANT_SPEC")" "quant-tf4" "${QUANT_TESTS[@]}" "$@"
if [[ "${FUSION_CORE_SKIP_RANGE:-0}" != "1" ]]; then
    for spec in "${RANGE_SPECS[@]}"; do
        name="$(range_env_name "$spec")"
        run_pytest "$(ensure_env "$name" "$spec" "$TEST_SPEC")" "range-$name" "${RANGE_TESTS[@]}" "$@"
    done
fi

# One line per run (transformers release, counts, what it skipped and why), then one closing line.
"$TF5_PY" "$ROOT/scripts/test_summary.py" "$reports"/*.xml
exit $status
