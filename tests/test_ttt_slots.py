"""TTT steps run where they are needed (`scored_slots`): step 0's outputs where it scores or a later
step goes on (its keys everywhere), the later steps where they score. Prompts, padding and the
last positions drop out, and the loss, the statistics and every gradient stay those of running
all positions, for every attention kernel, padded, packed and M-RoPE batches."""
from __future__ import annotations

import pytest
import torch

from specforge.models.attention import TTTMask, attend, take
from specforge.train.batches import collate
from specforge.train.ttt import Teacher, scored_slots
from tests.test_attention import OFF_CPU, _output_and_grads
from tests.test_draft_mrope import tiny_vl_draft, vl_batch
from tests.test_packing import documents, loss_and_grads
from tests.test_ttt import tiny_draft


def test_scored_slots_are_each_rows_scored_positions_topped_up_to_the_widest_row():
    needed = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert scored_slots(needed).tolist() == [[1, 2, 4], [0, 1, 2]]  # row 1: its 0, then 1 and 2 unscored
    assert scored_slots(torch.ones(2, 4, dtype=torch.bool)) is None  # nothing to drop
    almost = torch.ones(1, 20, dtype=torch.bool)
    almost[0, -1:] = False
    assert scored_slots(almost) is None  # under a tenth: not worth the gathers
    almost[0, -2:] = False
    assert scored_slots(almost).shape == (1, 18)
    assert scored_slots(torch.zeros(1, 4, dtype=torch.bool)).tolist() == [[3]]
    # after prompts: a narrower row is topped up after its first needed position, then just before it,
    # so no slot precedes the batch's first needed position (3 here)
    prompts = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0],
                            [0, 0, 0, 0, 0, 0, 1, 1, 1, 0],
                            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert scored_slots(prompts).tolist() == [[3, 4, 5, 6, 7], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]
    x = torch.arange(12).view(2, 6)
    assert take(x, scored_slots(needed)).tolist() == [[1, 2, 4], [6, 7, 8]]
    positions = torch.arange(36).view(2, 3, 6)  # M-RoPE [B, 3, S]: along the last dim
    assert take(positions, scored_slots(needed), dim=2)[1].tolist() == [[18, 19, 20], [24, 25, 26], [30, 31, 32]]


