"""transformers' ``ForCausalLMLoss``, computed from the head's input chunk by chunk.

``ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
shift_labels=None)`` (the same in transformers 4.57 and 5.x) upcasts the logits to float32, shifts
the labels (pad with ``ignore_index``, drop the first) unless ``shift_labels`` is given, and takes
``cross_entropy`` with ``reduction="sum"`` divided by ``num_items_in_batch`` when that is given
(gradient accumulation), else the mean over the tokens whose label is not ``ignore_index``.

:func:`chunked_causal_lm_loss` computes the same number without the logits: for each chunk of rows,
the head and the model's recorded ops give that chunk's logits, cross entropy gives its share of the
loss, and its gradients with respect to the rows and the head's trainable tensors are made at once;
then the chunk's logits, their float32 copy and their gradient are freed. Any head runs its own
forward and ``torch.autograd.grad`` (:func:`_generic`); a plain ``nn.Linear`` head has its two
backward GEMMs written out (:func:`_linear`), since a ``[vocab, hidden]`` gradient per chunk would cost
a pass over that tensor per chunk. When that head's weight trains, its gradient is made afterwards one
block of the vocabulary at a time over every row (:func:`_weight_grad_by_vocab`): one GEMM per element
as in the plain backward, where a sum over chunks of rows would need a float32 total, twice the
gradient's bytes, to stay as exact. Rows whose label
is ``ignore_index`` add nothing to the loss or any gradient, so they are not computed at all.
:class:`ChunkedCrossEntropy`'s backward only scales the kept gradients by the incoming one: it computes
no logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fusion_core import FusionError
from fusion_linear_cross_entropy.deferred import DeferredLogits
from fusion_linear_cross_entropy.tied_gradient import TiedGradient

CHUNK_BYTES = 128 * 2**20
"""Default chunk: about as many rows as make 128 MiB of float32 logits, in multiples of :data:`ROW_MULTIPLE`."""

ROW_MULTIPLE = 128
"""Chunks have a multiple of this many rows: a GEMM tile's height on GPUs; fewer rows waste GEMM throughput
(on CPU, 110-row head GEMMs ran about 3x slower per FLOP than 1024-row ones)."""

FLUSH_ROWS = 1024
"""A low-precision gradient is summed over chunks in its own dtype for this many rows, then into float32."""


def chunk_rows(vocab: int, chunk_tokens: int | None) -> int:
    """Rows per chunk: ``chunk_tokens``, or about :data:`CHUNK_BYTES` of float32 logits (256 rows at Qwen2's
    151936-token vocabulary and Llama 3's 128256, 128 at Gemma's 256000)."""
    if chunk_tokens is not None:
        return chunk_tokens
    return max(1, round(CHUNK_BYTES / (4 * vocab * ROW_MULTIPLE))) * ROW_MULTIPLE


class Sum:
    """The sum over chunks of one tensor's gradient.

    Summed in the tensor's dtype (a bf16 ``[vocab, hidden]`` weight gradient: one buffer, and for a plain
    ``nn.Linear`` head each chunk's GEMM adds into it, ``addmm_``), and every :data:`FLUSH_ROWS` rows
    into a float32 total: the rounding stays that of a few bf16 additions however long the batch, at a
    float32 copy of the gradient only for batches longer than that.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.part: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.rows = 0

    def add(self, grad: torch.Tensor, rows: int) -> None:
        self.part = grad if self.part is None else self.part.add_(grad)
        self._count(rows)

    def add_product(self, left: torch.Tensor, right: torch.Tensor, rows: int) -> None:
        self.part = left @ right if self.part is None else self.part.addmm_(left, right)
        self._count(rows)

    def _count(self, rows: int) -> None:
        self.rows += rows
        if self.rows >= FLUSH_ROWS and self.dtype in (torch.bfloat16, torch.float16):
            assert self.part is not None
            self.total = self.part.float() if self.total is None else self.total.add_(self.part)
            self.part, self.rows = None, 0

    def result(self) -> torch.Tensor | None:
        if self.total is None:
            return self.part
        total, self.total = self.total, None
        if self.part is not None:
            total.add_(self.part)
        self.part = None
        return total.to(self.dtype)


