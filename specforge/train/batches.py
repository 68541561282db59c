"""Batches over the hidden-state store: length-grouped so padding stays small, reshuffled per epoch
from the seed alone (so a resumed run sees the same order), dealt round-robin to the ranks.

Why round-robin: the epoch is one list of micro-batches of `train.batch_size` samples, the same
for every world size. One optimizer step consumes `grad_accum x world_size` consecutive micro-batches
of that list, micro-batch m going to rank m % world_size. So W ranks with accumulation A take exactly
the steps (same samples, same micro-batches) of one process with accumulation A x W, and the
averaged gradient is the same: a run's results do not depend on how many processes computed them,
only on the global batch (batch_size x grad_accum x world_size).

Packing (train.pack_tokens > 0): the shuffled samples are concatenated, in order, into rows of at
most pack_tokens tokens, and a micro-batch is batch_size such rows: no padding, and the TTT unroll
keeps attention, positions and scoring within each document (doc_ids). A micro-batch stays a list
of sample indices: cutting it into rows again, greedily in its order, gives back the same rows.
"""
from __future__ import annotations

import random

import torch


def pack_rows(lengths: list[int], pack_tokens: int) -> list[list[int]]:
    """Positions 0..n-1 of `lengths`, in order, cut into rows of at most pack_tokens tokens (a
    longer sample is a row of its own)."""
    rows, used = [], pack_tokens
    for i, n in enumerate(lengths):
        if used + n > pack_tokens:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def global_batches(lengths: list[int], batch_size: int, seed: int, epoch: int,
                   shuffle: bool = True, pack_tokens: int = 0) -> list[list[int]]:
    """Every micro-batch of the epoch (sample indices), the same on every rank."""
    order = list(range(len(lengths)))
    rng = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        rng.shuffle(order)
    if pack_tokens:
        rows = [[order[j] for j in row] for row in pack_rows([lengths[i] for i in order], pack_tokens)]
        return [[i for row in rows[r : r + batch_size] for i in row] for r in range(0, len(rows), batch_size)]
    # Sort within windows of 50 batches: similar lengths together, order still random overall.
    window = batch_size * 50
    order = [i for w in range(0, len(order), window)
             for i in sorted(order[w : w + window], key=lambda i: lengths[i])]
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        rng.shuffle(batches)
    return batches


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int,
                  shuffle: bool = True, rank: int = 0, world_size: int = 1,
                  pack_tokens: int = 0) -> list[list[int]]:
    """This rank's micro-batches: every world_size-th of the epoch's list, starting at `rank`,
    cut so that every rank gets the same number."""
    batches = global_batches(lengths, batch_size, seed, epoch, shuffle, pack_tokens)
    if world_size == 1:
        return batches
    usable = len(batches) - len(batches) % world_size
    return batches[rank:usable:world_size]


def steps_per_epoch(num_batches: int, grad_accum: int, world_size: int) -> int:
    """Optimizer steps in an epoch of `num_batches` micro-batches (the tail that does not fill a
    whole global batch is left out of that epoch)."""
    return num_batches // (grad_accum * world_size)


