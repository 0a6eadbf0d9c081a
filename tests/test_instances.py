"""Instance-by-instance decisions, scoped patching and thread isolation, on a custom PreTrainedModel."""

from __future__ import annotations

import threading

import pytest
import torch
from fusion_patch_embeddings.family import PatchLinearMixin
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

import fusion_core
from fusion_core.patching import installed_classes


class TwoTowerConfig(PretrainedConfig):
    model_type = "fusion_core_test_two_tower"

    def __init__(self, width: int = 8, **kwargs):
        self.width = width
        super().__init__(**kwargs)


class TwoTowerModel(PreTrainedModel):
    """Three Conv3d: two non-overlapping patch embeddings and one overlapping conv in between."""

    config_class = TwoTowerConfig

    def __init__(self, config: TwoTowerConfig):
        super().__init__(config)
        w = config.width
        self.first = nn.Conv3d(3, w, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.overlapping = nn.Conv3d(w, w, kernel_size=3, stride=1, padding=1)
        self.second = nn.Conv3d(w, w, kernel_size=(1, 2, 2), stride=(1, 2, 2), bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Conv3d):
            nn.init.normal_(module.weight)
            if module.bias is not None:
                nn.init.normal_(module.bias)

    def forward(self, video):
        return self.second(self.overlapping(self.first(video)))


@pytest.fixture(scope="module")
def two_tower(tmp_path_factory):
    directory = tmp_path_factory.mktemp("two_tower")
    torch.manual_seed(0)
    model = TwoTowerModel(TwoTowerConfig()).eval()
    model.save_pretrained(directory)
    return directory, model


VIDEO = torch.randn(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(1))


def test_only_fusable_instances_of_a_class_are_replaced(two_tower):
    directory, reference = two_tower
    model = fusion_core.from_pretrained(TwoTowerModel, directory, fusion_config={"patch_embeddings": True})
    assert isinstance(model.first, PatchLinearMixin) and isinstance(model.second, PatchLinearMixin)
    assert type(model.overlapping) is nn.Conv3d
    with torch.no_grad():
        assert torch.allclose(model(VIDEO), reference(VIDEO), rtol=1e-4, atol=1e-4)
    assert [m.path for m in fusion_core.get_fusion_plan(model).modules] == ["first", "second"]


def test_patches_are_gone_after_load_and_after_a_failure(two_tower, tmp_path):
    directory, _ = two_tower
    fusion_core.from_pretrained(TwoTowerModel, directory, fusion_config={"patch_embeddings": True})
    assert installed_classes() == []
    assert "__init__" in nn.Conv3d.__dict__ and not getattr(nn.Conv3d.__init__, "__fusion_core_wrapper__", False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((directory / "config.json").read_text())
    data = (directory / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(fusion_core.CheckpointError, match="truncated"):
        fusion_core.from_pretrained(TwoTowerModel, broken, fusion_config={"patch_embeddings": True})
    assert installed_classes() == []
    plain = TwoTowerModel.from_pretrained(directory)
    assert all(type(m) is nn.Conv3d for m in plain.modules() if isinstance(m, nn.Conv3d))


def test_plain_construction_in_another_thread_during_a_fused_load_is_plain(two_tower, monkeypatch):
    directory, _ = two_tower
    built: list[type] = []
    original_init = TwoTowerModel.__init__

    def init_and_build_elsewhere(self, config):
        original_init(self, config)
        worker = threading.Thread(target=lambda: built.append(type(nn.Conv3d(3, 8, (2, 4, 4), (2, 4, 4)))))
        worker.start()
        worker.join()

    monkeypatch.setattr(TwoTowerModel, "__init__", init_and_build_elsewhere)
    fusion_core.discovery.clear_cache()
    model = fusion_core.from_pretrained(TwoTowerModel, directory, fusion_config={"patch_embeddings": True})
    assert isinstance(model.first, PatchLinearMixin)
    assert built and all(cls is nn.Conv3d for cls in built)


def test_plain_load_after_fused_load_is_plain(two_tower):
    directory, _ = two_tower
    fusion_core.from_pretrained(TwoTowerModel, directory, fusion_config={"patch_embeddings": True})
    plain = TwoTowerModel.from_pretrained(directory)
    assert type(plain.first) is nn.Conv3d and plain.first.weight.dim() == 5
    assert type(nn.Conv3d(3, 3, 2)) is nn.Conv3d


def _plain_load(directory):
    """A plain load in another thread. transformers 4.57's own loading is not thread-safe (it
    patches nn.Module.register_parameter process-wide), so there plain loads go through
    fusion_core, which serializes its loads; on 5.x they call transformers directly."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return fusion_core.from_pretrained(TwoTowerModel, directory)
    return TwoTowerModel.from_pretrained(directory)


def test_concurrent_fused_and_plain_loads_stay_apart(two_tower):
    directory, reference = two_tower
    with torch.no_grad():
        expected = reference(VIDEO)
    results: dict[int, object] = {}
    barrier = threading.Barrier(8)

    def load(index: int) -> None:
        barrier.wait()
        try:
            if index % 2:
                model = fusion_core.from_pretrained(TwoTowerModel, directory, fusion_config={"patch_embeddings": True})
            else:
                model = _plain_load(directory)
            with torch.no_grad():
                results[index] = (model, model(VIDEO))
        except Exception as exc:  # reported below, with the thread that failed
            results[index] = exc

    threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, result in sorted(results.items()):
        assert not isinstance(result, Exception), f"thread {index}: {result!r}"
        model, output = result
        assert isinstance(model.first, PatchLinearMixin) is bool(index % 2), index
        assert type(model.overlapping) is nn.Conv3d
        assert torch.allclose(output, expected, rtol=1e-4, atol=1e-4), index
    assert installed_classes() == []
