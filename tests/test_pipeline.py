"""End to end on tiny real models: fused load, numerical equivalence, exact round trip, plain reload.

Every model is built from its real transformers config class, saved with ``save_pretrained``
and loaded back through the pipeline, on whichever transformers this environment has
(``scripts/test.sh`` runs the suite on 4.57.x and on the newest 5.x).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from fusion_patch_embeddings.family import PatchLinearMixin
from safetensors import safe_open

import fusion_core
from fusion_core.compare import checkpoint_tensors
from fusion_core.testing.kit import TOLERANCES
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

PATCH = {"patch_embeddings": True}
ALL_MODELS = list(TINY_MODELS)


def _output(model: torch.nn.Module, tiny, inputs) -> torch.Tensor:
    tower = model.get_submodule(tiny.vision_path) if tiny.vision_path else model
    with torch.no_grad():
        out = tower(**inputs)
    if isinstance(out, torch.Tensor):
        return out
    return out[0]


def _inputs(tiny, model, dtype=torch.float32):
    inputs = tiny.make_vision_input(model.config, torch.Generator().manual_seed(0))
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}




def _patch_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Conv3d)]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_fused_load_is_equivalent_and_clean(name, tiny_checkpoint):
    directory, reference = tiny_checkpoint(name)
    tiny = TINY_MODELS[name]
    model, info = fusion_core.from_pretrained(auto_class(tiny), directory, fusion_config=PATCH,
                                              output_loading_info=True)
    convs = _patch_modules(model)
    assert convs and all(isinstance(m, PatchLinearMixin) for m in convs)
    assert all(m.weight.dim() == 2 for m in convs)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    inputs = _inputs(tiny, reference)
    expected, got = _output(reference, tiny, inputs), _output(model, tiny, inputs)
    assert (expected - got).abs().max() <= TOLERANCES[torch.float32] * (expected.abs().max() + 1)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_bfloat16_load_is_equivalent(name, tiny_checkpoint):
    directory, reference = tiny_checkpoint(name)
    tiny = TINY_MODELS[name]
    model = fusion_core.from_pretrained(auto_class(tiny), directory, fusion_config=PATCH, dtype=torch.bfloat16)
    plain = auto_class(tiny).from_pretrained(directory, dtype=torch.bfloat16)
    conv = _patch_modules(model)[0]
    assert isinstance(conv, PatchLinearMixin) and conv.weight.dtype == torch.bfloat16
    inputs = _inputs(tiny, reference, torch.bfloat16)
    expected, got = _output(plain, tiny, inputs).float(), _output(model, tiny, inputs).float()
    assert (expected - got).abs().max() <= TOLERANCES[torch.bfloat16] * (expected.abs().max() + 1)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_save_reproduces_the_source_checkpoint_exactly(name, tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint(name)
    tiny = TINY_MODELS[name]
    model = fusion_core.from_pretrained(auto_class(tiny), directory, fusion_config=PATCH)
    fusion_core.save_pretrained(model, tmp_path / "out")
    for file in directory.glob("*.safetensors"):
        assert (tmp_path / "out" / file.name).read_bytes() == file.read_bytes(), file.name
    source, saved = checkpoint_tensors(directory), checkpoint_tensors(tmp_path / "out")
    assert list(source) == list(saved)
    for key in source:
        assert source[key].dtype == saved[key].dtype and torch.equal(source[key], saved[key]), key


@pytest.mark.parametrize("name", ["qwen2_vl", "videomae"])
def test_plain_model_save_pretrained_writes_original_layout(name, tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint(name)
    model = fusion_core.from_pretrained(auto_class(TINY_MODELS[name]), directory, fusion_config=PATCH)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "vivit"])
def test_saved_directory_loads_with_plain_transformers_silently(name, tiny_checkpoint, tmp_path, caplog):
    directory, reference = tiny_checkpoint(name)
    tiny = TINY_MODELS[name]
    model = fusion_core.from_pretrained(auto_class(tiny), directory, fusion_config=PATCH)
    fusion_core.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "fusion_config" not in config and config["fusion_core"] == {"fusion_config": PATCH}
    import transformers

    transformers.logging.set_verbosity_warning()
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            plain, info = auto_class(tiny).from_pretrained(tmp_path, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity_error()
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert not [w for w in caught if "fusion" in str(w.message).lower()]
    assert not [r for r in caplog.records if "fusion" in r.getMessage().lower() or "missing" in r.getMessage().lower()]
    assert all(type(m) is torch.nn.Conv3d for m in _patch_modules(plain))
    inputs = _inputs(tiny, reference)
    assert torch.equal(_output(plain, tiny, inputs), _output(reference, tiny, inputs))


def test_stored_fusion_config_is_reused_and_explicit_wins(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("qwen2_vl")
    cls = auto_class(TINY_MODELS["qwen2_vl"])
    fusion_core.save_pretrained(fusion_core.from_pretrained(cls, directory, fusion_config=PATCH), tmp_path)
    again = fusion_core.from_pretrained(cls, tmp_path)
    assert isinstance(_patch_modules(again)[0], PatchLinearMixin)
    plain = fusion_core.from_pretrained(cls, tmp_path, fusion_config={"patch_embeddings": False})
    assert type(_patch_modules(plain)[0]) is torch.nn.Conv3d
    assert fusion_core.get_fusion_plan(plain) is None


def test_top_level_fusion_config_is_read_but_never_reaches_transformers(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("qwen2_vl")
    target = tmp_path / "legacy"
    target.mkdir()
    for file in directory.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["fusion_config"] = PATCH
    (target / "config.json").write_text(json.dumps(config))
    model = fusion_core.from_pretrained(auto_class(TINY_MODELS["qwen2_vl"]), target)
    assert isinstance(_patch_modules(model)[0], PatchLinearMixin)
    assert not hasattr(model.config, "fusion_config")
    fusion_core.save_pretrained(model, tmp_path / "saved")
    assert "fusion_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())


def test_sharded_checkpoint_round_trip(tiny_checkpoint, tmp_path):
    directory, reference = tiny_checkpoint("qwen2_vl", max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    tiny = TINY_MODELS["qwen2_vl"]
    model = fusion_core.from_pretrained(auto_class(tiny), directory, fusion_config=PATCH)
    assert isinstance(_patch_modules(model)[0], PatchLinearMixin)
    fusion_core.save_pretrained(model, tmp_path / "out", max_shard_size="20KB")
    for file in directory.glob("*.safetensors"):
        assert (tmp_path / "out" / file.name).read_bytes() == file.read_bytes(), file.name
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"] == index
    inputs = _inputs(tiny, reference)
    assert torch.allclose(_output(model, tiny, inputs), _output(reference, tiny, inputs), atol=1e-4)


def test_fused_layout_save_loads_back_without_conversion_and_plain_refuses(tiny_checkpoint, tmp_path):
    directory, reference = tiny_checkpoint("qwen2_vl")
    tiny = TINY_MODELS["qwen2_vl"]
    cls = auto_class(tiny)
    model = fusion_core.from_pretrained(cls, directory, fusion_config=PATCH)
    fused_dir = tmp_path / "fused"
    fusion_core.save_pretrained(model, fused_dir, save_original_format=False)
    assert not (fused_dir / "config.json").exists()
    assert json.loads((fused_dir / "fused_config.json").read_text())["fusion_core"]["layout"] == "fused"
    with safe_open(str(fused_dir / "model.safetensors"), "pt") as handle:
        key = _stored_key(directory, "visual.patch_embed.proj.weight")
        assert handle.get_slice(key).get_shape() == [32, 3 * 2 * 14 * 14]
    with pytest.raises((OSError, ValueError), match="config.json"):
        cls.from_pretrained(fused_dir)
    again = fusion_core.from_pretrained(cls, fused_dir)
    inputs = _inputs(tiny, reference)
    assert torch.allclose(_output(again, tiny, inputs), _output(reference, tiny, inputs), atol=1e-4)
    fusion_core.save_pretrained(again, tmp_path / "original")
    assert (tmp_path / "original" / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()
    with pytest.raises(fusion_core.CheckpointError, match="fused-layout checkpoint"):
        fusion_core.from_pretrained(cls, fused_dir, fusion_config={"patch_embeddings": False})


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}])
def test_device_map_is_honoured(device_map, tiny_checkpoint):
    pytest.importorskip("accelerate")
    directory, reference = tiny_checkpoint("qwen3_vl")
    tiny = TINY_MODELS["qwen3_vl"]
    model = fusion_core.from_pretrained(auto_class(tiny), directory, fusion_config=PATCH, device_map=device_map)
    conv = _patch_modules(model)[0]
    assert isinstance(conv, PatchLinearMixin) and conv.weight.device.type == "cpu"
    inputs = _inputs(tiny, reference)
    assert torch.allclose(_output(model, tiny, inputs), _output(reference, tiny, inputs), atol=1e-4)


def test_concrete_class_and_state_dict_round_trip(tiny_checkpoint):
    directory, reference = tiny_checkpoint("qwen2_vl")
    cls = type(reference)
    model = fusion_core.from_pretrained(cls, directory, fusion_config=PATCH)
    assert type(model) is cls
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for key, tensor in reference.state_dict().items():
        assert torch.equal(state[key], tensor), key
    model.load_state_dict(state)
    with fusion_core.fused_layout():
        fused_state = model.state_dict()
    key = next(k for k in fused_state if k.endswith("patch_embed.proj.weight"))
    assert fused_state[key].dim() == 2


def test_nothing_to_fuse_is_an_error_naming_the_family(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(fusion_core.DiscoveryError, match="family 'patch_embeddings'.*found nothing to fuse"):
        fusion_core.from_pretrained(AutoModelForCausalLM, tmp_path, fusion_config=PATCH)


def test_exclude_modules_option_is_honoured(tiny_checkpoint):
    directory, _ = tiny_checkpoint("qwen2_vl")
    cls = auto_class(TINY_MODELS["qwen2_vl"])
    with pytest.raises(fusion_core.DiscoveryError, match=r"\d+ passed the name patterns, none is fusable"):
        fusion_core.from_pretrained(cls, directory, fusion_config={"patch_embeddings": {"exclude_modules": ["visual"]}})
    model = fusion_core.from_pretrained(
        cls, directory, fusion_config={"patch_embeddings": {"target_modules": ["patch_embed\\.proj$"]}}
    )
    assert [m.path for m in fusion_core.get_fusion_plan(model).modules] == ["model.visual.patch_embed.proj"]


def _stored_key(directory: Path, leaf: str) -> str:
    """The checkpoint's own key ending in ``leaf``: most releases save Qwen2-VL's tower as ``visual.``, some 5.x
    minors (5.4.0) under its runtime name ``model.visual.``."""
    [key] = [k for k in checkpoint_tensors(directory) if k == leaf or k.endswith("." + leaf)]
    return key


def _rewrite_tensor(source: Path, target: Path, key: str, tensor: torch.Tensor | None) -> None:
    """Copy a single-file checkpoint, replacing (or dropping, for None) one tensor."""
    from safetensors.torch import save_file

    target.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    tensors = checkpoint_tensors(source)
    if tensor is None:
        del tensors[key]
    else:
        tensors[key] = tensor
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w: w[:, :, :1].contiguous(), r"has shape \[32, 3, 1, 14, 14\], expected \[32, 3, 2, 14, 14\]"),
        (lambda w: (w * 100).to(torch.int32), "is stored as I32; a floating-point dtype is expected"),
    ],
    ids=["shape", "dtype"],
)
def test_bad_fused_tensor_raises_naming_key_module_and_family(change, message, tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("qwen2_vl")
    key = _stored_key(directory, "visual.patch_embed.proj.weight")
    _rewrite_tensor(directory, tmp_path / "bad", key, change(checkpoint_tensors(directory)[key]))
    with pytest.raises(fusion_core.CheckpointError, match=message) as info:
        fusion_core.from_pretrained(auto_class(TINY_MODELS["qwen2_vl"]), tmp_path / "bad", fusion_config=PATCH)
    assert "family 'patch_embeddings', module 'model.visual.patch_embed.proj'" in str(info.value)


def test_missing_fused_tensor_raises_naming_key_module_and_family(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("qwen2_vl")
    _rewrite_tensor(directory, tmp_path / "bad", _stored_key(directory, "visual.patch_embed.proj.weight"), None)
    missing = r"missing key '(model\.)?visual.patch_embed.proj.weight'"
    with pytest.raises(fusion_core.FusionLoadError, match=missing) as info:
        fusion_core.from_pretrained(auto_class(TINY_MODELS["qwen2_vl"]), tmp_path / "bad", fusion_config=PATCH)
    assert "family 'patch_embeddings', module 'model.visual.patch_embed.proj'" in str(info.value)


def test_extra_tensor_in_a_fused_module_raises(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("qwen2_vl")
    key = _stored_key(directory, "visual.patch_embed.proj.weight").removesuffix("weight") + "scale"
    _rewrite_tensor(directory, tmp_path / "bad", key, torch.ones(32))
    with pytest.raises(fusion_core.CheckpointError, match=f"unexpected tensor '{key}'"):
        fusion_core.from_pretrained(auto_class(TINY_MODELS["qwen2_vl"]), tmp_path / "bad", fusion_config=PATCH)


def test_torch_dtype_keyword_is_passed_through(tiny_checkpoint):
    directory, _ = tiny_checkpoint("glm4v")
    model = fusion_core.from_pretrained(auto_class(TINY_MODELS["glm4v"]), directory, fusion_config=PATCH,
                                        torch_dtype=torch.bfloat16)
    conv = _patch_modules(model)[0]
    assert isinstance(conv, PatchLinearMixin) and conv.weight.dtype == torch.bfloat16


def _tiny_omni_config():
    """A tiny Qwen2.5-Omni (thinker with vision and audio, talker, token2wav), or None without the class."""
    import transformers

    config_cls = getattr(transformers, "Qwen2_5OmniConfig", None)
    if config_cls is None:
        return None
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2]}
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rope_scaling=rope)
    return config_cls(
        thinker_config=dict(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                               fullatt_block_indexes=[0], patch_size=14, temporal_patch_size=2,
                               spatial_merge_size=2, window_size=28),
            audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64,
                              num_mel_bins=16, output_dim=32, n_window=4, max_source_positions=64),
        ),
        talker_config=dict(text, text_vocab_size=128, embedding_size=32, head_dim=8),
        token2wav_config=dict(
            dit_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ff_mult=1, emb_dim=16,
                            head_dim=16, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 32],
                            enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
                            enc_attention_channels=8, enc_res2net_scale=2, enc_se_channels=8, mel_dim=16,
                            repeats=1, num_embeds=32, look_ahead_layers=[0], look_backward_layers=[0]),
            bigvgan_config=dict(mel_dim=16, upsample_initial_channel=32, resblock_kernel_sizes=[3],
                                resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2], upsample_kernel_sizes=[4]),
        ),
    )


def test_a_model_class_whose_own_from_pretrained_uses_the_model_loads_fused(tmp_path):
    """Qwen2.5-Omni's from_pretrained calls ``load_speakers`` on what the base class returns: fusion-core
    must not turn that into a tuple (``output_loading_info=True``) yet still check the loading report."""
    import transformers

    config = _tiny_omni_config()
    if config is None:
        pytest.skip("this transformers has no Qwen2.5-Omni")
    omni = transformers.Qwen2_5OmniForConditionalGeneration
    torch.manual_seed(0)
    try:
        unfused = omni(config)
    except AttributeError as exc:  # transformers 5.0: the talker config lacks pad_token_id
        pytest.skip(f"transformers {transformers.__version__} cannot build Qwen2.5-Omni unfused: {exc}")
    unfused.save_pretrained(tmp_path)
    torch.save({"Chelsie": {"cond": torch.zeros(1)}}, tmp_path / "spk_dict.pt")
    plain = omni.from_pretrained(tmp_path)
    model, info = fusion_core.from_pretrained(omni, tmp_path, fusion_config=PATCH, output_loading_info=True)
    assert type(model) is omni and "Chelsie" in model.speaker_map  # the class's own from_pretrained ran to the end
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    path = next(name for name, _ in plain.named_modules() if name.endswith("visual.patch_embed"))
    fused, original = model.get_submodule(path), plain.get_submodule(path)
    assert isinstance(fused.proj, PatchLinearMixin)
    pixels = torch.randn(4, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = original(pixels), fused(pixels)
    assert (expected - got).abs().max() <= TOLERANCES[torch.float32] * (expected.abs().max() + 1)
