#!/usr/bin/env bash
# Runs the whole test suite on transformers 4.57.x and on the newest 5.x (torch 2.13.0, CPU),
# after ruff. Creates the environments on first use. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"

TF5_PY="$(ensure_env tf5 "$TF5_SPEC")"
TF4_PY="$(ensure_env tf4 "$TF4_SPEC")"

echo "== ruff"
"$TF5_PY" -m ruff check .

echo "== docs (mkdocs, strict: a broken link or a bad reference fails)"
"$(dirname "$TF5_PY")/mkdocs" build --strict --site-dir "$(mktemp -d)" -q

status=0
for py in "$TF5_PY" "$TF4_PY"; do
    echo "== pytest with $("$py" -c 'import transformers, torch; print(f"transformers {transformers.__version__}, torch {torch.__version__}")')"
    "$py" -m pytest -q "$@" || status=$?
done
exit $status
