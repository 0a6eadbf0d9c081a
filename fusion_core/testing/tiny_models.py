"""Tiny random models built from real transformers config classes, for offline tests and demos.

No model hub is needed: each factory returns a config small enough to build, save and load in
milliseconds, with the architecture (and so the module classes) of the real model. A factory
returns ``None`` when the installed transformers does not have the architecture.

Three tables, one namespace of names (:data:`ALL_TINY_MODELS`, looked up by :func:`tiny_model`;
every kit entry point and fixture takes these names): :data:`TINY_MODELS` (vision, video and
vision-language models, with an input for their vision tower), :data:`TEXT_MODELS` (decoder-only
language models) and :data:`MOE_MODELS` (mixture-of-experts decoders: per-expert ``ModuleList``
blocks returning ``(hidden, router_logits)`` on transformers 4.57, fused 3-D expert tensors on 5.x).
The names are listed in ``docs/tiny-models.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ALL_TINY_MODELS", "MOE_MODELS", "TEXT_MODELS", "TINY_MODELS", "TinyModel", "TinyTextModel", "auto_class",
    "save_tiny_model", "tiny_model",
]

_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


@dataclass(frozen=True)
class TinyModel:
    """A tiny architecture: how to build its config, which class loads it, what input it takes."""

    name: str
    auto_class: str
    make_config: Callable[[], Any]
    make_vision_input: Callable[[Any, torch.Generator], dict[str, torch.Tensor]]
    vision_path: str
    """Attribute path of the vision tower (or whole model for vision-only models)."""


def _qwen_vl_input(config: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    vision = config.vision_config
    patch, tps, merge = vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
    grid = torch.tensor([[1, 2 * merge, 2 * merge]])
    rows = int(grid.prod())
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
    pixels = torch.randn(rows, channels * tps * patch * patch, generator=gen)
    return {"hidden_states": pixels, "grid_thw": grid}


def _video_input(config: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    frames: Any = getattr(config, "num_frames", None) or getattr(config, "frames_per_clip", 4)
    size: Any = getattr(config, "image_size", None) or getattr(config, "crop_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels: Any = getattr(config, "num_channels", None) or getattr(config, "in_chans", 3)
    return {"pixel_values": torch.randn(2, int(frames), int(channels), int(size), int(size), generator=gen)}


def _vjepa2_input(config: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values_videos": _video_input(config, gen)["pixel_values"]}


def _vivit_input(config: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    size = config.image_size
    return {"pixel_values": torch.randn(2, config.num_frames, config.num_channels, size, size, generator=gen)}


def _import(name: str) -> Any:
    import transformers

    return getattr(transformers, name, None)


def _qwen2_vl() -> Any:
    cls = _import("Qwen2VLConfig")
    return cls and cls(
        text_config=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, in_channels=3,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2),
        vision_start_token_id=3, vision_end_token_id=4, image_token_id=5, video_token_id=6,
    )


def _qwen2_5_vl() -> Any:
    cls = _import("Qwen2_5_VLConfig")
    return cls and cls(
        text_config=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
                           window_size=56, fullatt_block_indexes=[1]),
        vision_start_token_id=3, vision_end_token_id=4, image_token_id=5, video_token_id=6,
    )


def _qwen3_vl() -> Any:
    cls = _import("Qwen3VLConfig")
    return cls and cls(
        text_config=dict(_TEXT, head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
                           num_position_embeddings=64, deepstack_visual_indexes=[1]),
        vision_start_token_id=3, vision_end_token_id=4, image_token_id=5, video_token_id=6,
    )


def _glm4v() -> Any:
    cls = _import("Glm4vConfig")
    return cls and cls(
        text_config=dict(
            _TEXT, rope_scaling={"type": "default", "mrope_section": [1, 1, 0]}, partial_rotary_factor=0.5
        ),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
                           image_size=56),
        image_start_token_id=3, image_end_token_id=4, image_token_id=5, video_token_id=6,
        video_start_token_id=7, video_end_token_id=8,
    )


def _videomae() -> Any:
    cls = _import("VideoMAEConfig")
    return cls and cls(image_size=32, patch_size=16, num_channels=3, num_frames=4, tubelet_size=2, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _vivit() -> Any:
    cls = _import("VivitConfig")
    return cls and cls(image_size=32, num_frames=4, tubelet_size=[2, 16, 16], num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _vjepa2() -> Any:
    cls = _import("VJEPA2Config")
    return cls and cls(crop_size=32, frames_per_clip=4, patch_size=16, tubelet_size=2, in_chans=3, hidden_size=48,
                       num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0, pred_hidden_size=48,
                       pred_num_hidden_layers=1, pred_num_attention_heads=2, pred_num_mask_tokens=2)


TINY_MODELS: dict[str, TinyModel] = {
    "qwen2_vl": TinyModel("qwen2_vl", "AutoModelForImageTextToText", _qwen2_vl, _qwen_vl_input, "model.visual"),
    "qwen2_5_vl": TinyModel("qwen2_5_vl", "AutoModelForImageTextToText", _qwen2_5_vl, _qwen_vl_input, "model.visual"),
    "qwen3_vl": TinyModel("qwen3_vl", "AutoModelForImageTextToText", _qwen3_vl, _qwen_vl_input, "model.visual"),
    "glm4v": TinyModel("glm4v", "AutoModelForImageTextToText", _glm4v, _qwen_vl_input, "model.visual"),
    "videomae": TinyModel("videomae", "AutoModel", _videomae, _video_input, ""),
    "vivit": TinyModel("vivit", "AutoModel", _vivit, _vivit_input, ""),
    "vjepa2": TinyModel("vjepa2", "AutoModel", _vjepa2, _vjepa2_input, "encoder"),
}


def auto_class(tiny: TinyModel | TinyTextModel) -> Any:
    import transformers

    return getattr(transformers, tiny.auto_class)


def save_tiny_model(tiny: TinyModel | TinyTextModel, directory: str | Path, seed: int = 0,
                    dtype: torch.dtype | None = None, **save_kwargs: Any) -> Any:
    """Build ``tiny`` with random weights (seeded), save it with ``save_pretrained``, return the model."""
    config = tiny.make_config()
    if config is None:
        raise LookupError(f"transformers {_version()} has no {tiny.name}")
    torch.manual_seed(seed)
    model = auto_class(tiny).from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    model.save_pretrained(directory, **save_kwargs)
    return model


def _version() -> str:
    import transformers

    return str(transformers.__version__)


# -- text-only decoder models (the qkv and gate_up families) ---------------------------------


@dataclass(frozen=True)
class TinyTextModel:
    """A tiny decoder-only language model: its config factory and the class that loads it."""

    name: str
    auto_class: str
    make_config: Callable[[], Any]


def _text_config(class_name: str, **overrides: Any) -> Callable[[], Any]:
    def make() -> Any:
        cls = _import(class_name)
        return cls and cls(**dict(_TEXT, **overrides))

    return make


TEXT_MODELS: dict[str, TinyTextModel] = {
    "llama": TinyTextModel("llama", "AutoModelForCausalLM", _text_config("LlamaConfig")),
    "llama_bias": TinyTextModel(
        "llama_bias", "AutoModelForCausalLM", _text_config("LlamaConfig", attention_bias=True, mlp_bias=True)
    ),
    "mistral": TinyTextModel("mistral", "AutoModelForCausalLM", _text_config("MistralConfig", head_dim=8)),
    "qwen2": TinyTextModel("qwen2", "AutoModelForCausalLM", _text_config("Qwen2Config")),
    "qwen3": TinyTextModel("qwen3", "AutoModelForCausalLM", _text_config("Qwen3Config", head_dim=8)),
    "gemma": TinyTextModel(
        "gemma", "AutoModelForCausalLM", _text_config("GemmaConfig", head_dim=8, hidden_act="gelu_pytorch_tanh")
    ),
}


def _moe_config(class_name: str, **overrides: Any) -> Callable[[], Any]:
    return _text_config(class_name, num_experts_per_tok=2, **overrides)


MOE_MODELS: dict[str, TinyTextModel] = {
    "mixtral": TinyTextModel("mixtral", "AutoModelForCausalLM", _moe_config("MixtralConfig", num_local_experts=4,
                                                                            head_dim=8)),
    "qwen2_moe": TinyTextModel(
        "qwen2_moe", "AutoModelForCausalLM",
        _moe_config("Qwen2MoeConfig", num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                    decoder_sparse_step=1),
    ),
    "olmoe": TinyTextModel("olmoe", "AutoModelForCausalLM", _moe_config("OlmoeConfig", num_experts=4)),
}

ALL_TINY_MODELS: dict[str, TinyModel | TinyTextModel] = {**TINY_MODELS, **TEXT_MODELS, **MOE_MODELS}
"""Every tiny model by name: what the kit's ``model`` arguments and ``fusion_tiny_checkpoint`` accept."""


def tiny_model(name: str) -> TinyModel | TinyTextModel:
    """The tiny model called ``name``; ``KeyError`` listing every name otherwise."""
    try:
        return ALL_TINY_MODELS[name]
    except KeyError:
        raise KeyError(f"no tiny model {name!r}; tiny models: {', '.join(ALL_TINY_MODELS)}") from None
