"""Peak memory of one bf16 training step (forward + backward), plain vs ``linear_cross_entropy``.

A Qwen2-0.5B-shaped causal LM (hidden 896, tied 151936-token vocabulary; layers as given) is built
with random weights in this process, fused or not, and one step at ``tokens`` tokens is run. What
is printed is the peak RSS above the built model (Linux ``VmHWM``, reset just before the step), and
``ru_maxrss`` before and after. Run one process per figure::

    python bench_memory.py plain 4 1024 [frozen-head]
    python bench_memory.py fused 4 1024 [frozen-head]

``frozen-head``: the head (and the tied embedding) does not train, as under LoRA.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time

os.environ.setdefault("USE_HUB_KERNELS", "NO")

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import fusion_core


def status(field: str) -> float:
    """A ``/proc/self/status`` memory field, in MiB."""
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) / 1024 for line in lines if line.startswith(field))


def main(mode: str, layers: int, tokens: int, head: str = "trainable") -> None:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=max(4096, tokens))
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if head == "frozen-head":
        model.get_output_embeddings().weight.requires_grad_(False)
    if mode == "fused":
        fusion_core.fuse(model, {"linear_cross_entropy": True})
    model.train()
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    base, base_max = status("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    elapsed = time.perf_counter() - start
    peak, peak_max = status("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{mode:5s} {head:11s} layers={layers} tokens={tokens} loss={output.loss.item():.5f} "
          f"model RSS={base:.0f} MiB, step peak above it={peak - base:.0f} MiB "
          f"(ru_maxrss {base_max:.0f} -> {peak_max:.0f} MiB), {elapsed:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
