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
