"""Multi-process scenarios for tests/test_distributed.py: real gloo process groups on CPU.

``python tests/distributed_worker.py SCENARIO WORLD OUT`` saves a tiny checkpoint, spawns WORLD
processes (``torch.multiprocessing``), and each rank runs SCENARIO and writes ``OUT/rank<r>.json``:
``{check: [ok, detail]}``. Every check compares with the *unfused* model loaded in one process
(no constants). One process group runs many checks, because each spawn costs seconds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusion_core.testing.distributed import (
    Checks,
    close,
    free_port,
    fsdp2,
    full_state,
    report_rank,
    same_generation,
    same_state,
    saved,
)

FUSION = {"qkv": True, "gate_up": True}


def text_config(world: int) -> Any:
    """A GQA Qwen2 (q/k/v with biases) whose q and k/v heads split evenly over ``world`` ranks.

    Qwen2, not Llama with ``attention_bias``: 4.57's rowwise style renames a rowwise bias in
    ``state_dict`` after a forward (``o_proj._bias``), unfused or not.
    """
    from transformers import Qwen2Config

    kv = world  # one k/v head per rank, two q heads per rank
    return Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2 * kv, num_key_value_heads=kv,
        head_dim=8, vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )


def is_tf5() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5






def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: a DTensor's local shard, or the plain local tensor transformers 5.1-5.15 load."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_parallel_state(model: torch.nn.Module, scratch: Path) -> dict[str, torch.Tensor] | None:
    """A tensor-parallel model's full original-layout state; None on ranks that cannot see it.

    DTensor shards are gathered in memory. Plain local shards (transformers 5.1-5.15) carry no
    placement: the model is saved (transformers gathers them by its plan, every rank takes part)
    and rank 0 reads the checkpoint.
    """
    import fusion_core

    if any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()):
        return full_state(model)
    fusion_core.save_pretrained(model, scratch)
    return saved(scratch) if dist.get_rank() == 0 else None


def same_state_if_seen(checks: Checks, name: str, actual: dict[str, torch.Tensor] | None,
                       expected: dict[str, torch.Tensor], **kwargs: Any) -> None:
    if actual is not None:
        same_state(checks, name, actual, expected, **kwargs)








def refused(checks: Checks, name: str, load: Callable[[], Any], *needles: str) -> None:
    from fusion_core import FusionLoadError

    try:
        load()
    except FusionLoadError as exc:
        checks[name] = [all(n in str(exc) for n in needles), str(exc)]
    else:
        checks[name] = [False, "loaded without an error"]


def sgd_step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


# -- tensor parallelism ----------------------------------------------------------------------------
def tensor_parallel(rank: int, world: int, path: Path, out: Path) -> Checks:
    """Fused qkv+gate_up under transformers' tensor parallelism, against the unfused model in one process."""
    from transformers import AutoModelForCausalLM

    import fusion_core

    checks: Checks = {}
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 3], [1, 4, 8, 16, 32, 64]])

    def load(**kwargs: Any) -> Any:
        return fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION, **kwargs)

    fused = load(tp_plan="auto")
    attention = fused.model.layers[1].self_attn
    ref_attention = reference.model.layers[1].self_attn
    own = [getattr(ref_attention, p).weight.chunk(world)[rank] for p in ("q_proj", "k_proj", "v_proj")]
    close(checks, "merged weight is [q_r; k_r; v_r]", local_of(attention.qkv_proj.weight), torch.cat(own), tol=0)
    own_bias = [getattr(ref_attention, p).bias.chunk(world)[rank] for p in ("q_proj", "k_proj", "v_proj")]
    close(checks, "merged bias is [q_r; k_r; v_r]", local_of(attention.qkv_proj.bias), torch.cat(own_bias), tol=0)
    with torch.no_grad():
        close(checks, "logits (tp_plan='auto')", fused(ids).logits, reference(ids).logits)
    same_generation(checks, "generate", fused, reference, ids[:1])

    fusion_core.save_pretrained(fused, out / "saved")
    if rank == 0:
        same_state(checks, "save: original layout, same bytes", saved(out / "saved"), saved(path), exact=True)
    with_kernels(checks, path, reference, ids, out / "kernels")

    fusion_core.save_pretrained(fused, out / "fused_layout", save_original_format=False)
    if rank == 0:
        single = fusion_core.from_pretrained(AutoModelForCausalLM, out / "fused_layout")
        with torch.no_grad():
            close(checks, "fused-layout save loads in one process", single(ids).logits, reference(ids).logits)

    snapshot = {key: value.clone() for key, value in fused.state_dict().items()}
    fused.train()
    reference.train()
    loss, ref_loss = sgd_step(fused, ids), sgd_step(reference, ids)
    checks["training loss"] = [abs(loss - ref_loss) <= 1e-5, f"{loss} vs {ref_loss}"]
    merged = attention.fused_projection
    checks["q/k/v share one GEMM per call"] = [
        merged.merged_gemms > 0 and merged.own_gemms == 0, f"merged {merged.merged_gemms}, own {merged.own_gemms}"
    ]
    same_state_if_seen(checks, "trained weights (state_dict, original layout)",
                       tensor_parallel_state(fused, out / "state-trained"), reference.state_dict())
    fusion_core.save_pretrained(fused, out / "trained")
    if rank == 0:
        same_state(checks, "save after training", saved(out / "trained"), reference.state_dict())
    fused.load_state_dict(snapshot)
    same_state_if_seen(checks, "load_state_dict of the original-layout shards",
                       tensor_parallel_state(fused, out / "state-reloaded"), saved(path), exact=True)

    if world == 2:
        plan_spellings(checks, path, world, ids, load, out)
        vision_language(checks, out)
    else:
        head_split_refused(checks, out)
    return checks


