"""A fused load leaves torch's global random generator as a plain load does.

Users seed once and then build what they train: ``torch.manual_seed(3)``, a load, then a LoRA adapter initialised from
that generator. A load that draws from it (a check on sample tensors, a timing on random inputs) gives the adapter other
weights than the plain model's, and the two runs no longer compare. What a load computes once per process (a per-class
check, a measured decision) runs only in a process that has not computed it yet, so each side runs in a fresh process
with an empty decision store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

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
