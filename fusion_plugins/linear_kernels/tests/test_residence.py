"""A fused load reads the dense weights ``linear_kernels`` runs at decode out of the checkpoint's file mapping into
memory the process owns (:mod:`fusion_linear_kernels.residence`): every such weight, the tied head included, and
nothing else; the same parameter objects, the same bits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fusion_linear_kernels import LinearKernelsMixin
from fusion_linear_kernels.residence import move_into_process_memory
from torch import nn
from transformers import AutoModelForCausalLM

import fusion_core
from fusion_core.plugin import merged_projection
from fusion_core.testing.tiny_models import TEXT_MODELS

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc"),
              pytest.mark.usefixtures("other_kernels_dense_weights")]


def _file_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s first byte lies in a mapping of a regular file (``/proc/self/maps``)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 checkpoints (loaded in their own dtype, transformers leaves them mapped): Llama untied, Qwen2 tied."""
    paths = {}
    for name, tied in (("llama", False), ("qwen2", True)):
        config = TEXT_MODELS[name].make_config()
        config.tie_word_embeddings = tied
        torch.manual_seed(0)
        paths[name] = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(paths[name])
    return paths


def _decode_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The fused model's linear_kernels layers and the containers of its merged projections, by path."""
    found = {path: m for path, m in model.named_modules() if isinstance(m, LinearKernelsMixin)}
    for path, module in model.named_modules():
        merged = merged_projection(module)
        if merged is not None:
            found[f"{path}.<merged>"] = merged.owner
    return found


@pytest.mark.parametrize("families", ["linear_kernels", "qkv+gate_up+linear_kernels"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_weights_decode_runs_leave_the_file_mapping_and_nothing_else_does(checkpoints: dict[str, Path],
                                                                              name: str, families: str) -> None:
    path = checkpoints[name]
    plain = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert all(_file_mapped(p) for p in plain.parameters())  # what transformers gives: the premise of the module
    fused: Any = fusion_core.from_pretrained(AutoModelForCausalLM, path, dtype="auto",
                                             fusion_config={f: True for f in families.split("+")})
    layers = _decode_layers(fused)
    assert layers and not [path for path, m in layers.items() if _file_mapped(m.weight)]
    moved = {id(p) for m in layers.values() for p in m.parameters(recurse=False)}
    # The rest stays as transformers left it (norms; the embedding table where the head is not tied to it).
    rest = [n for n, p in fused.named_parameters() if id(p) not in moved]
    assert rest and all(_file_mapped(fused.get_parameter(n)) for n in rest)
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == (name == "qwen2")
    reference = plain.state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in fused.state_dict().items())


@pytest.mark.parametrize("families", ["linear_kernels", "qkv+gate_up+linear_kernels"])
def test_exact_mode_leaves_every_weight_where_the_load_put_it(checkpoints: dict[str, Path], families: str) -> None:
    """A GEMM's bits can depend on the weight's address: on an AMD EPYC (avx512_bf16), ``F.linear`` of a float32
    32x32 weight 24 bytes past a 64-byte boundary (a view of the file mapping) differed from the same weight in an
    aligned copy, so moving it broke exact mode's bit-identical decode (the OLMoE exact-mode test failed there)."""
    path = checkpoints["llama"]
    config = {f: {"exact": True} if f == "linear_kernels" else True for f in families.split("+")}
    fused: Any = fusion_core.from_pretrained(AutoModelForCausalLM, path, dtype="auto", fusion_config=config)
    assert _decode_layers(fused)
    # Every weight but the merged q/k/v, which the merge wrote (gate/up lie back to back in the file: a view of it).
    kept = [n for n, _ in fused.named_parameters() if not n.endswith("qkv_proj.weight")]
    assert kept and [n for n in kept if not _file_mapped(fused.get_parameter(n))] == []


def test_fusing_a_plain_loaded_model_in_place_moves_its_decode_weights_too(checkpoints: dict[str, Path]) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], dtype="auto")
    head = model.lm_head.weight
    assert _file_mapped(head)
    fusion_core.fuse(model, {"linear_kernels": True})
    layers = _decode_layers(model)
    assert layers and not [path for path, m in layers.items() if _file_mapped(m.weight)]
    assert model.lm_head.weight is head is model.model.embed_tokens.weight  # moved in place: still one, still tied


def _mapped_file(tmp_path: Path, numel: int) -> torch.Tensor:
    """A float32 tensor over a private mapping of a file of its own (as transformers maps a shard)."""
    file = tmp_path / "weights.bin"
    file.write_bytes(torch.arange(numel, dtype=torch.float32).numpy().tobytes())
    storage = torch.UntypedStorage.from_file(str(file), False, numel * 4)
    return torch.empty(0).set_(storage, 0, (numel,), (1,))


def test_a_weight_whose_bytes_another_parameter_covers_stays_in_the_mapping(tmp_path: Path) -> None:
    flat = _mapped_file(tmp_path, 3 * 256)
    model = nn.Module()
    model.a, model.b, model.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
    model.a.weight = nn.Parameter(flat[:256].view(16, 16))
    model.b.weight = nn.Parameter(flat[128:384].view(16, 16))  # half of a's bytes: moving either would split them
    model.c.weight = nn.Parameter(flat[512:].view(16, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = [model.a.weight, model.b.weight, model.c.weight]
    assert move_into_process_memory(model, weights) == 256 * 4
    assert _file_mapped(model.a.weight) and _file_mapped(model.b.weight) and not _file_mapped(model.c.weight)
    assert model.c.weight is weights[2]  # the same parameter object, another storage
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("value", "asked"), [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_moved_weights_ask_for_huge_pages_unless_the_environment_says_0(
        value: str | None, asked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusion_linear_kernels import residence

    if value is None:
        monkeypatch.delenv(residence.HUGE_PAGES_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(residence.HUGE_PAGES_VARIABLE, value)
    seen: list[bool] = []
    monkeypatch.setattr(residence, "process_memory_copies",
                        lambda tensors, huge_pages=False: (seen.append(huge_pages), [None] * len(tensors))[1])
    layer = nn.Linear(4, 4)
    assert move_into_process_memory(nn.Sequential(layer), [layer.weight]) == 0
    assert seen == [asked]