def with_kernels(checks: Checks, path: Path, reference: Any, ids: torch.Tensor, out: Path) -> None:
    """linear_kernels with qkv+gate_up under the plan: a sharded weight (a DTensor, or a local shard the plan's hooks
    drive) runs and gives the unfused model's logits, greedy tokens and checkpoint."""
    from transformers import AutoModelForCausalLM

    import fusion_core

    model = fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config={**FUSION, "linear_kernels": True},
                                        tp_plan="auto").eval()
    with torch.no_grad():
        close(checks, "logits with linear_kernels (tp_plan='auto')", model(ids).logits, reference(ids).logits)
    same_generation(checks, "generate with linear_kernels", model, reference, ids[:1])
    fusion_core.save_pretrained(model, out)
    if dist.get_rank() == 0:
        same_state(checks, "save with linear_kernels: original layout, same bytes", saved(out), saved(path),
                   exact=True)


def plan_spellings(
    checks: Checks, path: Path, world: int, ids: torch.Tensor, load: Callable[..., Any], out: Path
) -> None:
    """The newer 5.x argument and an explicit plan load the same; a plan that gathers k_proj is refused."""
    from transformers import AutoModelForCausalLM

    plan = {f"model.layers.*.{p}": style for p, style in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise"),
    )}
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    if is_tf5():
        import inspect

        from transformers.distributed import DistributedConfig

        if "tp_size" in inspect.signature(DistributedConfig).parameters:  # not in 5.0
            spelled = load(distributed_config=DistributedConfig(tp_size=world))
            with torch.no_grad():
                close(checks, "logits (DistributedConfig)", spelled(ids).logits, reference(ids).logits)
        explicit = load(tp_plan=plan)
        bad = dict(plan, **{"model.layers.*.self_attn.k_proj": gathered_styles()[0]})
        refuse = lambda: load(tp_plan=bad)  # noqa: E731
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        config.base_model_tp_plan = {k.removeprefix("model."): v for k, v in plan.items()}
        explicit = load(tp_plan="auto", config=config)
        bad_config = AutoConfig.from_pretrained(path)
        bad_config.base_model_tp_plan = dict(config.base_model_tp_plan, **{"layers.*.self_attn.k_proj": "colwise_rep"})
        refuse = lambda: load(tp_plan="auto", config=bad_config)  # noqa: E731
    with torch.no_grad():
        close(checks, "logits (explicit plan)", explicit(ids).logits, reference(ids).logits)
    refused(checks, "a plan gathering k_proj alone is refused", refuse, "model.layers.0.self_attn", "k_proj")
    gathered_plan(checks, path, ids, load, out)


