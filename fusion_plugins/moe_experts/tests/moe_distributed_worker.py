"""Multi-process checks of ``moe_experts`` for test_moe_experts.py: real gloo process groups on CPU.

``python moe_distributed_worker.py WORLD OUT`` saves tiny transformers 4.57 MoE checkpoints, spawns
WORLD processes (``torch.multiprocessing``), and each rank runs every scenario below and writes
``OUT/rank<r>.json``: ``{check: [ok, detail]}``. Every check compares with the *unfused* model (no
constants). One process group runs all checks, because each spawn costs seconds. Modelled on the
repository's tests/distributed_worker.py.

- **FSDP2**: ``fully_shard`` on each decoder layer, then on the model, for the fused and the unfused
  Qwen2-MoE (routed experts stacked, a gated shared expert); one SGD step each: same loss, same
  updated weights (gathered, original layout), and the original-layout save after it.
- **Tensor parallelism** (``fusion_core.from_pretrained(..., tp_plan="auto")``): Qwen3-MoE's 4.57
  plan shards every expert's projections (``experts.*.gate_proj: colwise`` ...), which the fused
  block cannot run: the load is refused with a ``FusionLoadError`` naming the family, the module and
  the planned expert key. The same model with a plan of its attention entries only (set in the
  config, as 4.57 takes an explicit plan): the fused experts run replicated on every rank, and
  logits, greedy tokens and the save equal the unfused model's. (Qwen2-MoE's 4.57 plan, which names
  no expert, does not run under tensor parallelism unfused either: its attention reshapes to the
  full hidden size.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from fusion_core.testing.distributed import (
    Checks,
    close,
    free_port,
    full_state,
    report_rank,
    same_generation,
    same_state,
    saved,
)

FUSION = {"moe_experts": True}
IDS = torch.tensor([[1, 5, 7, 9, 11, 3], [1, 4, 8, 16, 32, 64]])
BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts_per_tok=2,
            intermediate_size=64, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1,
            tie_word_embeddings=False)


def configs() -> dict[str, Any]:
    import transformers

    return {
        "qwen2_moe": transformers.Qwen2MoeConfig(**BASE, shared_expert_intermediate_size=64),
        "qwen3_moe": transformers.Qwen3MoeConfig(**BASE, head_dim=8, norm_topk_prob=True),
    }












def sgd_step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(ids, labels=ids, output_router_logits=True).loss  # the auxiliary router loss too
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def fused_blocks(model: torch.nn.Module) -> int:
    from fusion_moe_experts import StackedExpertsMixin

    return sum(isinstance(m, StackedExpertsMixin) for m in model.modules())


# -- FSDP2 -------------------------------------------------------------------------------------------
def fsdp2(checks: Checks, rank: int, path: Path, out: Path) -> None:
    from fusion_moe_experts import ExpertProjection
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import fusion_core

    ids = IDS[rank % 2 :: 2]  # each rank its own batch
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION).train()
    plain = AutoModelForCausalLM.from_pretrained(path).train()
    checks["FSDP2: the model is fused"] = [fused_blocks(fused) == 2, f"{fused_blocks(fused)} fused blocks"]
    for model in (fused, plain):
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    stacked = fused.model.layers[0].mlp.experts.gate_up_proj
    checks["FSDP2: stacked experts are sharded"] = [
        isinstance(stacked, DTensor) and stacked.to_local().shape[0] < stacked.shape[0],
        f"{type(stacked).__name__} {tuple(stacked.shape)}"]
    calls: list[str] = []
    original_forward = ExpertProjection.forward
    ExpertProjection.forward = lambda self, x: calls.append(self.name) or original_forward(self, x)  # type: ignore
    try:
        losses = [sgd_step(m, ids) for m in (fused, plain)]
    finally:
        ExpertProjection.forward = original_forward  # type: ignore[method-assign]
    checks["FSDP2: no expert ran on its own"] = [not calls, f"{len(calls)} per-expert calls"]
    checks["FSDP2 loss"] = [abs(losses[0] - losses[1]) <= 1e-5, f"{losses}"]
    same_state(checks, "FSDP2 trained weights (original layout)", full_state(fused), full_state(plain))
    with torch.no_grad():
        close(checks, "FSDP2 logits after the step", fused.eval()(IDS).logits, plain.eval()(IDS).logits)
    fusion_core.save_pretrained(fused, out / "fsdp")
    plain_state = full_state(plain)
    if rank == 0:
        same_state(checks, "save after FSDP2 training", saved(out / "fsdp"), plain_state)


# -- tensor parallelism ------------------------------------------------------------------------------
def tensor_parallel(checks: Checks, rank: int, paths: dict[str, Path], out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import fusion_core
    from fusion_core import FusionLoadError

    try:
        fusion_core.from_pretrained(AutoModelForCausalLM, paths["qwen3_moe"], fusion_config=FUSION, tp_plan="auto")
    except FusionLoadError as exc:
        needles = ("'moe_experts'", "'model.layers.0.mlp'", "experts.0.gate_proj.weight", "colwise")
        checks["TP: a plan sharding the experts is refused by name"] = [all(n in str(exc) for n in needles), str(exc)]
    else:
        checks["TP: a plan sharding the experts is refused by name"] = [False, "loaded without an error"]

    # 4.57 takes an explicit plan in the config (tp_plan accepts only "auto" there): attention only.
    path = paths["qwen3_moe"]
    config = AutoConfig.from_pretrained(path)
    config.base_model_tp_plan = {k: v for k, v in config.base_model_tp_plan.items() if ".experts." not in k}
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION, tp_plan="auto",
                                        config=config).eval()
    q_proj = fused.model.layers[0].self_attn.q_proj.weight
    checks["TP: attention is sharded, experts replicated"] = [
        type(q_proj).__name__ == "DTensor" and fused_blocks(fused) == 2
        and type(fused.model.layers[0].mlp.experts.gate_up_proj).__name__ != "DTensor",
        f"q_proj {type(q_proj).__name__}, {fused_blocks(fused)} fused blocks"]
    with torch.no_grad():
        close(checks, "TP: logits (experts replicated)", fused(IDS).logits, reference(IDS).logits)
    same_generation(checks, "TP: generate", fused, reference, IDS[:1])
    fusion_core.save_pretrained(fused, out / "tp-saved")
    if rank == 0:
        same_state(checks, "TP: save, original layout, same bytes", saved(out / "tp-saved"), saved(path), exact=True)


def scenario(rank: int, world: int, paths: dict[str, Path], out: Path) -> Checks:
    checks: Checks = {}
    fsdp2(checks, rank, paths["qwen2_moe"], out)
    tensor_parallel(checks, rank, paths, out)
    return checks


def run_rank(rank: int, world: int, paths: dict[str, str], out: str, port: int) -> None:
    report_rank(rank, world, port, Path(out), lambda: scenario(rank, world, {k: Path(v) for k, v in paths.items()},
                                                              Path(out)))


def main(world: int, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    root = out / "checkpoints"  # under the test's own temporary directory, which pytest removes
    paths = {}
    for name, config in configs().items():
        torch.manual_seed(0)
        paths[name] = str(root / name)
        AutoModelForCausalLM.from_config(config).save_pretrained(paths[name])
    port = free_port()
    mp.spawn(run_rank, args=(world, paths, str(out), port), nprocs=world)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
