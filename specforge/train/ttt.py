"""Training-time test (docs/contract.md §4): unroll the draft k steps on its own features and score every
step against the target's distribution.

Alignment, for a sequence of S tokens: the target's states at position t have seen tokens 0..t.
At TTT step k the draft at position t consumes token t+1+k (ground truth) and the feature of the
previous step (step 0: the projected target aux states at t; later: the feature `draft.step`
returns, its pre-norm output or, with EAGLE 3.1's norm_output, the post-norm one), sits at
position t+k, and predicts token t+2+k, whose teacher is the target's distribution at position
t+1+k.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specforge.models.attention import TTTMask, take
from specforge.models.head_loss import TeacherRows


class Teacher:
    """The target's own head over its final post-norm states, restricted to the draft vocab.

    The loss reads the head's draft-vocab rows only; which positions count needs the target's
    argmax over its whole vocab (24x the draft's 2,048 columns on SmolLM2). That part depends on
    the stored states alone, so the training loop computes it once per sample (`in_vocab`, kept
    by TeacherMemo) and hands it in with the batch: later epochs never read the full head."""

    def __init__(self, lm_head_weight: torch.Tensor, t2d: torch.Tensor, chunk: int = 2048,
                 hard_weight: float = 0.0):
        self.weight = lm_head_weight  # [V, H_target], frozen
        self.draft_ids = torch.nonzero(t2d, as_tuple=False).squeeze(-1)  # sorted target ids
        self.draft_weight = lm_head_weight[self.draft_ids.to(lm_head_weight.device)]  # [Vd, H_target]
        self.t2d = t2d
        self.chunk = chunk
        if not 0.0 <= hard_weight <= 1.0:
            raise ValueError(f"train.hard_label_weight: {hard_weight} is not in [0, 1]")
        self.hard_weight = hard_weight  # the loss target: (1 - w) * distribution + w * one-hot of its argmax

    @torch.no_grad()
    def in_vocab(self, last: torch.Tensor) -> torch.Tensor:
        """last [..., H] -> whether the target's argmax over its whole vocab is a draft token [...]."""
        flat = last.reshape(-1, last.shape[-1]).to(self.weight.dtype)
        argmax = [(flat[i : i + self.chunk] @ self.weight.T).max(-1).indices  # 6x faster in bf16 on CPU
                  for i in range(0, flat.shape[0], self.chunk)]  # bounded memory: V can be 150K wide
        argmax = torch.cat(argmax) if argmax else flat.new_zeros(0, dtype=torch.long)
        return self.t2d.to(argmax.device)[argmax].view(last.shape[:-1])

    @torch.no_grad()
    def probs(self, last: torch.Tensor) -> torch.Tensor:
        """last [..., H] -> the loss target over the draft vocab [..., Vd], fp32. ttt_forward hands
        in the rows some step scores against, not every position ([N, Vd] fp32 is the larger
        block at a 32K draft vocab)."""
        flat = last.reshape(-1, last.shape[-1]).to(self.weight.dtype)
        probs = []
        for i in range(0, flat.shape[0], self.chunk):
            p = (flat[i : i + self.chunk] @ self.draft_weight.T).float().softmax(-1)
            if self.hard_weight:  # greedy verification accepts the argmax alone: weigh it up
                top = p.argmax(-1, keepdim=True)
                p = (1 - self.hard_weight) * p
                p.scatter_add_(-1, top, torch.full_like(top, self.hard_weight, dtype=p.dtype))
            probs.append(p)
        probs = torch.cat(probs) if probs else flat.new_zeros(0, self.draft_ids.numel(), dtype=torch.float32)
        return probs.view(*last.shape[:-1], self.draft_ids.numel())


class TeacherMemo:
    """Samples of a store with their `in_vocab` attached, computed the first time a sample is read
    and kept (one bit per token, on the CPU: 125 MB per billion tokens a rank reads): the
    full-vocab product runs once per sample, not once per epoch. Each rank keeps what it reads."""

    def __init__(self, store, teacher: Teacher, device):
        self.store, self.teacher, self.device = store, teacher, device
        self.known: dict[int, tuple[np.ndarray, torch.Size]] = {}

    def samples(self, indices) -> list[dict]:
        if hasattr(self.store, "prefetch"):  # extract=online: the micro-batch's states, computed together
            self.store.prefetch(indices)
        out = []
        for i in indices:
            sample = self.store[i]
            if i not in self.known:
                in_vocab = self.teacher.in_vocab(sample["last"].to(self.device)).cpu()
                self.known[i] = np.packbits(in_vocab.numpy()), in_vocab.shape
            bits, shape = self.known[i]
            in_vocab = torch.from_numpy(np.unpackbits(bits, count=shape.numel()).astype(bool)).view(shape)
            out.append({**sample, "in_vocab": in_vocab})
        return out


@dataclass
class StepStats:
    """Sums over positions for one TTT step; turned into rates once aggregated."""

    loss_sum: torch.Tensor
    positions: torch.Tensor
    correct: torch.Tensor
    chain_correct: torch.Tensor  # correct at this step and every step before
    chain_prev: torch.Tensor  # correct at every step before (the denominator of conditional acceptance)


def shift(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t+by], padding the end with `fill`."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


def scored_slots(needed: torch.Tensor) -> torch.Tensor | None:
    """[B, S] bool: the positions whose outputs a TTT step needs -> [B, n] the sorted positions its
    queries run on, n the widest row's count; None when nearly every position is needed (dropping
    under a tenth saves less than the gathers cost: +2-3% at S - 3 of S, measured). The others may
    drop because a later step's keys are seen by their own position alone (the diagonal) and step
    0's keys, which every step attends to, are computed at every position regardless: prompts and
    padding need no output. Narrower rows are topped up with unneeded positions, none twice: those
    after the row's first needed one, then the nearest before it, so that no slot comes before
    the batch's first needed position (the CPU flash kernel runs the span of slots alone)."""
    if not needed.numel():
        return None
    seq, n = needed.shape[1], max(int(needed.sum(1).max()), 1)
    if n > 0.9 * seq:
        return None
    pos = torch.arange(seq, device=needed.device).expand_as(needed)
    first = torch.where(needed, pos, seq).min(dim=1, keepdim=True).values  # S: none needed
    order = torch.where(needed, pos, torch.where(pos > first, seq + pos, 3 * seq - pos))
    return order.argsort(dim=1)[:, :n].sort(dim=1).values


def index_in(slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where each of `positions` [B, m] sits among the sorted `slots` [B, n] (one that is not
    among them: some index, its row is never scored)."""
    return torch.searchsorted(slots, positions).clamp(max=slots.shape[1] - 1)


def ttt_forward(draft, batch: dict, teacher: Teacher, ttt_length: int, step_weight: float,
                loss_chunk: int | None = None, reach_weight: float = 0.0, skip_unscored: bool = True):
    """Returns the weighted loss (a scalar to backprop) and per-step StepStats.

    batch: input_ids [B,S] long, loss_mask [B,S] bool (False on padding), aux [B,S,3H], last [B,S,H],
    position_ids [B,S] (or [B,3,S] M-RoPE positions of vision-language targets); optionally
    embed_override [B,S,H] + embed_override_mask [B,S] bool: where the mask is set, the draft's
    token embedding of that position is the override (the target's merged input embedding);
    optionally doc_ids [B,S] (packed rows, see batches.py): attention and scoring stay within a
    document, so a packed row gives its documents' losses and gradients as unpacked; optionally
    in_vocab [B,S] bool (TeacherMemo): whether the target's argmax is a draft token, else computed.
    reach_weight w: at step k a position's loss weighs 1 - w + w x [the draft's greedy chain was
    right there at steps 0..k-1] (greedy verification never uses a draft after its first miss).
    skip_unscored: the steps run where they are needed (`scored_slots`): step 0 computes keys and
    values everywhere but its outputs only where it scores or a later step goes on, the later steps
    only where they score. The same loss and gradients, less work on prompts and padding; False
    runs every step on every position.
    """
    if not 0.0 <= reach_weight <= 1.0:
        raise ValueError(f"train.reach_weight: {reach_weight} is not in [0, 1]")
    ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
    doc_ids = batch.get("doc_ids")
    in_vocab = batch.get("in_vocab")
    in_vocab = (teacher.in_vocab(batch["last"]) if in_vocab is None else in_vocab).bool()
    seq_len = ids.shape[1]
    feat = draft.project(batch["aux"].to(draft.fc.weight.dtype))
    embeds = None  # token embeddings of positions 0..S-1, shifted like the ids at each step
    if "embed_override" in batch:
        embeds = draft.embed_tokens(ids)
        override = batch["embed_override"].to(device=embeds.device, dtype=embeds.dtype)
        embeds = torch.where(batch["embed_override_mask"].bool()[..., None], override, embeds)
    valids = []  # [B, S] per step: the positions it scores
    for k in range(ttt_length):
        valid = shift(loss_mask, 2 + k, False) & shift(in_vocab, 1 + k, False)
        if doc_ids is not None:  # the token predicted must be of the same document
            valid &= shift(doc_ids, 2 + k, -1) == doc_ids
        valids.append(valid)
    # The teacher's rows: step k at position p is scored against the target's distribution at p+1+k,
    # so only those rows of `last` go through its head; teacher_row maps a position to its row.
    read = torch.zeros_like(loss_mask)
    for k, valid in enumerate(valids[: seq_len - 1]):
        read[:, 1 + k :] |= valid[:, : seq_len - 1 - k]
    probs = teacher.probs(batch["last"][read])  # [N, Vd]
    teacher_top = probs.argmax(-1)  # the teacher's choice within the draft vocab
    teacher_row = read.flatten().cumsum(0).view_as(read) - 1
    # Where the steps' queries sit (None: every position): step 0's keys are needed everywhere,
    # its outputs where it scores or a later step continues; the later steps' only where they score.
    first = later = None
    if skip_unscored:
        needed_later = torch.stack(valids[1:]).any(0) if ttt_length > 1 else torch.zeros_like(valids[0])
        first, later = scored_slots(valids[0] | needed_later), scored_slots(needed_later)
        # later's needed positions are among first's, so later is None only where first is
    positions_3d = batch["position_ids"].dim() == 3  # M-RoPE [B, 3, S]
    keys, values = [], []  # per TTT step: the attention splits them, never concatenated
    total = feat.new_zeros((), dtype=torch.float32)
    stats, chain = [], torch.ones_like(loss_mask)
    for k, valid in enumerate(valids):
        slots = first if k == 0 else later
        inputs = None if k == 0 else later  # step 0 reads every position (its keys)
        if k == 1:
            feat = take(feat, later if first is None else index_in(first, later))
        out, normed, (new_k, new_v) = draft.step(
            take(shift(ids, 1 + k), inputs), feat,
            take(batch["position_ids"], inputs, dim=2 if positions_3d else 1) + k,
            past_kv=(keys, values) if keys else None,
            attn_mask=TTTMask(seq_len, k, doc_ids, slots),
            input_embeds=None if embeds is None else take(shift(embeds, 1 + k), inputs),
            head=False, queries=first if k == 0 else None,
        )
        keys.append(new_k)
        values.append(new_v)
        rows, at = take(valid, slots).nonzero(as_tuple=True)  # only scored positions reach the head
        positions = at if slots is None else slots[rows, at]
        target = teacher_row[rows, positions + 1 + k]
        weight = None
        if reach_weight and k:
            weight = 1.0 - reach_weight + reach_weight * chain[rows, positions].float()
        loss_sum, predicted = draft.lm_head(normed[rows, at], TeacherRows(probs, target, loss_chunk, weight))
        n = valid.sum()
        total = total + (step_weight**k) * loss_sum / n.clamp(min=1)
        with torch.no_grad():
            correct = torch.zeros_like(valid)
            correct[rows, positions] = predicted == teacher_top[target]
            prev = chain & valid
            chain = prev & correct
            stats.append(StepStats(loss_sum.detach(), n, correct.sum(), chain.sum(), prev.sum()))
        feat = out  # the next step's feature: the pre-norm output (norm(out) with norm_output, EAGLE 3.1)
    return total, stats


def summarize(stats_per_step: list[StepStats]) -> dict:
    """Rates from summed StepStats: loss_k, acc_k, cond_acc_k and the simulated accept length."""
    out, prod, accept = {}, 1.0, 1.0
    for k, s in enumerate(stats_per_step):
        n = max(int(s.positions), 1)
        acc = int(s.correct) / n
        out[f"loss_{k}"] = float(s.loss_sum) / n
        out[f"acc_{k}"] = acc
        out[f"cond_acc_{k}"] = int(s.chain_correct) / max(int(s.chain_prev), 1)
        prod *= acc
        accept += prod
    out["positions"] = int(stats_per_step[0].positions) if stats_per_step else 0
    out["sim_accept_length"] = accept
    return out


def add_stats(a: list[StepStats] | None, b: list[StepStats]) -> list[StepStats]:
    if a is None:
        return [StepStats(*(t.detach().clone() for t in vars(s).values())) for s in b]
    return [StepStats(*(x + y for x, y in zip(vars(sa).values(), vars(sb).values())))
            for sa, sb in zip(a, b)]
