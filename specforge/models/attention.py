"""Attention for the draft: the training-time-test (TTT) mask and its kernels.

During TTT step k the draft has produced keys for steps 0..k over the same S positions. A query at
position t sees the keys 0..t of step 0 (causal) plus the key at position t of every later step
(a diagonal per step): exactly what the draft sees at serving time, where step k's token sits at
position t+k and its own earlier drafts are its only extra context. With packed documents
(`TTTMask.doc_ids`) the causal block also stops at the document's start.

The dense mask spans (k+1) x S keys per query: O(k S^2) work for S + k allowed keys. The TTT
kernels split it instead, O(S^2 + k S): the causal block once, each later step's key as one dot
product per position, both under one log-sum-exp. Same numbers as the dense mask.

- sdpa: on CPU, torch's fused flash kernel for the causal block (it returns the log-sum-exp; a
  custom backward reuses its kernel with the combined output), the diagonals element-wise;
  elsewhere the eager split. For plain causal masks (the engine), torch's SDPA.
- eager: the split written out in plain torch; readable, autograd does the backward.
- dense: the full (k+1) x S mask through SDPA; the reference that parity tests compare against.
- flex: FlexAttention with a block mask built from the same rule; GPU training (its backward does
  not run on CPU). Imported lazily so the CPU path never depends on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TTTMask:
    """The mask of TTT step `step` over `seq_len` positions: keys are [step 0 | step 1 | ... | step].
    `doc_ids` [B, S] (packed batches): a query never sees a key of another document."""

    seq_len: int
    step: int
    doc_ids: Optional[torch.Tensor] = None

    def allows(self, q_idx, kv_idx, b=None):
        """The rule itself, written once: usable on tensors (dense and flex alike)."""
        block, kv_pos = kv_idx // self.seq_len, kv_idx % self.seq_len
        rule = ((block == 0) & (kv_pos <= q_idx)) | ((block > 0) & (kv_pos == q_idx))
        if self.doc_ids is not None:
            rule = rule & (self.doc_ids[b, q_idx] == self.doc_ids[b, kv_pos])
        return rule

    def dense(self, device=None) -> torch.Tensor:
        """[B|1, S, (step+1) S] bool."""
        return self._grid(self.seq_len * (self.step + 1), device)

    def causal_block(self, device=None) -> torch.Tensor:
        """[B|1, S, S] bool: the step-0 keys alone."""
        return self._grid(self.seq_len, device)

    def _grid(self, n_keys: int, device) -> torch.Tensor:
        q = torch.arange(self.seq_len, device=device)[None, :, None]
        kv = torch.arange(n_keys, device=device)[None, None, :]
        if self.doc_ids is None:
            return self.allows(q, kv)
        b = torch.arange(self.doc_ids.shape[0], device=device)[:, None, None]
        return self.allows(q, kv, b.to(self.doc_ids.device)).to(device)


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


def _split_kv(keys, values, mask: TTTMask, n_rep: int):
    """[B,kvh,(k+1)S,d] -> step 0's keys/values [B,h,S,d] and the later steps' [B,h,k,S,d]."""
    keys, values = _expand_kv(keys, n_rep), _expand_kv(values, n_rep)
    s = mask.seq_len
    later = (mask.step, s)
    return keys[:, :, :s], values[:, :, :s], keys[:, :, s:].unflatten(2, later), values[:, :, s:].unflatten(2, later)


def ttt_eager_attention(q, keys, values, mask: TTTMask) -> torch.Tensor:
    """The O(S^2 + kS) split in plain torch: scores of the causal block [.., S, S] and of each
    later step's diagonal [.., S, k] share one softmax."""
    k0, v0, kd, vd = _split_kv(keys, values, mask, q.shape[1] // keys.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf = q.float()
    causal = (qf @ k0.float().transpose(-1, -2)) * scale
    causal = causal.masked_fill(~mask.causal_block(q.device)[:, None], float("-inf"))
    diag = (qf[:, :, None] * kd.float()).sum(-1).transpose(-1, -2) * scale  # [B,h,S,k]
    p = torch.cat([causal, diag], dim=-1).softmax(-1)
    out = p[..., : mask.seq_len] @ v0.float()
    out = out + (p[..., mask.seq_len :].transpose(-1, -2)[..., None] * vd.float()).sum(2)
    return out.to(q.dtype)


class _FlashTTT(torch.autograd.Function):
    """The split on torch's CPU flash kernel. Forward: the kernel gives the causal block's output
    and log-sum-exp; the diagonals join under the combined log-sum-exp. Backward: the flash
    backward, handed the COMBINED output and log-sum-exp, yields exactly the causal keys' share of
    the gradient (its probabilities are normalised by what it is given); the diagonals' share is
    the softmax backward written out, element-wise."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, block_mask):
        scale = 1.0 / math.sqrt(q.shape[-1])
        causal_out, causal_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k0, v0, 0.0, block_mask is None, attn_mask=block_mask, scale=scale)
        diag = (q.float()[:, :, None] * kd.float()).sum(-1) * scale  # [B,h,k,S]
        lse = torch.logsumexp(torch.cat([causal_lse[:, :, None], diag], dim=2), dim=2)  # [B,h,S]
        p_diag = (diag - lse[:, :, None]).exp()
        out = (causal_lse - lse).exp()[..., None] * causal_out.float()
        out = (out + (p_diag[..., None] * vd.float()).sum(2)).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, p_diag, block_mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, kd, vd, out, lse, p_diag, block_mask = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k0, v0, out, lse, 0.0, block_mask is None, attn_mask=block_mask, scale=ctx.scale)
        g = grad_out.float()
        row = (g * out.float()).sum(-1)  # [B,h,S]: sum_j p_j dP_j over every key
        d_diag = p_diag * ((g[:, :, None] * vd.float()).sum(-1) - row[:, :, None])  # [B,h,k,S]
        dq = (dq.float() + (d_diag[..., None] * kd.float()).sum(2) * ctx.scale).to(q.dtype)
        dkd = (d_diag[..., None] * q.float()[:, :, None] * ctx.scale).to(kd.dtype)
        dvd = (p_diag[..., None] * g[:, :, None]).to(vd.dtype)
        return dq, dk0, dv0, dkd, dvd, None


def ttt_fused_attention(q, keys, values, mask: TTTMask) -> torch.Tensor:
    k0, v0, kd, vd = _split_kv(keys, values, mask, q.shape[1] // keys.shape[1])
    block_mask = None  # plain causal: the kernel skips the blocks above the diagonal
    if mask.doc_ids is not None:
        allowed = mask.causal_block(q.device)[:, None]
        block_mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    return _FlashTTT.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), kd, vd, block_mask)


def flex_attention(q, k, v, mask: TTTMask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex

    def mask_mod(b, h, q_idx, kv_idx):
        return mask.allows(q_idx, kv_idx, b)

    batch = None if mask.doc_ids is None else q.shape[0]
    block_mask = create_block_mask(
        mask_mod, B=batch, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=q.device
    )
    return _flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def attend(q, k, v, mask, impl: str = "sdpa") -> torch.Tensor:
    """Dispatch on `impl`; `mask` is a bool tensor [B|1, n, L] (inference) or a TTTMask (training)."""
    if impl not in ("sdpa", "eager", "flex", "dense"):
        raise ValueError(f"train.attention: {impl!r} is not one of sdpa, eager, flex")
    if isinstance(mask, TTTMask):
        if impl == "flex":
            return flex_attention(q, k, v, mask)
        if impl == "dense":
            return sdpa_attention(q, k, v, mask.dense(q.device))
        if impl == "sdpa" and q.device.type == "cpu":
            return ttt_fused_attention(q, k, v, mask)
        return ttt_eager_attention(q, k, v, mask)
    if impl == "flex":
        raise ValueError("attention=flex needs a TTTMask (it is the training kernel)")
    if impl == "eager":
        return eager_attention(q, k, v, mask)
    return sdpa_attention(q, k, v, mask)
