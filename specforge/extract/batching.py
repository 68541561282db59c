"""What every extract backend shares: batches planned by a token budget, and throughput counters.

A backend (embedded transformers, or servers that speak SGLang's /generate) only says how one
batch of rows becomes stored tensors (`forward_rows`); the plan, the order and the counters are
the same, so a resumed run does the same forwards whatever computes them.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Sequence

import torch


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches whose padded size (rows x longest row) fits `batch_tokens`.

    Samples are taken longest first (ties by index, so the plan is deterministic) to limit
    padding; a sample longer than the budget gets a batch of its own.
    """
    if batch_tokens < 1:
        raise ValueError(f"extract.batch_tokens: must be >= 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # longest first: the first row of a batch is its longest
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def total_tokens(samples: Iterable[dict]) -> int:
    return sum(len(s["input_ids"]) for s in samples)


class Extractor:
    """Runs rows through a backend in planned batches. `stats` counts real tokens, padded tokens
    and forward seconds since construction. `storage_dtype` is the dtype rows are handed to the
    store writer in (store.handoff_dtype: for fp8 and float16 stores the target's own, the writer
    quantises or checks the range).
    `writes_behind`: the store is written on a thread of its own while the next batch computes
    (write_behind.py), where the compute is not this process's CPU (a GPU, a server); on the CPU
    the two would share its cores (6-14% slower end to end on 2 cores, docs/benchmarks.md)."""

    writes_behind = True

    def __init__(self, batch_tokens: int, storage_dtype: torch.dtype):
        self.batch_tokens = batch_tokens
        self.storage_dtype = storage_dtype
        self.stats = {"tokens": 0, "padded_tokens": 0, "seconds": 0.0}

    def forward_rows(self, rows: Sequence[dict]) -> list[dict]:
        """What the store keeps of each row of one batch: {"aux", "last", ...} (store writer keywords)."""
        raise NotImplementedError

    def count(self, lens: list[int], width: int, t0: float) -> None:
        """Add one forward to `stats` (real and padded tokens, seconds since t0)."""
        self.stats["tokens"] += sum(lens)
        self.stats["padded_tokens"] += width * len(lens)
        self.stats["seconds"] += time.perf_counter() - t0

    def batches(self, samples: Sequence[dict], chunk: int | None = None) -> Iterator[list[dict]]:
        """The rows of each forward, longest samples first.

        With `chunk`, samples are planned in consecutive chunks of that many (of the length-sorted
        order), so batches never cross a shard boundary when chunk == shard size: a resumed run
        then does exactly the forwards an uninterrupted run would have done.
        """
        order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]["input_ids"]), i))
        step = chunk or max(len(order), 1)
        for c in range(0, len(order), step):
            part = [samples[i] for i in order[c : c + step]]
            for batch in plan_batches([len(s["input_ids"]) for s in part], self.batch_tokens):
                yield [part[i] for i in batch]

    def run(self, samples: Sequence[dict], chunk: int | None = None) -> Iterator[tuple[dict, dict]]:
        """Yield (sample, states) for samples with `input_ids`, in the order of `batches`."""
        for rows in self.batches(samples, chunk):
            yield from zip(rows, self.forward_rows(rows))

    @property
    def tokens_per_s(self) -> float:
        return self.stats["tokens"] / self.stats["seconds"] if self.stats["seconds"] else 0.0
