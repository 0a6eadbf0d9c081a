#!/usr/bin/env bash
# The prepared GPU run of the benchmarks: module and end-to-end tables in bf16 on one NVIDIA GPU.
#
#   bash benchmarks/gpu.sh [OUT_DIR] [run.py options]   # on the GPU machine (under 8 minutes on an H200)
#   bash benchmarks/gpu.sh --device cpu --quick         # the same path on a CPU machine, in about a minute
#   bash benchmarks/gpu.sh --fetch-wheels               # on a machine with PyPI: wheels the GPU image lacks
#
# Results in OUT_DIR (default: $OUT, else /tmp/fusion-bench-gpu-out): bench-gpu.{json,md} (module tables, eager end to end,
# explain), bench-gpu-compiled.{json,md} (compiled end to end), bench-gpu.log.
#
# Python: the first of $FUSION_BENCH_PYTHON, python3, python, .venvs/tf5/bin/python whose torch
# sees a CUDA device (with --device cpu: whose torch imports). A `pip install torch` would bring a
# CPU build, so no torch is ever installed: a machine without a CUDA torch is reported and the
# script exits 2. When that python cannot import fusion_core with its three families, the wheels
# in build/gpu-wheels/ (missing dependencies such as pydantic, fetched beforehand with
# --fetch-wheels and carried along) are installed offline into $FUSION_BENCH_SITE (default
# /tmp/fusion-bench-site), benchmarks/gpu_site.py writes the checkout's package metadata there
# (no build needed), and both go on PYTHONPATH. Nothing is downloaded on that machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
WHEELS="$ROOT/build/gpu-wheels"
SITE="${FUSION_BENCH_SITE:-/tmp/fusion-bench-site}"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # The GPU image (Python 3.12, torch, transformers, safetensors, pluggy) has no pydantic; pydantic wants a
    # newer typing-extensions than some images have.
    mkdir -p "$WHEELS"
    # Resolved for the GPU's interpreter (pydantic pins its pydantic-core exactly).
    exec python3 -m pip download -q --only-binary=:all: --python-version "${FUSION_BENCH_PYVER:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" "pydantic>=2.6"
fi

OUT_DIR="${OUT:-/tmp/fusion-bench-gpu-out}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    OUT_DIR="$1"
    shift
fi
DEVICE=cuda
for ((i = 1; i <= $#; i++)); do
    if [[ "${!i}" == "--device" ]]; then
        j=$((i + 1))
        DEVICE="${!j}"
    fi
done
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/bench-gpu.log"
: >"$LOG"
say() { echo "gpu.sh: $*" | tee -a "$LOG" >&2; }

torch_ok() {  # $1: python; succeeds when its torch imports (and, for cuda, sees a GPU)
    "$1" - "$DEVICE" >/dev/null 2>&1 <<'EOF'
import sys
import torch
sys.exit(0 if not sys.argv[1].startswith("cuda") or torch.cuda.is_available() else 1)
EOF
}

fusion_ok() {  # $1: python; succeeds when fusion_core, its dependencies and the three families load
    "$1" - >>"$LOG" 2>&1 <<'EOF'
import sys
import pydantic, pluggy, safetensors, transformers  # noqa: F401
import fusion_core
names = set(fusion_core.get_registry().names())
missing = {"patch_embeddings", "qkv", "gate_up"} - names
if missing:
    print("gpu.sh: families not registered:", sorted(missing))
sys.exit(1 if missing else 0)
EOF
}

PY=""
for candidate in "${FUSION_BENCH_PYTHON:-}" python3 python "$ROOT/.venvs/tf5/bin/python"; do
    [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 || continue
    if torch_ok "$candidate"; then
        PY=$(command -v "$candidate")
        break
    fi
done
if [[ -z "$PY" ]]; then
    say "no python here has a torch that sees a CUDA device (--device $DEVICE); tried FUSION_BENCH_PYTHON, python3,"
    say "python, .venvs/tf5/bin/python. Not installing one: pip's default torch is a CPU build. Nothing measured."
    for candidate in python3 python; do
        command -v "$candidate" >/dev/null && "$candidate" -c \
            'import torch; print("  ", torch.__file__, torch.__version__, "cuda:", torch.version.cuda)' 2>&1 \
            | tee -a "$LOG" >&2
    done
    exit 2
fi
say "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"

if ! fusion_ok "$PY"; then
    say "fusion_core or a dependency is missing for $PY: installing this checkout into $SITE (offline)"
    rm -rf "$SITE"
    mkdir -p "$SITE"
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    if ((${#wheels[@]})); then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}" >>"$LOG" 2>&1 \
            || say "installing the wheels in build/gpu-wheels failed (see $LOG)"
    fi
    # No build: the sources import as they are; gpu_site.py writes the metadata whose entry points register the
    # families, and prints the PYTHONPATH (the site folder, then each project's source root).
    paths=$("$PY" benchmarks/gpu_site.py "$SITE" 2>>"$LOG") || say "writing the checkout's metadata failed (see $LOG)"
    export PYTHONPATH="${paths:-$SITE}${PYTHONPATH:+:$PYTHONPATH}"
    if ! fusion_ok "$PY"; then
        say "still cannot import fusion_core with patch_embeddings, qkv and gate_up (tail of $LOG below)."
        say "A missing dependency (pydantic?) must be carried as wheels: run 'bash benchmarks/gpu.sh --fetch-wheels'"
        say "on a machine with PyPI and bring build/gpu-wheels along. Nothing measured."
        tail -n 20 "$LOG" >&2
        exit 2
    fi
fi

if [[ "$DEVICE" == cuda* ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >>"$LOG" 2>&1
fi
export PYTHONUNBUFFERED=1
LIMIT="${FUSION_BENCH_TIMEOUT:-470}"  # seconds for both runs together: under 8 minutes
# 1. --gpu: --device cuda --dtypes bf16 --sections runtime,e2e,explain, eager end-to-end rows (the module tables keep
#    their compiled rows). Arguments given to this script follow and override.
timeout "$LIMIT" "$PY" benchmarks/run.py --gpu --modes eager --json "$OUT_DIR/bench-gpu.json" \
    --markdown "$OUT_DIR/bench-gpu.md" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
# 2. The compiled end-to-end rows, in whatever time is left: compiling is the slow, unpredictable part, so it runs
#    last and on its own (the time budget skips a compiled group that would start with < 150 s left, and the JSON
#    and Markdown are rewritten after every row, so a run cut short keeps what it measured).
left=$((LIMIT - SECONDS))
if ((left > 60)); then
    timeout "$left" "$PY" benchmarks/run.py --gpu --sections e2e,explain --modes compiled --time-budget "$left" \
        --json "$OUT_DIR/bench-gpu-compiled.json" --markdown "$OUT_DIR/bench-gpu-compiled.md" "$@" 2>&1 \
        | tee -a "$LOG"
    compiled=${PIPESTATUS[0]}
    [[ $compiled == 124 ]] && say "compiled run stopped at the time limit; its JSON/Markdown hold the rows it finished"
    ((status == 0)) && status=$compiled
else
    say "no time left for the compiled end-to-end rows (${left}s)"
fi
say "exit $status; results in $OUT_DIR (bench-gpu*.json, bench-gpu*.md, bench-gpu.log)"
exit "$status"
