"""Integrations are plugins: the lifecycle hooks, their order and refusals, and missing distributions.

A recording plugin registered on the process-wide registry sees every hook a fused load, a save,
``fuse`` and ``unfuse`` call, in order; the shipped integrations (``fusion-peft``,
``fusion-tensor-parallel``) are found through entry points like families, and without them the
workflows they serve are refused naming the distribution.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core import Integration, MissingIntegrationError, hookimpl
from fusion_core.layout import module_plan
from fusion_core.plugins import FamilyRegistry, PluginSource, get_registry
from fusion_core.spec import OPTIONAL_MEMBERS, spec_member

ALL_TEXT = {"qkv": True, "gate_up": True}


class Recorder:
    """Implements every lifecycle hook and writes down what it saw."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.load_kwargs: dict[str, Any] = {}

    @hookimpl
    def fusion_load_planned(self, plan: Any, load_kwargs: Any, families: Any) -> None:
        self.calls.append(f"planned:{len(plan.modules)}:{sorted(families)}")
        self.load_kwargs = dict(load_kwargs)

    @hookimpl(wrapper=True)
    def fusion_convert_loaded(self, model: Any, built: Any) -> Generator[None, None, None]:
        self.calls.append(f"before:{len(built)}:{sum(1 for m in model.modules() if module_plan(m))}")
        result = yield
        self.calls.append("after")
        return result

    @hookimpl
    def fusion_module_fused(self, module: Any, plan: Any) -> None:
        if not any(p.is_meta for p in module.parameters()):
            self.calls.append(f"fused:{plan.family}")

    @hookimpl
    def fusion_module_unfused(self, module: Any, plan: Any) -> None:
        self.calls.append(f"unfused:{plan.family}")

    @hookimpl
    def fusion_save_kwargs(self, model: Any, save_kwargs: dict[str, Any]) -> None:
        self.calls.append("save")
        save_kwargs["max_shard_size"] = "20KB"


def test_a_fused_load_calls_the_lifecycle_hooks_in_order(llama: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    get_registry().register_plugin(recorder, source=PluginSource("recorder"))
    model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT, dtype=torch.float32)
    planned = fusion_core.get_fusion_plan(model)
    assert planned is not None
    modules = len(planned.modules)
    assert recorder.calls[0] == f"planned:{modules}:['gate_up', 'qkv']"
    assert recorder.load_kwargs == {"dtype": torch.float32}
    # The wrapper runs before any module is fused, and after every one of them was.
    assert recorder.calls[1] == f"before:{modules}:0"
    assert sorted(recorder.calls[2:-1]) == sorted(f"fused:{m.family}" for m in planned.modules)
    assert recorder.calls[-1] == "after"
    fusion_core.save_pretrained(model, tmp_path / "out")
    assert recorder.calls[-1] == "save"
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1  # the hook's max_shard_size was used
    recorder.calls.clear()
    fusion_core.unfuse(model)
    assert sorted(recorder.calls) == sorted(f"unfused:{m.family}" for m in planned.modules)


