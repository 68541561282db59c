"""Batches over the hidden-state store: length-grouped so padding stays small, reshuffled per epoch
from the seed alone (so a resumed run sees the same order), split evenly across ranks."""
from __future__ import annotations

import random

import torch


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int,
                  shuffle: bool = True, rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """Sample indices per batch for this rank. Every rank gets the same number of batches."""
    order = list(range(len(lengths)))
    rng = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        rng.shuffle(order)
    # Sort within windows of 50 batches: similar lengths together, order still random overall.
    window = batch_size * 50
    order = [i for w in range(0, len(order), window)
             for i in sorted(order[w : w + window], key=lambda i: lengths[i])]
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        rng.shuffle(batches)
    per_rank = len(batches) // world_size if world_size > 1 else len(batches)
    return batches[rank * per_rank : (rank + 1) * per_rank] if world_size > 1 else batches


def collate(samples: list[dict], dtype=torch.float32) -> dict:
    """Right-pad samples to one length; the loss mask is False on padding."""
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
    batch["position_ids"] = torch.arange(n).expand(b, n)
    return batch
