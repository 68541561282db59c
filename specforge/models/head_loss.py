"""The draft head's training loss, -sum_t p_t . log softmax(W h_t), without [positions x vocab] tensors.

At long sequences and a 32K draft vocab the per-step logits, their log-softmax and the teacher's
rows would dominate memory (for each of the 7 TTT steps, kept for the backward). Here the head
runs over chunks of positions, and each chunk's gradients with respect to h and W are formed at
once: the loss is the end of the graph, so its backward only scales them. Only the positions that
count are computed at all (the draft's output at a prompt or padding position is never scored).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# Rows per chunk: [rows x vocab] fp32 temporaries of 16 MiB at most. glibc maps anything above
# 32 MiB afresh (and faults every page in) each time; below it freed buffers are reused. At 1,024 x
# 8,192 (32 MiB) the loss ran 15-20% slower than at 512 rows (docs/benchmarks.md, #19).
CHUNK_ELEMENTS = 1 << 22


def chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


@dataclass
class TeacherRows:
    """Which rows of the teacher's distribution score which hidden rows: hidden row i is scored
    against probs[index[i]]; probs [P, V] fp32, the teacher's rows of the whole batch (not a copy
    per step). `chunk`: rows at a time (None: chunk_rows of the vocab); `weight` [N]: each row's
    loss weight."""

    probs: torch.Tensor
    index: torch.Tensor
    chunk: int | None = None
    weight: torch.Tensor | None = None

    def __post_init__(self):
        if self.chunk is None:
            self.chunk = chunk_rows(self.probs.shape[-1])


class _LinearSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, rows: TeacherRows):
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        want_weight = ctx.needs_input_grad[1]  # a frozen head (train.freeze_lm_head): no [V, H] product per chunk
        grad_weight = torch.zeros(weight.shape if want_weight else (), dtype=torch.float32, device=weight.device)
        predicted = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        device = hidden.device.type  # under autocast the head runs in its dtype, as the plain one would
        w = weight.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else weight
        for i in range(0, hidden.shape[0], rows.chunk):
            h = hidden[i : i + rows.chunk].to(w.dtype)
            p = rows.probs[rows.index[i : i + rows.chunk]]
            if rows.weight is not None:  # a weighted target: the gradient below holds for any row sum
                p = p * rows.weight[i : i + rows.chunk, None]
            logits = h @ w.T
            logp = logits.float().log_softmax(-1)
            loss -= (p * logp).sum()
            predicted[i : i + rows.chunk] = logits.max(-1).indices  # argmax; 6x faster in bf16 on CPU
            d_logits = (logp.exp() * p.sum(-1, keepdim=True) - p).to(w.dtype)
            grad_hidden[i : i + rows.chunk] = d_logits @ w
            if want_weight:
                grad_weight += (d_logits.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(predicted)
        return loss, predicted

    @staticmethod
    def backward(ctx, grad_loss, _grad_predicted):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_w = (grad_weight * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_w, None


def linear_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, rows: TeacherRows):
    """hidden [N, H], weight [V, H] -> (summed loss, a scalar; the head's argmax per row [N])."""
    if hidden.shape[0] == 0:  # nothing to score: a zero that still reaches the graph
        return (hidden.sum() + weight.sum()) * 0.0, torch.empty(0, dtype=torch.long, device=hidden.device)
    return _LinearSoftCrossEntropy.apply(hidden, weight, rows)


class DraftHead(torch.nn.Linear):
    """The draft's lm_head. Given TeacherRows it returns (loss, argmax) instead of logits; both go
    through the module call, so the hooks of FSDP and ZeRO-3 gather its weight either way."""

    def forward(self, hidden: torch.Tensor, rows: TeacherRows | None = None):
        if rows is None:
            return super().forward(hidden)
        return linear_soft_cross_entropy(hidden, self.weight, rows)