def test_an_integration_refuses_a_load_before_any_weight_is_read(llama: Path, tmp_path: Path) -> None:
    class Refuser:
        @hookimpl
        def fusion_load_planned(self, load_kwargs: Any) -> None:
            if "device_map" in load_kwargs:
                raise ValueError("device maps are not for me")

    get_registry().register_plugin(Refuser(), source=PluginSource("refuser", "fusion-refuser", "1.0"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in llama.iterdir():
        (broken / file.name).write_bytes(file.read_bytes() if file.suffix != ".safetensors" else b"not a header")
    with pytest.raises(fusion_core.FusionLoadError, match="plugin 'refuser' refused the load in fusion_load_planned: "
                                                          "ValueError: device maps are not for me"):
        fusion_core.from_pretrained(AutoModelForCausalLM, broken, fusion_config=ALL_TEXT, device_map="cpu")


def test_fuse_and_unfuse_ask_the_plugins_first(llama: Path) -> None:
    class Guard:
        refuse_fuse: str | None = "it is Tuesday"
        refuse_unfuse: str | None = None

        @hookimpl
        def fusion_fuse_refusal(self, model: Any) -> str | None:
            return self.refuse_fuse

        @hookimpl
        def fusion_unfuse_refusal(self, module: Any, plan: Any) -> str | None:
            return self.refuse_unfuse

    guard = Guard()
    get_registry().register_plugin(guard, source=PluginSource("guard"))
    model = AutoModelForCausalLM.from_pretrained(llama)
    with pytest.raises(fusion_core.FusionError, match="LlamaForCausalLM: it is Tuesday"):
        fusion_core.fuse(model, ALL_TEXT)
    assert fusion_core.get_fusion_plan(model) is None
    guard.refuse_fuse, guard.refuse_unfuse = None, "not today"
    fusion_core.fuse(model, ALL_TEXT)
    with pytest.raises(fusion_core.FusionError, match=r"family 'qkv', module 'model.layers.0.self_attn': not today"):
        fusion_core.unfuse(model)
    assert fusion_core.get_fusion_plan(model) is not None  # nothing was unfused


@pytest.mark.parametrize("reverse", [False, True], ids=["name-order", "reverse-name-order"])
def test_conversion_wrappers_nest_as_declared_whatever_the_registration_order(
    monkeypatch: pytest.MonkeyPatch, reverse: bool
) -> None:
    from fusion_quantization import plugin as quantization
    from fusion_tensor_parallel import plugin as tensor_parallel

    calls: list[str] = []

    def record(event: str, result: Any = None) -> Any:
        return lambda *args: calls.append(event) or result

    # The real wrappers run; only their work is replaced by a note of when it ran.
    monkeypatch.setattr(tensor_parallel, "localize_built", record("tensor_parallel before", [(None, None, None)]))
    monkeypatch.setattr(tensor_parallel, "finish", record("tensor_parallel after"))
    monkeypatch.setattr(quantization, "quantized_parts", record("quantization before"))
    monkeypatch.setattr(quantization, "attach_guard", record("quantization after"))

    class Undeclared:
        @hookimpl(wrapper=True)
        def fusion_convert_loaded(self) -> Generator[None, None, None]:
            calls.append("undeclared before")
            result = yield
            calls.append("undeclared after")
            return result

    shipped = [(quantization, "quantization"), (tensor_parallel, "tensor_parallel")]  # entry points load by name
    registry = FamilyRegistry()
    for plugin, name in [*(reversed(shipped) if reverse else shipped), (Undeclared(), "undeclared")]:
        registry.register_plugin(plugin, source=PluginSource(name))
    assert not registry.failures
    registry.hook.fusion_convert_loaded(model=torch.nn.Module(), built=[(torch.nn.Linear(2, 2), None)], families={})
    # tensor parallelism replaces plans (outermost); quantization completes the conversion (innermost)
    assert calls == ["tensor_parallel before", "undeclared before", "quantization before",
                     "quantization after", "undeclared after", "tensor_parallel after"]


def test_the_shipped_integrations_are_plugins_found_through_entry_points() -> None:
    found = {entry.name: entry.source.distribution for entry in get_registry().integrations()}
    assert found == {"peft": "fusion-peft", "quantization": "fusion-quantization",
                     "tensor_parallel": "fusion-tensor-parallel"}


def test_without_the_tensor_parallel_distribution_a_tp_load_is_refused_naming_it(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    fusion_core.reset_registry()
    from fusion_qkv.family import QkvFamily

    fusion_core.register_family(QkvFamily())
    with pytest.raises(MissingIntegrationError, match=r"tp_plan='auto' needs fusion-core's 'tensor_parallel' "
                                                      r"integration.*fusion-tensor-parallel"):
        fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"qkv": True}, tp_plan="auto")


def test_an_uninstalled_integration_is_named_by_the_convention() -> None:
    registry = FamilyRegistry()
    with pytest.raises(MissingIntegrationError, match="'quantizer_x' integration, which is not installed.*"
                                                      "pip install fusion-quantizer-x"):
        registry.require_integration("quantizer_x", "quantizing a fused model")


def test_an_integration_name_two_plugins_claim_is_disabled_with_both_plugins_hooks() -> None:
    class Claimant:
        def __init__(self) -> None:
            self.fused = 0

        @hookimpl
        def register_fusion_integrations(self, register: Any) -> None:
            register(Integration("twin", "claimed twice"))

        @hookimpl
        def fusion_module_fused(self) -> None:
            self.fused += 1

    registry = FamilyRegistry()
    first, second = Claimant(), Claimant()
    registry.register_plugin(first, source=PluginSource("a", "fusion-a", "1"))
    registry.register_plugin(second, source=PluginSource("b", "fusion-b", "1"))
    assert registry.integrations() == []
    assert [str(f) for f in registry.failures] == [
        "plugin 'a' from distribution fusion-a 1: integration name 'twin' is also registered by plugin 'b' from "
        "distribution fusion-b 1; the integration is disabled until one is uninstalled or left out with "
        "FUSION_CORE_ALLOWED_PLUGINS",
        "plugin 'b' from distribution fusion-b 1: integration name 'twin' is also registered by plugin 'a' from "
        "distribution fusion-a 1; the integration is disabled until one is uninstalled or left out with "
        "FUSION_CORE_ALLOWED_PLUGINS",
    ]
    registry.hook.fusion_module_fused(module=None, plan=None)
    assert (first.fused, second.fused) == (0, 0)


def test_a_plugin_whose_registration_fails_runs_none_of_its_hooks() -> None:
    class Broken:
        fused = 0

        @hookimpl
        def register_fusion_integrations(self, register: Any) -> None:
            register("not an integration")

        @hookimpl
        def fusion_module_fused(self) -> None:
            Broken.fused += 1

    registry = FamilyRegistry()
    registry.register_plugin(Broken(), source=PluginSource("broken"))
    assert "is not a fusion_core.Integration" in str(registry.failures[0])
    registry.hook.fusion_module_fused(module=None, plan=None)
    assert Broken.fused == 0


def test_optional_spec_members_have_their_declared_defaults() -> None:
    class Minimal:  # only the required members
        name = "minimal"

    assert spec_member(Minimal(), "tensor_parallel") is None
    assert spec_member(Minimal(), "owns_submodules") is False
    assert spec_member(Minimal(), "sample_inputs")(torch.nn.Linear(2, 2), torch.Generator()) == []
    assert spec_member(Minimal(), "refusal")(torch.nn.Linear(2, 2), None) is None
    assert spec_member(Minimal(), "module_transforms")(torch.nn.Linear(2, 2), None, None) is None
    assert spec_member(Minimal(), "preserves") == "outputs"
    assert set(OPTIONAL_MEMBERS) == {"tensor_parallel", "owns_submodules", "sample_inputs", "refusal",
                                     "module_transforms", "preserves"}
    with pytest.raises(KeyError, match="'is_fusable' is not an optional member"):
        spec_member(Minimal(), "is_fusable")


def test_fusion_list_shows_integrations_and_autoload_off_leaves_them_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def listed(env: dict[str, str]) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-m", "fusion_core", "list", "--json"], capture_output=True, text=True,
                              env={**_environ(), **env}, check=True)
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    shown = listed({})
    assert {i["name"]: i["distribution"] for i in shown["integrations"]} == {
        "peft": "fusion-peft", "quantization": "fusion-quantization", "tensor_parallel": "fusion-tensor-parallel"}
    assert listed({"FUSION_CORE_DISABLE_PLUGIN_AUTOLOAD": "1"})["integrations"] == []


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("FUSION_CORE_")}


