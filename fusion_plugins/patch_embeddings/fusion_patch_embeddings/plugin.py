"""Entry point of the ``fusion-patch-embeddings`` distribution (group ``fusion_core``)."""

from collections.abc import Callable
from typing import Any

import fusion_core
from fusion_patch_embeddings.family import PatchEmbeddingsFamily


@fusion_core.hookimpl
def register_fusion_families(register: Callable[[Any], None]) -> None:
    register(PatchEmbeddingsFamily())
