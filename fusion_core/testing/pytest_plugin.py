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
    ``transform_op(op, shapes, bad_shapes=None)``, ``discovery(spec, model, expected_modules=None)``,
    ``fused_load(spec, model)``, ``quantizer_visibility(spec, model, quantize=None)``. A ``model``
    is a tiny-model name, a ``(model_class, config)`` pair or a checkpoint directory; ``config=``
    (every method that builds transforms) is what the family's ``make_transforms`` receives.

``fusion_registered``
    ``fusion_registered(spec, ...)`` registers families in the process-wide registry until the
    test ends (a same-named installed family is put back afterwards).

``fusion_tiny_checkpoint``
    ``fusion_tiny_checkpoint("qwen2_vl")`` (or a ``(model_class, config)`` pair) -> the directory
    of a tiny real checkpoint, built once per session (skips the test when the installed
    transformers lacks that architecture).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

__all__ = ["Conformance", "fusion_conformance", "fusion_registered", "fusion_tiny_checkpoint"]


class Conformance:
    """The conformance checks of :mod:`fusion_core.testing.kit`, bound to one test's ``tmp_path``.

    ``model`` arguments take a tiny-model name, a ``(model_class, config)`` pair or a checkpoint
    directory; a tiny model the installed transformers lacks skips the test. ``config`` is what
    the family's ``make_transforms(config, options)`` receives (see the kit's module docs).
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def options_schema(self, spec: Any) -> dict[str, Any]:
        from fusion_core.testing.kit import assert_options_schema

        return assert_options_schema(spec)

    def numerics(
        self,
        spec: Any,
        module_factory: Callable[[], Any],
        inputs_factory: Callable[[Any], Any],
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

    def transform_op(self, op: Any, shapes: Sequence[Any], bad_shapes: Sequence[Any] | None = None) -> None:
        from fusion_core.testing.kit import assert_transform_op

        assert_transform_op(op, shapes, bad_shapes=bad_shapes)

    def state_dict_round_trip(self, spec: Any, module: Any, options: Any = None, config: Any = None) -> None:
        from fusion_core.testing.kit import assert_state_dict_round_trip

        assert_state_dict_round_trip(module, spec, options, config)

    def discovery(self, spec: Any, model: Any, options: Any = None,
                  expected_modules: Sequence[str] | None = None, config: Any = None) -> Any:
        from fusion_core.testing.kit import assert_discovers

        _require_model(model)
        return assert_discovers(spec, model, options, expected_modules, config)

    def fused_load(self, spec: Any, model: Any, options: Any = None, config: Any = None) -> Any:
        from fusion_core.testing.kit import assert_fused_load

        _require_model(model)
        return assert_fused_load(spec, model, self.tmp_path / "fused-load", options, config=config)

    def quantizer_visibility(self, spec: Any, model: Any, options: Any = None, config: Any = None,
                             quantize: Callable[[Any], Any] | None = None) -> dict[str, int]:
        from fusion_core.testing.kit import assert_quantizers_see_the_same_weights

        _require_model(model)
        return assert_quantizers_see_the_same_weights(spec, model, options, config=config, quantize=quantize)

    def check_family(
        self,
        spec: Any,
        module_factory: Callable[[], Any],
        inputs_factory: Callable[[Any], Any],
        tiny_model: Any = None,
        dtypes: Sequence[Any] | None = None,
        options: Any = None,
        config: Any = None,
        quantizers: bool = False,
    ) -> None:
        """Every check: options schema, numerics per dtype, both round trips, discovery and a fused load.

        ``tiny_model`` (any model source) adds discovery and a fused load of that model; its
        config is then also what the module-level checks hand ``make_transforms``, unless
        ``config`` is given. ``quantizers=True`` adds :meth:`quantizer_visibility` on it, for a family
        whose fused model should stay quantizable (one that moves an ``nn.Linear``'s weight out of a
        Linear, like the scaffold's transpose, fails it: quantizing such a fused model is refused by
        ``fusion-quantization`` instead).
        """
        from fusion_core.testing.kit import model_config

        if tiny_model is not None:
            _require_model(tiny_model)
            if config is None:
                config = model_config(tiny_model)
        self.options_schema(spec)
        self.numerics(spec, module_factory, inputs_factory, dtypes, options, config)
        self.transform_round_trip(spec, module_factory(), options, config)
        self.state_dict_round_trip(spec, module_factory(), options, config)
        if tiny_model is not None:
            self.discovery(spec, tiny_model, options, config=config)
            self.fused_load(spec, tiny_model, options, config=config)
            if quantizers:
                self.quantizer_visibility(spec, tiny_model, options, config=config)


def _require_model(model: Any) -> None:
    """Skip the test when ``model`` names a tiny model this transformers does not have."""
    if not isinstance(model, str) or Path(model).is_dir():
        return
    from fusion_core.testing.tiny_models import tiny_model

    if tiny_model(model).make_config() is None:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {model}")


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
def fusion_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``fusion_tiny_checkpoint(model)`` -> directory of a tiny real checkpoint (built once per session).

    ``model`` is a tiny-model name or a ``(model_class, config)`` pair (random weights, seed 0).
    """
    built: dict[str, Path] = {}

    def make(model: Any) -> Path:
        from fusion_core.testing.kit import build_model, resolve_model

        _require_model(model)
        resolved = resolve_model(model)
        key = resolved.label if isinstance(model, str) else f"{resolved.label}-{resolved.config.to_json_string()}"
        if key not in built:
            directory = tmp_path_factory.mktemp(f"fusion-tiny-{resolved.label}")
            build_model(resolved).save_pretrained(directory)
            built[key] = directory
        return built[key]

    return make
