# Shared set-up for scripts/demo.sh and scripts/test.sh: one virtual environment per
# transformers line, created on first use, reused while its requirements are unchanged.
#
# torch (~900 MB unpacked) is installed once, into .venvs/_torch, and every other environment
# sees it through a .pth file instead of unpacking its own copy: pip finds it there and installs
# nothing for `torch==2.13.0`, and each environment still has its own transformers, quantizers
# and tools ahead of it on sys.path. The core and the plugins are installed editable without
# build isolation (setuptools comes from .venvs/_torch too), which saves a build environment per
# distribution per environment.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"
BASE_SPEC="$TORCH_SPEC setuptools>=77 wheel"
TF4_SPEC="transformers>=4.57,<4.58"
TF5_SPEC="transformers>=5,<6"
# The newest 5.x, 5.25.0, requires kernels>=0.19.1, which the package registry here does not serve, so
# pip's resolver settles TF5_SPEC on 5.24. Environments of the TF5 line are resolved with TF5_SPEC and
# then get this release without its dependencies (its others are 5.24's); transformers' hub kernels are
# switched off (USE_HUB_KERNELS=NO, exported below; the tests' conftest.py sets it too).
TF5_NEWEST="transformers==5.25.0"
export USE_HUB_KERNELS="${USE_HUB_KERNELS:-NO}"
TEST_SPEC="pytest>=8 hypothesis>=6.100 accelerate>=1.0 peft>=0.17 gguf>=0.10"
# trl (SFTTrainer) for the training tests, on the two main lines; matplotlib for the benchmark summary's charts.
TOOLS_SPEC="$TEST_SPEC ruff>=0.6 mypy>=1.10 mkdocs>=1.6 mkdocstrings[python]>=0.26 trl>=1.16 matplotlib>=3.8"
# The quantizers users bring, as the quantization tests run them: in environments of their own (with
# torchao installed, transformers imports it on every load, ~0.5 s, and its warnings reach stderr).
# Pinned to the releases checked (their ranges and the private names read: fusion_quantization/compat.py).
QUANT_SPEC="torchao==0.18.0 bitsandbytes==0.50.2 optimum-quanto==0.2.7"
# The oldest PEFT fusion-peft supports (its peft>=0.17), beside 4.57, in an environment without quantizers (it
# imports a name torchao 0.18 no longer has): its update_layer takes init_lora_weights as an argument of its own
# where later releases pass a config.
PEFT_OLDEST="peft==0.17.1"
# The minors between 4.57 and the newest 5.x that CI runs the range subset on (tests marked `range`):
# the first 5.x release and minors spread across the line, each the newest patch of its minor.
RANGE_SPECS=("transformers>=5.0,<5.1" "transformers>=5.8,<5.9" "transformers>=5.16,<5.17" "transformers>=5.22,<5.23"
             "transformers>=5.24,<5.25")

# site_packages PYTHON -> its purelib directory
site_packages() {
    "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

# ensure_base -> prints the shared torch environment's site-packages (created on first use)
ensure_base() {
    local venv="$ROOT/.venvs/_torch"
    if [[ ! -x "$venv/bin/python" ]] || [[ "$(cat "$venv/.fusion-base" 2>/dev/null)" != "$BASE_SPEC" ]]; then
        echo "setting up $venv ($TORCH_SPEC)" >&2
        rm -rf "$venv"
        "$PYTHON" -m venv "$venv" >&2
        "$venv/bin/python" -m pip install -q --upgrade pip >&2
        # The CPU wheel on this machine's disk, never a multi-GB CUDA build: pip with torch pinned.
        "$venv/bin/python" -m pip install -q $BASE_SPEC >&2
        echo "$BASE_SPEC" > "$venv/.fusion-base"
    fi
    site_packages "$venv/bin/python"
}

# ensure_env NAME TRANSFORMERS_SPEC [TOOLS] -> prints the environment's python (TOOLS: default TOOLS_SPEC)
ensure_env() {
    local name="$1" tf_spec="$2" tools="${3:-$TOOLS_SPEC}"
    local venv="$ROOT/.venvs/$name"
    local base_site
    base_site="$(ensure_base)"
    local base_want="$BASE_SPEC|$tf_spec|$tools"
    local pkg_want
    pkg_want="$(cat "$ROOT/pyproject.toml" "$ROOT"/fusion_plugins/*/pyproject.toml | cksum)"
    if [[ ! -x "$venv/bin/python" ]] || [[ "$(cat "$venv/.fusion-base" 2>/dev/null)" != "$base_want" ]]; then
        echo "setting up $venv ($tf_spec)" >&2
        rm -rf "$venv" "$venv.fusion-packages"
        "$PYTHON" -m venv "$venv" >&2
        echo "$base_site" > "$(site_packages "$venv/bin/python")/_fusion_shared_torch.pth"
        "$venv/bin/python" -m pip install -q --upgrade pip >&2
        "$venv/bin/python" -m pip install -q "$TORCH_SPEC" "$tf_spec" $tools >&2
        echo "$base_want" > "$venv/.fusion-base"
    fi
    if [[ "$(cat "$venv/.fusion-packages" 2>/dev/null)" != "$pkg_want" ]]; then
        # The core and every plugin distribution, editable: a new family is picked up here.
        local editables=(-e "$ROOT")
        for plugin in "$ROOT"/fusion_plugins/*/; do
            editables+=(-e "$plugin")
        done
        "$venv/bin/python" -m pip install -q --no-build-isolation "$TORCH_SPEC" "$tf_spec" "${editables[@]}" >&2
        echo "$pkg_want" > "$venv/.fusion-packages"
    fi
    if [[ "$tf_spec" == "$TF5_SPEC" ]]; then
        local have
        have="$("$venv/bin/python" -c 'import importlib.metadata as m; print("transformers==" + m.version("transformers"))')"
        if [[ "$have" != "$TF5_NEWEST" ]]; then
            "$venv/bin/python" -m pip install -q --no-deps "$TF5_NEWEST" >&2
        fi
    fi
    echo "$venv/bin/python"
}
