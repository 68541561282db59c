"""Sequence packing (train.pack_tokens): documents concatenated into rows give the loss and the
gradients of the same documents as separate padded rows, and the packed run still computes on 2
processes what it computes on one."""
from __future__ import annotations

import pytest
import torch

from dist_helpers import EPOCHS, checkpoint_weights, launch, master_weights, metrics, prepared, reference_run
from specforge.train.batches import collate, epoch_batches, global_batches, pack_rows, steps_per_epoch
from specforge.train.ttt import Teacher, TeacherMemo, summarize, ttt_forward
from tests.test_ttt import CountingTeacher, tiny_draft


def test_rows_hold_every_sample_once_within_the_budget():
    lengths = [(i * 37) % 101 + 5 for i in range(61)] + [300]  # one longer than a row: a row of its own
    batches = global_batches(lengths, 2, seed=3, epoch=1, pack_tokens=160)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        rows = pack_rows([lengths[i] for i in b], 160)  # cutting a micro-batch again gives its rows
        assert 1 <= len(rows) <= 2
        assert all(sum(lengths[b[j]] for j in row) <= 160 or len(row) == 1 for row in rows)
    assert [len(r) for r in pack_rows([300], 160)] == [1]
    # rows are dealt to ranks as samples are: W ranks take the micro-batches of one process
    ranks = [epoch_batches(lengths, 2, 3, 1, rank=r, world_size=2, pack_tokens=160) for r in range(2)]
    steps = steps_per_epoch(len(batches), 1, 2)
    assert [b for s in range(steps) for b in (ranks[0][s], ranks[1][s])] == batches[: 2 * steps]


def documents(draft, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    docs = []
    for n in lengths:
        loss_mask = torch.ones(n, dtype=torch.bool)
        loss_mask[: n // 3] = False  # a prompt, not scored
        docs.append({"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g), "loss_mask": loss_mask,
                     "aux": torch.randn(n, 3 * cfg.target_hidden_size, generator=g),
                     "last": torch.randn(n, cfg.target_hidden_size, generator=g)})
    return docs


def loss_and_grads(draft, batch, teacher, ttt=4, **options):
    """`options`: ttt_forward's (reach_weight, skip_unscored)."""
    draft.zero_grad()
    loss, stats = ttt_forward(draft, batch, teacher, ttt, 0.8, **options)
    loss.backward()
    return loss.detach(), summarize(stats), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_trains_like_its_documents_unpacked(attention):
    draft = tiny_draft()
    draft.attention = attention
    torch.manual_seed(2)
    teacher = Teacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size), draft.t2d)
    docs = documents(draft, [9, 14, 6, 11])
    packed = collate(docs, pack_tokens=32)  # rows [9, 14, 6] and [11]
    assert packed["input_ids"].shape == (2, 29)
    assert packed["doc_ids"][0].tolist() == [0] * 9 + [1] * 14 + [2] * 6
    assert packed["doc_ids"][1].tolist() == [0] * 11 + [-1] * 18
    assert packed["position_ids"][0].tolist() == list(range(9)) + list(range(14)) + list(range(6))
    loss, stats, grads = loss_and_grads(draft, packed, teacher)
    ref_loss, ref_stats, ref_grads = loss_and_grads(draft, collate(docs), teacher)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert stats == pytest.approx(ref_stats)  # same positions scored, same accuracies
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)