def gathered_plan(checks: Checks, path: Path, ids: torch.Tensor, load: Callable[..., Any], out: Path) -> None:
    """An OLMo-2 style plan: q/k/v outputs gathered to full width, o_proj splitting its replicated input."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gather, split = gathered_styles()
    plan = {f"layers.*.self_attn.{p}": gather for p in ("q_proj", "k_proj", "v_proj")}
    plan["layers.*.self_attn.o_proj"] = split
    if is_tf5():
        fused = load(tp_plan={f"model.{key}": style for key, style in plan.items()})
    else:
        config = AutoConfig.from_pretrained(path)
        config.base_model_tp_plan = dict(config.base_model_tp_plan, **plan)
        fused = load(tp_plan="auto", config=config)
    reference = AutoModelForCausalLM.from_pretrained(path)
    merged = fused.model.layers[0].self_attn.fused_projection
    checks["q/k/v outputs gathered"] = [merged.__dict__.get("_tp_gather") is True, type(merged).__name__]
    with torch.no_grad():
        close(checks, "logits (gathered q/k/v plan)", fused.eval()(ids).logits, reference.eval()(ids).logits)
    fused.train()
    reference.train()
    losses = sgd_step(fused, ids), sgd_step(reference, ids)
    checks["training loss (gathered q/k/v plan)"] = [abs(losses[0] - losses[1]) <= 1e-5, f"{losses}"]
    same_state_if_seen(checks, "trained weights (gathered q/k/v plan)",
                       tensor_parallel_state(fused, out / "state-gathered"), reference.state_dict())


def head_split_refused(checks: Checks, out: Path) -> None:
    """Two k/v heads over four ranks: each rank's k rows would split a head, so the fused load is refused."""
    from transformers import AutoModelForCausalLM

    import fusion_core

    path = out / "two_kv_heads"
    if dist.get_rank() == 0:
        AutoModelForCausalLM.from_config(text_config(2)).save_pretrained(path)
    dist.barrier()
    load = lambda: fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION, tp_plan="auto")  # noqa: E731
    refused(checks, "k/v heads split over ranks are refused", load,
            "model.layers.0.self_attn", "k_proj.weight", "splits a head_dim of 8")


def vision_language(checks: Checks, out: Path) -> None:
    """Qwen2-VL under tp_plan='auto': the text model is sharded, the fused patch embedding is replicated."""
    from operator import attrgetter

    import fusion_core
    from fusion_core.testing.tiny_models import TINY_MODELS, auto_class, save_tiny_model

    tiny = TINY_MODELS["qwen2_vl"]
    path = out / "qwen2_vl"
    if dist.get_rank() == 0:
        save_tiny_model(tiny, path)
    dist.barrier()
    model_cls = auto_class(tiny)
    reference = model_cls.from_pretrained(path).eval()
    fusion = {"patch_embeddings": True, **FUSION}
    fused = fusion_core.from_pretrained(model_cls, path, fusion_config=fusion, tp_plan="auto").eval()
    inputs = tiny.make_vision_input(reference.config, torch.Generator().manual_seed(0))
    tower = attrgetter(tiny.vision_path)
    patch = type(tower(fused).patch_embed.proj).__qualname__
    checks["vision tower: patch embedding fused"] = ["PatchLinearMixin" in patch, patch]
    with torch.no_grad():
        vision, expected = (tower(model)(**inputs) for model in (fused, reference))
        vision, expected = (getattr(v, "last_hidden_state", v) for v in (vision, expected))
        close(checks, "vision tower output (patch_embeddings)", vision, expected, tol=1e-4)
        ids = torch.tensor([[1, 5, 7, 9]])
        logits = [model(input_ids=ids).logits for model in (fused, reference)]
        close(checks, "VL text logits (qkv, gate_up sharded)", *logits)


def gathered_styles() -> tuple[str, str]:
    """(gathered colwise, split-input rowwise) style names: 4.57 and 5.0 spell them ``colwise_rep``/``rowwise_rep``."""
    import transformers

    if not is_tf5() or transformers.__version__.startswith("5.0."):
        return "colwise_rep", "rowwise_rep"
    return "colwise_gather_output", "rowwise_split_input"


