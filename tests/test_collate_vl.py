"""Batches of vision-language samples: M-RoPE positions padded per row, and the draft's
embedding override at image positions (draft.image_embeddings=merged)."""
from __future__ import annotations

import pytest
import torch

from specforge.train.batches import collate

H, IMG = 4, 9


def sample(ids, positions, image_embeds):
    n = len(ids)
    return {"input_ids": torch.tensor(ids), "loss_mask": torch.ones(n, dtype=torch.long),
            "aux": torch.randn(n, 3 * H), "last": torch.randn(n, H),
            "position_ids": torch.tensor(positions), "image_embeds": image_embeds}


def test_positions_and_override():
    emb = torch.arange(2 * H, dtype=torch.float32).view(2, H)
    a = sample([1, IMG, IMG, 2, 3], [[0, 1, 1, 3, 4], [0, 1, 2, 3, 4], [0, 1, 1, 3, 4]], emb)
    b = sample([5, 6], [[0, 1]] * 3, torch.zeros(0, H))
    batch = collate([a, b], image_token_id=IMG)
    assert batch["position_ids"].shape == (2, 3, 5)
    assert batch["position_ids"][0].tolist() == a["position_ids"].tolist()
    assert batch["position_ids"][1, :, :2].tolist() == [[0, 1]] * 3
    assert batch["position_ids"][1, :, 2:].tolist() == [[2, 3, 4]] * 3  # padding goes on counting
    assert batch["embed_override_mask"].tolist() == [[False, True, True, False, False], [False] * 5]
    assert torch.equal(batch["embed_override"][0, 1:3], emb)
    assert not batch["embed_override"][1].any()
    # draft.image_embeddings=token: no override, positions still 3-D
    plain = collate([a, b])
    assert "embed_override" not in plain and plain["position_ids"].shape == (2, 3, 5)


def test_override_count_mismatch_is_an_error():
    a = sample([1, IMG, 2], [[0, 1, 2]] * 3, torch.zeros(2, H))
    with pytest.raises(ValueError, match="1 image tokens but 2 stored image embeddings"):
        collate([a], image_token_id=IMG)
