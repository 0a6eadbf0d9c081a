"""The compatibility matrix: which tiny models pass with which installed family, per transformers line.

Repository tooling, not part of the package. ``python scripts/compat.py --write`` runs every
installed family on every tiny model (:mod:`fusion_core.testing.tiny_models`) with this
environment's transformers, records the results in ``docs/compat/transformers-<line>.json`` and
regenerates ``docs/compatibility.md`` from every recorded line. ``tests/test_docs.py`` reruns
the matrix and fails when the recorded one is stale.

A cell is ``pass`` (fused load, every fused module and the whole model within tolerance, exact
round trip), ``n/a`` (the family finds nothing to fuse in that model), ``absent`` (this
transformers has no such architecture) or ``fail: <reason>``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def transformers_line() -> str:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return f"{major}.{minor}" if major == "4" else f"{major}.x"


def _cell(model_cls: Any, directory: Path, plain: Any, family: str) -> str:
    import fusion_core
    from fusion_core.compare import compare_models, round_trip
    from fusion_core.errors import DiscoveryError, FusionError

    try:
        fused = fusion_core.from_pretrained(model_cls, directory, fusion_config={family: True})
    except DiscoveryError as exc:
        if "found nothing to fuse" in str(exc):
            return "n/a"
        return f"fail: {type(exc).__name__}"
    except (FusionError, Exception) as exc:  # any failure is a matrix cell, not a crash
        return f"fail: {type(exc).__name__}"
    plan = fusion_core.get_fusion_plan(fused)
    registry = fusion_core.get_registry()
    comparison = compare_models(plain, fused, plan, specs={family: registry.get(family).spec}, repeats=1)
    comparison.round_trip = round_trip(fused, directory)
    if comparison.ok:
        return "pass"
    if not comparison.round_trip.ok:
        return "fail: round trip"
    if any(m.max_rel_error is not None and not m.ok for m in comparison.modules) or not comparison.whole_model.ok:
        return "fail: numerics"
    unreached = sum(1 for m in comparison.modules if not m.input_sets)
    return f"untested: {unreached} fused module(s) not reached by generic inputs"


def run_matrix() -> dict[str, Any]:
    """Every installed family on every tiny model, with this environment's transformers."""
    import transformers

    import fusion_core
    from fusion_core.testing.tiny_models import TINY_MODELS, auto_class, save_tiny_model

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    families = sorted(fusion_core.get_registry().names())
    results: dict[str, dict[str, str]] = {}
    for name, tiny in TINY_MODELS.items():
        if tiny.make_config() is None:
            results[name] = dict.fromkeys(families, "absent")
            continue
        with tempfile.TemporaryDirectory(prefix="fusion-compat-") as tmp:
            plain = save_tiny_model(tiny, Path(tmp) / name)
            results[name] = {f: _cell(auto_class(tiny), Path(tmp) / name, plain, f) for f in families}
    return {"transformers": transformers.__version__, "line": transformers_line(), "families": families,
            "results": results}


def recorded() -> dict[str, dict[str, Any]]:
    """Recorded matrices by transformers line."""
    data = {}
    for path in sorted((DOCS / "compat").glob("transformers-*.json")):
        item = json.loads(path.read_text())
        data[item["line"]] = item
    return data


