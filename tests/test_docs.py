"""The documentation builds (mkdocs, strict: a broken link fails), its Python runs, and it is current."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusion_core import cli

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compat  # noqa: E402  (repository tooling: scripts/compat.py)
import gen_api  # noqa: E402  (repository tooling: scripts/gen_api.py)

sys.path.insert(0, str(ROOT / "benchmarks"))
import summary  # noqa: E402  (benchmarks/summary.py)
from doc_snippets import python_blocks, run_python_blocks  # noqa: E402  (tests/doc_snippets.py)

DOCS = ROOT / "docs"


@pytest.mark.parametrize("page", ["index.md", "writing-a-family.md", "recipes.md", "tiny-models.md", "interop.md"])
def test_python_snippets_run(page, tmp_path):
    """Each page's blocks as one user script in a fresh process; interop.md's (torch.compile, PEFT, a
    routed load) take about a minute of CI on each line, which is what keeping that page runnable costs."""
    assert python_blocks(page), f"{page} has no python block"
    result = run_python_blocks(page, tmp_path)
    assert result.returncode == 0, f"{page}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_snippet_failures_are_caught(tmp_path):
    # The runner above must be able to fail: a block that raises makes the script exit non-zero.
    script = tmp_path / "bad.py"
    script.write_text("\n\n".join(["x = 1", "assert x == 2"]))
    assert subprocess.run([sys.executable, str(script)], capture_output=True).returncode != 0


def test_cli_reference_covers_every_command_and_option():
    text = (DOCS / "cli.md").read_text()
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        assert f"## `fusion {name}" in text, name
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text or f" {option}" in text, f"{name} {option}"


def test_readme_links_the_docs_it_promises():
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/index.md", "docs/writing-a-family.md"):
        assert page in readme and (ROOT / page).is_file()


@pytest.mark.once
def test_mkdocs_build_is_strict_and_passes(tmp_path):
    """Built from the sources alone (mkdocstrings reads them statically): the newest line runs it for both."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is part of the test tools (scripts/_env.sh TOOLS_SPEC)"
    config = (ROOT / "mkdocs.yml").read_text()
    assert "strict: true" in config
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "from_pretrained" in api and "ModuleFusionSpec" in api  # generated from the docstrings


def test_compatibility_matrix_is_current():
    matrix = compat.run_matrix()
    recorded = compat.recorded()
    hint = f"regenerate with: {sys.executable} scripts/compat.py --write"
    assert matrix["line"] in recorded, hint
    stored = recorded[matrix["line"]]
    assert (stored["families"], stored["results"]) == (matrix["families"], matrix["results"]), (
        f"{hint}\nrecorded {json.dumps(stored['results'])}\nnow      {json.dumps(matrix['results'])}"
    )
    assert (DOCS / "compatibility.md").read_text() == compat.render(recorded), hint
    assert all(cell == "pass" for cell in (r["patch_embeddings"] for r in matrix["results"].values())
               if cell != "absent")


def test_api_reference_is_current():
    assert (DOCS / "api.md").read_text() == gen_api.render(), (
        f"docs/api.md is stale: regenerate with {sys.executable} scripts/gen_api.py"
    )


def test_api_reference_covers_every_public_name():
    import fusion_core
    from fusion_core.testing import kit, pytest_plugin

    text = (DOCS / "api.md").read_text()
    names = [n for n in fusion_core.__all__ if n != "__version__"] + kit.__all__ + pytest_plugin.__all__
    names += [f"Conformance.{m}" for m in vars(pytest_plugin.Conformance) if not m.startswith("_")]
    names += [f"{cls}.{m}" for cls in ("TransformOp", "FusionFamily") for m in ("forward_shapes", "make_transforms")
              if m in vars(getattr(fusion_core, cls))]
    names += ["register_fusion_families", "register_fusion_integrations", "ModuleFusionSpec.sample_inputs",
              "compare_models", "ALL_TINY_MODELS", "tiny_model"]
    missing = [n for n in names if f"`{n}" not in text]
    assert not missing, f"docs/api.md lacks {missing}"


def test_tiny_models_page_lists_every_tiny_model():
    from fusion_core.testing.tiny_models import ALL_TINY_MODELS

    text = (DOCS / "tiny-models.md").read_text()
    assert not [name for name in ALL_TINY_MODELS if f"| `{name}` |" not in text]


def test_benchmark_summary_is_current_and_its_charts_draw(tmp_path):
    """The summary that opens docs/benchmarks.md is what benchmarks/summary.json records, and its charts render."""
    rows = summary.rows()
    page = summary.PAGE.read_text()
    assert summary.page_with(summary.markdown(rows), page) == page, (
        f"docs/benchmarks.md's summary is stale: regenerate with {sys.executable} benchmarks/summary.py")
    charts = {row.chart for row in rows}
    written = summary.draw(rows, tmp_path)
    assert sorted(p.name for p in written) == sorted(f"summary-{chart}.png" for chart in charts)
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    for chart in charts:  # the page shows the charts it draws
        assert (summary.IMAGES / f"summary-{chart}.png").is_file() and f"images/summary-{chart}.png" in page


def test_a_summary_row_outside_its_range_is_refused(tmp_path):
    record = tmp_path / "summary.json"
    row = {"family": "f", "workload": "w", "chart": "speed", "value": 2.0, "low": 0.5, "high": 1.5, "budget": "-",
           "machine": "m", "transformers": "5.25.0", "date": "2026-12-03", "command": "c"}
    record.write_text(json.dumps({"rows": [row]}))
    with pytest.raises(ValueError, match="outside its range"):
        summary.rows(record)


def test_the_readme_demo_passes_and_leaves_nothing_in_the_temp_folder(tmp_path):
    """README's first command (``scripts/demo.py``, run by scripts/demo.sh): every check passes, and the checkpoints
    it builds in a temporary folder are removed (each run used to leave 0.8 MB in /tmp)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0 and "all checks passed" in result.stdout, result.stdout + result.stderr[-3000:]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("fusion-")]