@dataclass
class Chunks:
    """What one loss call computes: the logits placeholder, the rows' targets, the divisor, and options."""

    logits: DeferredLogits
    targets: torch.Tensor
    denominator: torch.Tensor
    ignore_index: int
    rows: int
    out: torch.Tensor | None = None
    """Where ``return_logits`` collects the (detached) logits of every row, or None."""
    tied: TiedGradient | None = None
    """Where the backward hands the tied embedding's weight its share of the gradient, or None: it returns it."""

    def loss(self, logits: torch.Tensor, start: int, stop: int, lse: torch.Tensor | None = None) -> torch.Tensor:
        """The chunk's share of the loss, from its logits (after the recorded ops); each row's log-sum-exp into
        ``lse[start:stop]`` when given."""
        if self.out is not None:
            self.out[start:stop] = logits.detach()
        logits = logits.float()
        if lse is None:
            return F.cross_entropy(logits, self.targets[start:stop], ignore_index=self.ignore_index,
                                   reduction="sum") / self.denominator
        # cross_entropy is nll_loss(log_softmax): the same kernels, and the log-softmax gives each row's
        # log-sum-exp from one element (x - log_softmax(x)), with no second pass over the logits.
        log_probs = F.log_softmax(logits, -1)
        torch.sub(logits.detach()[:, 0], log_probs.detach()[:, 0], out=lse[start:stop])
        return F.nll_loss(log_probs, self.targets[start:stop], ignore_index=self.ignore_index,
                          reduction="sum") / self.denominator


