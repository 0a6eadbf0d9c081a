"""Comparisons for multi-process tests of fused models: every rank checks against the unfused model.

Used by the repository's tensor-parallel / FSDP2 workers and by family packages that test their
fused modules in a real process group. A check is recorded, not raised, so that one rank's report
(``{name: [ok, detail]}``) lists every check it ran.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion_core.compat import torch as torch_compat

Checks = dict[str, list[Any]]
"""One rank's report: check name -> ``[ok, detail]``."""


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference, in float32."""
    return float((a.detach().float() - b.detach().float()).abs().max())


def close(checks: Checks, name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """Record whether ``actual`` has ``expected``'s shape and lies within ``tol`` of it."""
    diff = max_diff(actual, expected) if actual.shape == expected.shape else float("inf")
    checks[name] = [diff <= tol, f"max |diff| {diff:.3g} (shapes {tuple(actual.shape)} vs {tuple(expected.shape)})"]


def same_generation(checks: Checks, name: str, model: Any, reference: Any, ids: torch.Tensor,
                    tokens: int = 6) -> None:
    """Record whether ``model`` greedily generates exactly ``reference``'s ``tokens`` tokens after ``ids``."""
    generated = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    expected = reference.generate(ids, max_new_tokens=tokens, do_sample=False)
    checks[name] = [torch.equal(generated, expected), f"{generated.tolist()} vs {expected.tolist()}"]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered to its full tensor (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


def same_state(checks: Checks, name: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
               tol: float = 1e-5, exact: bool = False) -> None:
    """Record whether two state dicts have the same keys and tensors (within ``tol``, or bit for bit)."""
    if actual.keys() != expected.keys():
        checks[name] = [False, f"keys differ: {sorted(actual.keys() ^ expected.keys())[:6]}"]
        return
    worst = max(expected, key=lambda k: max_diff(actual[k], expected[k]))
    diff = max_diff(actual[worst], expected[worst])
    ok = all(torch.equal(actual[k], expected[k]) for k in expected) if exact else diff <= tol
    checks[name] = [ok, f"worst {worst}: max |diff| {diff:.3g}"]


def saved(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in ``directory``."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a process group's rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def report_rank(rank: int, world: int, port: int, out: Path, scenario: Callable[[], Checks]) -> None:
    """Run ``scenario`` as ``rank`` of a gloo group of ``world`` on 127.0.0.1:``port``; write ``out/rank<r>.json``.

    A scenario that raises is reported as the failed check ``"scenario ran"`` with its traceback.
    Every rank leaves through one monitored barrier before the group is destroyed: a rank that tore
    its gloo group down while another still worked on rank-local checks was seen to abort
    ("terminate called without an active exception"); the barrier names a rank that never arrives.
    The rank process then ends at once (:func:`fusion_core.compat.torch.end_gloo_rank_process`), without the
    interpreter's teardown: with every report
    written and every rank past the barrier, a rank still aborted the same way there, about once in ten CI runs
    (torch 2.13.0, gloo), failing a job whose checks had all passed.
    """
    import datetime
    import json
    import os
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        checks = scenario()
    except Exception:
        checks = {"scenario ran": [False, traceback.format_exc()]}
    (out / f"rank{rank}.json").write_text(json.dumps(checks, indent=1))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    dist.destroy_process_group()
    torch_compat.end_gloo_rank_process()


def fsdp2(model: Any, head: bool = False) -> Any:
    """``model`` (a decoder whose layers are ``model.model.layers``) sharded by FSDP2 as the data-parallel tests
    shard it: each decoder layer, then the model (its embeddings, norm and LM head in the root group); with
    ``head``, the LM head in a group of its own first (its own unshard/reshard hooks around its forward)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if head:
        fully_shard(model.get_output_embeddings())
    fully_shard(model)
    return model


def run_job(command: Sequence[str], world: int, out: Path, expected: set[str] | Callable[[set[str]], set[str]],
            every_rank: bool = False, env: Mapping[str, str] | None = None, timeout: float = 900) -> set[str]:
    """Run ``command`` (a worker that spawns ``world`` ranks, each writing ``out/rank<r>.json`` through
    :func:`report_rank`); fail with every rank's failed checks, and each ``expected`` check that rank 0 (with
    ``every_rank``, any rank) did not run. ``expected`` may be a function of the checks rank 0 ran (a scenario that
    takes another branch on a release that lacks what it needs reports other checks). Returns rank 0's checks."""
    import json
    import subprocess

    result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout,
                            env=None if env is None else dict(env))
    reports = {rank: out / f"rank{rank}.json" for rank in range(world)}
    missing = [rank for rank, file in reports.items() if not file.exists()]
    assert result.returncode == 0 and not missing, f"ranks {missing} reported nothing:\n{result.stderr[-4000:]}"
    failed: dict[str, Any] = {}
    first: set[str] = set()
    for rank, file in reports.items():
        checks = json.loads(file.read_text())
        assert checks, f"rank {rank} ran no check"
        failed.update({f"rank {rank}: {name}": detail for name, (ok, detail) in checks.items() if not ok})
        first = set(checks) if rank == 0 else first
        if rank == 0 or every_rank:  # without every_rank, the others skip checks on files only rank 0 writes
            want = expected(first) if callable(expected) else expected
            failed.update({f"rank {rank}: {name}": "did not run" for name in want - checks.keys()})
    assert not failed, "\n".join(f"{name}: {detail}" for name, detail in failed.items())
    return first
