"""The draft vocabulary (docs/contract.md §4): the most frequent loss tokens of the training data.

`d2t[i] = used[i] - i` maps draft id i to target id `i + d2t[i]`; `t2d[j]` says whether target
token j is in the draft vocab. The map is cached by data + tokenizer + sizes because counting a
large dataset is slow and a draft's lm_head rows are only meaningful with the map it was
trained with.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file

from specforge.errors import InvalidInput
from specforge.utils.io import atomic_path, fingerprint


def count_loss_tokens(samples: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> Counter:
    """Frequency of each token id under the loss mask."""
    counts: Counter = Counter()
    for input_ids, loss_mask in samples:
        if len(input_ids) != len(loss_mask):
            raise ValueError(f"sample: input_ids ({len(input_ids)}) and loss_mask ({len(loss_mask)}) differ in length")
        counts.update(t for t, m in zip(input_ids, loss_mask) if m)
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {sorted(bad)[:5]} are outside the target vocab [0, {vocab_size})")
    return counts


def build_vocab_mapping(
    samples: Iterable[tuple[list[int], list[int]]], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab_size], t2d bool [vocab_size]).

    Keeps the `draft_vocab_size` most frequent loss tokens (ties: lower id first); when the data
    has fewer distinct tokens, pads with the lowest unused ids so the lm_head has a fixed size.
    A draft vocab larger than the target's is clamped to it, saying so (the draft model
    clamps the same way, so small test targets work with the default config)."""
    draft_vocab_size = effective_draft_vocab_size(vocab_size, draft_vocab_size, warn=True)
    counts = count_loss_tokens(samples, vocab_size)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    used = {t for t, _ in ranked[:draft_vocab_size]}
    pad = draft_vocab_size - len(used)
    if pad:
        used.update(j for j in _lowest_unused(used, pad))
    used_ids = torch.tensor(sorted(used), dtype=torch.int64)
    d2t = used_ids - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used_ids] = True
    return d2t, t2d


def effective_draft_vocab_size(vocab_size: int, draft_vocab_size: int, warn: bool = False) -> int:
    """`draft_vocab_size`, clamped to the target vocab size. `warn`: print requested vs used, since
    a draft smaller than configured changes its checkpoint and what it can predict."""
    if draft_vocab_size <= 0:
        raise InvalidInput(f"draft.draft_vocab_size: must be positive, got {draft_vocab_size}")
    if vocab_size <= 0:
        raise InvalidInput(f"vocab_size: must be positive, got {vocab_size}")
    if draft_vocab_size > vocab_size:
        if warn:
            print(f"[data] draft.draft_vocab_size={draft_vocab_size} is larger than the target's vocab "
                  f"({vocab_size} tokens): requested {draft_vocab_size}, used {vocab_size}",
                  file=sys.stderr, flush=True)
        return vocab_size
    return draft_vocab_size


def _lowest_unused(used: set[int], n: int) -> list[int]:
    out, j = [], 0
    while len(out) < n:
        if j not in used:
            out.append(j)
        j += 1
    return out


def vocab_cache_key(data_fingerprint: str, tokenizer_fingerprint: str, vocab_size: int, draft_vocab_size: int) -> str:
    return fingerprint("vocab", data_fingerprint, tokenizer_fingerprint, vocab_size, draft_vocab_size)


def cache_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / "vocab" / f"{key}.safetensors"


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp))


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a safetensors file, checked for dtypes and mutual consistency."""
    tensors = load_file(str(path))
    missing = {"d2t", "t2d"} - set(tensors)
    if missing:
        raise InvalidInput(f"{path}: missing tensor(s) {sorted(missing)}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise InvalidInput(f"{path}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    check_vocab_mapping(d2t, t2d, where=str(path))
    return d2t, t2d


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, where: str = "vocab") -> None:
    """d2t must map draft ids onto exactly the target ids t2d marks, in ascending order."""
    target_ids = torch.arange(len(d2t), dtype=torch.int64) + d2t
    ok = (
        d2t.dim() == 1 and t2d.dim() == 1 and len(d2t) > 0
        and int(t2d.sum()) == len(d2t)
        and bool((target_ids[1:] > target_ids[:-1]).all())
        and 0 <= int(target_ids[0]) and int(target_ids[-1]) < len(t2d)
    )
    ok = ok and bool(t2d[target_ids].all())
    if not ok:
        raise InvalidInput(f"{where}: d2t and t2d are inconsistent (d2t must map onto the ids t2d marks)")


def cached_vocab_mapping(
    cache_dir: str | Path,
    key: str,
    samples: Iterable[tuple[list[int], list[int]]],
    vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(d2t, t2d, hit): load the map for `key` from the cache or build and store it. A clamped
    size is reported once, on a cache hit too."""
    used = effective_draft_vocab_size(vocab_size, draft_vocab_size, warn=True)
    path = cache_path(cache_dir, key)
    if path.exists():
        d2t, t2d = load_vocab(path)
        if len(d2t) == used and len(t2d) == vocab_size:
            return d2t, t2d, True
    d2t, t2d = build_vocab_mapping(samples, vocab_size, used)
    save_vocab(path, d2t, t2d)
    return d2t, t2d, False
