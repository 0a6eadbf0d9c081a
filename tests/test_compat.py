"""The compat modules: each version-dependent entry on the installed release, and each fallback or refusal.

The other releases' shapes are built here as those releases return them (checked on each line
by CI's range run, where the installed release takes the real path).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import transformers
from torch import nn

import fusion_core
from fusion_core.compat import peft as peft_compat, transformers as compat
from fusion_core.errors import FusionLoadError


@pytest.mark.parametrize("version", ["4.57.0", "4.57.6", "5.0.0", "5.8.1", "5.24.0", "5.99.1.dev0"])
def test_releases_in_the_declared_range_are_accepted(version):
    compat.check_supported(version)


@pytest.mark.parametrize("version", ["4.56.2", "4.46.0", "6.0.0", "6.1.0rc1"])
def test_releases_outside_the_range_are_refused_naming_it(version):
    with pytest.raises(ImportError, match=rf"supports transformers>=4\.57,<6; transformers {version} is installed"):
        compat.check_supported(version)


def test_import_fails_with_the_range_where_transformers_is_outside_it(tmp_path):
    """A release outside the range (a dist-info first on sys.path) stops ``import fusion_core`` with the message."""
    info = tmp_path / "transformers-4.50.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.50.0\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import fusion_core"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "ImportError: fusion-core supports transformers>=4.57,<6; transformers 4.50.0 is installed" in result.stderr


# -- the loading report ---------------------------------------------------------------------------
def test_the_4_57_result_shape_gives_the_model_and_its_report():
    model = nn.Linear(2, 2)
    result = (model, ["a"], ["b"], [("c", (1,), (2,))], None, ["err"])
    loaded, report = compat.loading_report(result, (type(model), model), {})
    assert loaded is model
    assert report() == {"missing_keys": ["a"], "unexpected_keys": ["b"], "mismatched_keys": [("c", (1,), (2,))],
                        "error_msgs": ["err"]}


def test_the_5_0_dataclass_is_read_after_the_load_adjusted_it():
    @dataclasses.dataclass
    class Info:  # transformers 5.0's LoadStateDictInfo: a dataclass, adjusted in place after the method returns
        missing_keys: set[str]
        unexpected_keys: set[str]

    model, info = nn.Linear(2, 2), Info({"lm_head.weight"}, set())
    loaded, report = compat.loading_report(info, (type(model), model), {})  # classmethod: (cls, model, ...)
    info.missing_keys.discard("lm_head.weight")  # the tie transformers resolves later
    assert loaded is model and report() == {"missing_keys": set(), "unexpected_keys": set()}


def test_the_5_x_tuple_is_read_with_to_dict():
    class Info:
        def to_dict(self):
            return {"missing_keys": set()}

    model = nn.Linear(2, 2)
    loaded, report = compat.loading_report((Info(), {}), (), {"model": model})  # staticmethod: (model, ...)
    assert loaded is model and report() == {"missing_keys": set()}


def test_a_result_no_checked_release_returns_is_refused():
    with pytest.raises(TypeError, match="which no release fusion-core was checked on returns"):
        compat.loading_report(["not", "a", "report"], (nn.Linear(1, 1),), {})


def test_the_installed_release_reports_through_the_wrapped_load_method(llama):
    """The real method, wrapped as a fused load wraps it: the report equals ``output_loading_info``'s."""
    seen = []

    def wrap(function):
        def method(*args, **kwargs):
            result = function(*args, **kwargs)
            seen.append(compat.loading_report(result, args, kwargs))
            return result

        return method

    raw = compat.raw_load_method()
    with compat.wrapped_load_method(wrap):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(llama, output_loading_info=True)
    assert compat.raw_load_method() is raw
    [(loaded, report)] = seen
    assert loaded is model
    assert {k: report()[k] for k in ("missing_keys", "unexpected_keys")} == {
        k: info[k] for k in ("missing_keys", "unexpected_keys")}


def test_a_load_whose_report_fusion_core_cannot_see_is_refused(llama, monkeypatch):
    def no_report(*args, **kwargs):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(llama))

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: no_report()))
    with pytest.raises(FusionLoadError, match="loading report fusion-core could not see"):
        fusion_core.from_pretrained(transformers.LlamaForCausalLM, llama, fusion_config={"qkv": True})


# -- tensor parallelism ---------------------------------------------------------------------------
def _transformers_plan_matcher():
    """transformers' own private matcher, wherever the installed release keeps it (None if nowhere)."""
    for module, name in (("transformers.distributed.parallel_utils", "_get_parameter_plan"),
                         ("transformers.distributed.tensor_parallel", "_get_parameter_plan"),
                         ("transformers.distributed.tensor_parallel", "_get_parameter_tp_plan"),
                         ("transformers.integrations.tensor_parallel", "_get_parameter_tp_plan")):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj.weight": "colwise", "lm_head": "colwise_gather_output", "model.w1": "x"}
NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.11.self_attn.q_proj.bias",
         "model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.gate_proj.weight",
         "model.layers.3.mlp.gate_proj.bias", "lm_head.weight", "model.w1.weight", "model.w1",
         "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj"]