def test_a_rehearsal_on_the_meta_device_installs_no_peft_hook(llama: Path) -> None:
    script = (
        "import sys, fusion_core\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "from fusion_core.config import parse_fusion_config\n"
        "from fusion_core.discovery import discover\n"
        f"config = AutoConfig.from_pretrained({str(llama)!r})\n"
        "discover(AutoModelForCausalLM, config, parse_fusion_config({'qkv': True}, fusion_core.get_registry()))\n"
        "print(sorted(type(f).__module__ for f in sys.meta_path if 'fusion' in type(f).__module__))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_environ(), check=True)
    assert done.stdout.strip() == "[]"


def test_reset_state_clears_every_resettable_piece_in_one_call(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusion_core import checkpoint, discovery, integration_needs, merge_policy, plugins, routing

    registry = get_registry()
    fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"qkv": True})
    merge_policy.set_merge_policy("never")
    routing_on = fusion_core.integrate_transformers()
    assert routing.is_integrated() and discovery._cache and checkpoint._header_cache
    monkeypatch.setenv("FUSION_CORE_MERGE", "always")
    fusion_core.reset_state()
    assert not routing.is_integrated() and not discovery._cache and not checkpoint._header_cache
    assert merge_policy.merge_policy() == "always" and merge_policy.merge_decisions() == {}
    assert plugins.get_registry() is not registry
    integration_needs._WARNED.add("peft")
    fusion_core.reset_state()
    assert not integration_needs._WARNED
    routing_on.__exit__(None, None, None)  # a stale handle switches nothing back on
    assert not routing.is_integrated()