# -- data parallelism --------------------------------------------------------------------------------
def data_parallel(rank: int, world: int, path: Path, out: Path) -> Checks:
    """DDP and FSDP2 training steps: the fused model against the unfused one, same group, same batches."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import fusion_core

    checks: Checks = {}
    ids = torch.tensor([[1, 5, 7, 9, 11, 3], [1, 4, 8, 16, 32, 64]])[rank % 2 :: 2]  # each rank its own batch

    def models(fusion_config: dict[str, Any] = FUSION) -> tuple[Any, Any]:
        fused = fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=fusion_config).train()
        return fused, AutoModelForCausalLM.from_pretrained(path).train()

    fused, plain = models()
    merged = [type(m).__name__ for m in fused.modules() if "fused_projection" in dir(type(m))]
    checks["the model is fused"] = [len(merged) == 2 * len(fused.model.layers), f"merged modules: {merged}"]
    losses = [sgd_step(DistributedDataParallel(m), ids) for m in (fused, plain)]
    checks["DDP loss"] = [abs(losses[0] - losses[1]) <= 1e-5, f"{losses}"]
    same_state(checks, "DDP trained weights", fused.state_dict(), plain.state_dict())

    fused, plain = models()
    losses = [sgd_step(fsdp2(m), ids) for m in (fused, plain)]
    checks["FSDP2 loss"] = [abs(losses[0] - losses[1]) <= 1e-5, f"{losses}"]
    same_state(checks, "FSDP2 trained weights", full_state(fused), full_state(plain))
    fusion_core.save_pretrained(fused, out / "fsdp")
    plain_state = full_state(plain)
    if rank == 0:
        same_state(checks, "save after FSDP2 training", saved(out / "fsdp"), plain_state)
    with_kernels_in_the_job(checks, models, ids)
    return checks


def with_kernels_in_the_job(checks: Checks, models: Callable[..., tuple[Any, Any]], ids: torch.Tensor) -> None:
    """linear_kernels loaded in the job packs nothing (a packed weight has no storage to broadcast or shard), so
    DDP and FSDP2 wrap it and train like the unfused model."""
    from torch.nn.parallel import DistributedDataParallel

    kernels = {**FUSION, "linear_kernels": True}
    fused, plain = models(kernels)
    packed = [name for name, p in fused.named_parameters() if p.is_mkldnn]
    checks["linear_kernels packs nothing in a distributed job"] = [not packed, f"packed: {packed}"]
    losses = [sgd_step(DistributedDataParallel(m), ids) for m in (fused, plain)]
    checks["DDP loss (linear_kernels)"] = [abs(losses[0] - losses[1]) <= 1e-5, f"{losses}"]
    fused, plain = models(kernels)
    losses = [sgd_step(fsdp2(m), ids) for m in (fused, plain)]
    checks["FSDP2 loss (linear_kernels)"] = [abs(losses[0] - losses[1]) <= 1e-5, f"{losses}"]
    same_state(checks, "FSDP2 trained weights (linear_kernels)", full_state(fused), full_state(plain))


def uneven_rows(rank: int, world: int, path: Path, out: Path) -> Checks:
    """At 3 ranks the MLP's 64 rows do not split evenly (the heads do): transformers shards gate/up unevenly, which
    no merged shard can hold. ``gate_up`` leaves those modules unfused, as plain loaded them, ``qkv`` still merges,
    and the model runs as plain does (on 4.57, whose own uneven shards fail, it fails as plain does)."""
    from transformers import AutoModelForCausalLM

    import fusion_core

    checks: Checks = {}
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])

    def load(fusion_config: dict[str, Any] | None) -> Any:
        if fusion_config is None:
            return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
        return fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=fusion_config,
                                           tp_plan="auto").eval()

    def logits(model: Any) -> torch.Tensor | Exception:
        try:
            with torch.no_grad():
                return model(ids).logits
        except Exception as exc:  # compared with what plain does below
            return exc

    fused = load({"qkv": True, "gate_up": {"required": False}})
    layers = fused.model.layers
    shapes = [(type(layer.mlp).__name__, sorted(layer.mlp._modules), sorted(layer.self_attn._modules))
              for layer in layers]
    checks["gate_up left unfused, qkv merged"] = [
        all("gate_proj" in mlp and "gate_up_proj" not in mlp and "qkv_proj" in attention
            for _, mlp, attention in shapes), f"{shapes}"]
    plain, got = logits(load(None)), logits(fused)
    if isinstance(plain, Exception):
        checks["fails as plain does"] = [type(got) is type(plain), f"plain: {plain!r}; fused: {got!r}"]
    elif isinstance(got, Exception):
        checks["logits (uneven rows)"] = [False, repr(got)]
    else:
        with torch.no_grad():
            close(checks, "logits (uneven rows)", got, reference(ids).logits)
    refused(checks, "a required gate_up with nothing left fused is refused", lambda: load(FUSION),
            "family 'gate_up'", "every module it would fuse is left unfused", "required=False")
    return checks


SCENARIOS = {"tensor_parallel": tensor_parallel, "data_parallel": data_parallel, "uneven_rows": uneven_rows}


def run_rank(rank: int, world: int, scenario: str, path: str, out: str, port: int) -> None:
    report_rank(rank, world, port, Path(out), lambda: SCENARIOS[scenario](rank, world, Path(path), Path(out)))


def main(scenario: str, world: int, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "checkpoint"  # under the test's own temporary directory, which pytest removes
    AutoModelForCausalLM.from_config(text_config(world)).save_pretrained(path)
    port = free_port()
    mp.spawn(run_rank, args=(world, scenario, str(path), str(out), port), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
