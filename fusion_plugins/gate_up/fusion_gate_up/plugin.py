"""Entry point of the ``fusion-gate-up`` distribution (group ``fusion_core``)."""

from collections.abc import Callable
from typing import Any

import fusion_core
from fusion_gate_up.family import GateUpFamily


@fusion_core.hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register(GateUpFamily())
