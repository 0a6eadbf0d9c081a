"""A tied LM head's gradient made once: the input embedding's share added into the chunked loss's, in place.

When the head's weight is the input embedding's and trains, its gradient has two shares: the loss's, a
``[vocab, hidden]`` tensor the chunked loss makes in its forward, and the embedding lookup's. torch's embedding
backward makes a second dense ``[vocab, hidden]`` tensor for its share, zero but for the rows looked up, and
autograd adds the two. That happens at the very end of the backward, with every other gradient already held: in
a full fine-tuning step it is the step's resident peak, one weight-sized tensor over all the gradients (0.5 GB at
Llama-3.2-1B's widths, measured by sampling the resident size during the step).

So during a training call with labels, a plain ``nn.Embedding`` whose weight is the head's looks its tokens up
through :class:`_Lookup`, whose backward adds each looked-up row's gradient, summed per token by torch's own
``embedding_dense_backward``, into the loss's gradient in place, and returns that tensor as the weight's whole
gradient; the loss then returns none for the weight. ``G + E`` and ``G.index_add_(rows of E)`` round alike, so
the gradient is bit-identical. The loss hands its share over only when the lookup's output reaches the head's
input in the autograd graph (:meth:`TiedGradient.feeds`): then the lookup's backward runs after the loss's and
takes it. A lookup that finds nothing handed over makes its gradient as torch does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class TiedGradient:
    """One training call's hand-over point between the chunked loss and the lookups of the tied embedding."""

    def __init__(self, embedding: nn.Embedding) -> None:
        self.embedding = embedding
        self.weight = embedding.weight
        self.nodes: set[int] = set()
        """The ``id`` of this call's lookups' autograd nodes (not the nodes: they hold this object)."""
        self.pending: torch.Tensor | None = None
        """The loss's share of the weight's gradient, handed over by its backward, until a lookup's backward takes
        it."""

    def lookup(self, input: torch.Tensor) -> torch.Tensor:
        """The embedding's forward, through :class:`_Lookup` when its weight's gradient is wanted."""
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return nn.Embedding.forward(self.embedding, input)
        output: torch.Tensor = _Lookup.apply(input, self.weight, self)  # type: ignore[no-untyped-call]
        self.nodes.add(id(output.grad_fn))
        return output

    def feeds(self, tensor: torch.Tensor) -> bool:
        """Whether a lookup of this call is in ``tensor``'s autograd graph (so its backward runs after one from
        ``tensor``). The walk visits about the whole graph once a step, the lookup being at its far end: 1.2 ms at
        28 decoder layers, with or without checkpointing (a throwaway timing)."""
        seen: set[int] = set()
        stack = [tensor.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            if id(node) in self.nodes:
                return True
            seen.add(id(node))
            stack.extend(next_node for next_node, _ in node.next_functions)
        return False


class _Lookup(torch.autograd.Function):
    """``F.embedding(input, weight)``, whose backward adds into the gradient the loss handed over, if any."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, tied: TiedGradient) -> torch.Tensor:
        embedding = tied.embedding
        ctx.save_for_backward(input)
        ctx.tied, ctx.rows, ctx.padding_idx = tied, weight.shape[0], embedding.padding_idx
        return F.embedding(input, weight, embedding.padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (input,) = ctx.saved_tensors
        padding = -1 if ctx.padding_idx is None else ctx.padding_idx
        pending, ctx.tied.pending = ctx.tied.pending, None
        if pending is None:
            return None, torch.ops.aten.embedding_dense_backward(grad, input, ctx.rows, padding, False), None
        tokens, where = torch.unique(input, return_inverse=True)
        padded = (tokens == padding).nonzero()
        sums = torch.ops.aten.embedding_dense_backward(grad, where, tokens.numel(),
                                                       int(padded[0, 0]) if padded.numel() else -1, False)
        return None, pending.index_add_(0, tokens, sums.to(pending.dtype)), None


def tied_embedding(model: nn.Module, head: nn.Module) -> nn.Embedding | None:
    """``model``'s input embedding when it is a plain ``nn.Embedding`` sharing ``head``'s trainable weight, and
    looks up as :class:`_Lookup` does (no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``); else None."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if (type(embedding) is not nn.Embedding or "forward" in embedding.__dict__ or weight is None
            or embedding.weight is not weight or not weight.requires_grad or type(weight) is not nn.Parameter):
        return None
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return None
    return embedding


@contextmanager
def tied_lookups(model: nn.Module, head: nn.Module) -> Iterator[TiedGradient | None]:
    """For the ``with`` block (a training call's forward), the tied embedding looking up through a
    :class:`TiedGradient`, which the block gets; None where :func:`tied_embedding` finds none."""
    embedding = tied_embedding(model, head)
    if embedding is None:
        yield None
        return
    tied = TiedGradient(embedding)
    embedding.forward = tied.lookup  # type: ignore[method-assign]
    try:
        yield tied
    finally:
        del embedding.forward
