"""Attention for the draft: the training-time-test (TTT) mask and its kernels.

During TTT step k the draft has produced keys for steps 0..k over the same S positions. A query at
position t sees the keys 0..t of step 0 (causal) plus the key at position t of every later step
(a diagonal per step): exactly what the draft sees at serving time, where step k's token sits at
position t+k and its own earlier drafts are its only extra context. With packed documents
(`TTTMask.doc_ids`) the causal block also stops at the document's start.

The dense mask spans (k+1) x S keys per query: O(k S^2) work for S + k allowed keys. The TTT
kernels split it instead, O(S^2 + k S): the causal block once, each later step's key as one dot
product per position, both under one log-sum-exp. Same numbers as the dense mask. Training keeps
each step's keys and values apart (lists, never concatenated or expanded to the query heads).
After step 0 a position's own keys are seen by itself alone, so the later steps may run on the
positions a loss still needs (`TTTMask.slots`, train/ttt.py): queries and later keys at those
positions only, step 0's keys at all S.

- sdpa: on CPU, torch's fused flash kernel for the causal block (it returns the log-sum-exp; a
  custom backward reuses its kernel with the combined output, in pieces when the heads do not
  divide among the threads), the diagonals element-wise, one step at a time; with slots, the
  kernel runs the rows from the batch's first slot to its last (the keys before them as one
  rectangle); elsewhere (GPUs) SDPA's own fused kernels (flash, memory-efficient), the diagonals
  joining as one extra "sink" key per query, autograd through SDPA: no [S, S] scores are kept.
  For plain causal masks (the engine), torch's SDPA.
- eager: the split written out in plain torch; readable, autograd does the backward.
- dense: the full (k+1) x S mask through SDPA; the reference that parity tests compare against.
- flex: FlexAttention with a block mask built from the same rule, both compiled once; GPU training
  (its backward does not run on CPU). Imported lazily so the CPU path never depends on it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from specforge.config import ATTENTIONS


@dataclass(frozen=True)
class TTTMask:
    """The mask of TTT step `step` over `seq_len` positions: keys are [step 0 | step 1 | ... | step].
    `doc_ids` [B, S] (packed batches): a query never sees a key of another document.
    `slots` [B, n] (steps after the first): the queries are these positions only (sorted, no
    repeats), and so are the keys of steps 1..step; step 0's keys are all S positions."""

    seq_len: int
    step: int
    doc_ids: Optional[torch.Tensor] = None
    slots: Optional[torch.Tensor] = None

    @property
    def n_queries(self) -> int:
        return self.seq_len if self.slots is None else self.slots.shape[1]

    def allows(self, q_idx, kv_idx, b=None):
        """The rule itself, written once: usable on tensors (dense and flex alike). Flex evaluates it
        on indices padded up to its block size too: those read in range and are refused."""
        n = self.n_queries
        q_pos = q_idx if self.slots is None else self.slots[b, q_idx.clamp(max=n - 1)]
        first = kv_idx < self.seq_len
        later = (kv_idx - self.seq_len) % n  # index of a later step's key among the queries
        rule = (first & (kv_idx <= q_pos)) | (~first & (later == q_idx))
        rule = rule & (q_idx < n) & (kv_idx < self.seq_len + n * self.step)
        if self.doc_ids is not None:  # a later step's allowed key sits at the query's own position
            kv_pos = torch.where(first, kv_idx, q_pos)
            rule = rule & (self.doc_ids[b, q_pos] == self.doc_ids[b, kv_pos])
        return rule

    def dense(self, device=None) -> torch.Tensor:
        """[B|1, n, S + step n] bool."""
        return self._grid(self.seq_len + self.n_queries * self.step, device)

    def causal_block(self, device=None) -> torch.Tensor:
        """[B|1, n, S] bool: the step-0 keys alone."""
        return self._grid(self.seq_len, device)

    def _grid(self, n_keys: int, device) -> torch.Tensor:
        q = torch.arange(self.n_queries, device=device)[None, :, None]
        kv = torch.arange(n_keys, device=device)[None, None, :]
        per_row = self.slots if self.slots is not None else self.doc_ids
        if per_row is None:
            return self.allows(q, kv)
        b = torch.arange(per_row.shape[0], device=per_row.device)[:, None, None]
        return self.allows(q.to(per_row.device), kv.to(per_row.device), b).to(device)


