"""Shared fixtures: quiet transformers, a fresh plugin registry per test, tiny checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import transformers

import fusion_core
from fusion_core import discovery
from fusion_core.testing.tiny_models import TEXT_MODELS, TINY_MODELS, save_tiny_model

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts from the installed plugins only, with no env overrides and no cache."""
    for name in ("FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD", "FUSION_CORE_STRICT_PLUGINS", "FUSION_CORE_ALLOWED_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    fusion_core.reset_registry()
    discovery.clear_cache()
    yield
    fusion_core.reset_registry()


_CHECKPOINTS: dict[tuple[Any, ...], tuple[Path, Any]] = {}


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture
def tiny_checkpoint(checkpoint_root: Path) -> Callable[..., tuple[Path, Any]]:
    """``tiny_checkpoint(name, **save_kwargs)`` -> (directory, reference model); built once per session."""

    def make(name: str, **save_kwargs: Any) -> tuple[Path, Any]:
        key = (name, tuple(sorted(save_kwargs.items())))
        if key not in _CHECKPOINTS:
            tiny = TINY_MODELS[name]
            if tiny.make_config() is None:
                pytest.skip(f"transformers {transformers.__version__} has no {name}")
            directory = checkpoint_root / f"{name}-{len(_CHECKPOINTS)}"
            model = save_tiny_model(tiny, directory, **save_kwargs)
            _CHECKPOINTS[key] = (directory, model)
        return _CHECKPOINTS[key]

    return make


@pytest.fixture(scope="session")
def llama(checkpoint_root: Path) -> Path:
    """A tiny Llama checkpoint (grouped-query attention, gated MLP) for the interop tests; built once."""
    directory = checkpoint_root / "llama-interop"
    if not directory.exists():
        save_tiny_model(TEXT_MODELS["llama"], directory)
    return directory
