"""Reliability: concurrent fused and plain loads of real tiny models stay apart.

8 threads start together (a barrier) and load the same class, some fused and some plain; every fused
model must be fused, every plain one plain, every output right, and no class patch may remain.
transformers 4.57's own loading is not thread-safe (``init_empty_weights`` patches
``nn.Module.register_parameter`` for the whole process), so on 4.57 the plain loads go through
``fusion_core.from_pretrained`` without a ``fusion_config``, which serializes with the fused loads;
on 5.x they call transformers directly. See tests/test_instances.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from fusion_patch_embeddings.family import PatchLinearMixin

import fusion_core
from fusion_core.patching import installed_classes
from fusion_core.testing.tiny_models import TINY_MODELS, auto_class

PATCH = {"patch_embeddings": True}
TF5 = int(transformers.__version__.split(".")[0]) >= 5


def _plain(cls, directory):
    return cls.from_pretrained(directory) if TF5 else fusion_core.from_pretrained(cls, directory)


def _run_threads(n, work):
    barrier = threading.Barrier(n)
    results: dict[int, object] = {}

    def run(index):
        barrier.wait()
        try:
            results[index] = work(index)
        except BaseException as exc:  # reported per thread below
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def _vision_output(model, inputs):
    with torch.no_grad():
        out = model.model.visual(**inputs)
    return out if isinstance(out, torch.Tensor) else out[0]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_eight_threads_fused_and_plain_of_the_same_class(name, tiny_checkpoint):
    directory, reference = tiny_checkpoint(name)
    tiny = TINY_MODELS[name]
    cls = auto_class(tiny)
    inputs = tiny.make_vision_input(reference.config, torch.Generator().manual_seed(0))
    expected = _vision_output(reference, inputs)
    fusion_core.discovery.clear_cache()  # the threads race to discover, too

    def work(index):
        fused = index % 2
        model = fusion_core.from_pretrained(cls, directory, fusion_config=PATCH) if fused else _plain(cls, directory)
        return model, _vision_output(model, inputs)

    results = _run_threads(8, work)
    assert sorted(results) == list(range(8))
    for index, result in sorted(results.items()):
        assert not isinstance(result, BaseException), f"thread {index}: {result!r}"
        model, output = result
        proj = model.model.visual.patch_embed.proj
        if index % 2:
            assert isinstance(proj, PatchLinearMixin) and proj.weight.dim() == 2, index
            assert fusion_core.get_fusion_plan(model) is not None
        else:
            assert type(proj) is torch.nn.Conv3d and proj.weight.dim() == 5, index
            assert fusion_core.get_fusion_plan(model) is None
        assert all(not p.is_meta for p in model.parameters()), index
        assert torch.allclose(output, expected, rtol=1e-4, atol=1e-4), index
    assert installed_classes() == []
    assert type(_plain(cls, directory).model.visual.patch_embed.proj) is torch.nn.Conv3d


def test_failing_fused_loads_among_good_ones_leave_no_patch(tiny_checkpoint, tmp_path):
    """Half the fused loads hit a truncated checkpoint: they fail alone, the others are right."""
    directory, reference = tiny_checkpoint("qwen2_vl")
    cls = auto_class(TINY_MODELS["qwen2_vl"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((directory / "config.json").read_bytes())
    data = (directory / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:-100])
    inputs = TINY_MODELS["qwen2_vl"].make_vision_input(reference.config, torch.Generator().manual_seed(0))
    expected = _vision_output(reference, inputs)

    def work(index):
        if index % 2:
            return fusion_core.from_pretrained(cls, broken, fusion_config=PATCH)
        return fusion_core.from_pretrained(cls, directory, fusion_config=PATCH)

    results = _run_threads(8, work)
    for index, result in sorted(results.items()):
        if index % 2:
            assert isinstance(result, fusion_core.CheckpointError), f"thread {index}: {result!r}"
        else:
            assert not isinstance(result, BaseException), f"thread {index}: {result!r}"
            assert torch.allclose(_vision_output(result, inputs), expected, rtol=1e-4, atol=1e-4)
    assert installed_classes() == []


def test_threads_with_different_fusion_configs_get_their_own(tiny_checkpoint):
    """Same class, same checkpoint, different options per thread: each model follows its own config."""
    directory, _ = tiny_checkpoint("qwen2_vl")
    cls = auto_class(TINY_MODELS["qwen2_vl"])
    configs = [
        PATCH,
        {"patch_embeddings": {"target_modules": ["patch_embed"]}},
        {"patch_embeddings": False},
        None,
    ]

    def work(index):
        return fusion_core.from_pretrained(cls, directory, fusion_config=configs[index % 4])

    results = _run_threads(8, work)
    for index, model in sorted(results.items()):
        assert not isinstance(model, BaseException), f"thread {index}: {model!r}"
        fused = isinstance(model.model.visual.patch_embed.proj, PatchLinearMixin)
        assert fused is (index % 4 in (0, 1)), index
    assert installed_classes() == []


def test_discover_holds_the_load_lock_whoever_calls_it(tiny_checkpoint, monkeypatch):
    """fusion plan, fusion convert and the kit call discover() directly: its meta build (which may patch
    nn.Module.register_parameter for the whole process) must still run under the load lock."""
    from fusion_core import discovery
    from fusion_core.patching import LOAD_LOCK

    held: list[bool] = []
    real_build = discovery.build_meta_model

    def build(*args, **kwargs):
        held.append(LOAD_LOCK._is_owned())
        return real_build(*args, **kwargs)

    monkeypatch.setattr(discovery, "build_meta_model", build)
    tiny = TINY_MODELS["qwen2_vl"]
    discovery.discover(auto_class(tiny), tiny.make_config(), fusion_core.parse_fusion_config(PATCH))
    assert held == [True]
    assert not LOAD_LOCK._is_owned()


def test_the_loading_report_capture_is_gone_after_every_load(tiny_checkpoint, monkeypatch):
    """The loading report is taken by wrapping transformers' _load_pretrained_model for the load only."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["_load_pretrained_model"]
    directory, _ = tiny_checkpoint("qwen2_vl")
    cls = auto_class(TINY_MODELS["qwen2_vl"])
    fusion_core.from_pretrained(cls, directory, fusion_config=PATCH)
    assert PreTrainedModel.__dict__["_load_pretrained_model"] is original

    def broken(*args, **kwargs):
        raise RuntimeError("transformers failed")

    failing = type(original)(broken)  # staticmethod on 5.x, classmethod on 4.57
    monkeypatch.setattr(PreTrainedModel, "_load_pretrained_model", failing)
    with pytest.raises(RuntimeError, match="transformers failed"):
        fusion_core.from_pretrained(cls, directory, fusion_config=PATCH)
    assert PreTrainedModel.__dict__["_load_pretrained_model"] is failing


