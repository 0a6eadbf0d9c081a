"""Which linear layers the model's own code reads the weight of directly (those stay dense): each source file is
parsed once, and the pairs found are the ones parsing every class's own source finds."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from fusion_linear_kernels.direct_reads import attributes_read, read_directly
from torch import nn


def _each_class_parsed_alone(cls: type) -> frozenset[tuple[str, str]]:
    """What attributes_read computed before: every class of the MRO's own source (inspect.getsource) parsed."""
    pairs: set[tuple[str, str]] = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] == "torch":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        pairs |= {(n.value.attr, n.attr) for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)}
    return frozenset(pairs)


@pytest.mark.parametrize("name", ["mamba", "rwkv", "qwen2"])
def test_the_pairs_are_those_of_each_class_parsed_alone(name):
    module = pytest.importorskip(f"transformers.models.{name}.modeling_{name}")
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == module.__name__]
    assert classes
    for cls in classes:
        assert attributes_read(cls) == _each_class_parsed_alone(cls), cls


def test_a_class_defined_in_a_function_is_found_by_its_qualified_name():
    class Parent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.child.weight

    assert Parent.__qualname__.endswith("<locals>.Parent")
    assert ("child", "weight") in attributes_read(Parent)


def test_a_layer_whose_weight_the_parent_reads_is_found_and_others_are_not():
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=1, vocab_size=32))
    assert read_directly(model, "backbone.layers.0.mixer.dt_proj") is not None  # self.dt_proj.weight @ ...
    assert read_directly(model, "backbone.layers.0.mixer.in_proj") is None
