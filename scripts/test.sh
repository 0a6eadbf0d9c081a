#!/usr/bin/env bash
# Runs the whole test suite on transformers 4.57.x and on the newest 5.x (torch 2.13.0, CPU),
# after ruff and mypy. Creates the environments on first use. Extra arguments go to pytest.
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

status=0
reports="$(mktemp -d)"
for py in "$TF5_PY" "$TF4_PY"; do
    echo "== pytest with $("$py" -c 'import transformers, torch; print(f"transformers {transformers.__version__}, torch {torch.__version__}")')"
    "$py" -m pytest -q --junitxml="$reports/$(basename "$(dirname "$(dirname "$py")")").xml" "$@" || status=$?
done

# One closing line over both transformers lines (pytest's own lines above are per line).
"$TF5_PY" - "$reports"/*.xml <<'PY'
import sys
import xml.etree.ElementTree as ET

total = failed = skipped = 0
for path in sys.argv[1:]:
    for suite in ET.parse(path).getroot().iter("testsuite"):
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
print(f"tests: {total - failed - skipped} passed, {failed} failed, {skipped} skipped")
PY
exit $status
