#!/usr/bin/env bash
# The main job: build a tiny Qwen2-VL-style checkpoint locally, load it with
# fusion_config={"patch_embeddings": True}, compare, time, save and check the round trip.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
PY="$(ensure_env tf5 "$TF5_SPEC")"
exec "$PY" scripts/demo.py "$@"
