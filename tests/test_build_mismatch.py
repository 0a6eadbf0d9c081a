"""A model built differently at load than in discovery's meta build: required=False leaves the
modules it cannot place unfused (a warning naming each), a required family raises."""

from __future__ import annotations

import pytest
import torch
from fusion_patch_embeddings.family import PatchLinearMixin
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

import fusion_core
from fusion_core import discovery


class DriftConfig(PretrainedConfig):
    model_type = "fusion_core_test_drift"

    def __init__(self, width: int = 8, **kwargs):
        self.width = width
        super().__init__(**kwargs)


#: Set while discovery builds its meta model: the model then constructs its convolutions in another order.
META_BUILD = [False]


class DriftModel(PreTrainedModel):
    """Four Conv3d, three of them patch embeddings; ``first`` and ``second`` swap construction order
    between the meta build and the real one, the way an ``__init__`` reading a global flag would."""

    config_class = DriftConfig

    def __init__(self, config: DriftConfig):
        super().__init__(config)
        w = config.width
        if META_BUILD[0]:
            first = nn.Conv3d(3, w, kernel_size=(2, 4, 4), stride=(2, 4, 4))
            overlapping = nn.Conv3d(w, w, kernel_size=3, stride=1, padding=1)
            second = nn.Conv3d(w, w, kernel_size=(1, 2, 2), stride=(1, 2, 2), bias=False)
        else:
            second = nn.Conv3d(w, w, kernel_size=(1, 2, 2), stride=(1, 2, 2), bias=False)
            overlapping = nn.Conv3d(w, w, kernel_size=3, stride=1, padding=1)
            first = nn.Conv3d(3, w, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.first, self.overlapping, self.second = first, overlapping, second
        self.third = nn.Conv3d(w, w, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Conv3d):
            nn.init.normal_(module.weight)
            if module.bias is not None:
                nn.init.normal_(module.bias)

    def forward(self, video):
        return self.third(self.second(self.overlapping(self.first(video))))


class GatedMLP(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DriftMLPModel(PreTrainedModel):
    """Two gated MLPs of different widths, constructed in the other order in discovery's meta build."""

    config_class = DriftConfig

    def __init__(self, config: DriftConfig):
        super().__init__(config)
        w = config.width
        if META_BUILD[0]:
            first, second = GatedMLP(w, 2 * w), GatedMLP(w, 4 * w)
        else:
            second = GatedMLP(w, 4 * w)
            first = GatedMLP(w, 2 * w)
        self.first, self.second = first, second
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)

    def forward(self, x):
        return self.second(self.first(x))


@pytest.fixture(scope="module")
def drift_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("drift")
    torch.manual_seed(0)
    DriftModel(DriftConfig()).save_pretrained(directory)
    return directory


@pytest.fixture
def drifting(monkeypatch):
    """Discovery's meta build sees the other construction order."""
    build = discovery.build_meta_model

    def meta_build(*args, **kwargs):
        META_BUILD[0] = True
        try:
            return build(*args, **kwargs)
        finally:
            META_BUILD[0] = False

    monkeypatch.setattr(discovery, "build_meta_model", meta_build)


VIDEO = torch.randn(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(1))


def test_modules_built_elsewhere_than_planned_are_left_unfused_when_not_required(drift_dir, drifting, caplog):
    plain = DriftModel.from_pretrained(drift_dir).eval()
    with caplog.at_level("WARNING", logger="fusion_core"):
        model = fusion_core.from_pretrained(DriftModel, drift_dir,
                                            fusion_config={"patch_embeddings": {"required": False}}).eval()
    assert type(model.first) is nn.Conv3d and type(model.second) is nn.Conv3d
    assert isinstance(model.third, PatchLinearMixin)
    assert [m.path for m in fusion_core.get_fusion_plan(model).modules] == ["third"]
    for path, actual in (("first", "second"), ("second", "first")):
        assert (f"fusion family 'patch_embeddings': module planned at {path!r} was built at {actual!r}"
                in caplog.text)
    assert caplog.text.count("left unfused (required=False)") == 2
    with torch.no_grad():
        assert torch.allclose(model(VIDEO), plain(VIDEO), rtol=1e-4, atol=1e-4)
    expected, got = plain.state_dict(), model.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_modules_built_elsewhere_than_planned_raise_when_required(drift_dir, drifting):
    with pytest.raises(fusion_core.FusionLoadError,
                       match="family 'patch_embeddings': module planned at 'first' was built at 'second'"):
        fusion_core.from_pretrained(DriftModel, drift_dir, fusion_config={"patch_embeddings": True})


def test_modules_left_unfused_hold_what_plain_loads_when_the_load_casts(drifting, tmp_path):
    # a bf16 checkpoint loaded as float32: the gated MLPs' parts are loaded as stored for their merge
    # (fusion_core.casting); the two built where the other was planned are left unfused, cast back
    torch.manual_seed(0)
    DriftMLPModel(DriftConfig()).to(torch.bfloat16).save_pretrained(tmp_path)
    plain = DriftMLPModel.from_pretrained(tmp_path, dtype=torch.float32)
    model = fusion_core.from_pretrained(DriftMLPModel, tmp_path, fusion_config={"gate_up": {"required": False}},
                                        dtype=torch.float32)
    assert fusion_core.get_fusion_plan(model).modules == () and type(model.first) is GatedMLP
    expected, got = plain.state_dict(), model.state_dict()
    assert {t.dtype for t in got.values()} == {torch.float32}
    assert all(torch.equal(got[key], expected[key]) for key in expected)
