"""Multi-process checks of ``linear_cross_entropy`` for test_workflows.py: real gloo process groups on CPU.

``python distributed_worker.py WORLD OUT`` saves tiny checkpoints under ``OUT``, spawns WORLD processes
(``torch.multiprocessing``), and each rank runs every scenario below and writes ``OUT/rank<r>.json``:
``{check: [ok, detail]}``. Every check compares the fused model with the *unfused* one trained the same
way in the same process group (no constants). One process group runs all checks, because each spawn
costs seconds. Modelled on the repository's tests/distributed_worker.py.

- **DDP**: ``DistributedDataParallel`` over the fused and the plain model, each rank its own batch (some
  labels ignored), a few SGD steps: the same loss at every step, the same weight updates.
- **FSDP2**: ``fully_shard`` on each decoder layer, then on the model (the LM head is in the root's
  group), the same steps: the same losses and the same updates of the gathered weights; the head's
  weight is a DTensor between steps (so the scenario really shards it).

Both on an untied Llama (``lm_head`` its own weight) and a tied Qwen2 (the head is the embedding table).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from fusion_core.testing.distributed import Checks, free_port, fsdp2, full_state, report_rank
from fusion_core.testing.kit import relative_l2

FUSION = {"linear_cross_entropy": {"chunk_tokens": 5}}  # several chunks per rank's batch
STEPS = 3
LR = 0.05
TOLERANCE = 1e-5  # float32: loss relative error; relative L2 error of each trained weight and of all updates together
TENSOR_UPDATE_TOLERANCE = 1e-3  # one tensor's own update, ill-conditioned (test_workflows._assert_same_updates)


def configs() -> dict[str, Any]:
    import transformers

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    return {
        "llama": transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "qwen2_tied": transformers.Qwen2Config(**common, tie_word_embeddings=True),
    }


def batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's own batches: random ids, a masked prompt and a masked span, so rows are skipped."""
    generator = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, 256, (2, 11), generator=generator)
        labels = ids.clone()
        labels[0, :3] = -100
        labels[1, 6:8] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def train(model: torch.nn.Module, wrapped: torch.nn.Module, rank: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches(rank):
        loss = wrapped(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def compare(checks: Checks, label: str, losses: tuple[list[float], list[float]],
            states: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], initial: dict[str, torch.Tensor]) -> None:
    got, expected = losses
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected, strict=True))
    checks[f"{label}: losses"] = [worst <= TOLERANCE, f"fused {got} vs plain {expected}"]
    fused, plain = states
    if fused.keys() != plain.keys():
        checks[f"{label}: weight updates"] = [False, f"keys differ: {sorted(fused.keys() ^ plain.keys())[:6]}"]
        return
    moved = [k for k in plain if not torch.equal(plain[k], initial[k])]
    weights = {k: relative_l2(plain[k], fused[k]) for k in moved}
    updates = {k: relative_l2(plain[k] - initial[k], fused[k] - initial[k]) for k in moved}
    together = relative_l2(torch.cat([(plain[k] - initial[k]).flatten() for k in moved]),
                           torch.cat([(fused[k] - initial[k]).flatten() for k in moved]))
    name = max(updates, key=updates.__getitem__)
    ok = (len(moved) == len(plain) and max(weights.values()) <= TOLERANCE  # every tensor trained, each as plain's
          and updates[name] <= TENSOR_UPDATE_TOLERANCE and together <= TOLERANCE)
    checks[f"{label}: weight updates"] = [ok, f"{len(moved)}/{len(plain)} tensors updated; worst weight relative L2 "
                                              f"{max(weights.values()):.3g}; worst update {name} {updates[name]:.3g}; "
                                              f"all updates together {together:.3g}"]


def scenario(rank: int, paths: dict[str, Path]) -> Checks:
    import warnings

    from fusion_linear_cross_entropy import LinearCrossEntropyMixin
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import fusion_core

    checks: Checks = {}
    for name, path in paths.items():
        initial = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}

        def models(path: Path = path) -> tuple[Any, Any]:
            fused = fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION).train()
            return fused, AutoModelForCausalLM.from_pretrained(path).train()

        fused, plain = models()
        checks[f"{name}: the model is fused"] = [isinstance(fused, LinearCrossEntropyMixin), type(fused).__name__]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train(fused, DistributedDataParallel(fused), rank), train(plain, DistributedDataParallel(plain),
                                                                                rank)
        compare(checks, f"{name} DDP", losses, (fused.state_dict(), plain.state_dict()), initial)
        lce = [str(w.message) for w in caught if "linear_cross_entropy" in str(w.message)]
        checks[f"{name} DDP: no fallback warning"] = [not lce, f"{lce}"]

        fused, plain = models()
        fsdp2(fused), fsdp2(plain)
        head = fused.get_output_embeddings().weight
        checks[f"{name} FSDP2: the head's weight is sharded"] = [isinstance(head, DTensor), type(head).__name__]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train(fused, fused, rank), train(plain, plain, rank)
        compare(checks, f"{name} FSDP2", losses, (full_state(fused), full_state(plain)), initial)
        lce = [str(w.message) for w in caught if "linear_cross_entropy" in str(w.message)]
        checks[f"{name} FSDP2: no fallback warning"] = [not lce, f"{lce}"]
        if name == "llama":
            head_in_its_own_group(checks, models, rank, initial)
    return checks


def head_in_its_own_group(checks: Checks, models: Any, rank: int, initial: dict[str, torch.Tensor]) -> None:
    """FSDP2 with ``fully_shard(lm_head)``: its hooks all-gather a fresh weight per call, which the chunked loss
    cannot differentiate; the family falls back to the original forward with one warning, and trains like plain."""
    import warnings

    fused, plain = models()
    fsdp2(fused, head=True), fsdp2(plain, head=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(fused, fused, rank), train(plain, plain, rank)
        output = fused(**batches(rank)[0])
    compare(checks, "llama FSDP2 (head in its own group)", losses, (full_state(fused), full_state(plain)), initial)
    lce = [str(w.message) for w in caught if "linear_cross_entropy" in str(w.message)]
    checks["llama FSDP2 (head in its own group): one fallback warning"] = [
        len(lce) == 1 and "sharded by FSDP2" in lce[0] and "original forward" in lce[0], f"{lce}"]
    checks["llama FSDP2 (head in its own group): the original forward's logits"] = [
        output.logits is not None, f"logits {type(output.logits).__name__}"]


def run_rank(rank: int, world: int, paths: dict[str, str], out: str, port: int) -> None:
    report_rank(rank, world, port, Path(out), lambda: scenario(rank, {k: Path(v) for k, v in paths.items()}))


def main(world: int, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, config in configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # unit-scale logits: the loss and its gradients are not all near log(vocab)
            model.get_output_embeddings().weight.normal_(0.0, 1.0)
        paths[name] = str(out / f"checkpoint-{name}")
        model.save_pretrained(paths[name])
    mp.spawn(run_rank, args=(world, paths, str(out), free_port()), nprocs=world)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