def eval_batches(lengths: list[int], batch_size: int, rank: int = 0,
                 world_size: int = 1) -> list[tuple[list[int], bool]]:
    """Held-out batches for this rank as (indices, counted). Every rank gets the same number (the
    sharded strategies run collectives in each forward); fillers are repeats with counted=False."""
    batches = global_batches(lengths, batch_size, seed=0, epoch=0, shuffle=False)
    mine = [(b, True) for b in batches[rank::world_size]]
    per_rank = -(-len(batches) // world_size) if batches else 0
    while len(mine) < per_rank:
        mine.append((batches[0], False))
    return mine


def pack(samples: list[dict]) -> dict:
    """One row of documents: tensors concatenated, positions restarting at 0 per document (M-RoPE
    positions as stored), `doc_ids` numbering the documents."""
    keys = ("input_ids", "loss_mask", "aux", "last") + (("in_vocab",) if "in_vocab" in samples[0] else ())
    row = {key: torch.cat([s[key] for s in samples]) for key in keys}
    if "position_ids" in samples[0]:
        row["position_ids"] = torch.cat([s["position_ids"] for s in samples], dim=-1)
    else:
        row["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])
    if "image_embeds" in samples[0]:
        row["image_embeds"] = torch.cat([s["image_embeds"] for s in samples])
    row["doc_ids"] = torch.cat([torch.full((len(s["input_ids"]),), d) for d, s in enumerate(samples)])
    return row


def collate(samples: list[dict], dtype=torch.float32, image_token_id: int | None = None,
            pack_tokens: int = 0) -> dict:
    """Right-pad samples to one length; the loss mask is False on padding. With pack_tokens, the
    samples are first packed into rows (see the module docstring); padding has doc_ids -1.

    Vision-language samples bring their M-RoPE `position_ids` [3, S] (-> [B, 3, n]). With
    `image_token_id` (draft.image_embeddings=merged) their `image_embeds` become
    `embed_override` [B, n, H] + `embed_override_mask` [B, n]: the draft's token embedding at
    image positions is the target's merged input embedding, as the serving engine feeds it."""
    if pack_tokens:
        rows = pack_rows([len(s["input_ids"]) for s in samples], pack_tokens)
        samples = [pack([samples[i] for i in row]) for row in rows]
    n = max(len(s["input_ids"]) for s in samples)
    b = len(samples)
    h3, h = samples[0]["aux"].shape[-1], samples[0]["last"].shape[-1]
    batch = {
        "input_ids": torch.zeros(b, n, dtype=torch.long),
        "loss_mask": torch.zeros(b, n, dtype=torch.bool),
        "aux": torch.zeros(b, n, h3, dtype=dtype),
        "last": torch.zeros(b, n, h, dtype=dtype),
    }
    for i, s in enumerate(samples):
        m = len(s["input_ids"])
        batch["input_ids"][i, :m] = s["input_ids"]
        batch["loss_mask"][i, :m] = s["loss_mask"].bool()
        batch["aux"][i, :m] = s["aux"].to(dtype)
        batch["last"][i, :m] = s["last"].to(dtype)
    if "in_vocab" in samples[0]:  # TeacherMemo's: whether the target's argmax is a draft token
        batch["in_vocab"] = torch.zeros(b, n, dtype=torch.bool)
        for i, s in enumerate(samples):
            batch["in_vocab"][i, : len(s["input_ids"])] = s["in_vocab"]
    if "doc_ids" in samples[0]:
        batch["doc_ids"] = torch.full((b, n), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            batch["doc_ids"][i, : len(s["input_ids"])] = s["doc_ids"]
    if "position_ids" not in samples[0]:
        batch["position_ids"] = torch.arange(n).expand(b, n)
        return batch
    # padding continues each row's positions (never attended to, never scored)
    shape = samples[0]["position_ids"].shape[:-1]  # () for packed text rows, (3,) for M-RoPE
    pos = torch.arange(n).expand(b, *shape, n).clone()
    for i, s in enumerate(samples):
        m = len(s["input_ids"])
        pos[i, ..., :m] = s["position_ids"]
        pos[i, ..., m:] += s["position_ids"].max() + 1 - m
    batch["position_ids"] = pos
    if image_token_id is not None:
        batch["embed_override"] = torch.zeros(b, n, h, dtype=dtype)
        batch["embed_override_mask"] = batch["input_ids"] == image_token_id
        for i, s in enumerate(samples):
            at = batch["embed_override_mask"][i]
            if int(at.sum()) != s["image_embeds"].shape[0]:
                raise ValueError(f"sample {i} of the batch: {int(at.sum())} image tokens but "
                                 f"{s['image_embeds'].shape[0]} stored image embeddings")
            batch["embed_override"][i, at] = s["image_embeds"].to(dtype)
    return batch
