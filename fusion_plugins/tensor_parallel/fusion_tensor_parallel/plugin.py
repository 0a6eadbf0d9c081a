"""fusion-core's tensor-parallel integration: the plugin module its entry point names.

It registers the integration ``tensor_parallel`` and wraps the conversion of every fused load:
before it, each fused module's family rule is executed on the shards transformers loaded; after
it, the sharded fused modules are finished (see :mod:`fusion_tensor_parallel.sharded`). A model
that transformers did not load under a tensor-parallel plan passes through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, MutableSequence
from typing import Any

from torch import nn

from fusion_core import Integration, ModulePlan, hookimpl
from fusion_tensor_parallel.sharded import finish, localize_built

INTEGRATION = Integration(
    "tensor_parallel",
    "fused modules under transformers' tensor-parallel plans (tp_plan=...): each rank fuses its own shards",
)


@hookimpl
def register_fusion_integrations(register: Callable[[Integration], None]) -> None:
    register(INTEGRATION)


@hookimpl(wrapper=True, tryfirst=True)  # it replaces plans in `built`: the outermost wrapper (see the hookspec)
def fusion_convert_loaded(
    model: nn.Module, built: MutableSequence[tuple[nn.Module, ModulePlan]], families: Mapping[str, Any]
) -> Generator[None, None, None]:
    pending = localize_built(model, built, families)
    result = yield
    for module, plan, sharded in pending:
        finish(module, plan, sharded)
    return result
