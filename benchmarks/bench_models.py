"""The models the end-to-end benchmarks run: real architectures and widths, random weights, cached on disk.

No model hub is reachable, so each workload is a real transformers config class at the width of
a released model, with random weights saved once as a bf16 safetensors checkpoint under
``FUSION_BENCH_CHECKPOINTS`` (default ``/tmp/fusion-bench``). Plain and fused models are then
loaded from that one checkpoint, exactly as a user loads a downloaded one.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_io import CHECKPOINT_ROOT, qwen2_vl_config
from torch import nn

#: Qwen2-0.5B's geometry (hidden 896, 14 query / 2 key-value heads, MLP 4864, vocabulary 151936, tied
#: embeddings); ``num_hidden_layers`` is the released 24 unless a run asks for fewer.
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
QWEN2_05B_LAYERS = 24
#: Qwen2-VL-2B's vision tower: depth 32, width 1280, 16 heads, MLP ratio 4, 14x14x2 patches.
QWEN2_VL_TOWER_DEPTH = 32


def text_config(quick: bool, layers: int) -> Any:
    """A Qwen2 causal LM: Qwen2-0.5B-shaped (``layers`` deep), or tiny for ``--quick``."""
    from transformers import Qwen2Config

    if quick:
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                           max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    return Qwen2Config(num_hidden_layers=layers, **QWEN2_05B)


def tower_config(quick: bool, depth: int) -> Any:
    """Qwen2-VL with the 2B model's vision tower (``depth`` blocks at width 1280) and a small text model."""
    config = qwen2_vl_config(quick)
    config.vision_config.depth = depth
    return config


def random_init_(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter with N(0, 0.02) (norm scales with 1, shifts with 0); zero float buffers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).mul_(0.02))
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                for name, value in ((n, 1.0 if n == "weight" else 0.0) for n in ("weight", "bias")):
                    tensor = module._parameters.get(name)
                    if tensor is not None:
                        tensor.fill_(value)
        for _name, buf in model.named_buffers():
            if buf.is_floating_point():
                buf.zero_()


def build_checkpoint(config: Any, auto_class: str, tag: str, log: Callable[[str], None]) -> Path:
    """A single-file bf16 checkpoint of ``config`` with random weights, built once per config and version."""
    import transformers

    key = hashlib.sha256((config.to_json_string() + transformers.__version__).encode()).hexdigest()[:12]
    path = CHECKPOINT_ROOT / f"{tag}-tf{transformers.__version__}-{key}"
    if (path / "config.json").is_file():
        return path
    log(f"  building checkpoint {path} (once)")
    start = time.perf_counter()
    cls = getattr(transformers, auto_class)
    with torch.device("meta"):
        model = cls.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage; tie them again (Qwen2's lm_head)
    random_init_(model)
    # Non-persistent buffers (rotary inv_freq) are not saved; a load recomputes them from the config.
    tmp = Path(str(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    log(f"  built in {time.perf_counter() - start:.1f} s: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
        "parameters")
    return path
