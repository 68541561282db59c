"""Training without a hidden-state store (`extract=online`): the target's states of a micro-batch
are computed when training reads it, every epoch.

Why: a store holds 8H bytes per token (4H in fp8); 300M tokens of a 4,096-wide target are ~10 TB.
Online, nothing is written, at the price of one target forward per sample and epoch (the
target stays loaded beside the draft). The samples read exactly as a store's (input_ids,
loss_mask, aux, last; the states rounded to `extract.dtype` as a store would hold them, inf/nan
refused naming the sample as the store writer refuses them), so everything downstream of the
store is the same code. Text targets with the embedded backend.
"""
from __future__ import annotations

import torch

from specforge.extract.batching import plan_batches
from specforge.extract.embedded import EmbeddedExtractor
from specforge.extract.stage import store_order
from specforge.extract.store import STORAGE_DTYPES, stored_states


class OnlineStates:
    """A data split's rows as a HiddenStateStore reads them, in its order, the states computed when read.
    `prefetch(indices)` computes a micro-batch's states and keeps them until the next one. `meta`'s
    `storage_dtype` (store_meta's) is the dtype they are rounded to; without it, the extractor's."""

    vl = False

    def __init__(self, rows: list[dict], extractor: EmbeddedExtractor, meta: dict):
        # in the order a store holds them (longest first): the same batches, in the same order
        self.rows = [rows[i] for i in store_order(rows)]
        self.extractor, self.meta = extractor, meta
        # as a store holds them: the extractor hands float16's over in the target's dtype (store.handoff_dtype)
        self.dtype = STORAGE_DTYPES[meta["storage_dtype"]] if "storage_dtype" in meta else extractor.storage_dtype
        self.lengths = [len(r["input_ids"]) for r in self.rows]
        self._states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def prefetch(self, indices) -> None:
        indices = [int(i) for i in indices]
        missing = [i for i in indices if i not in self._states]
        kept = {i: self._states[i] for i in indices if i in self._states}
        # forwards of at most extract.batch_tokens padded tokens, as an extraction's (a packed
        # micro-batch can hold many samples)
        for part in plan_batches([self.lengths[i] for i in missing], self.extractor.batch_tokens):
            chosen = [missing[j] for j in part]
            for i, (aux, last) in zip(chosen, self.extractor.forward([self.rows[i]["input_ids"] for i in chosen])):
                sid = self.rows[i]["id"]  # inf/nan refused before training reads them (a nan loss skips steps)
                kept[i] = stored_states(sid, "aux", aux, self.dtype), stored_states(sid, "last", last, self.dtype)
        self._states = kept

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self._states:
            self.prefetch([i])
        aux, last = self._states[i]
        row = self.rows[i]
        return {"input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].long(), "aux": aux, "last": last}