def take(x: torch.Tensor, slots: Optional[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """x [B, .., S (at `dim`), ..] -> the slots' positions [B, .., n, ..], row by row (None: x)."""
    if slots is None:
        return x
    shape = [1] * x.dim()
    shape[0], shape[dim] = slots.shape
    index = slots.view(shape).expand(*x.shape[:dim], slots.shape[1], *x.shape[dim + 1 :])
    return x.gather(dim, index)


def causal_mask(n: int, past: int, device=None) -> torch.Tensor:
    """[n, past+n]: every new token sees the whole past and the new tokens up to itself."""
    q = torch.arange(n, device=device)[:, None]
    kv = torch.arange(past + n, device=device)[None, :]
    return kv <= q + past


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def eager_attention(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """q [B,h,n,d], k/v [B,kvh,L,d], mask bool [B|1, n, L] -> [B,h,n,d]."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def sdpa_attention(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, _expand_kv(k, n_rep), _expand_kv(v, n_rep), attn_mask=mask[:, None]
    )


def _steps(keys, values, mask: TTTMask):
    """Per-step keys and values: [B,kvh,S,d] for step 0, then [B,kvh,n,d] per later step (n = S
    without slots). Accepts the lists the training loop keeps, or the steps concatenated along the
    sequence (dense layout)."""
    if torch.is_tensor(keys):  # [step 0: S | each later step: n]
        keys, values = (_split_steps(x, mask.seq_len, mask.n_queries) for x in (keys, values))
    if len(keys) != mask.step + 1 or len(values) != mask.step + 1:
        raise ValueError(f"TTT step {mask.step} needs {mask.step + 1} steps of keys, got {len(keys)}")
    return list(keys), list(values)


def _split_steps(x: torch.Tensor, seq_len: int, n: int) -> list[torch.Tensor]:
    rest = x[:, :, seq_len:]
    return [x[:, :, :seq_len], *(rest.split(n, dim=2) if rest.shape[2] else ())]


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B,h,..] -> [B,kvh,h/kvh,..]: the query heads of each key head side by side (GQA without
    copying the keys; head i reads key head i // (h/kvh), as repeat_interleave lays them out)."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _diagonal_scores(qg: torch.Tensor, later_keys, scale: float) -> torch.Tensor:
    """Each later step's one score per position: grouped queries [B,g,r,n,d] (fp32) against that
    step's keys [B,g,n,d], broadcast over the group -> [k,B,g,r,n] fp32 (the keys promote exactly;
    autograd keeps them in their own dtype)."""
    return torch.stack([(qg * k[:, :, None]).sum(-1) for k in later_keys]) * scale


def ttt_eager_attention(q, keys, values, mask: TTTMask) -> torch.Tensor:
    """The O(S^2 + kS) split in plain torch: scores of the causal block [.., S, S] and of each
    later step's diagonal [.., S, k] share one softmax."""
    keys, values = _steps(keys, values, mask)
    n_rep = q.shape[1] // keys[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf = q.float()
    causal = (qf @ _expand_kv(keys[0], n_rep).float().transpose(-1, -2)) * scale
    causal = causal.masked_fill(~mask.causal_block(q.device)[:, None], float("-inf"))
    diag = [(qf * _expand_kv(k, n_rep).float()).sum(-1) * scale for k in keys[1:]]  # each [B,h,S]
    p = torch.cat([causal, *(d[..., None] for d in diag)], dim=-1).softmax(-1)
    out = p[..., : mask.seq_len] @ _expand_kv(values[0], n_rep).float()
    for j, v in enumerate(values[1:]):
        out = out + p[..., mask.seq_len + j, None] * _expand_kv(v, n_rep).float()
    return out.to(q.dtype)


def causal_flash_backward(grad_out, q, k, v, out, lse, mask, scale, pieces: bool | None = None):
    """torch's CPU flash backward for causal attention (plus an additive `mask` [B,1,S,S] or None).

    The kernel runs each (batch, head) on one thread: 1 x 9 heads on 2 threads wait for the thread
    with five. When B*h does not divide among the threads (`pieces` None: decided here), the causal
    square goes in three pieces with twice as many items of equal work: the two triangles (queries
    and keys [0, S/2) and [S/2, S)) batched in one call, then the rectangle below them (queries
    [S/2, S) x keys [0, S/2)) in `_rectangle_backward` (as two quarters batched). Each piece takes the whole
    output and log-sum-exp as they are, so the pieces' gradients sum to the whole exactly."""
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    batch, heads, seq = q.shape[:3]
    if pieces is None:
        pieces = (batch * heads) % torch.get_num_threads() != 0 and seq % 4 == 0 and seq >= 256
    if not pieces:
        return backward(grad_out, q, k, v, out, lse, 0.0, True, attn_mask=mask, scale=scale)
    half = seq // 2

    def triangles(x):  # [B, h, S, ..] -> the two halves' rows, batched: [2B, h, S/2, ..]
        return torch.cat([x[:, :, :half], x[:, :, half:]])

    tq, tk, tv = backward(triangles(grad_out), triangles(q), triangles(k), triangles(v), triangles(out),
                          triangles(lse), 0.0, True, scale=scale,
                          attn_mask=None if mask is None else torch.cat([mask[:, :, :half, :half], mask[:, :, half:, half:]]))
    rq, rk, rv = _rectangle_backward(grad_out[:, :, half:], q[:, :, half:], k[:, :, :half], v[:, :, :half],
                                     out[:, :, half:], lse[:, :, half:],
                                     None if mask is None else mask[:, :, half:, :half], scale)
    first, second = slice(0, batch), slice(batch, 2 * batch)
    dq = torch.cat([tq[first], tq[second] + rq], dim=2)
    dk = torch.cat([(tk[first].float() + rk).to(k.dtype), tk[second]], dim=2)
    dv = torch.cat([(tv[first].float() + rv).to(v.dtype), tv[second]], dim=2)
    return dq, dk, dv


def _rectangle_backward(grad_out, q, k, v, out, lse, mask, scale: float):
    """The flash backward of queries that see every key (no causal mask but `mask`) -> dq, and dk,
    dv in fp32 (the callers add them to another block's before rounding). The kernel gives each
    (batch, head) to one thread: when they do not divide among the threads the query rows go in two
    halves batched side by side (twice the items, the same work), their key gradients summed."""
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    batch, heads, rows = q.shape[:3]
    if (batch * heads) % torch.get_num_threads() == 0 or rows % 2:
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        return dq, dk.float(), dv.float()
    half = rows // 2

    def halves(x):
        return None if x is None else torch.cat([x[:, :, :half], x[:, :, half:]])

    dq, dk, dv = backward(halves(grad_out), halves(q), torch.cat([k, k]), torch.cat([v, v]), halves(out),
                          halves(lse), 0.0, False, attn_mask=halves(mask), scale=scale)
    first, second = slice(0, batch), slice(batch, 2 * batch)
    return torch.cat([dq[first], dq[second]], dim=2), dk[first].float() + dk[second], dv[first].float() + dv[second]


def _span(slots: Optional[torch.Tensor], seq: int) -> tuple[int, int]:
    """The positions [lo, hi) the flash kernel runs queries on: from the batch's first slot to its
    last (scored_slots keeps every row's slots in such a span), widened to a multiple of 4 rows
    where the sequence allows (the backward's thread-balancing pieces need it); all S without slots."""
    if slots is None:
        return 0, seq
    lo, hi = int(slots[:, 0].min()), int(slots[:, -1].max()) + 1
    width = -(-(hi - lo) // 4) * 4
    hi = min(seq, lo + width)
    return max(0, hi - width), hi


def _all_rows(x: torch.Tensor, slots: Optional[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """[B,h,n,d] at the slots' positions -> [B,h,hi-lo,d] for positions lo..hi-1, zeros elsewhere."""
    if slots is None:
        return x
    index = (slots - lo)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return x.new_zeros(x.shape[0], x.shape[1], hi - lo, x.shape[3]).scatter_(2, index, x)


def _causal_from(q, k, v, mask, lo: int, scale: float):
    """Queries at positions lo..lo+L-1 attending causally to keys 0..lo+L-1, on torch's CPU flash
    kernel: the triangle (keys from lo, the kernel's own causal alignment) and, when lo > 0, the
    rectangle before it (keys 0..lo-1, seen by every query), joined under their log-sum-exp.
    `mask`: the additive document mask [B,1,S,S] or None. -> (out fp32, lse) [B,h,L,d], [B,h,L]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    hi = lo + q.shape[2]
    out, lse = flash(q, k[:, :, lo:hi], v[:, :, lo:hi], 0.0, True,
                     attn_mask=None if mask is None else mask[:, :, lo:hi, lo:hi], scale=scale)
    if not lo:
        return out.float(), lse
    rect_out, rect_lse = flash(q, k[:, :, :lo], v[:, :, :lo], 0.0, False,
                               attn_mask=None if mask is None else mask[:, :, lo:hi, :lo], scale=scale)
    if mask is not None:  # a row of a document that starts at lo or later sees none of it (the kernel says lse 0)
        rect_lse = rect_lse.masked_fill(~(mask[:, :, lo:hi, :lo] == 0).any(-1), float("-inf"))
    both = torch.logaddexp(lse, rect_lse)
    out = (lse - both).exp()[..., None] * out.float() + (rect_lse - both).exp()[..., None] * rect_out.float()
    return out, both


def _causal_from_backward(grad_out, q, k, v, out, lse, mask, lo: int, scale: float):
    """The gradients of _causal_from's two blocks, each from the flash backward with the combined
    output and log-sum-exp (the pieces' gradients sum to the whole). -> dq, dk, dv; dk and dv
    [B,kvh,lo+L,d] (keys past the last query get none)."""
    hi = lo + q.shape[2]
    dq, dk, dv = causal_flash_backward(grad_out, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse,
                                       None if mask is None else mask[:, :, lo:hi, lo:hi], scale)
    if not lo:
        return dq, dk, dv
    rq, rk, rv = _rectangle_backward(grad_out, q, k[:, :, :lo], v[:, :, :lo], out, lse,
                                     None if mask is None else mask[:, :, lo:hi, :lo], scale)
    return (dq.float() + rq).to(q.dtype), torch.cat([rk.to(k.dtype), dk], dim=2), torch.cat([rv.to(v.dtype), dv], dim=2)


class _FlashTTT(torch.autograd.Function):
    """The split on torch's CPU flash kernel. Forward: the kernel gives the causal block's output
    and log-sum-exp; the diagonals join under the combined log-sum-exp. Backward: the flash
    backward, handed the COMBINED output and log-sum-exp, yields exactly the causal keys' share of
    the gradient (its probabilities are normalised by what it is given); the diagonals' share is
    the softmax backward written out, element-wise, one step at a time (no [k, S, d] temporaries).
    The kernel takes grouped key heads (GQA) as they are; the diagonals broadcast over the group.
    With `slots` (queries at some positions only) the kernel runs on the rows from the batch's
    first slot to its last (`_span`: prompts before the answers and the unscored ends drop out),
    the rows between the slots zero: their share of every gradient is zero."""

    @staticmethod
    def forward(ctx, q, k0, v0, block_mask, slots, *later):
        kd, vd = later[: len(later) // 2], later[len(later) // 2 :]
        scale = 1.0 / math.sqrt(q.shape[-1])
        lo, hi = _span(slots, k0.shape[2])
        causal_out, causal_lse = _causal_from(_all_rows(q, slots, lo, hi), k0, v0, block_mask, lo, scale)
        all_lse = causal_lse  # the backward's log-sum-exp of the rows outside the slots
        if slots is not None:
            causal_out, causal_lse = take(causal_out, slots - lo, 2), take(causal_lse, slots - lo, 2)
        kvh = k0.shape[1]
        qg = _grouped(q.float(), kvh)  # [B,g,r,S,d]
        causal_lse = _grouped(causal_lse, kvh)  # [B,g,r,S]
        diag = (_diagonal_scores(qg, kd, scale) if kd
                else causal_lse.new_empty((0, *causal_lse.shape)))  # [k,B,g,r,S]
        lse = torch.logsumexp(torch.cat([causal_lse[None], diag]), dim=0)
        p_diag = (diag - lse).exp()
        out = (causal_lse - lse).exp()[..., None] * _grouped(causal_out.float(), kvh)
        for p, v in zip(p_diag, vd):
            out.addcmul_(p[..., None], v[:, :, None].float())
        out = out.flatten(1, 2).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, out, lse.flatten(1, 2), p_diag, block_mask, slots,
                              all_lse if slots is not None else None, *later)
        ctx.scale, ctx.span = scale, (lo, hi)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, out, lse, p_diag, block_mask, slots, all_lse, *later = ctx.saved_tensors
        kd, vd = later[: len(later) // 2], later[len(later) // 2 :]
        grad_out = grad_out.contiguous()
        if slots is None:
            dq, dk0, dv0 = causal_flash_backward(grad_out, q, k0, v0, out, lse, block_mask, ctx.scale)
        else:  # rows outside the slots: no gradient in, their own finite log-sum-exp
            seq, (lo, hi) = k0.shape[2], ctx.span
            dq, dk0, dv0 = _causal_from_backward(
                _all_rows(grad_out, slots, lo, hi), _all_rows(q, slots, lo, hi), k0, v0,
                _all_rows(out, slots, lo, hi), all_lse.scatter(2, (slots - lo)[:, None].expand(-1, lse.shape[1], -1), lse),
                block_mask, lo, ctx.scale)
            dq = take(dq, slots - lo, 2)
            if hi < seq:  # keys after the last query: seen by none
                dk0, dv0 = (F.pad(x, (0, 0, 0, seq - hi)) for x in (dk0, dv0))
        kvh = k0.shape[1]
        g, qg = _grouped(grad_out.float(), kvh), _grouped(q.float(), kvh)
        row = (g * _grouped(out.float(), kvh)).sum(-1)  # [B,g,r,S]: sum_j p_j dP_j over every key
        dq = _grouped(dq.float(), kvh)
        dkd, dvd = [], []
        for p, k, v in zip(p_diag, kd, vd):
            d = p * ((g * v[:, :, None].float()).sum(-1) - row)  # [B,g,r,S]: dscore of this diagonal
            dq.addcmul_(d[..., None], k[:, :, None].float(), value=ctx.scale)
            dkd.append(((d[..., None] * qg).sum(2) * ctx.scale).to(k.dtype))
            dvd.append((p[..., None] * g).sum(2).to(v.dtype))
        return (dq.flatten(1, 2).to(q.dtype), dk0, dv0, None, None, *dkd, *dvd)


def ttt_fused_attention(q, keys, values, mask: TTTMask) -> torch.Tensor:
    keys, values = _steps(keys, values, mask)
    block_mask = None  # causal: the kernel skips the blocks above the diagonal, with or without it
    if mask.doc_ids is not None:  # over all S x S: the kernel's pieces slice it
        allowed = TTTMask(mask.seq_len, 0, mask.doc_ids).causal_block(q.device)[:, None]
        block_mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    return _FlashTTT.apply(q.contiguous(), keys[0].contiguous(), values[0].contiguous(), block_mask,
                           mask.slots, *keys[1:], *values[1:])


def ttt_sdpa_attention(q, keys, values, mask: TTTMask) -> torch.Tensor:
    """The split on SDPA's own fused kernels, off the CPU (flash or memory-efficient on GPUs: no
    [S, S] scores are kept, autograd does the backward). The later steps' diagonals enter as ONE
    extra key per query, a sink before position 0 that every query sees: its score is the
    diagonals' log-sum-exp b (carried by two extra query dimensions, hi + lo so that bf16 rounds
    nothing away, against a key of ones; the real keys are zero there), its value a one in an extra
    dimension. The kernel returns the causal output already weighted by 1 - s and, in that
    dimension, s, the diagonals' share of the softmax; adding s times the diagonals' own
    softmax-weighted values gives the TTT output exactly. With slots the kernel runs the rows of
    their span (`_span`), causal to the lower right: row i sees keys up to position lo + i."""
    keys, values = _steps(keys, values, mask)
    n_rep, dim = q.shape[1] // keys[0].shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(dim)
    lo, hi = _span(mask.slots, mask.seq_len)
    k0, v0 = (_expand_kv(x[:, :, :hi], n_rep) for x in (keys[0], values[0]))
    later = len(keys) > 1
    # SDPA's head dim: dim, the sink's two, then zeros up to a multiple of 8 (the same scores). The
    # memory-efficient kernel, the fused one that takes a document mask (and fp32), refuses others,
    # and SDPA then falls back to its math path with [B, h, L, S] scores; flash pads so itself.
    extra = -(dim + 2 * later) % 8
    if later:
        kvh = keys[0].shape[1]
        qg = _grouped(q.float(), kvh)  # [B,g,r,n,d]
        diag = _diagonal_scores(qg, keys[1:], scale)  # [k,B,g,r,n]
        sink = diag.logsumexp(0)
        weights = (diag - sink).exp()
        diag_out = sum(w[..., None] * v[:, :, None] for w, v in zip(weights, values[1:])).flatten(1, 2)
        score = (sink * math.sqrt(dim)).flatten(1, 2)  # [B,h,n]: times the kernel's scale, b
        high = score.detach().to(q.dtype)
        q = torch.cat([q, high[..., None], (score - high.float()).to(q.dtype)[..., None],
                       q.new_zeros(*q.shape[:-1], extra)], dim=-1)
        sink_k = k0.new_zeros(*k0.shape[:2], 1, dim + 2 + extra)
        sink_k[..., dim : dim + 2] = 1
        sink_v = torch.zeros_like(sink_k)
        sink_v[..., dim] = 1
        k0 = torch.cat([sink_k, F.pad(k0, (0, 2 + extra))], dim=2)
        v0 = torch.cat([sink_v, F.pad(v0, (0, 2 + extra))], dim=2)
    elif extra:
        q, k0, v0 = (F.pad(x, (0, extra)) for x in (q, k0, v0))
    rows = _all_rows(q, mask.slots, lo, hi)  # [B,h,L,..]: the span's rows, zeros between slots
    if mask.doc_ids is None:
        allowed = causal_lower_right(hi - lo, k0.shape[2])
    else:
        allowed = TTTMask(mask.seq_len, 0, mask.doc_ids).causal_block(q.device)[:, None, lo:hi, :hi]
        if later:
            allowed = F.pad(allowed, (1, 0), value=True)
    out = F.scaled_dot_product_attention(rows, k0, v0, attn_mask=allowed, scale=scale)
    if mask.slots is not None:
        out = take(out, mask.slots - lo, 2)
    if later:
        return (out[..., :dim].float() + out[..., dim : dim + 1].float() * diag_out).to(q.dtype)
    return out[..., :dim]


@functools.cache
def _compiled_flex():
    """FlexAttention and its block mask, compiled once (first use): uncompiled, flex_attention is
    the reference that materialises every score, and create_block_mask every [B, Q, KV] bit."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), torch.compile(create_block_mask)


def flex_kernel_options(q: torch.Tensor, mask: TTTMask) -> Optional[dict]:
    """Tiles of 64 for document-packed rows of 16-bit heads wider than 64 on a GPU. On an H200
    (torch 2.11) torch's forward tiles for those (128 x 64, 3 stages) asked 256 KiB of shared memory
    where it has 227 (pytorch/pytorch#133254); the same heads without documents compiled and ran.
    The backward's take 64 too, as its default tiles are larger still. None: torch's tiles."""
    if (q.device.type == "cpu" or mask.doc_ids is None or q.dtype not in (torch.bfloat16, torch.float16)
            or q.shape[-1] <= 64):
        return None
    return dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"), 64)


def flex_attention(q, k, v, mask: TTTMask, kernel_options="auto") -> torch.Tensor:
    """Compiled on GPUs. On the CPU (no backward there: forward checks only) the reference
    implementation: torch 2.13's compiled CPU kernel returns wrong rows for per-row masks.
    `kernel_options`: torch's flex tiles; "auto" is flex_kernel_options, None torch's defaults."""
    if q.device.type == "cpu":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention as flex
    else:
        flex, create_block_mask = _compiled_flex()
    if kernel_options == "auto":
        kernel_options = flex_kernel_options(q, mask)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask.allows(q_idx, kv_idx, b)

    batch = None if mask.doc_ids is None and mask.slots is None else q.shape[0]
    block_mask = create_block_mask(
        mask_mod, B=batch, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=q.device
    )
    return flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1], kernel_options=kernel_options)


def attend(q, k, v, mask, impl: str = "sdpa") -> torch.Tensor:
    """Dispatch on `impl`; `mask` is a bool tensor [B|1, n, L] (inference) or a TTTMask (training),
    whose keys and values come per step (lists) or concatenated along the sequence."""
    if impl not in ATTENTIONS:
        raise ValueError(f"train.attention: {impl!r} is not one of {', '.join(ATTENTIONS)}")
    if isinstance(mask, TTTMask):
        if impl in ("flex", "dense"):
            k, v = (torch.cat(_steps(k, v, mask)[i], dim=2) for i in (0, 1))
            if impl == "flex":
                return flex_attention(q, k, v, mask)
            return sdpa_attention(q, k, v, mask.dense(q.device))
        if impl == "sdpa":
            return (ttt_fused_attention if q.device.type == "cpu" else ttt_sdpa_attention)(q, k, v, mask)
        return ttt_eager_attention(q, k, v, mask)
    if impl == "flex":
        raise ValueError("attention=flex needs a TTTMask (it is the training kernel)")
    if impl == "eager":
        return eager_attention(q, k, v, mask)
    return sdpa_attention(q, k, v, mask)
