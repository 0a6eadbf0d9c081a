"""The discovery cache: a cached plan is reused only for the same model class, config content and family objects."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

import fusion_core
from fusion_core import discovery
from fusion_core.config import parse_fusion_config


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128)


class _HeadFamily(fusion_core.FusionFamily[fusion_core.FamilyOptions]):
    """Fuses the LM head with the mixin it was made with (one instance per mixin)."""

    name = "cache_probe"
    target_modules_patterns = (r"lm_head$",)

    def __init__(self, mixin: type) -> None:
        self.fused_mixin = mixin  # type: ignore[misc]

    def is_fusable(self, module: nn.Module, options: fusion_core.FamilyOptions) -> bool:
        return isinstance(module, nn.Linear)


def test_a_new_family_object_is_never_served_a_plan_cached_for_a_freed_one() -> None:
    """CPython hands a freed object's id to the next object of its size: the cache must not key on ids alone."""
    from transformers import LlamaForCausalLM

    config = _config()
    stale = []
    for i in range(30):
        mixin = type(f"Mixin{i}", (fusion_core.FusedModule,), {})
        fusion_core.register_family(_HeadFamily(mixin))
        found = discovery.discover(LlamaForCausalLM, config, parse_fusion_config({"cache_probe": True}))
        if not issubclass(found.plan.modules[0].fused_class, mixin):
            stale.append(i)
        fusion_core.unregister_family("cache_probe")
        gc.collect()
    assert stale == []


def test_a_config_json_cannot_hold_is_discovered_afresh_every_time() -> None:
    """Two configs whose values differ only where ``repr`` shortens them must not share a plan."""
    from transformers import LlamaForCausalLM

    first, second = _config(), _config()
    first.table = torch.zeros(5000)
    second.table = torch.zeros(5000)
    second.table[2500] = 1.0
    assert repr(first.table) == repr(second.table)
    fusion = parse_fusion_config({"qkv": True})
    plans = [discovery.discover(LlamaForCausalLM, config, fusion) for config in (first, second)]
    assert plans[0] is not plans[1]