def _qkv(slots, seq, step, heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    batch, n = slots.shape
    q = torch.randn(batch, heads, n, dim, generator=g)
    k = torch.randn(batch, kv_heads, seq + step * n, dim, generator=g)
    return q, k, torch.randn(k.shape, generator=g)


@pytest.mark.parametrize("impl", ["sdpa", "eager", OFF_CPU])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("layout", ["scattered", "answers"])
@pytest.mark.parametrize("step", [0, 3])
def test_split_attention_on_slots_equals_the_dense_mask(impl, packed, layout, step):
    """`answers`: prompts first and unscored ends, so the flash kernel's rows start at the batch's
    first slot (a rectangle of the keys before it, a triangle after) and end at its last; packed,
    a document starts after that first slot (its rows see none of the rectangle). Step 0: queries at
    the slots, keys everywhere."""
    seq = 64
    needed = torch.rand(2, seq, generator=torch.Generator().manual_seed(2)) < 0.4
    if layout == "answers":
        needed[0, :23], needed[1, :30], needed[:, 57:] = False, False, False
    slots = scored_slots(needed)
    doc_ids = None
    if packed:
        doc_ids = torch.zeros(2, seq, dtype=torch.long)
        doc_ids[0, 20:], doc_ids[0, 41:] = 1, 2
        doc_ids[1, 35:] = 1
    mask = TTTMask(seq, step, doc_ids, slots)
    q, k, v = _qkv(slots, seq, step)
    for got, want in zip(_output_and_grads(impl, q, k, v, mask), _output_and_grads("dense", q, k, v, mask)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_attention_on_slots_with_heads_that_do_not_divide_among_threads():
    """1 x 3 heads on 2 threads after a prompt: the span's triangle goes in pieces and the rectangle
    before it in two halves of rows, and both still equal the dense mask."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seq, step = 330, 2
        needed = torch.zeros(1, seq, dtype=torch.bool)
        needed[0, 61:318] = torch.rand(257, generator=torch.Generator().manual_seed(4)) < 0.5
        needed[0, 61] = needed[0, 317] = True  # a span of 257 rows, widened to 260
        slots = scored_slots(needed)
        for doc_ids in (None, torch.tensor([[0] * 40 + [1] * 100 + [2] * 190])):
            mask = TTTMask(seq, step, doc_ids, slots)
            q, k, v = _qkv(slots, seq, step, heads=3, kv_heads=1)
            for got, want in zip(_output_and_grads("sdpa", q, k, v, mask), _output_and_grads("dense", q, k, v, mask)):
                torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_flex_forward_on_slots_matches_the_dense_mask():
    """Flex (the GPU training kernel) reads the slots through its mask rule; its forward runs here."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    seq, step = 32, 2
    slots = scored_slots(torch.rand(2, seq, generator=torch.Generator().manual_seed(3)) < 0.5)
    doc_ids = torch.zeros(2, seq, dtype=torch.long)
    doc_ids[1, 11:] = 1
    mask = TTTMask(seq, step, doc_ids, slots)
    q, k, v = _qkv(slots, seq, step)
    try:
        out = attend(q, k, v, mask, "flex")
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - platform without flex
        pytest.skip(f"flex attention unavailable here: {e}")
    torch.testing.assert_close(out, attend(q, k, v, mask, "dense"), atol=1e-4, rtol=1e-4)


def test_the_dense_mask_on_slots_is_the_full_mask_at_those_rows():
    """Queries at the slots, later keys at the slots: the rows of the full S x (k+1) S mask there."""
    seq, step = 12, 2
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    slots = torch.tensor([[1, 4, 5, 9]])
    full = TTTMask(seq, step, doc_ids).dense()[0]
    keys = torch.cat([torch.arange(seq), *(seq * s + slots[0] for s in range(1, step + 1))])
    assert torch.equal(TTTMask(seq, step, doc_ids, slots).dense()[0], full[slots[0]][:, keys])


def _assert_same_training(draft, batch, ttt=4, **kwargs):
    torch.manual_seed(5)
    teacher = Teacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size), draft.t2d)
    widths = []  # positions each step computes outputs for
    hook = draft.midlayer.register_forward_hook(lambda m, i, o: widths.append(o[0].shape[1]))
    try:
        loss, stats, grads = loss_and_grads(draft, batch, teacher, ttt, skip_unscored=True, **kwargs)
    finally:
        hook.remove()
    seq = batch["input_ids"].shape[1]
    assert len(widths) == ttt and seq > widths[0] > widths[1]  # the test drops positions at every step
    ref_loss, ref_stats, ref_grads = loss_and_grads(draft, batch, teacher, ttt, skip_unscored=False, **kwargs)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert stats == pytest.approx(ref_stats) and stats["positions"] > 0
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "dense"])
@pytest.mark.parametrize("pack_tokens", [0, 32])
def test_training_on_the_scored_slots_equals_training_on_every_position(attention, pack_tokens):
    draft = tiny_draft()
    draft.attention = attention
    batch = collate(documents(draft, [9, 14, 6, 11]), pack_tokens=pack_tokens)  # a third of each is prompt
    _assert_same_training(draft, batch, reach_weight=0.5 if pack_tokens else 0.0)


def test_training_on_the_scored_slots_with_mrope_positions_and_merged_embeddings():
    draft = tiny_vl_draft()
    batch = vl_batch(draft, seq=14)
    batch["loss_mask"][0, :6] = False  # row 0: an image and a prompt first
    batch["loss_mask"][1, 9:] = False  # row 1: padding
    _assert_same_training(draft, batch, ttt=3)