def test_plan_styles_follow_transformers_own_rule():
    """Where the installed release has its private matcher, every answer is the same; elsewhere the rule stands."""
    own = _transformers_plan_matcher()
    expected = {name: own(name, PLAN, is_weight=True) for name in NAMES} if own is not None else None
    got = {name: compat.plan_style(name, PLAN) for name in NAMES}
    assert got["model.layers.11.self_attn.q_proj.bias"] == "colwise"
    assert got["model.layers.3.mlp.gate_proj.bias"] is None
    assert got["lm_head.weight"] == "colwise_gather_output"
    assert got["model.w1.weight"] == ("x" if compat.release() >= (5, 0) else None)  # 4.57 reads w1 as w*
    if expected is not None:
        assert got == expected


def test_tensor_parallel_size_of_a_model_not_sharded_is_one(llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    assert compat.tensor_parallel_size(model) == 1
    model._tp_size = 4
    assert compat.tensor_parallel_size(model) == 4


def test_build_from_config_for_auto_and_concrete_classes(llama):
    config = transformers.AutoConfig.from_pretrained(llama)
    for cls in (transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM):
        assert type(compat.build_from_config(cls, config)) is transformers.LlamaForCausalLM


# -- PEFT -----------------------------------------------------------------------------------------
def test_a_peft_without_the_wrapped_factory_is_refused_naming_it(monkeypatch):
    pytest.importorskip("peft")
    lora_module = types.ModuleType("fake_lora_model")
    lora_module.LoraModel = type("LoraModel", (), {})
    with pytest.raises(ImportError, match=r"has no LoraModel\._create_new_module .*checked on peft"):
        peft_compat.wrap_lora_factories(lora_module, lambda f: f, lambda f: f)


def test_peft_factories_are_wrapped_on_the_installed_release():
    pytest.importorskip("peft")
    code = textwrap.dedent("""
        import sys
        import peft.tuners.lora.model as lora_model
        import peft.tuners.tuners_utils as tuners_utils
        from fusion_core.compat import peft as compat
        calls = []
        def tag(name):
            def wrap(original):
                calls.append(name)
                return original
            return wrap
        compat.wrap_lora_factories(lora_model, tag("create"), tag("all_linear"))
        assert calls == ["create", "all_linear"], calls
        assert isinstance(lora_model.LoraModel.__dict__["_create_new_module"], staticmethod)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_argument_a_model_class_reads_itself_is_listed():
    """A release that adds a ``from_pretrained`` argument fails here, instead of offering it to the config."""
    function = inspect.unwrap(transformers.PreTrainedModel.from_pretrained.__func__)
    source = inspect.getsource(function)
    before_config = source[:source.index("return_unused_kwargs=True")]
    popped = set(re.findall(r'(?<![\w.])kwargs\.pop\("(\w+)"', before_config))
    named = {p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert popped and named
    assert popped | named <= compat.MODEL_LOAD_KWARGS, sorted((popped | named) - compat.MODEL_LOAD_KWARGS)


def test_every_argument_an_auto_class_takes_before_its_config_is_listed():
    source = inspect.getsource(transformers.AutoModelForCausalLM.from_pretrained)
    before_config = source[:source.index("AutoConfig.from_pretrained(")]
    # Up to 5.24 a list of the hub arguments' names; from 5.25 a dict built from them ({"cache_dir": cache_dir, ...}).
    hub = (re.search(r"hub_kwargs_names = \[(.*?)\]", before_config, re.S)
           or re.search(r"hub_kwargs = \{(.*?)\}", before_config, re.S))
    assert hub is not None
    popped = set(re.findall(r'(?<![\w.])kwargs\.pop\("(\w+)"', before_config))
    taken = set(re.findall(r'"(\w+)"', hub.group(1))) | popped
    taken -= {"dtype", "torch_dtype", "quantization_config"}  # handled on their own (compat.config_overrides)
    assert taken <= compat.AUTO_LOAD_KWARGS, sorted(taken - compat.AUTO_LOAD_KWARGS)


def test_config_overrides_split_a_model_class_and_an_auto_class_load_as_transformers_does():
    quantization = object()
    kwargs = {"num_labels": 3, "device_map": "cpu", "revision": "main", "trust_remote_code": False,
              "quantization_config": quantization}
    assert compat.config_overrides({**kwargs, "dtype": "bfloat16"}, auto=False) == ({"num_labels": 3}, frozenset())
    # An Auto class offers its config more, but never an "auto" dtype or the caller's quantization_config.
    assert compat.config_overrides({**kwargs, "dtype": "auto"}, auto=True) == (
        {"num_labels": 3, "device_map": "cpu"}, frozenset()
    )
    assert compat.config_overrides({**kwargs, "torch_dtype": "float16"}, auto=True) == (
        {"num_labels": 3, "device_map": "cpu", "torch_dtype": "float16"}, frozenset({"torch_dtype"})
    )
