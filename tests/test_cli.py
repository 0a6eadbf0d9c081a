"""The ``fusion`` command on real tiny checkpoints: its arguments, exit codes and output.

Most tests call the command's entry point in this process (:func:`fusion`), with its own stdout
and stderr captured: a subprocess per call paid ~4 s of imports each, most of this module's time.
What only a real process shows (the installed ``fusion`` found through its entry points, a closed
pipe, the progress bars on a terminal's stderr) runs in one (:func:`fusion_process`).

``fusion plan`` is compared with what a fused load actually does (``get_fusion_plan``),
``fusion check`` must fail on a family that computes something else, and ``fusion convert``
must give what ``save_pretrained(save_original_format=False)`` gives, and come back exactly.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fusion_patch_embeddings import PatchEmbeddingsFamily
from fusion_patch_embeddings.family import PatchLinearMixin

import fusion_core
from fusion_core import cli
from fusion_core.checkpoint import read_checkpoint_index
from fusion_core.compare import checkpoint_tensors
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

PATCH = "patch_embeddings"


def fusion(*args: str, check: bool | None = True) -> subprocess.CompletedProcess[str]:
    """``fusion ARGS...`` by its entry point in this process (argparse's usage errors give their exit status)."""
    argv = [str(arg) for arg in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code if isinstance(exc.code, int) else 1
    return _checked(subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue()), check)


def fusion_process(*args: str, check: bool | None = True) -> subprocess.CompletedProcess[str]:
    """``python -m fusion_core ARGS...`` in a fresh process, as a user runs it (no FUSION_CORE_* settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_CORE_")}
    result = subprocess.run([sys.executable, "-m", "fusion_core", *map(str, args)], capture_output=True, text=True,
                            env=env, timeout=600)
    return _checked(result, check)


def _checked(result: subprocess.CompletedProcess[str], check: bool | None) -> subprocess.CompletedProcess[str]:
    if check and result.returncode != 0:
        raise AssertionError(f"fusion {result.args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def fusion_json(*args: str, check: bool | None = True) -> tuple[int, dict]:
    result = fusion(*args, "--json", check=check)
    return result.returncode, json.loads(result.stdout)




@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


# -- plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "videomae"])
def test_plan_is_what_a_fused_load_does(name, tiny_checkpoint):
    directory, _ = tiny_checkpoint(name)
    code, plan = fusion_json("plan", directory, "-f", PATCH)
    assert code == 0 and plan["ok"] and plan["checkpoint"] == {"checked": True, "error": None}
    model = fusion_core.from_pretrained(auto_class(TINY_MODELS[name]), directory, fusion_config={PATCH: True})
    loaded = fusion_core.get_fusion_plan(model)
    assert [m["module"] for m in plan["modules"]] == [m.path for m in loaded.modules]
    described = [{k: v for k, v in row.items() if k not in ("checkpoint_keys", "dtype", "file")}
                 for row in plan["transforms"]]
    assert described == json.loads(json.dumps(loaded.describe()))
    index = read_checkpoint_index(directory)
    for row in plan["transforms"]:
        for model_key, shape in row["original"].items():
            ckpt_key = row["checkpoint_keys"][model_key]
            assert list(index[ckpt_key].shape) == shape and row["dtype"] == index[ckpt_key].dtype
        for model_key, shape in row["fused"].items():
            assert len(shape) == 2 and row["checkpoint_keys"][model_key].endswith(model_key.split(".")[-1])


def test_plan_human_output_is_a_table(tiny_checkpoint):
    directory, _ = tiny_checkpoint("qwen2_vl")
    out = fusion("plan", directory, "-f", PATCH).stdout
    assert "MODULE" in out and "FUSED CLASS" in out and "ORIGINAL KEY" in out
    line = next(li for li in out.splitlines() if li.startswith("visual.patch_embed.proj.weight"))
    assert "[32, 3, 2, 14, 14]" in line and "[32, 1176]" in line and "Flatten" in line
    header = next(li for li in out.splitlines() if li.startswith("ORIGINAL KEY"))
    assert header.index("FUSED KEY") == line.index("visual.patch_embed.proj.weight", 5)  # aligned columns


def test_plan_names_fused_classes_readably(tiny_checkpoint, capsys):
    """A fused class's ``__qualname__`` is for pickle (``fused_class[...]``); plans show its mixin and original."""
    directory, _ = tiny_checkpoint("qwen2_vl")
    readable = f"{PatchLinearMixin.__module__}.{PatchLinearMixin.__qualname__}[Conv3d]"
    assert cli.main(["plan", str(directory), "-f", PATCH, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [m["fused_class"] for m in plan["modules"]] == [readable]
    assert {row["fused_class"] for row in plan["transforms"]} == {readable}
    assert cli.main(["plan", str(directory), "-f", PATCH]) == 0
    out = capsys.readouterr().out
    path = plan["modules"][0]["module"]
    assert next(li.split() for li in out.splitlines() if li.startswith(f"{path} ")) == [
        path, PATCH, "torch.nn.modules.conv.Conv3d", readable]
    assert "fused_class[" not in out


def test_plan_says_why_nothing_matches(llama_dir, capsys):
    result = fusion("plan", llama_dir, "-f", PATCH, check=False)
    assert result.returncode == 1
    assert "Nothing to fuse" in result.stdout and "found nothing to fuse in LlamaForCausalLM" in result.stdout
    code, plan = fusion_json("plan", llama_dir, "-f", PATCH, check=False)
    assert code == 1 and plan["ok"] is False and plan["error_type"] == "DiscoveryError" and plan["modules"] == []

    optional = json.dumps({PATCH: {"required": False}, "qkv": True})  # one config for a fleet: skips, fuses
    capsys.readouterr()
    assert cli.main(["plan", str(llama_dir), "--options", optional, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ok"] and plan["skipped"] == [PATCH] and {m["family"] for m in plan["modules"]} == {"qkv"}
    assert cli.main(["plan", str(llama_dir), "--options", optional]) == 0
    assert f"Skipped, nothing to fuse (required=False): {PATCH}" in capsys.readouterr().out


def test_plan_options_and_config_file(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("qwen2_vl")
    code, plan = fusion_json("plan", directory, "--options", json.dumps({PATCH: {"exclude_modules": ["visual"]}}),
                             check=False)
    assert code == 1 and "none is fusable" in plan["error"]
    config = tmp_path / "fusion.json"
    config.write_text(json.dumps({"fusion_config": {PATCH: {"target_modules": ["patch_embed"]}}}))
    _, plan = fusion_json("plan", directory, "--config", config)
    assert plan["fusion_config"] == {PATCH: {"target_modules": ["patch_embed"]}} and len(plan["modules"]) == 1


def test_unknown_family_and_bad_options_are_errors(tiny_checkpoint):
    directory, _ = tiny_checkpoint("qwen2_vl")
    result = fusion("plan", directory, "-f", "no_such_family", check=False)
    assert result.returncode == 1 and "unknown fusion family 'no_such_family'" in result.stderr
    result = fusion("plan", directory, "--options", json.dumps({PATCH: {"bogus": 1}}), "--json", check=False)
    assert result.returncode == 1 and "bogus" in json.loads(result.stdout)["error"]
    result = fusion("plan", directory, check=False)
    assert result.returncode == 2 and "no fusion family given" in result.stderr


# -- check ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2_vl", "vivit"])
def test_check_passes_and_reports_every_part(name, tiny_checkpoint):
    directory, _ = tiny_checkpoint(name)
    code, report = fusion_json("check", directory, "-f", PATCH, "--repeats", "1")
    assert code == 0 and report["ok"]
    assert [m["module"] for m in report["modules"]] and all(m["ok"] and m["input_sets"] for m in report["modules"])
    assert all(m["max_abs_error"] < 1e-3 for m in report["modules"])
    assert report["round_trip"]["ok"] and report["round_trip"]["tensors"] > 10
    assert report["forward_time_ratio"] > 0
    if name == "vivit":  # a video model is driven whole; a VL model is driven through its text path
        assert report["whole_model"]["ran"] and report["whole_model"]["inputs"] == {"pixel_values": [1, 4, 3, 32, 32]}
    human = fusion("check", directory, "-f", PATCH, "--repeats", "1").stdout
    assert "MAX ABS" in human and "Round trip: ok" in human and human.rstrip().endswith("PASS")


def test_check_bfloat16(tiny_checkpoint):
    directory, _ = tiny_checkpoint("videomae")
    code, report = fusion_json("check", directory, "-f", PATCH, "--dtype", "bfloat16", "--repeats", "1")
    assert code == 0 and report["dtype"] == "bfloat16" and report["modules"][0]["tolerance"] == 3e-2
    assert report["round_trip"]["ok"]


class _OffByOne(PatchLinearMixin):
    def forward(self, input):
        return super().forward(input) + 1e-2


class _BrokenFamily(PatchEmbeddingsFamily):
    """Like patch_embeddings, but computes something else."""

    name = "broken_patch"

    def make_fused_class(self, original_cls, options):
        return type(original_cls.__name__, (_OffByOne, original_cls), {})


def test_check_fails_on_a_family_that_computes_something_else(tiny_checkpoint, fusion_registered, capsys):
    directory, _ = tiny_checkpoint("vivit")
    fusion_registered(_BrokenFamily())
    assert cli.main(["check", str(directory), "-f", "broken_patch", "--repeats", "1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and not report["modules"][0]["ok"] and "exceeds" in report["modules"][0]["note"]
    assert report["round_trip"]["ok"]  # the weights themselves are still saved exactly
    assert cli.main(["check", str(directory), "-f", "broken_patch", "--repeats", "1"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")


def _raising_family(raise_on: str) -> PatchEmbeddingsFamily:
    """patch_embeddings whose fused forward raises: on every call, or on its first call only."""
    calls = []

    class Raising(PatchLinearMixin):
        def forward(self, input):
            calls.append(None)
            if raise_on == "every call" or len(calls) == 1:
                raise RuntimeError(f"fused forward exploded (call {len(calls)})")
            return super().forward(input)

    class RaisingFamily(PatchEmbeddingsFamily):
        name = "raising_patch"
        fused_calls = calls

        def make_fused_class(self, original_cls, options):
            return type(original_cls.__name__, (Raising, original_cls), {})

    return RaisingFamily()


@pytest.mark.parametrize("raise_on", ["every call", "first call"])
@pytest.mark.parametrize("name", ["vivit", "qwen2_vl"])  # whole model; a VL model's vision tower
def test_check_fails_when_the_fused_model_raises(name, raise_on, tiny_checkpoint, fusion_registered, capsys):
    """A fused forward that raises on inputs the plain model ran is a failure, not "not run".

    The first call is the whole-model run (vivit) or the vision tower's run (qwen2_vl); a fused
    forward that raises only there used to leave every module comparison passing: a PASS.
    """
    directory, _ = tiny_checkpoint(name)
    family = _raising_family(raise_on)
    fusion_registered(family)
    code = cli.main(["check", str(directory), "-f", "raising_patch", "--repeats", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ok"] is False and report["whole_model"]["ok"] is False
    failed = report["whole_model"] if name == "vivit" else report["whole_model"]["towers"]["model.visual"]
    assert failed["ok"] is False and "RuntimeError: fused forward exploded (call 1)" in failed["note"]
    assert "not run" not in failed["note"]
    assert report["round_trip"]["ok"]
    family.fused_calls.clear()
    code = cli.main(["check", str(directory), "-f", "raising_patch", "--repeats", "1"])
    human = capsys.readouterr().out
    assert code == 1 and "RuntimeError: fused forward exploded" in human and human.rstrip().endswith("FAIL")


# -- convert -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [None, "20KB"])
def test_convert_round_trip_matches_save_pretrained_and_loads(shards, tiny_checkpoint, tmp_path):
    kwargs = {"max_shard_size": shards} if shards else {}
    directory, reference = tiny_checkpoint("qwen2_vl", **kwargs)
    cls = auto_class(TINY_MODELS["qwen2_vl"])
    fused_dir, back_dir = tmp_path / "fused", tmp_path / "back"
    code, result = fusion_json("convert", directory, fused_dir, "-f", PATCH, "--to", "fused", "--verify")
    assert code == 0 and result["verify"]["ok"] and result["transformed_groups"] == 1
    assert (fused_dir / "fused_config.json").is_file() and not (fused_dir / "config.json").exists()
    # The same tensors as a fused-layout save_pretrained writes.
    model = fusion_core.from_pretrained(cls, directory, fusion_config={PATCH: True})
    fusion_core.save_pretrained(model, tmp_path / "saved", save_original_format=False)
    converted, saved = checkpoint_tensors(fused_dir), checkpoint_tensors(tmp_path / "saved")
    assert converted.keys() == saved.keys()
    assert all(torch.equal(converted[k], saved[k]) and converted[k].dtype == saved[k].dtype for k in saved)
    record = json.loads((fused_dir / "fused_config.json").read_text())["fusion_core"]
    assert record == json.loads((tmp_path / "saved" / "fused_config.json").read_text())["fusion_core"]
    # It loads, fused, and computes what the reference computes.
    again = fusion_core.from_pretrained(cls, fused_dir)
    tiny = TINY_MODELS["qwen2_vl"]
    inputs = tiny.make_vision_input(reference.config, torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = _first(again.model.visual(**inputs)), _first(reference.model.visual(**inputs))
    assert isinstance(again.model.visual.patch_embed.proj, PatchLinearMixin) and torch.allclose(got, want, atol=1e-4)
    # And back: every shard and the index byte for byte.
    fusion("convert", fused_dir, back_dir, "--to", "original")
    for file in directory.glob("*.safetensors*"):
        assert (back_dir / file.name).read_bytes() == file.read_bytes(), file.name
    config = json.loads((back_dir / "config.json").read_text())
    assert config["fusion_core"] == {"fusion_config": {PATCH: True}}
    plain = cls.from_pretrained(back_dir)
    assert type(plain.model.visual.patch_embed.proj) is torch.nn.Conv3d


def _first(output):
    return output if isinstance(output, torch.Tensor) else output[0]


def test_convert_refuses_and_leaves_nothing_behind(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    directory, _ = tiny_checkpoint("videomae")
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    result = fusion("convert", directory, target, "-f", PATCH, check=False)
    assert result.returncode == 2 and "--overwrite" in result.stderr
    result = fusion("convert", directory, tmp_path / "x", "--to", "original", "-f", PATCH, check=False)
    assert result.returncode == 2 and "already in the original layout" in result.stderr
    import safetensors.torch

    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    assert cli.main(["convert", str(directory), str(target), "-f", PATCH, "--overwrite"]) == 1
    assert calls and "disk full" in capsys.readouterr().err
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left


def test_convert_shows_progress_on_request(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("videomae")
    result = fusion_process("convert", directory, tmp_path / "out", "-f", PATCH, "--progress")
    assert "convert to fused" in result.stderr and "shard" in result.stderr
    quiet = fusion_process("convert", directory, tmp_path / "out2", "-f", PATCH)
    assert quiet.stderr == ""


# -- list ----------------------------------------------------------------------------------------
def test_list_shows_where_each_family_comes_from():
    listing = json.loads(fusion_process("list", "--json").stdout)  # the installed command, as users run it
    family = next(f for f in listing["families"] if f["name"] == PATCH)
    assert family["distribution"] == "fusion-patch-embeddings" and family["version"]
    assert family["module"] == "fusion_patch_embeddings.family" and family["spec_class"] == "PatchEmbeddingsFamily"
    assert Path(family["location"]).is_file() and Path(family["location"]).name == "family.py"
    out = fusion("list").stdout
    assert "LOCATION" in out and family["location"] in out


@pytest.mark.parametrize("args", [["list", "--json"], ["list"]])
def test_a_closed_pipe_ends_the_command_quietly(args):
    """``fusion list --json | head -1``: the reader is gone before anything is written."""
    read_end, write_end = os.pipe()
    process = subprocess.Popen([sys.executable, "-m", "fusion_core", *args], stdout=write_end,
                               stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    os.close(read_end)  # long before the command has imported what it needs and printed
    _, stderr = process.communicate(timeout=600)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert process.returncode == 1


def test_every_command_takes_json():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"list", "plan", "check", "convert", "new-family", "tune"}
    for name, sub in commands.items():
        assert any("--json" in action.option_strings for action in sub._actions), name


class _ScaledLoss(fusion_core.FusedModule):
    """A training-time root fusion whose loss is 1% off (eval and no-label calls stay the original's)."""

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        if self.training and kwargs.get("labels") is not None:
            outputs.loss = outputs.loss * 1.01
        return outputs


class _ScaledLossFamily(fusion_core.FusionFamily):
    """Declares preserves='training_loss' and breaks it."""

    name = "scaled_loss"
    target_modules_patterns = ("^$",)
    preserves = "training_loss"
    fused_mixin = _ScaledLoss

    def is_fusable(self, module, options):
        return type(module).__name__.endswith("ForCausalLM")


def test_check_runs_a_training_step_for_a_family_that_declares_the_training_loss(
        tmp_path, fusion_registered, capsys):
    """A preserves='training_loss' family is checked where it promises something: loss and gradients."""
    from fusion_core.testing.tiny_models import TEXT_MODELS, save_tiny_model

    save_tiny_model(TEXT_MODELS["qwen2"], tmp_path / "qwen2")
    assert cli.main(["check", str(tmp_path / "qwen2"), "-f", "linear_cross_entropy", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["training"]["ok"] and report["training"]["families"] == ["linear_cross_entropy"]
    assert report["training"]["loss"] <= 1e-5
    fusion_registered(_ScaledLossFamily())
    assert cli.main(["check", str(tmp_path / "qwen2"), "-f", "scaled_loss", "--repeats", "1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["whole_model"]["ok"] and not report["training"]["ok"]
    assert "training loss" in report["training"]["note"]
    assert cli.main(["check", str(tmp_path / "qwen2"), "-f", "scaled_loss", "--repeats", "1"]) == 1
    assert "Training step with labels (scaled_loss" in capsys.readouterr().out


class _RaisingLoss(_ScaledLoss):
    """A training-time root fusion whose training step raises (where the plain model trains)."""

    def forward(self, *args, **kwargs):
        if self.training and kwargs.get("labels") is not None:
            raise RuntimeError("training step exploded")
        return super().forward(*args, **kwargs)


class _RaisingLossFamily(_ScaledLossFamily):
    """Declares preserves='training_loss' and cannot train."""

    name = "raising_loss"
    fused_mixin = _RaisingLoss


def test_check_fails_when_the_fused_training_step_raises(tmp_path, fusion_registered, capsys):
    from fusion_core.testing.tiny_models import TEXT_MODELS, save_tiny_model

    save_tiny_model(TEXT_MODELS["qwen2"], tmp_path / "qwen2")
    fusion_registered(_RaisingLossFamily())
    assert cli.main(["check", str(tmp_path / "qwen2"), "-f", "raising_loss", "--repeats", "1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["training"]["ok"] and "RuntimeError in the training step" in report["training"]["note"]


def test_the_training_comparison_returns_a_report_and_the_kit_asserts_it(fusion_registered):
    """``compare_training`` reports what differs like the other comparisons (it does not raise);
    ``kit.assert_training_loss`` fails with that note."""
    import copy

    from fusion_core.compare import compare_training
    from fusion_core.testing import kit

    plain = kit.build_model(kit.resolve_model("qwen2"))
    fusion_registered(_ScaledLossFamily())
    fused = fusion_core.fuse(copy.deepcopy(plain), {"scaled_loss": True})
    report = compare_training(plain, fused)
    assert not report.ok and "training loss" in report.note and report.loss is not None and report.loss > 1e-3
    with pytest.raises(AssertionError, match="training loss"):
        kit.assert_training_loss(plain, fused)
    exact = kit.assert_training_loss(plain, copy.deepcopy(plain))
    assert exact.ok and exact.loss == 0.0 and exact.gradients == 0.0 and exact.note == ""