@pytest.mark.parametrize("pack_tokens", [0, 32])
def test_the_memo_reads_the_whole_head_once_per_sample_and_changes_no_loss_or_gradient(pack_tokens):
    """TeacherMemo: the full-vocab argmax (which positions count) is computed the first time a
    sample is read; padded, packed or not, later epochs train exactly as without it."""
    draft = tiny_draft()
    torch.manual_seed(3)
    weight = torch.randn(draft.config.vocab_size, draft.config.target_hidden_size)
    teacher = CountingTeacher(weight, draft.t2d)
    docs = documents(draft, [9, 14, 6, 11])
    memo = TeacherMemo(docs, teacher, torch.device("cpu"))
    ref_loss, ref_stats, ref_grads = loss_and_grads(draft, collate(docs, pack_tokens=pack_tokens), teacher)
    assert teacher.head_rows == (29 * 2 if pack_tokens else 4 * 14)  # without the memo: every padded row
    assert 0 < ref_stats["positions"] < sum(int(d["loss_mask"].sum()) for d in docs)  # some argmaxes are not draft tokens
    teacher.head_rows = 0
    for epoch in range(2):
        batch = collate(memo.samples([0, 1, 2, 3]), pack_tokens=pack_tokens)
        loss, stats, grads = loss_and_grads(draft, batch, teacher)
        assert teacher.head_rows == 9 + 14 + 6 + 11  # each sample once, unpadded; none in the second epoch
        torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
        assert stats == ref_stats
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=0, rtol=0, msg=name)
    assert [tuple(memo.known[i][1]) for i in range(4)] == [(9,), (14,), (6,), (11,)]
    assert [memo.known[i][0].nbytes for i in range(4)] == [2, 2, 1, 2]  # one bit per token


def test_packed_vision_language_rows_keep_each_documents_mrope_positions():
    a = {"input_ids": torch.arange(3), "loss_mask": torch.ones(3), "aux": torch.zeros(3, 6),
         "last": torch.zeros(3, 2), "position_ids": torch.tensor([[0, 1, 1], [0, 1, 2], [0, 1, 1]]),
         "image_embeds": torch.zeros(0, 2)}
    b = {**a, "input_ids": torch.arange(2), "loss_mask": torch.ones(2), "aux": torch.zeros(2, 6),
         "last": torch.zeros(2, 2), "position_ids": torch.tensor([[0, 1], [0, 1], [0, 1]])}
    batch = collate([a, b, a], pack_tokens=6)  # rows [a, b] and [a]
    assert batch["position_ids"].shape == (2, 3, 5)
    assert batch["position_ids"][0, 1].tolist() == [0, 1, 2, 0, 1]
    assert batch["position_ids"][1, 0].tolist() == [0, 1, 1, 3, 4]  # padding continues after the largest
    assert batch["doc_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, -1, -1]]


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_target_dir):
    return prepared(tmp_path_factory, tiny_target_dir)


def test_packed_training_on_two_processes_equals_one(prep):
    """DDP on 2 processes and one process with grad_accum 2, both packing rows of <= 1500 tokens (about
    3 of the 24 samples of ~440 tokens), one row per micro-batch."""
    packing = ("train.pack_tokens=1500", "train.batch_size=1")
    ref = reference_run(prep, "packed_accum2", 1, "train.grad_accum=2", *packing)
    run = reference_run(prep, "packed_ddp", 2, "train.strategy=ddp", *packing)
    m_ref, m_run = metrics(ref), metrics(run)
    assert [(m["split"], m["step"]) for m in m_run] == [(m["split"], m["step"]) for m in m_ref]
    train_rows = [m for m in m_ref if m["split"] == "train"]
    unpacked_steps = EPOCHS * 12  # 24 samples, one per micro-batch, global batch 2
    assert 0 < len(train_rows) <= unpacked_steps // 2  # rows of several samples: fewer steps
    for a, b in zip(m_ref, m_run):
        key = "loss" if a["split"] == "train" else "loss_0"
        assert b[key] == pytest.approx(a[key], rel=1e-5), (a, b)
    weights, ref_weights = master_weights(run), master_weights(ref)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=0, atol=1e-5, msg=k)
    assert sorted(checkpoint_weights(run)) == sorted(checkpoint_weights(ref))
    assert "rows of <= 1500 tokens" in launch(prep, "packed_log", 1, *packing, "train.epochs=1")