SUPPORT = """
## Supported and tested releases

`pyproject.toml` declares `transformers>=4.57,<6` and `torch>=2.6`; every release it admits is
meant to work, and none is excluded (no release in the range lacks a public API the code needs).
Importing `fusion_core` with a transformers outside the range fails at once with an `ImportError`
that names the range, not deep inside a load.

`bash scripts/test.sh` (CI) runs, each release in its own environment with torch 2.13.0 (CPU),
peft 0.21.2 and accelerate 1.16.0 (torchao is not installed: with it, every transformers load imports it,
~0.5 s, and it prints its own import warnings; the moe_experts torchao test then skips, saying so):

| transformers | what runs |
|---|---|
| 4.57.6 (newest 4.57.x) | the whole suite; the matrix above |
| 5.25.0 (newest 5.x) | the whole suite; the matrix above |
| 5.0.0, 5.8.1, 5.16.1, 5.22.2, 5.24.0 | the range subset (`RANGE_TESTS` in `scripts/checks.py`) |
| 5.12.1, 5.20.2 | the range subset, once by hand (not in CI) |
| 4.57.1, 5.1.0, 5.3.0, 5.6.2, 5.10.4, 5.14.1, 5.18.0, 5.21.1, 5.23.0 | the range subset, once by hand (not in CI) |
| 5.19.0 | the range subset and the census (inference and training), once by hand (not in CI) |
| 5.2.0, 5.4.0 | the range subset less tensor parallelism, once by hand (not in CI) |
| 4.57.6 and 5.25.0, each with torchao, bitsandbytes and optimum-quanto | `QUANT_TESTS` (`scripts/checks.py`) |
| 4.57.6 with peft 0.17.1, the oldest fusion-peft supports | `PEFT_TESTS` (`scripts/checks.py`) |

The range subset: every shipped family loaded, run, saved and reloaded on the tiny models and the
decoder families, the compat fallbacks, `integrate_transformers` (Auto and model classes,
`pipeline`, a Trainer script), PEFT LoRA, in-place fuse/unfuse, pickling, tensor parallelism.

5.25.0 requires `kernels>=0.19.1`, a release the package registry CI installs from does not serve, so
pip settles `transformers>=5,<6` on 5.24.0. The 5.x environments are resolved that way and then get
5.25.0 without its dependencies (its other requirements are 5.24.0's), and transformers' hub kernels
are switched off with `USE_HUB_KERNELS=NO` (`scripts/_env.sh`, and the tests' `conftest.py`): without
`kernels`, 5.25.0's own plain `from_pretrained` raises unless they are. A user with `kernels`
installed needs neither step; fusion-core does not use hub kernels either way.

5.4.0 cannot build some MoE configs (OLMoE, PhiMoE) itself next to the current huggingface_hub (a
strict dataclass rejects its own `tie_word_embeddings` default); the tests that need them skip.

CI prints one line per release with its counts and every test it skipped, with the reason
(a feature that release lacks, such as an architecture it does not ship).

Every private name or version-dependent behaviour of transformers, PEFT and torch that the code
needs lives in one module per library (`fusion_core/compat/`), each entry with the releases it was
checked on and its fallback or refusal elsewhere:

- **transformers** (`fusion_core.compat.transformers`): the loading report of
  `PreTrainedModel._load_pretrained_model` (a 6-tuple on 4.57, a plain dataclass on 5.0, an object
  with `to_dict` from 5.1), read after `from_pretrained` returns; the tensor-parallel plan matching
  rule (4.57 and 5.x variants, implemented rather than imported: the private function moved three
  times between 5.0 and 5.24); the tensor-parallel size (`_tp_size`, or 5.16's
  `config.distributed_config.tp_size`); `_from_config` for concrete model classes.
- **Tensor parallelism**: fused `qkv`/`gate_up` under `tp_plan` work on every tested release.
  4.57, 5.0 and 5.16 and later load each rank's shard as a DTensor; the 5.x minors between (5.8.1
  tested; 5.4 and 5.12 read from the source) load plain local tensors driven by module hooks, and
  the fused modules then stay local too (`config.distributed_config` or `_device_mesh` give the
  mesh), with the same checks passing: logits, generate, training, both save layouts, reloads.
  The kind is read from the loaded tensors, not from the version.
- **PEFT** (`fusion_core.compat.peft`): `LoraModel._create_new_module` and
  `tuners_utils._maybe_include_all_linear_layers`, checked on 0.21.2; a release without them is
  refused by name when LoRA meets a fused module.
- **torch** (`fusion_core.compat.torch`): the floor 2.6 is set by `torch.accelerator.synchronize`
  (2.6), `torch.distributed.tensor` with `DTensor.from_local(shape=, stride=)` (2.5), the public
  module state-dict hooks (2.5) and `torch.compiler.is_compiling` (2.3); only 2.13.0 can be
  installed here, so the floor is read from the code, not tested.
"""


def render(matrices: dict[str, dict[str, Any]]) -> str:
    lines = sorted(matrices, key=lambda line: [int(p) if p.isdigit() else 99 for p in line.split(".")])
    models = list(dict.fromkeys(m for line in lines for m in matrices[line]["results"]))
    families = sorted({f for line in lines for f in matrices[line]["families"]})
    out = [
        "# Compatibility",
        "",
        "Generated by `python scripts/compat.py --write` from a run of every installed family on",
        "every tiny model (real transformers architectures, random weights); `tests/test_docs.py` reruns it",
        "and fails when this page is stale. `pass`: fused load, every fused module and the whole model",
        "within tolerance, and an exact round trip. `n/a`: the family finds nothing to fuse there.",
        "`absent`: that transformers has no such architecture. `untested`: fused modules that the",
        "generic inputs of `fusion check` do not reach (the tiny model's own forward fails, for example).",
        "",
        "Versions: " + ", ".join(f"transformers {matrices[line]['transformers']} ({line})" for line in lines) + ".",
        "",
        "| model | family | " + " | ".join(f"transformers {line}" for line in lines) + " |",
        "|---|---|" + "---|" * len(lines),
    ]
    for model in models:
        for family in families:
            cells = [matrices[line]["results"].get(model, {}).get(family, "-") for line in lines]
            out.append(f"| {model} | {family} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n" + SUPPORT


def write(matrix: dict[str, Any]) -> None:
    (DOCS / "compat").mkdir(exist_ok=True)
    path = DOCS / "compat" / f"transformers-{matrix['line']}.json"
    path.write_text(json.dumps(matrix, indent=2, sort_keys=True) + "\n")
    (DOCS / "compatibility.md").write_text(render(recorded()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record this line and regenerate compatibility.md")
    args = parser.parse_args()
    matrix = run_matrix()
    if args.write:
        write(matrix)
    print(json.dumps(matrix, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
