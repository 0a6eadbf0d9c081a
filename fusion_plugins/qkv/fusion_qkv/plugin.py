"""Entry point of the ``fusion-qkv`` distribution (group ``fusion_core``)."""

from collections.abc import Callable
from typing import Any

import fusion_core
from fusion_qkv.family import QkvFamily


@fusion_core.hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register(QkvFamily())
