"""Hidden states of a vision-language target (the `embedded` backend with images).

Besides aux and last (docs/contract.md §2), a vision-language row keeps what the draft needs to see the
prompt the way the serving engine shows it: the target's own M-RoPE positions [3, S] and its
merged input embeddings at the image positions (vision features, docs/contract.md §2 VL notes).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from specforge.extract.embedded import EmbeddedExtractor
from specforge.targets.vl import image_inputs, open_images, vl_hidden_states


class VLExtractor(EmbeddedExtractor):
    """EmbeddedExtractor for rows with `images` + `image_grid_thw` (from the data stage)."""

    def __init__(self, model, aux_layer_ids, batch_tokens, storage_dtype, image_processor, info,
                 pad_token_id: int | None = None):
        super().__init__(model, aux_layer_ids, batch_tokens, storage_dtype, pad_token_id)
        self.image_processor = image_processor
        self.info = info

    @torch.inference_mode()
    def forward_rows(self, rows: Sequence[dict]) -> list[dict]:
        t0 = time.perf_counter()
        ids, mask, lens = self.pad([r["input_ids"] for r in rows])
        paths = [p for r in rows for p in r.get("images", [])]
        pixels = grid = None
        if paths:
            inputs = image_inputs(open_images(paths), self.image_processor)
            pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
            stored = [g for r in rows for g in r.get("image_grid_thw", [])]
            if grid.tolist() != stored:
                bad = next(r["id"] for r in rows if r.get("images"))
                raise ValueError(
                    f"sample {bad!r} (or a neighbour in its batch): the images give grids {grid.tolist()}, "
                    f"the data stage stored {stored}; the images or data.image_*_pixels changed: run the data stage again")
            pixels, grid = pixels.to(self.device), grid.to(self.device)
        out = vl_hidden_states(self.model, ids.to(self.device), mask.to(self.device), pixels, grid,
                               self.aux_layer_ids)
        counts = (ids == self.info.image_token_id).sum(1).tolist()
        if sum(counts) != out["image_embeds"].shape[0]:
            raise ValueError(f"{sum(counts)} image tokens in the batch, {out['image_embeds'].shape[0]} image embeddings")
        image_embeds = torch.split(out["image_embeds"].to("cpu", self.storage_dtype), counts)
        aux = out["aux"].to("cpu", self.storage_dtype)
        last = out["last"].to("cpu", self.storage_dtype)
        pos = out["position_ids"].to("cpu")
        result = [{"aux": aux[i, :n].clone(), "last": last[i, :n].clone(), "position_ids": pos[:, i, :n].clone(),
                   "image_embeds": image_embeds[i].clone()} for i, n in enumerate(lens)]
        self.count(lens, ids.shape[1], t0)
        return result
