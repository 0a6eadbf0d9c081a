"""Entry point of the ``fusion-linear-cross-entropy`` distribution (group ``fusion_core``)."""

from collections.abc import Callable
from typing import Any

import fusion_core
from fusion_linear_cross_entropy.family import LinearCrossEntropyFamily


@fusion_core.hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register(LinearCrossEntropyFamily())
