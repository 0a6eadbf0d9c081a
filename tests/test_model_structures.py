"""Model structures that pair keys or instances by position: towers sharing a suffix, modules built then replaced.

- Two towers of one model both have ``layers.N.self_attn``. Checkpoint keys are matched to the
  model by the renaming transformers itself loads with (base-model prefix, ``key_mapping``, 5.x
  weight conversions), never by the shared suffix, which paired one tower's module with the
  other tower's tensors (lfm3_vl, unlimited_ocr).
- A decoder layer that builds an attention module in ``__init__`` and then replaces it (MiniMax)
  constructs instances that never reach the model; the one that does is fused.

Each case runs on a synthetic model (both transformers lines) and on the tiny real architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from fusion_qkv import QkvMixin
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

import fusion_core

OPTIONAL = {"qkv": {"required": False}, "gate_up": {"required": False}}


class TowersConfig(PretrainedConfig):
    model_type = "fusion_core_test_towers"

    def __init__(self, vision_width: int = 64, text_width: int = 32, rebuild: bool = False, **kwargs: Any) -> None:
        self.vision_width = vision_width
        self.text_width = text_width
        self.rebuild = rebuild
        super().__init__(**kwargs)


class Attention(nn.Module):
    """q/k/v (k and v half as wide), a norm on q, an optional output gate the other tower lacks."""

    def __init__(self, width: int, gated: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width // 2)
        self.v_proj = nn.Linear(width, width // 2)
        self.q_norm = nn.LayerNorm(width)
        self.gate_proj = nn.Linear(width, width) if gated else None
        self.o_proj = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(torch.cat([self.q_norm(self.q_proj(x)), self.k_proj(x), self.v_proj(x)], -1))
        return out * torch.sigmoid(self.gate_proj(x)) if self.gate_proj is not None else out


class Mixer(nn.Module):
    """What replaces the attention of every other layer in a rebuilding model."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Layer(nn.Module):
    def __init__(self, width: int, gated: bool, index: int, rebuild: bool) -> None:
        super().__init__()
        self.self_attn: nn.Module = Attention(width, gated)
        if rebuild:  # MiniMax's decoder layer: an attention module first, then the one its layer type needs
            self.self_attn = Mixer(width) if index % 2 == 0 else Attention(width, gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(x)


class Tower(nn.Module):
    def __init__(self, width: int, gated: bool, rebuild: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(width, gated, i, rebuild) for i in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TowersModel(PreTrainedModel):
    """A vision tower and a text tower whose attention modules share the suffix ``layers.N.self_attn``."""

    config_class = TowersConfig

    def __init__(self, config: TowersConfig) -> None:
        super().__init__(config)
        self.vision = Tower(config.vision_width, gated=False, rebuild=config.rebuild)
        self.text = Tower(config.text_width, gated=True, rebuild=config.rebuild)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            nn.init.normal_(module.weight)
            nn.init.normal_(module.bias)

    def forward(self, vision: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.vision(vision), self.text(text)


def _inputs(config: TowersConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"vision": torch.randn(2, 3, config.vision_width, generator=gen),
            "text": torch.randn(2, 3, config.text_width, generator=gen)}


def _save_towers(directory: Path, rebuild: bool = False) -> TowersModel:
    torch.manual_seed(0)
    model = TowersModel(TowersConfig(rebuild=rebuild)).eval()
    model.save_pretrained(directory)
    return model


def _fused(model: nn.Module, mixin: type) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, mixin)]


# (how the vision tower's tensors are stored, the key_mapping that loads them, what today's suffix match did)
RENAMES = {
    # a leaf only the text tower still holds under its model name: paired with it, the gate is "unexpected"
    "renamed_norm": ("self_attn.q_norm.", "self_attn.q_layernorm.", {r"q_layernorm": "q_norm"}),
    # a fused tensor only the text tower holds under its model name: paired with it, its shape is "wrong"
    "renamed_projection": ("self_attn.k_proj.", "self_attn.key.", {r"\.key\.": ".k_proj."}),
}


@pytest.mark.parametrize("case", list(RENAMES))
def test_towers_sharing_a_suffix_are_matched_by_transformers_own_renaming(case, tmp_path):
    old, new, key_mapping = RENAMES[case]
    reference = _save_towers(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({k.replace(old, new) if k.startswith("vision.") else k: v for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
    _, info = TowersModel.from_pretrained(tmp_path, key_mapping=key_mapping, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    model = fusion_core.from_pretrained(TowersModel, tmp_path, OPTIONAL, key_mapping=key_mapping)
    assert _fused(model, QkvMixin) == [f"{tower}.layers.{i}.self_attn" for tower in ("vision", "text")
                                       for i in range(2)]
    inputs = _inputs(reference.config)
    with torch.no_grad():
        for expected, got in zip(reference(**inputs), model(**inputs), strict=True):
            torch.testing.assert_close(got, expected)


def test_a_module_built_then_replaced_in_init_is_not_fused_and_its_replacement_is(tmp_path):
    reference = _save_towers(tmp_path, rebuild=True)
    model = fusion_core.from_pretrained(TowersModel, tmp_path, OPTIONAL)
    assert _fused(model, QkvMixin) == ["vision.layers.1.self_attn", "text.layers.1.self_attn"]
    assert [m.path for m in fusion_core.get_fusion_plan(model).modules] == _fused(model, QkvMixin)
    inputs = _inputs(reference.config)
    with torch.no_grad():
        for expected, got in zip(reference(**inputs), model(**inputs), strict=True):
            torch.testing.assert_close(got, expected)
    saved = tmp_path / "saved"
    fusion_core.save_pretrained(model, saved)
    assert (saved / "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()


# -- the tiny real architectures ----------------------------------------------------------------
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _lfm3_vl() -> Any:
    return transformers.Lfm3VlConfig(
        text_config=dict(_TEXT, model_type="lfm3", head_dim=8, layer_types=["conv", "full_attention"]),
        vision_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, layer_types=["conv", "full_attention"], patch_size=4),
        projector_hidden_size=32, image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4,
    )


def _unlimited_ocr() -> Any:
    return transformers.UnlimitedOcrConfig(
        text_config=dict(_TEXT, sliding_window=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         n_shared_experts=1),
        vision_config=dict(
            sam_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2,
                            image_size=64, patch_size=16, window_size=2, global_attn_indexes=[1], mlp_dim=64,
                            downsample_channels=[32, 64]),
            encoder_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                image_size=28, patch_size=14),
        ),
        image_token_id=5,
    )


def _minimax() -> Any:
    return transformers.MiniMaxConfig(**_TEXT, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                      layer_types=["linear_attention", "full_attention"])


# name -> (config class, config factory, auto class, modules that must be fused with qkv)
REAL = {
    "lfm3_vl": ("Lfm3VlConfig", _lfm3_vl, "AutoModelForImageTextToText",
                ["model.vision_tower.layers.1.self_attn", "model.language_model.layers.1.self_attn"]),
    "unlimited_ocr": ("UnlimitedOcrConfig", _unlimited_ocr, "AutoModelForImageTextToText",
                      ["model.vision_tower.vision_encoder.encoder.layers.0.self_attn",
                       "model.language_model.layers.0.self_attn", "model.language_model.layers.1.self_attn"]),
    "minimax": ("MiniMaxConfig", _minimax, "AutoModelForCausalLM", ["model.layers.1.self_attn"]),
}


@pytest.mark.parametrize("name", list(REAL))
def test_tiny_real_architecture_loads_fused_and_computes_the_same(name, tmp_path):
    config_class, make_config, auto, expected = REAL[name]
    if getattr(transformers, config_class, None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    auto_class = getattr(transformers, auto)
    torch.manual_seed(0)
    reference = auto_class.from_config(make_config()).eval()
    reference.save_pretrained(tmp_path)
    plain, info = auto_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"], "plain transformers must load the tiny checkpoint completely"

    model = fusion_core.from_pretrained(auto_class, tmp_path, OPTIONAL).eval()
    fused = _fused(model, QkvMixin)
    assert set(expected) <= set(fused), fused
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain.eval()(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
