"""A fused load leaves the process's random generators as a plain load does.

Users seed once and then build what they train: ``torch.manual_seed(3)``, a load, then a LoRA adapter initialised from
that generator. A load that draws from it (a check on sample tensors, a timing on random inputs) gives the adapter other
weights than the plain model's, and the two runs no longer compare. What a load computes once per process (a per-class
check, a measured decision) runs only in a process that has not computed it yet, so the shipped families' test runs
each side in a fresh process with an empty decision store. The core keeps the generators around everything it adds
to a load (:mod:`fusion_core.random_state`), so a third-party plugin that draws in its hooks moves nothing either.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

import fusion_core
from fusion_core import hookimpl
from fusion_core.plugins import PluginSource, get_registry

ALL = {"qkv": True, "gate_up": True}
FAMILIES = {"qkv": True, "gate_up": True, "linear_kernels": True, "linear_cross_entropy": True}

_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
import fusion_core

fusion_config = json.loads(sys.argv[2]) or None
torch.manual_seed(3)
model = fusion_core.from_pretrained(AutoModelForCausalLM, sys.argv[1], fusion_config=fusion_config)
after_load = torch.rand(3).tolist()
with torch.no_grad():
    model.eval().generate(torch.tensor([[5, 17, 42, 9]]), max_new_tokens=3, do_sample=False)
after_decode = torch.rand(3).tolist()
ids = torch.tensor([[5, 17, 42, 9, 11, 3]])
model.train()(input_ids=ids, labels=ids).loss.backward()
print(json.dumps([after_load, after_decode, torch.rand(3).tolist()]))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _draws(checkpoint: Path, store: Path, fusion_config: dict[str, bool] | None) -> list[list[float]]:
    env = {**os.environ, "FUSION_CORE_CACHE_DIR": str(store), "FUSION_CORE_MERGE": "measure"}
    env.pop("FUSION_CORE_DECISIONS", None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(checkpoint), json.dumps(fusion_config)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_fused_load_decode_and_training_step_draw_nothing_plain_does_not(checkpoint: Path, tmp_path: Path) -> None:
    plain = _draws(checkpoint, tmp_path / "plain", None)
    fused = _draws(checkpoint, tmp_path / "fused", FAMILIES)
    assert fused[0] == plain[0], "the fused load drew from torch's global random generator"
    assert fused[1] == plain[1], "the fused model's first greedy decode drew from torch's global random generator"
    assert fused[2] == plain[2], "the fused model's training step drew from torch's global random generator"


class _Drawer:
    """A plugin that draws from every generator in each hook a load and ``fuse`` call."""

    def __init__(self) -> None:
        self.draws = 0

    def _draw(self) -> None:
        torch.rand(4)
        random.random()
        self.draws += 1

    @hookimpl
    def fusion_load_planned(self) -> None:
        self._draw()

    @hookimpl(wrapper=True)
    def fusion_convert_loaded(self) -> Any:
        self._draw()
        result = yield
        self._draw()
        return result

    @hookimpl
    def fusion_module_fused(self) -> None:
        self._draw()


def _next_draws(seed: int, work: Any) -> tuple[Any, list[float], float]:
    """What ``work()`` returns, then the generators' next draws, from ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    result = work()
    return result, torch.rand(3).tolist(), random.random()


def test_a_plugin_drawing_in_its_hooks_leaves_a_fused_load_where_a_plain_load_is(llama: Path) -> None:
    _, *plain = _next_draws(3, lambda: AutoModelForCausalLM.from_pretrained(llama))
    drawer = _Drawer()
    get_registry().register_plugin(drawer, source=PluginSource("drawer"))
    _, *fused = _next_draws(3, lambda: fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL))
    assert drawer.draws > 3  # planned, around the conversion, once per fused module
    assert fused == plain


def test_fuse_leaves_the_generators_where_they_were(llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama)
    drawer = _Drawer()
    get_registry().register_plugin(drawer, source=PluginSource("drawer"))
    _, *untouched = _next_draws(5, lambda: None)
    _, *fused = _next_draws(5, lambda: fusion_core.fuse(model, ALL))
    assert drawer.draws > 2 and fusion_core.get_fusion_plan(model) is not None
    assert fused == untouched


def test_transformers_draws_in_a_fused_load_as_in_a_plain_one(llama: Path) -> None:
    # A head the checkpoint lacks is initialised from the generator in both loads, alike: the core puts back only
    # what it drew itself, before transformers loads.
    get_registry().register_plugin(_Drawer(), source=PluginSource("drawer"))
    plain, *after_plain = _next_draws(7, lambda: AutoModelForSequenceClassification.from_pretrained(llama))
    fused, *after_fused = _next_draws(7, lambda: fusion_core.from_pretrained(
        AutoModelForSequenceClassification, llama, fusion_config=ALL))
    assert fusion_core.get_fusion_plan(fused) is not None
    assert torch.equal(plain.score.weight, fused.score.weight)
    assert after_fused == after_plain
