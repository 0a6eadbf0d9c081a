"""What the family's test files share: tiny checkpoints with a head worth computing a loss over."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[], Any]], Path]:
    """``checkpoint_of(name, make_config)``: a tiny causal LM saved once per module, its head drawn from N(0, 1)
    (the default initialisation gives logits so flat that any loss looks right)."""
    built: dict[tuple[str, str], Path] = {}  # by name and config: two files may ask for "llama" at other sizes

    def checkpoint(name: str, make_config: Callable[[], Any]) -> Path:
        config = make_config()
        key = (name, config.to_json_string(use_diff=False))
        if key not in built:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            with torch.no_grad():
                model.get_output_embeddings().weight.normal_(0.0, 1.0)
            built[key] = tmp_path_factory.mktemp(name)
            model.save_pretrained(built[key])
        return built[key]

    return checkpoint
