"""fusion-core in one screen: fuse a tiny Qwen2-VL, check it, time it, save it, reload it plainly."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForImageTextToText

import fusion_core
from fusion_core.checkpoint import read_checkpoint_index
from fusion_core.compare import median_seconds
from fusion_core.testing.kit import TOLERANCES, fuse_module
from fusion_core.testing.tiny_models import TINY_MODELS, save_tiny_model


def _vision_output(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.visual(**inputs)
    return getattr(out, "last_hidden_state", out)




def patch_embedding_speedup(patches: int = 1024, width: int = 1280) -> tuple[float, float]:
    """Conv3d vs fused at Qwen2-VL's real patch embedding (3x2x14x14 -> width), interleaved."""
    from fusion_patch_embeddings import PatchEmbeddingsFamily

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, width, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).eval()
    fused = fuse_module(conv, PatchEmbeddingsFamily())
    x = torch.randn(patches, 3, 2, 14, 14)
    conv_ms, fused_ms = [], []
    with torch.no_grad():
        for _ in range(3):
            conv(x), fused(x)
        for _ in range(5):
            conv_ms.append(median_seconds(lambda: conv(x), 3) * 1e3)
            fused_ms.append(median_seconds(lambda: fused(x), 3) * 1e3)
    return sorted(conv_ms)[2], sorted(fused_ms)[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, help="keep the checkpoints here instead of a temp dir")
    args = parser.parse_args()
    if args.workdir is not None:
        return run(args.workdir)
    with tempfile.TemporaryDirectory(prefix="fusion-demo-") as scratch:  # nothing left behind in /tmp
        return run(Path(scratch))


def run(workdir: Path) -> int:
    """Build, load fused, compare, save and reload under ``workdir``; 0 when every check passed."""
    source, saved = workdir / "source", workdir / "saved"
    shutil.rmtree(source, ignore_errors=True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"fusion-core {fusion_core.__version__} demo ({versions})")

    tiny = TINY_MODELS["qwen2_vl"]
    reference = save_tiny_model(tiny, source)
    tensors = len(read_checkpoint_index(source))
    print(f"1. built a tiny random Qwen2-VL checkpoint locally: {source} ({tensors} tensors)")

    model, info = fusion_core.from_pretrained(
        AutoModelForImageTextToText, source, fusion_config={"patch_embeddings": True}, output_loading_info=True
    )
    print('2. loaded with fusion_config={"patch_embeddings": True}; fused modules:')
    for row in fusion_core.get_fusion_plan(model).describe():
        (before_key, before), (_, after) = next(iter(row["original"].items())), next(iter(row["fused"].items()))
        print(f"   {row['module']}: {row['original_class']} -> {row['fused_class']}")
        print(f"     {before_key}: {before} -> {after}")
    counts = {k: len(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    print(f"   transformers' loading report: {counts}")
    ok = not any(counts.values())

    inputs = tiny.make_vision_input(reference.config, torch.Generator().manual_seed(0))
    expected = _vision_output(reference, inputs)
    diff = float((expected - _vision_output(model, inputs)).abs().max())
    tolerance = TOLERANCES[torch.float32]
    print(f"3. vision tower, fused vs unfused: max |diff| = {diff:.2e} (float32 tolerance {tolerance:g})")
    ok &= diff <= tolerance

    conv_ms, fused_ms = patch_embedding_speedup()
    print(f"4. patch embedding at Qwen2-VL width (3x2x14x14 -> 1280), 1024 patches, float32, "
          f"{torch.get_num_threads()} threads:")
    print(f"   Conv3d {conv_ms:.2f} ms, fused Linear {fused_ms:.2f} ms: {conv_ms / fused_ms:.1f}x faster")

    fusion_core.save_pretrained(model, saved)
    identical = (saved / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    print(f"5. fusion_core.save_pretrained -> {saved}")
    print(f"   model.safetensors byte-identical to the source: {'yes' if identical else 'NO'}")
    ok &= identical

    plain = AutoModelForImageTextToText.from_pretrained(saved)
    plain_is_plain = fusion_core.get_fusion_plan(plain) is None and all(
        type(m) is torch.nn.Conv3d for m in plain.modules() if isinstance(m, torch.nn.Conv3d)
    )
    same = torch.equal(_vision_output(plain, inputs), expected)
    print(f"6. plain transformers loads the saved directory: unfused {'yes' if plain_is_plain else 'NO'}, "
          f"identical vision output {'yes' if same else 'NO'}")
    ok &= same and plain_is_plain
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