def test_peft_imported_without_its_integration_is_named_once(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import peft  # noqa: F401  (imported: the sign that LoRA is about to be used)

    from fusion_core import integration_needs

    monkeypatch.setenv("FUSION_CORE_ALLOWED_PLUGINS", "fusion-qkv")
    fusion_core.reset_registry()
    integration_needs.forget_warnings()
    with pytest.warns(integration_needs.MissingIntegrationWarning, match="pip install fusion-peft"):
        fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"qkv": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"qkv": True})
    assert not [w for w in caught if issubclass(w.category, integration_needs.MissingIntegrationWarning)]


def test_peft_imported_after_the_load_without_its_integration_is_named_then(llama: Path) -> None:
    """Most scripts import peft after loading the model: the warning comes at that import (a fresh process,
    where peft is not imported yet), and an adapter's save on the fused module is refused, naming fusion-peft."""
    script = f"""
import warnings
import fusion_core
from fusion_core.integration_needs import MissingIntegrationWarning
from transformers import AutoModelForCausalLM
warnings.simplefilter("error", MissingIntegrationWarning)
model = fusion_core.from_pretrained(AutoModelForCausalLM, {str(llama)!r}, fusion_config={{"qkv": True}})
try:
    import peft
except MissingIntegrationWarning as warning:
    print("WARNED:", warning)
warnings.simplefilter("ignore")
import peft
lora = peft.get_peft_model(model, peft.LoraConfig(target_modules="all-linear"))
try:
    lora.save_pretrained({str(llama / "adapter-no-integration")!r})
except fusion_core.SaveError as error:
    print("REFUSED:", error)
"""
    env = {**os.environ, "FUSION_CORE_ALLOWED_PLUGINS": "fusion-qkv,fusion-quantization"}  # only PEFT unserved
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "WARNED: peft is imported" in result.stdout and "pip install fusion-peft" in result.stdout, result.stderr
    assert "REFUSED:" in result.stdout and "qkv_proj.base_layer.weight" in result.stdout, result.stderr
    assert "integration (pip install fusion-peft)" in result.stdout.split("REFUSED:")[1]


def test_reset_state_clears_the_plugins_own_state(llama: Path) -> None:
    """The PEFT integration's import finder is its own state, reached through the fusion_reset_state hook;
    linear_kernels' measured decisions live in the core's decisions facility, which reset_state resets."""
    from fusion_linear_kernels import choice, pack_decisions
    from fusion_peft import lora

    fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config={"linear_kernels": True})
    choice._DECISIONS["probe"] = (True, "probe")
    sys.meta_path.insert(0, lora._AfterImport())
    lora._state["finder"] = True
    fusion_core.reset_state()
    assert choice.decisions() == {} and pack_decisions() == {}
    assert not any(isinstance(finder, lora._AfterImport) for finder in sys.meta_path)
    assert lora._state["finder"] is False
