"""A tied head's gradient: the embedding's share is added into the loss's, and no second vocab-sized tensor is made."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from fusion_linear_cross_entropy.tied_gradient import TiedGradient, tied_embedding
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fusion_core

VOCAB, HIDDEN = 512, 32


class _Outputs(TorchDispatchMode):
    """The shapes of the new tensors ops make while active (not in place, not views of an argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
            self.shapes.append((func.overloadpacket.__name__, tuple(out.shape)))
        return out


def _tied_qwen2() -> nn.Module:
    config = transformers.Qwen2Config(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      tie_word_embeddings=True, pad_token_id=3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return model


def _backward_outputs(model: nn.Module, ids: torch.Tensor) -> tuple[list[tuple[str, tuple[int, ...]]], torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    with _Outputs() as seen:
        loss.backward()
    return seen.shapes, model.get_input_embeddings().weight.grad.clone()


def test_the_backward_makes_no_second_vocab_sized_gradient():
    plain = _tied_qwen2()
    fused = fusion_core.fuse(copy.deepcopy(plain), {"linear_cross_entropy": {"chunk_tokens": 8}})
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    ids[0, :5] = 3  # the padding token: torch's backward leaves its row out
    plain_shapes, plain_grad = _backward_outputs(plain, ids)
    fused_shapes, fused_grad = _backward_outputs(fused, ids)
    assert ("embedding_dense_backward", (VOCAB, HIDDEN)) in plain_shapes  # what the test looks for, in plain
    assert [s for s in fused_shapes if s[1] == (VOCAB, HIDDEN)] == []
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("handed_over", [False, True])
def test_a_lookup_adds_its_rows_to_what_the_loss_handed_over(padding_idx, handed_over):
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx).to(torch.bfloat16)
    reference = copy.deepcopy(embedding)
    ids = torch.tensor([[3, 7, 7, 9, 3], [500, 7, 1, 1, 3]])
    upstream = torch.randn(2, 5, HIDDEN, dtype=torch.bfloat16)
    share = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)

    tied = TiedGradient(embedding)
    out = tied.lookup(ids)
    if handed_over:  # as the loss's backward does before the lookup's backward runs
        tied.pending = share.clone()
    (out * upstream).sum().backward()

    (reference(ids) * upstream).sum().backward()
    expected = reference.weight.grad + share if handed_over else reference.weight.grad
    assert torch.equal(embedding.weight.grad, expected)  # bit for bit: one rounding per element, as plain's
    assert tied.pending is None


def test_feeds_follows_the_autograd_graph():
    embedding = nn.Embedding(VOCAB, HIDDEN)
    tied = TiedGradient(embedding)
    hidden = torch.tanh(tied.lookup(torch.tensor([[1, 2]])) * 2)
    other = torch.ones(1, 2, HIDDEN, requires_grad=True) * 3
    assert tied.feeds(hidden) and not tied.feeds(other) and not tied.feeds(hidden.detach())


def test_only_a_plain_trainable_tied_embedding_is_taken():
    model = _tied_qwen2()
    head = model.get_output_embeddings()
    assert tied_embedding(model, head) is model.get_input_embeddings()
    model.get_input_embeddings().weight.requires_grad_(False)
    assert tied_embedding(model, head) is None  # frozen (LoRA): nothing to hand over
    model.get_input_embeddings().weight.requires_grad_(True)
    model.get_input_embeddings().max_norm = 1.0
    assert tied_embedding(model, head) is None  # max_norm renormalises the weight in the lookup
    untied = copy.deepcopy(model)
    untied.get_output_embeddings().weight = nn.Parameter(head.weight.detach().clone())
    assert tied_embedding(untied, untied.get_output_embeddings()) is None


def test_the_embedding_forward_is_restored_after_the_call():
    fused = fusion_core.fuse(_tied_qwen2(), {"linear_cross_entropy": True}).train()
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    fused(input_ids=ids, labels=ids).loss.backward()
    assert "forward" not in fused.get_input_embeddings().__dict__
