"""Reliability: malformed ``fusion_config`` values are rejected by pydantic before any model is built.

Every case goes through ``fusion_core.from_pretrained`` on a real tiny Qwen2-VL checkpoint. A spy on
transformers' own ``PreTrainedModel.__init__`` and ``from_pretrained`` proves that nothing was
constructed or loaded; the same spy sees a valid config build models, so it can fail.
"""

from __future__ import annotations

import json
import re
import shutil
import traceback
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn
from transformers import PreTrainedModel

import fusion_core
from fusion_core import FamilyOptions, FusionFamily, WeightTransform
from fusion_core.patching import installed_classes
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

QWEN = auto_class(TINY_MODELS["qwen2_vl"])


class _Nested(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    depth: int = 1


class ToyOptions(FamilyOptions):
    rank: int = Field(default=4, ge=1)
    mode: Literal["fast", "exact"] = "exact"
    scale: float = 1.0
    nested: _Nested = _Nested()


class ToyFamily(FusionFamily):
    """A family with typed options; it fuses nothing (validation must fail before it is asked)."""

    name = "toy"
    options_model = ToyOptions

    def is_fusable(self, module: nn.Module, options: ToyOptions) -> bool:
        raise AssertionError("is_fusable must not run for a rejected fusion_config")


class CopycatFamily(FusionFamily):
    """Claims the same Conv3d modules as patch_embeddings: two families, one module."""

    name = "copycat"

    def is_fusable(self, module: nn.Module, options: FamilyOptions) -> bool:
        return isinstance(module, nn.Conv3d)

    def make_fused_class(self, original_cls: type[nn.Module], options: FamilyOptions) -> type[nn.Module]:
        return type(original_cls.__name__, (original_cls,), {})

    def make_transforms(self, config, options):
        return [WeightTransform(("weight",), ("weight",))]


@pytest.fixture
def qwen_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2_vl")[0]


@pytest.fixture
def spy(monkeypatch, qwen_dir):
    """Counts transformers model constructions and from_pretrained calls (the real ones still run)."""
    calls = {"init": 0, "from_pretrained": 0}
    original_init = PreTrainedModel.__init__
    original_from_pretrained = PreTrainedModel.from_pretrained.__func__

    def init(self, *args, **kwargs):
        calls["init"] += 1
        original_init(self, *args, **kwargs)

    def from_pretrained(cls, *args, **kwargs):
        calls["from_pretrained"] += 1
        return original_from_pretrained(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "__init__", init)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    return calls


@pytest.fixture
def families():
    fusion_core.register_family(ToyFamily())
    fusion_core.register_family(CopycatFamily())


# (case id, fusion_config, expected loc of the first error, text the message must contain)
# loc[0] is the family; deeper entries are the field. () means the value is not a mapping at all.
CORPUS: list[tuple[str, object, tuple, str]] = [
    # -- unknown families
    ("unknown-family", {"nope": True}, ("nope",), "unknown fusion family 'nope'"),
    ("misspelled-family", {"patch_embedding": True}, ("patch_embedding",), "Did you mean 'patch_embeddings'"),
    ("wrong-case-family", {"Patch_Embeddings": True}, ("Patch_Embeddings",), "installed families: "),
    ("empty-family-name", {"": True}, ("",), "unknown fusion family ''"),
    ("dashed-family-name", {"patch-embeddings": True}, ("patch-embeddings",), "Did you mean 'patch_embeddings'"),
    ("valid-and-unknown", {"patch_embeddings": True, "nope": {"x": 1}}, ("nope",), "unknown fusion family 'nope'"),
    # -- family names that are not strings
    ("int-family-name", {1: True}, ("1",), "family names are strings, got int"),
    ("none-family-name", {None: True}, ("None",), "got NoneType"),
    ("tuple-family-name", {("patch_embeddings",): True}, ("('patch_embeddings',)",), "got tuple"),
    # -- wrong setting types
    ("setting-int-1", {"patch_embeddings": 1}, ("patch_embeddings",), "got int"),
    ("setting-int-0", {"patch_embeddings": 0}, ("patch_embeddings",), "got int"),
    ("setting-float", {"patch_embeddings": 1.0}, ("patch_embeddings",), "got float"),
    ("setting-str-true", {"patch_embeddings": "true"}, ("patch_embeddings",), "got str"),
    ("setting-str-yes", {"patch_embeddings": "yes"}, ("patch_embeddings",), "got str"),
    ("setting-none", {"patch_embeddings": None}, ("patch_embeddings",), "got NoneType"),
    ("setting-list", {"patch_embeddings": [True]}, ("patch_embeddings",), "got list"),
    ("setting-other-family-options", {"patch_embeddings": ToyOptions()}, ("patch_embeddings",), "got ToyOptions"),
    # -- unknown or mistyped options
    ("option-typo", {"patch_embeddings": {"target_module": ["proj"]}}, ("patch_embeddings", "target_module"),
     "Extra inputs are not permitted"),
    ("option-unknown", {"patch_embeddings": {"enabled": True}}, ("patch_embeddings", "enabled"), "Extra inputs"),
    ("option-wrong-case", {"toy": {"Rank": 8}}, ("toy", "Rank"), "Extra inputs"),
    ("option-str-for-list", {"patch_embeddings": {"exclude_modules": "visual"}},
     ("patch_embeddings", "exclude_modules"), "family 'patch_embeddings'"),
    ("option-int-in-list", {"patch_embeddings": {"target_modules": [1, 2]}},
     ("patch_embeddings", "target_modules", 0), "valid string"),
    ("option-dict-for-list", {"patch_embeddings": {"target_modules": {"a": 1}}},
     ("patch_embeddings", "target_modules"), "family 'patch_embeddings'"),
    ("option-bad-regex", {"patch_embeddings": {"target_modules": ["proj("]}},
     ("patch_embeddings", "target_modules"), "invalid regular expression 'proj\\('"),
    ("option-bad-exclude-regex", {"patch_embeddings": {"exclude_modules": ["[a-"]}},
     ("patch_embeddings", "exclude_modules"), "invalid regular expression"),
    ("option-str-for-int", {"toy": {"rank": "many"}}, ("toy", "rank"), "valid integer"),
    ("option-fraction-for-int", {"toy": {"rank": 1.5}}, ("toy", "rank"), "valid integer"),
    ("option-out-of-range", {"toy": {"rank": 0}}, ("toy", "rank"), "greater than or equal to 1"),
    ("option-none-for-int", {"toy": {"rank": None}}, ("toy", "rank"), "valid integer"),
    ("option-list-for-int", {"toy": {"rank": [4]}}, ("toy", "rank"), "valid integer"),
    ("option-not-in-literal", {"toy": {"mode": "turbo"}}, ("toy", "mode"), "'fast' or 'exact'"),
    ("option-str-for-float", {"toy": {"scale": "big"}}, ("toy", "scale"), "valid number"),
    ("option-object", {"toy": {"rank": object()}}, ("toy", "rank"), "valid integer"),
    # -- nested garbage
    ("nested-wrong-type", {"toy": {"nested": {"depth": "deep"}}}, ("toy", "nested", "depth"), "valid integer"),
    ("nested-extra-key", {"toy": {"nested": {"deep": {"x": 1}}}}, ("toy", "nested", "deep"), "Extra inputs"),
    ("nested-list", {"toy": {"nested": [1, 2]}}, ("toy", "nested"), "family 'toy'"),
    ("nested-lists-of-lists", {"patch_embeddings": {"target_modules": [["proj"]]}},
     ("patch_embeddings", "target_modules", 0), "valid string"),
    ("options-dict-in-dict", {"patch_embeddings": {"patch_embeddings": True}},
     ("patch_embeddings", "patch_embeddings"), "Extra inputs"),
    # -- not a mapping at all (JSON strings included: the config is a mapping, not its text)
    ("json-string", '{"patch_embeddings": true}', (), "must be a mapping"),
    ("json-bytes", b'{"patch_embeddings": true}', (), "got bytes"),
    ("empty-string", "", (), "got str"),
    ("family-name-string", "patch_embeddings", (), "got str"),
    ("list-of-names", ["patch_embeddings"], (), "got list"),
    ("list-of-pairs", [("patch_embeddings", True)], (), "got list"),
    ("set-of-names", {"patch_embeddings"}, (), "got set"),
    ("bare-true", True, (), "got bool"),
    ("bare-int", 42, (), "got int"),
]


@pytest.mark.parametrize(("value", "loc", "text"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_malformed_fusion_config_is_rejected_before_anything_is_built(
    value, loc, text, families, spy, qwen_dir
):
    directory = qwen_dir
    with pytest.raises(ValidationError) as info:
        fusion_core.from_pretrained(QWEN, directory, fusion_config=value)
    errors = info.value.errors()
    assert errors[0]["loc"] == loc
    message = str(info.value)
    assert text in message or re.search(text, message), message
    if loc:  # names the family, and the field when the fault is inside the family's options
        assert str(loc[0]) in message
        if len(loc) > 1:
            assert ".".join(str(part) for part in loc) in message
    # nothing was built or loaded, no patch is left, and the error comes from validation, not the pipeline
    assert spy == {"init": 0, "from_pretrained": 0}
    assert installed_classes() == []
    frames = [frame.filename for frame in traceback.extract_tb(info.value.__traceback__)]
    assert not any("transformers" in f or f.endswith(("discovery.py", "patching.py", "layout.py")) for f in frames)


def test_corpus_is_at_least_thirty_cases():
    assert len(CORPUS) >= 30
    assert len({c[0] for c in CORPUS}) == len(CORPUS)


def test_every_error_of_a_config_is_reported_at_once(families, spy, qwen_dir):
    directory = qwen_dir
    value = {"toy": {"rank": "x", "mode": "turbo"}, "patch_embeddings": {"foo": 1}, "nope": True}
    with pytest.raises(ValidationError) as info:
        fusion_core.from_pretrained(QWEN, directory, fusion_config=value)
    assert {e["loc"] for e in info.value.errors()} == {
        ("toy", "rank"), ("toy", "mode"), ("patch_embeddings", "foo"), ("nope",)
    }
    assert spy["init"] == 0 and spy["from_pretrained"] == 0


def test_spy_sees_a_valid_config_build_and_load(families, spy, qwen_dir):
    """The control: the same spy does count constructions when validation passes."""
    directory = qwen_dir
    fusion_core.from_pretrained(QWEN, directory, fusion_config={"patch_embeddings": True, "toy": False})
    assert spy["init"] >= 2 and spy["from_pretrained"] == 1  # meta discovery model + the loaded model


def test_bad_fusion_config_is_reported_before_a_missing_checkpoint(families, spy, tmp_path):
    with pytest.raises(ValidationError, match="unknown fusion family 'nope'"):
        fusion_core.from_pretrained(QWEN, tmp_path / "does-not-exist", fusion_config={"nope": True})


@pytest.mark.parametrize(
    ("record", "error", "text"),
    [
        ({"fusion_config": {"nope": True}}, ValidationError, "unknown fusion family 'nope'"),
        ({"fusion_config": {"patch_embeddings": {"target_modules": ["("]}}}, ValidationError,
         "invalid regular expression"),
        ({"fusion_config": "patch_embeddings"}, ValidationError, "must be a mapping"),
        ("patch_embeddings", fusion_core.CheckpointError, "config key 'fusion_core' must be an object"),
        ([1, 2], fusion_core.CheckpointError, "must be an object"),
    ],
    ids=["unknown-family", "bad-regex", "string", "record-string", "record-list"],
)
def test_malformed_fusion_config_stored_in_config_json(record, error, text, families, spy, qwen_dir, tmp_path):
    directory = qwen_dir
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    config = json.loads((target / "config.json").read_text())
    config["fusion_core"] = record
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=text):
        fusion_core.from_pretrained(QWEN, target)
    assert spy == {"init": 0, "from_pretrained": 0}


def test_legacy_top_level_fusion_config_garbage_is_rejected(families, spy, qwen_dir, tmp_path):
    directory = qwen_dir
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    config = json.loads((target / "config.json").read_text())
    config["fusion_config"] = {"patch_embeddings": "on"}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValidationError, match="family 'patch_embeddings': expected True, False"):
        fusion_core.from_pretrained(QWEN, target)
    assert spy == {"init": 0, "from_pretrained": 0}


def test_conflicting_families_are_a_plan_error_before_loading(families, spy, qwen_dir):
    """Both families are valid names, but they claim the same Conv3d: reported before transformers loads."""
    directory = qwen_dir
    with pytest.raises(fusion_core.PlanError, match="families 'patch_embeddings' and 'copycat' both replace"):
        fusion_core.from_pretrained(QWEN, directory, fusion_config={"patch_embeddings": True, "copycat": True})
    assert spy["from_pretrained"] == 0  # only the meta-device discovery model was built
    assert installed_classes() == []


# -- patterns from files run in linear time ------------------------------------------------------------------

_LOAD_SCRIPT = """
import sys
import fusion_core
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class
try:
    fusion_core.from_pretrained(auto_class(TINY_MODELS["qwen2_vl"]), sys.argv[1])
except fusion_core.FusionError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("option", ["target_modules", "exclude_modules"])
def test_a_catastrophic_pattern_in_a_downloaded_config_does_not_hang_loading(option, qwen_dir, tmp_path):
    """``(.*.*)*X`` backtracks for minutes in Python's re on a 30-character path. Loading runs in a
    subprocess under a timeout (a bound, not a measurement): with linear-time matching it ends at once."""
    import subprocess
    import sys

    directory = tmp_path / "downloaded"
    shutil.copytree(qwen_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    options = {option: ["(.*.*)*X"]}
    config["fusion_core"] = {"fusion_config": {"patch_embeddings": options}}
    (directory / "config.json").write_text(json.dumps(config))
    try:
        result = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(directory)], capture_output=True,
                                text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading with {options} did not finish within 240 s")
    assert result.returncode == 0, result.stderr[-2000:]
    if option == "target_modules":  # the pattern matches no module path: nothing to fuse, said so
        assert "DiscoveryError" in result.stdout and "0 passed the name patterns" in result.stdout
    else:  # it excludes nothing: the load is fused
        assert result.stdout == ""


@pytest.mark.parametrize("pattern", [r"(?=visual)patch", r"(proj)\1"])
def test_patterns_that_cannot_run_in_linear_time_are_refused_at_validation(pattern):
    with pytest.raises(ValidationError, match="invalid regular expression") as info:
        fusion_core.parse_fusion_config({"patch_embeddings": {"target_modules": [pattern]}})
    assert info.value.errors()[0]["loc"] == ("patch_embeddings", "target_modules")


# -- a family that finds nothing to fuse -----------------------------------------------------------------------

def test_a_family_that_is_not_required_is_skipped_where_it_finds_nothing(qwen_dir, caplog):
    """One fusion_config across a fleet: required=False skips the family, in the plan and in a warning;
    the default still raises."""
    absent = {"patch_embeddings": {"target_modules": ["no_such_module"]}}
    with pytest.raises(fusion_core.DiscoveryError, match="found nothing to fuse"):
        fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config=absent)
    skipped = {"patch_embeddings": {"target_modules": ["no_such_module"], "required": False}}
    with caplog.at_level("WARNING", logger="fusion_core"):
        model = fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config=skipped)
    assert type(model.model.visual.patch_embed.proj) is nn.Conv3d
    plan = fusion_core.get_fusion_plan(model)
    assert plan.modules == () and plan.skipped == ("patch_embeddings",)
    assert "'patch_embeddings' found nothing to fuse" in caplog.text and "required=False" in caplog.text
    assert model.config.fusion_core == {"fusion_config": skipped}
    fused = fusion_core.from_pretrained(QWEN, qwen_dir, fusion_config={"patch_embeddings": {"required": False}})
    assert fusion_core.get_fusion_plan(fused).skipped == ()
    assert type(fused.model.visual.patch_embed.proj) is not nn.Conv3d
