"""pytest plugin of fusion-core (entry point ``pytest11``): conformance fixtures for family authors.

Installed with fusion-core, so any test suite can use these fixtures without a ``conftest.py``:

``fusion_conformance``
    The conformance kit bound to the test's temporary directory. Typical use::

        def test_conformance(fusion_conformance):
            fusion_conformance.check_family(
                MyFamily(),
                module_factory=lambda: nn.Linear(16, 8),
                inputs_factory=lambda dtype: [torch.randn(4, 16, dtype=dtype)],
                tiny_model="vivit",
            )

    ``check_family`` runs every check below; each is also a method of its own:
    ``options_schema(spec)``, ``numerics(spec, module_factory, inputs_factory, dtypes=...)``,
    ``transform_round_trip(spec, module)``, ``state_dict_round_trip(spec, module)``,
    ``discovery(spec, tiny_model, expected_modules=None)``, ``fused_load(spec, tiny_model)``.

``fusion_registered``
    ``fusion_registered(spec, ...)`` registers families in the process-wide registry until the
    test ends (a same-named installed family is put back afterwards).

``fusion_tiny_checkpoint``
    ``fusion_tiny_checkpoint("qwen2_vl")`` -> the directory of a tiny real checkpoint, built once
    per session (skips the test when the installed transformers lacks that architecture).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest


class Conformance:
    """The conformance checks of :mod:`fusion_core.testing.kit`, bound to one test's ``tmp_path``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def options_schema(self, spec: Any) -> dict[str, Any]:
        from fusion_core.testing.kit import assert_options_schema

        return assert_options_schema(spec)

    def numerics(
        self,
        spec: Any,
        module_factory: Callable[[], Any],
        inputs_factory: Callable[[Any], Sequence[Any]],
        dtypes: Sequence[Any] | None = None,
        options: Any = None,
        config: Any = None,
    ) -> dict[Any, float]:
        import torch

        from fusion_core.testing.kit import assert_numerically_equivalent

        dtypes = dtypes if dtypes is not None else (torch.float32, torch.bfloat16)
        return assert_numerically_equivalent(module_factory, inputs_factory, spec, dtypes, options, config)

    def transform_round_trip(self, spec: Any, module: Any, options: Any = None, config: Any = None) -> Any:
        from fusion_core.testing.kit import assert_transform_round_trip

        return assert_transform_round_trip(module, spec, options, config)

    def state_dict_round_trip(self, spec: Any, module: Any, options: Any = None, config: Any = None) -> None:
        from fusion_core.testing.kit import assert_state_dict_round_trip

        assert_state_dict_round_trip(module, spec, options, config)

    def discovery(self, spec: Any, tiny_model: str, options: Any = None,
                  expected_modules: Sequence[str] | None = None) -> Any:
        from fusion_core.testing.kit import assert_discovers

        _require_tiny(tiny_model)
        return assert_discovers(spec, tiny_model, options, expected_modules)

    def fused_load(self, spec: Any, tiny_model: str, options: dict[str, Any] | None = None) -> Any:
        from fusion_core.testing.kit import assert_fused_load

        _require_tiny(tiny_model)
        return assert_fused_load(spec, tiny_model, self.tmp_path / "fused-load", options)

    def check_family(
        self,
        spec: Any,
        module_factory: Callable[[], Any],
        inputs_factory: Callable[[Any], Sequence[Any]],
        tiny_model: str | None = None,
        dtypes: Sequence[Any] | None = None,
        options: Any = None,
    ) -> None:
        """Every check: options schema, numerics per dtype, both round trips, discovery and a fused load."""
        self.options_schema(spec)
        self.numerics(spec, module_factory, inputs_factory, dtypes, options)
        self.transform_round_trip(spec, module_factory(), options)
        self.state_dict_round_trip(spec, module_factory(), options)
        if tiny_model is not None:
            self.discovery(spec, tiny_model, options)
            self.fused_load(spec, tiny_model, options.model_dump(mode="json") if options is not None else None)


def _require_tiny(name: str) -> None:
    from fusion_core.testing.tiny_models import TINY_MODELS

    if TINY_MODELS[name].make_config() is None:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {name}")


@pytest.fixture
def fusion_conformance(tmp_path: Path) -> Conformance:
    """The fusion-core conformance kit for one family (see the module docs)."""
    return Conformance(tmp_path)


@pytest.fixture
def fusion_registered() -> Iterator[Callable[..., None]]:
    """``fusion_registered(spec, ...)``: families registered process-wide until the test ends."""
    from contextlib import ExitStack

    from fusion_core.testing.kit import registered

    with ExitStack() as stack:
        yield lambda *specs: stack.enter_context(registered(*specs))


@pytest.fixture(scope="session")
def fusion_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``fusion_tiny_checkpoint(name)`` -> directory of a tiny real checkpoint (built once per session)."""
    built: dict[str, Path] = {}

    def make(name: str) -> Path:
        from fusion_core.testing.tiny_models import TINY_MODELS, save_tiny_model

        _require_tiny(name)
        if name not in built:
            directory = tmp_path_factory.mktemp(f"fusion-tiny-{name}")
            save_tiny_model(TINY_MODELS[name], directory)
            built[name] = directory
        return built[name]

    return make
