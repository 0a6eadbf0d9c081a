"""Entry point of the ``fusion-moe-experts`` distribution (group ``fusion_core``)."""

from collections.abc import Callable
from typing import Any

import fusion_core
from fusion_moe_experts.family import MoeExpertsFamily


@fusion_core.hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register(MoeExpertsFamily())