def _in_other_thread(inside, other):
    """Run ``other()`` in a second thread while this thread is inside the context manager ``inside``."""
    result: dict[str, object] = {}

    def run():
        try:
            result["value"] = other()
        except BaseException as exc:
            result["error"] = exc

    with inside:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]


def test_discovery_building_on_meta_leaves_modules_other_threads_build_alone():
    """Discovery's fallback registers parameters on the meta device; a module another thread builds meanwhile
    gets real parameters, and one built in discovery's own context gets meta ones."""
    from fusion_core.discovery import _parameters_on_meta

    built = _in_other_thread(_parameters_on_meta(), lambda: torch.nn.Linear(16, 16))
    assert not any(p.is_meta for p in built.parameters())
    with _parameters_on_meta():
        assert all(p.is_meta for p in torch.nn.Linear(16, 16).parameters())
    assert not any(p.is_meta for p in torch.nn.Linear(16, 16).parameters())


def test_a_patch_another_library_makes_meanwhile_is_never_undone_by_discovery():
    """Code that patches nn.Module.register_parameter while discovery builds (transformers 4.57's
    init_empty_weights, in a plain load on another thread) keeps its patch until it restores it itself."""
    from fusion_core.discovery import _parameters_on_meta
    from fusion_core.patching import construction_order

    for attribute, scope in (("register_parameter", _parameters_on_meta), ("__init__", construction_order)):
        before = getattr(torch.nn.Module, attribute)
        theirs_seen = []
        inside = scope()
        inside.__enter__()
        saved = getattr(torch.nn.Module, attribute)

        def theirs(*args, _saved=saved, **kwargs):
            return _saved(*args, **kwargs)

        setattr(torch.nn.Module, attribute, theirs)  # the other library's patch
        inside.__exit__(None, None, None)  # discovery ends while the other patch is active
        theirs_seen.append(getattr(torch.nn.Module, attribute) is theirs)
        setattr(torch.nn.Module, attribute, saved)  # the other library restores what it saw
        assert theirs_seen == [True], attribute
        assert not any(p.is_meta for p in torch.nn.Linear(4, 4).parameters())
        assert getattr(torch.nn.Module, attribute) in (before, saved)
