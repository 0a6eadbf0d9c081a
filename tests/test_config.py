"""FusionConfig: validation against the installed families, errors that name family and field."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from fusion_core import FamilyOptions, FusionConfig, FusionFamily, register_family


class _Options(FamilyOptions):
    rank: int = 4


class _Family(FusionFamily):
    """A test family with one option."""

    name = "toy"
    options_model = _Options


@pytest.fixture
def toy() -> None:
    register_family(_Family())


def test_true_false_and_options_keep_order_and_round_trip(toy):
    value = {"toy": {"rank": 8}, "patch_embeddings": False}
    config = FusionConfig.model_validate(value)
    assert list(config.root) == ["toy", "patch_embeddings"]
    assert config.enabled_names() == ["toy"]
    assert config.enabled()["toy"].rank == 8
    dumped = config.model_dump()
    assert dumped == value
    assert FusionConfig.model_validate(json.loads(config.to_json())).model_dump() == value
    assert FusionConfig.model_validate({"toy": True}).enabled()["toy"] == _Options()


@pytest.mark.parametrize(
    ("value", "loc", "text"),
    [
        ({"toy": {"rank": "many"}}, ("toy", "rank"), "family 'toy'"),
        ({"toy": {"rnak": 8}}, ("toy", "rnak"), "Extra inputs"),
        ({"toy": 1}, ("toy",), "expected True, False or a mapping"),
        ({"toy": "yes"}, ("toy",), "got str"),
        ({"toy": None}, ("toy",), "got NoneType"),
        ({"nope": True}, ("nope",), "installed families: .*toy"),
        ({"toy": {"exclude_modules": "abc"}}, ("toy", "exclude_modules"), "family 'toy'"),
    ],
)
def test_errors_name_family_and_field(toy, value, loc, text):
    with pytest.raises(ValidationError) as info:
        FusionConfig.model_validate(value)
    error = info.value.errors()[0]
    assert error["loc"] == loc
    assert re.search(text, str(info.value))


@pytest.mark.parametrize("value", ['{"toy": true}', ["toy"], 3, None])
def test_non_mapping_is_rejected(toy, value):
    with pytest.raises(ValidationError, match="must be a mapping"):
        FusionConfig.model_validate(value)


def test_missing_family_names_its_distribution(monkeypatch):
    """From installed metadata when a distribution declares the plugin, else by the naming convention."""
    monkeypatch.setenv("FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    import fusion_core

    fusion_core.reset_registry()
    with pytest.raises(ValidationError, match="installed distribution fusion-patch-embeddings .* not loaded"):
        FusionConfig.model_validate({"patch_embeddings": True})
    with pytest.raises(ValidationError, match="provided by the distribution 'fusion-not-installed': pip install "
                                              "fusion-not-installed"):
        FusionConfig.model_validate({"not_installed": True})


# -- errors are FusionErrors (and still pydantic ValidationErrors) ---------------------------------
def _validators():
    import torch
    import transformers

    import fusion_core
    from fusion_core.config import parse_fusion_config

    return {
        "FusionConfig.model_validate": FusionConfig.model_validate,
        "FusionConfig.model_validate_json": lambda value: FusionConfig.model_validate_json(json.dumps(value)),
        "FusionConfig()": FusionConfig,
        "parse_fusion_config": parse_fusion_config,
        "fusion_core.parse_fusion_config": fusion_core.parse_fusion_config,
        "from_pretrained": lambda value: fusion_core.from_pretrained(
            transformers.AutoModel, "/nonexistent/checkpoint", fusion_config=value
        ),
        "fuse": lambda value: fusion_core.fuse(torch.nn.Linear(2, 2), value),
    }


@pytest.mark.parametrize("entry", list(_validators()))
def test_an_unknown_family_is_an_unknown_family_error(toy, entry):
    import fusion_core

    with pytest.raises(fusion_core.UnknownFamilyError) as info:
        _validators()[entry]({"toy": True, "nope": True})
    error = info.value
    assert isinstance(error, fusion_core.FusionError) and isinstance(error, ValueError)
    assert isinstance(error, ValidationError)  # what callers caught so far keeps working
    assert [e["loc"] for e in error.errors()] == [("nope",)]
    assert re.search(r"unknown fusion family 'nope'; installed families: .*patch_embeddings.*toy", str(error))


_BAD_OPTIONS = [
    ({"toy": {"rank": "many"}}, "family 'toy': Input should be a valid integer"),
    ({"toy": {"rnak": 8}}, "family 'toy': Extra inputs are not permitted"),
    ({"toy": "yes"}, "family 'toy': expected True, False or a mapping of options, got str"),
]


@pytest.mark.parametrize("entry", list(_validators()))
def test_a_bad_option_is_a_fusion_config_error_naming_the_family(toy, entry):
    import fusion_core
    from fusion_core.errors import FusionConfigError

    for value, text in _BAD_OPTIONS:
        with pytest.raises(FusionConfigError) as info:
            _validators()[entry](value)
        error = info.value
        assert isinstance(error, fusion_core.FusionError) and isinstance(error, ValueError)
        assert isinstance(error, ValidationError) and not isinstance(error, fusion_core.UnknownFamilyError)
        assert text in str(error) and error.errors()[0]["loc"][0] == "toy"


def test_an_unknown_family_among_bad_options_reports_every_error(toy):
    import fusion_core
    from fusion_core.errors import FusionConfigError

    with pytest.raises(fusion_core.UnknownFamilyError) as info:
        FusionConfig.model_validate({"toy": {"rank": "x"}, "nope": True})
    assert isinstance(info.value, FusionConfigError)
    assert {e["loc"] for e in info.value.errors()} == {("toy", "rank"), ("nope",)}


def test_the_constructor_validates_like_model_validate(toy):
    config = FusionConfig({"toy": {"rank": 8}, "patch_embeddings": False})
    assert config == FusionConfig.model_validate({"toy": {"rank": 8}, "patch_embeddings": False})
    assert config.enabled()["toy"].rank == 8 and config.model_dump() == {"toy": {"rank": 8}, "patch_embeddings": False}
    assert [family.name for family, _ in config.families()] == ["toy"]
