"""Tiny GGUF files as llama.cpp's converter writes them, for the GGUF loads transformers offers (``gguf_file=``).

Random weights under the GGUF tensor names and shapes of three architectures transformers reads: ``llama``
(transformers un-permutes q and k), ``qwen2`` (attention biases) and ``qwen2moe`` (routed experts stacked per
layer, one shared expert). The tests compare a fused load of a file with the plain load of the same file, so
the weights need no model to come from. Matrices are stored as ``Q8_0`` (transformers dequantizes them while
it loads) or ``F32``; norms and biases as ``F32``, as the converter stores them.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

HIDDEN, HEADS, KV_HEADS, VOCAB, LAYERS, FFN = 64, 4, 2, 128, 2, 96
# transformers (4.57.6, 5.25.0) reads neither of qwen2moe's expert widths from a GGUF file: its config keeps
# Qwen2MoeConfig's defaults, so the experts here have those widths.
EXPERTS, EXPERTS_USED, EXPERT_FFN, SHARED_FFN = 4, 2, 1408, 5632


def _shapes(arch: str) -> dict[str, tuple[int, ...]]:
    head = HIDDEN // HEADS
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        block = {
            "attn_norm.weight": (HIDDEN,), "ffn_norm.weight": (HIDDEN,),
            "attn_q.weight": (HEADS * head, HIDDEN), "attn_k.weight": (KV_HEADS * head, HIDDEN),
            "attn_v.weight": (KV_HEADS * head, HIDDEN), "attn_output.weight": (HIDDEN, HEADS * head),
        }
        if arch in ("qwen2", "qwen2moe"):
            block.update({"attn_q.bias": (HEADS * head,), "attn_k.bias": (KV_HEADS * head,),
                          "attn_v.bias": (KV_HEADS * head,)})
        if arch == "qwen2moe":
            block.update({
                "ffn_gate_inp.weight": (EXPERTS, HIDDEN),
                "ffn_gate_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_up_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_down_exps.weight": (EXPERTS, HIDDEN, EXPERT_FFN), "ffn_gate_inp_shexp.weight": (HIDDEN,),
                "ffn_gate_shexp.weight": (SHARED_FFN, HIDDEN), "ffn_up_shexp.weight": (SHARED_FFN, HIDDEN),
                "ffn_down_shexp.weight": (HIDDEN, SHARED_FFN),
            })
        else:
            block.update({"ffn_gate.weight": (FFN, HIDDEN), "ffn_up.weight": (FFN, HIDDEN),
                          "ffn_down.weight": (HIDDEN, FFN)})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def write_gguf(path: Path, arch: str, quantized: bool = True, seed: int = 0, leave_out: tuple[str, ...] = ()) -> Path:
    """Write a tiny ``arch`` model to ``path`` (a ``.gguf`` file) without the tensors named in ``leave_out``."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    if arch == "qwen2moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(EXPERTS_USED)
    for name, shape in _shapes(arch).items():
        if name in leave_out:
            continue
        data = (rng.standard_normal(shape) * (0.5 if len(shape) == 1 else 0.08)).astype(np.float32)
        if name.endswith("norm.weight"):
            data += 1.0
        if quantized and len(shape) >= 2:
            packed = quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
