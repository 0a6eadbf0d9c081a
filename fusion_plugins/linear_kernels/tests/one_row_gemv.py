"""What the tests of the GEMV kernel's candidates (row-dot, blocked-rows, few-rows) and of the kernels built on it (the
decode step's) share."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch

import fusion_core


def one_row_layer(shape: tuple[int, int], dtype: torch.dtype, bias: bool,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A ``shape`` weight (scaled as an initialised layer's), a bias or None, and a one-row ``[1, 1, in]`` input."""
    out, inn = shape
    weight = (torch.randn(out, inn, generator=generator) / inn**0.5).to(dtype)
    return weight, (torch.randn(out, generator=generator).to(dtype) if bias else None), torch.randn(
        1, 1, inn, generator=generator).to(dtype)


def skip_unless_built(build: Callable[[], object], what: str) -> None:
    """Skips the test where ``build()`` gives None: a GEMV kernel that cannot be built here (no C++ compiler), whose
    fallback the failed-build tests cover."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if build() is None:
            pytest.skip(f"{what} cannot be built here: {[str(w.message) for w in caught]}")


def fresh_kernels_of(module: ModuleType) -> Iterator[None]:
    """A fixture's body: ``module``'s built kernels forgotten before the test, and gone after
    ``fusion_core.reset_state()`` (which reaches them through the plugin's ``fusion_reset_state`` hook)."""
    module.clear()
    fusion_core.get_registry().get("linear_kernels")  # the family's plugin loaded: reset_state reaches its hook
    yield
    fusion_core.reset_state()
    assert not len(module._KERNELS) and not module._KERNELS.warned


def without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without a C++ compiler, which never built the kernel: every build raises, and no stored library
    file is read (decisions off; the built kernels and their files in this process are forgotten by the caller's
    ``fresh_kernels``)."""
    from fusion_linear_kernels import compat

    def no_compiler(argtypes: list[str], source: str) -> None:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compat, "cpp_kernel", no_compiler)
    monkeypatch.setenv("FUSION_CORE_DECISIONS", "off")


def recorded_calls(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[Any]:
    """The first argument after ``self`` of every call of ``owner.name`` from now on, in order (the method still
    runs): which modules a decode step ran on."""
    calls: list[Any] = []
    method = getattr(owner, name)

    def recorded(self: Any, first: Any, *args: Any) -> Any:
        calls.append(first)
        return method(self, first, *args)

    monkeypatch.setattr(owner, name, recorded)
    return calls


def without_the_kernel_of(monkeypatch: pytest.MonkeyPatch, marker: str) -> None:
    """A machine where the kernels whose C++ holds ``marker`` cannot be built (the others can): no stored library
    file is read (decisions off), nor one this process built (the GEMV's forgotten, built again)."""
    from fusion_linear_kernels import compat, row_dot

    build = compat.cpp_kernel

    def refusing(argtypes: list[str], source: str) -> Any:
        if marker in source:
            raise RuntimeError("no C++ compiler found")
        return build(argtypes, source)

    monkeypatch.setattr(compat, "cpp_kernel", refusing)
    monkeypatch.setenv("FUSION_CORE_DECISIONS", "off")
    row_dot.clear()
