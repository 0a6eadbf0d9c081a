"""torch.compile and torch.export on fused models: no graph break the unfused model does not have, same outputs."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModel, AutoModelForCausalLM

import fusion_core
from fusion_core.plugin import MergedLinear

ALL_TEXT = {"qkv": True, "gate_up": True}
IDS = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _breaks(model: Any, **inputs: Any) -> tuple[int, int, list[str]]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**inputs)
    return explained.graph_count, explained.graph_break_count, [str(r.reason) for r in explained.break_reasons]


def test_fused_text_model_has_the_graph_breaks_of_the_unfused_one(llama):
    plain = AutoModelForCausalLM.from_pretrained(llama).eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT).eval()
    with torch.no_grad():
        expected, got = _breaks(plain, input_ids=IDS), _breaks(fused, input_ids=IDS)
    assert got[:2] == expected[:2], f"unfused {expected}, fused {got}"


def test_fused_patch_embedding_has_the_graph_breaks_of_the_unfused_one(tiny_checkpoint):
    directory, plain = tiny_checkpoint("videomae")
    fused = fusion_core.from_pretrained(AutoModel, directory, fusion_config={"patch_embeddings": True})
    pixels = torch.randn(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = _breaks(plain.eval(), pixel_values=pixels), _breaks(fused.eval(), pixel_values=pixels)
    assert got[:2] == expected[:2], f"unfused {expected}, fused {got}"


def test_fullgraph_inductor_matches_the_unfused_model(llama):
    plain = AutoModelForCausalLM.from_pretrained(llama).eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT).eval()
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True)
    with torch.no_grad():
        expected = plain(input_ids=IDS).logits
        got = compiled(input_ids=IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # eager calls after compiling still merge (the per-slice path is only taken while tracing)
    projection = fused.model.layers[0].self_attn.fused_projection
    before = projection.merged_gemms
    with torch.no_grad():
        fused(input_ids=IDS)
    assert projection.merged_gemms == before + 1


def test_merged_kernels_extension_points_run_eager_and_traced(llama):
    """``MergedLinear.kernel`` computes a plain container's GEMMs in eager code and ``traced_kernel`` its merged GEMM
    under ``torch.compile``, once for all its parts (neither is called where the other mode runs), with the unfused
    model's outputs."""
    plain = AutoModelForCausalLM.from_pretrained(llama).eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT).eval()
    calls = {"eager": 0, "traced": 0}

    def counted(mode: str) -> Any:
        def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            calls[mode] += 1
            return torch.nn.functional.linear(input, weight, bias)
        return linear

    merged = [m.fused_projection for m in fused.modules() if isinstance(getattr(m, "fused_projection", None),
                                                                     MergedLinear)]
    parts = sum(len(m.sizes) for m in merged)
    assert merged and parts > len(merged)
    for projection in merged:
        projection.kernel, projection.traced_kernel = counted("eager"), counted("traced")
    with torch.no_grad():
        expected = plain(input_ids=IDS).logits
        torch.testing.assert_close(fused(input_ids=IDS).logits, expected, rtol=1e-4, atol=1e-5)
        assert calls == {"eager": len(merged), "traced": 0}  # one merged GEMM per container
        torch._dynamo.reset()
        got = torch.compile(fused, fullgraph=True, backend="eager")(input_ids=IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert calls == {"eager": len(merged), "traced": len(merged)}  # one merged call per container in the graph


def test_torch_export_matches_the_unfused_model(llama):
    plain = AutoModelForCausalLM.from_pretrained(llama).eval()
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=ALL_TEXT).eval()
    inputs = {"input_ids": IDS, "use_cache": False}  # a DynamicCache output is no pytree, fused or not
    exported = torch.export.export(fused, (), inputs)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(**inputs).logits, plain(**inputs).logits, rtol=1e-4, atol=1e-5)
