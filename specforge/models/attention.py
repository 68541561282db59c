"""Attention for the draft: the training-time-test (TTT) mask and three interchangeable kernels.

During TTT step k the draft has produced keys for steps 0..k over the same S positions. A query at
position t sees the keys 0..t of step 0 (causal) plus the key at position t of every later step
(a diagonal per step): exactly what the draft sees at serving time, where step k's token sits at
position t+k and its own earlier drafts are its only extra context.

- sdpa: torch's scaled_dot_product_attention with a dense boolean mask; runs everywhere.
- eager: the same maths written out; the reference for parity tests.
- flex: FlexAttention with a block mask built from the same rule; GPU training (its backward does
  not run on CPU). Imported lazily so the CPU path never depends on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TTTMask:
    """The mask of TTT step `step` over `seq_len` positions: keys are [step 0 | step 1 | ... | step]."""

    seq_len: int
    step: int

    def allows(self, q_idx, kv_idx):
        """The rule itself, written once: usable on tensors (dense and flex alike)."""
        block, kv_pos = kv_idx // self.seq_len, kv_idx % self.seq_len
        return ((block == 0) & (kv_pos <= q_idx)) | ((block > 0) & (kv_pos == q_idx))

    def dense(self, device=None) -> torch.Tensor:
        q = torch.arange(self.seq_len, device=device)[:, None]
        kv = torch.arange(self.seq_len * (self.step + 1), device=device)[None, :]
        return self.allows(q, kv)


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


def flex_attention(q, k, v, mask: TTTMask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex

    def mask_mod(b, h, q_idx, kv_idx):
        return mask.allows(q_idx, kv_idx)

    block_mask = create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=q.device
    )
    return _flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def attend(q, k, v, mask, impl: str = "sdpa") -> torch.Tensor:
    """Dispatch on `impl`; `mask` is a bool tensor [B|1, n, L] or a TTTMask."""
    if impl == "flex":
        if not isinstance(mask, TTTMask):
            raise ValueError("attention=flex needs a TTTMask (it is the training kernel)")
        return flex_attention(q, k, v, mask)
    if isinstance(mask, TTTMask):
        mask = mask.dense(q.device)[None]
    if impl == "sdpa":
        return sdpa_attention(q, k, v, mask)
    if impl == "eager":
        return eager_attention(q, k, v, mask)
    raise ValueError(f"train.attention: {impl!r} is not one of sdpa, eager, flex")