def _generic(chunks: Chunks, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
             needs: tuple[bool, ...]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Any head: its forward (hooks included) per chunk, gradients by ``torch.autograd.grad``."""
    wanted = [i for i, need in enumerate(needs[1:]) if need]
    sums = [Sum(tensors[i].dtype) for i in wanted]
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    loss = torch.zeros((), dtype=torch.float32, device=chunks.targets.device)
    for start in range(0, hidden.shape[0], chunks.rows):
        stop = min(start + chunks.rows, hidden.shape[0])
        rows = hidden[start:stop].detach().requires_grad_(needs[0])
        with torch.enable_grad():
            part = chunks.loss(chunks.logits.compute(rows), start, stop)
            inputs = ([rows] if needs[0] else []) + [tensors[i] for i in wanted]
            grads = list(torch.autograd.grad(part, inputs, allow_unused=True)) if part.requires_grad else []
        loss += part.detach()
        if needs[0] and grads:
            assert grad_hidden is not None
            grad_hidden[start:stop] = grads.pop(0)
        for total, grad in zip(sums, grads, strict=False):
            if grad is not None:
                total.add(grad, stop - start)
    result: list[torch.Tensor | None] = [None] * len(tensors)
    for i, total in zip(wanted, sums, strict=True):
        result[i] = total.result()
    return loss, [grad_hidden, *result]


def _linear(chunks: Chunks, hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...],
            needs: tuple[bool, ...], head: nn.Linear) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """A plain ``nn.Linear`` head: its GEMMs written out, the weight gradient summed by ``addmm_`` in place.

    ``torch.autograd.grad`` per chunk would make a ``[vocab, hidden]`` weight gradient per chunk and add
    it to the sum: a pass over that tensor per chunk, the main cost of small chunks.
    """
    weight, bias = head.weight, head.bias
    index = {id(t): i for i, t in enumerate(tensors)}
    w_at, b_at = index.get(id(weight)), index.get(id(bias)) if bias is not None else None
    others = [i for i, need in enumerate(needs[1:]) if need and i not in (w_at, b_at)]
    weight_trains = w_at is not None and needs[1 + w_at]
    by_vocab = weight_trains and chunks.logits.acts_per_logit()
    weight_sum = Sum(weight.dtype) if weight_trains and not by_vocab else None
    lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device) if by_vocab else None
    bias_sum = Sum(torch.float32) if b_at is not None and needs[1 + b_at] else None
    other_sums = [Sum(tensors[i].dtype) for i in others]
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    loss = torch.zeros((), dtype=torch.float32, device=chunks.targets.device)
    for start in range(0, hidden.shape[0], chunks.rows):
        stop = min(start + chunks.rows, hidden.shape[0])
        rows = hidden[start:stop].detach()
        with torch.enable_grad():
            product = F.linear(rows, weight.detach(), None if bias is None else bias.detach()).requires_grad_()
            part = chunks.loss(chunks.logits.replay(product), start, stop, lse)
            grads = list(torch.autograd.grad(part, [product, *(tensors[i] for i in others)], allow_unused=True))
        loss += part.detach()
        grad = grads.pop(0)
        if grad_hidden is not None:
            torch.mm(grad, weight.detach(), out=grad_hidden[start:stop])
        if weight_sum is not None:
            weight_sum.add_product(grad.t(), rows, stop - start)
        if bias_sum is not None:
            bias_sum.add(grad.sum(0, dtype=torch.float32), stop - start)
        for total, other in zip(other_sums, grads, strict=True):
            if other is not None:
                total.add(other, stop - start)
    result: list[torch.Tensor | None] = [None] * len(tensors)
    if lse is not None:
        result[w_at] = _weight_grad_by_vocab(chunks, hidden, head, lse)  # type: ignore[index]
    if weight_sum is not None:
        result[w_at] = weight_sum.result()  # type: ignore[index]
    if bias_sum is not None and bias is not None:
        bias_grad = bias_sum.result()
        result[b_at] = None if bias_grad is None else bias_grad.to(bias.dtype)  # type: ignore[index]
    for i, other_sum in zip(others, other_sums, strict=True):
        result[i] = other_sum.result()
    return loss, [grad_hidden, *result]


def _vocab_block(chunk_logits: int, rows: int) -> int:
    """Columns per block of :func:`_weight_grad_by_vocab`: as many logits as a chunk of rows has, over ``rows``
    rows, in multiples of :data:`ROW_MULTIPLE` where there are that many."""
    block = max(1, chunk_logits // max(rows, 1))
    return block // ROW_MULTIPLE * ROW_MULTIPLE if block >= ROW_MULTIPLE else block


def _weight_grad_by_vocab(chunks: Chunks, hidden: torch.Tensor, head: nn.Linear, lse: torch.Tensor) -> torch.Tensor:
    """The head weight's share of the gradient, ``dloss/dproduct^T @ hidden``, one block of the vocabulary at a time.

    Each block's logits are made again for every row (a fourth head GEMM, about a third more head FLOPs),
    turned in place into ``(softmax - onehot) / denominator`` with the rows' log-sum-exp from the chunks, taken back
    through the recorded ops by autograd, and multiplied by all rows at once: each element of the gradient is
    one GEMM, rounded once, as in the plain backward, and nothing float32 the size of the weight exists.
    """
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    hidden, vocab = hidden.detach(), weight.shape[0]
    counted = chunks.targets != chunks.ignore_index
    every_row_counts = bool(counted.all())
    grad_weight = torch.empty_like(weight)
    shift = (lse + chunks.denominator.to(lse.dtype).log())[:, None]  # exp(x - shift) = softmax / denominator
    block = _vocab_block(chunks.rows * vocab, hidden.shape[0])
    for begin in range(0, vocab, block):
        end = min(begin + block, vocab)
        with torch.enable_grad():
            product = F.linear(hidden, weight[begin:end], None if bias is None else bias[begin:end]).requires_grad_()
            replayed = chunks.logits.replay(product)
            logits = replayed.float()
        # The upcast made ``logits`` (nothing saved it for backward): its memory can hold the gradient.
        grad = logits.detach() if replayed.dtype != torch.float32 else logits.detach().clone()
        grad.sub_(shift).exp_()
        hit = (counted & (chunks.targets >= begin) & (chunks.targets < end)).nonzero().squeeze(1)
        grad[hit, chunks.targets[hit] - begin] -= 1 / chunks.denominator
        if not every_row_counts:
            grad[~counted] = 0
        (grad_product,) = torch.autograd.grad(logits, product, grad)
        torch.mm(grad_product.t(), hidden, out=grad_weight[begin:end])
    return grad_weight


class ChunkedCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(head(hidden) -> ops -> float)) / denominator`` with gradients made in the forward.

    Inputs: the :class:`Chunks`, the head's input rows, and every trainable tensor the logits depend on
    (the head's parameters that require grad, a learnable logit scale). Each one's gradient is summed
    over the chunks in the forward and returned, scaled, by the backward.
    """

    @staticmethod
    def forward(ctx: Any, chunks: Chunks, hidden: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        needs = tuple(ctx.needs_input_grad[1:])
        linear = chunks.logits.fusion_source.linear
        # The GEMMs are written out only where they run in the head's dtype (not under autocast).
        if linear is not None and linear.weight.dtype == hidden.dtype and not torch.is_autocast_enabled(
                hidden.device.type):
            loss, grads = _linear(chunks, hidden, tensors, needs, linear)
        else:
            loss, grads = _generic(chunks, hidden, tensors, needs)
        ctx.grads = grads
        ctx.tied = None
        if chunks.tied is not None:
            ctx.tied = chunks.tied
            ctx.tied_at = 2 + next(i for i, t in enumerate(tensors) if t is chunks.tied.weight)  # after chunks, hidden
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = ctx.grads
        if grads is None:
            raise FusionError("linear_cross_entropy: the fused loss was differentiated twice; its gradients are "
                              "kept once (retain_graph and double backward are not supported)")
        ctx.grads = None
        grads = [None, *(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)]
        if ctx.tied is not None:
            ctx.tied.pending, grads[ctx.tied_at] = grads[ctx.tied_at], None
        return tuple(grads)


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    *,
    chunk_tokens: int | None = None,
    return_logits: bool = False,
    tied: TiedGradient | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``ForCausalLMLoss`` on a :class:`DeferredLogits` (see the module docs); same arguments, same result.

    ``tied``: the call's tied embedding lookups; the head weight's gradient is handed to them when one is in the
    head input's graph (:mod:`fusion_linear_cross_entropy.tied_gradient`).
    """
    if not isinstance(logits, DeferredLogits):
        raise FusionError("linear_cross_entropy: the loss received computed logits, not the LM head's deferred ones")
    vocab = logits.shape[-1]
    if vocab != vocab_size:
        raise FusionError(f"linear_cross_entropy: {logits.fusion_source.owner}'s head gives {vocab} logits per token "
                          f"but its loss is asked for vocab_size={vocab_size}")
    hidden = logits.fusion_source.hidden
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    if targets.numel() != hidden.shape[0]:
        raise FusionError(f"linear_cross_entropy: {targets.numel()} labels for {hidden.shape[0]} tokens")
    counted = targets != ignore_index
    if num_items_in_batch is None:
        denominator = counted.sum().to(torch.float32)
    elif isinstance(num_items_in_batch, torch.Tensor):
        denominator = num_items_in_batch.to(logits.device)
    else:
        denominator = torch.tensor(num_items_in_batch, device=logits.device)
    out = None
    if return_logits:  # every row, for the logits; ignored ones cost compute but add nothing to the loss
        out = torch.empty(hidden.shape[0], vocab, dtype=logits.dtype, device=logits.device)
    else:  # only the rows that count: an ignored row adds nothing to the loss or to any gradient
        index = counted.nonzero().squeeze(1)
        hidden, targets = hidden.index_select(0, index.to(hidden.device)), targets.index_select(0, index)
    chunks = Chunks(logits, targets, denominator, ignore_index, chunk_rows(vocab, chunk_tokens), out)
    source = logits.fusion_source
    tensors: dict[int, torch.Tensor] = {}
    for tensor in (*source.head.parameters(), *(t for op in logits.fusion_ops for t in op.tensors())):
        if tensor.requires_grad:
            tensors.setdefault(id(tensor), tensor)
    if tied is not None and id(tied.weight) in tensors and tied.feeds(source.hidden):
        chunks.tied = tied
    loss: torch.Tensor = ChunkedCrossEntropy.apply(chunks, hidden, *tensors.values())  # type: ignore[no-untyped-call]
    if out is not None:
        source.computed[id(logits)] = out.view(logits.shape)
    return loss
