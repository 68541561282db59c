"""The TTT unroll must compute exactly what the draft computes when it drafts a chain at serving
time: step k at position t = the k-th chained draft step after the prefix 0..t."""
import pytest
import torch

from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.train.ttt import Teacher, shift, summarize, ttt_forward


def tiny_draft(vocab=50, draft_vocab=20, hidden=32, target_hidden=24, seed=0, rope_scaling=None, head_dim=8,
               **options):
    """`options`: further Eagle3Config fields, e.g. the EAGLE 3.1 options."""
    torch.manual_seed(seed)
    cfg = Eagle3Config(vocab_size=vocab, draft_vocab_size=draft_vocab, hidden_size=hidden,
                       intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       target_hidden_size=target_hidden, aux_layer_ids=[0, 1, 2], rope_scaling=rope_scaling,
                       **options)
    draft = Eagle3Draft(cfg, attention="eager")
    used = torch.arange(0, 2 * draft_vocab, 2)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab_mapping(used - torch.arange(draft_vocab), t2d)
    return draft


def random_batch(draft, batch=2, seq=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
        "loss_mask": torch.ones(batch, seq, dtype=torch.bool),
        "aux": torch.randn(batch, seq, 3 * cfg.target_hidden_size, generator=g),
        "last": torch.randn(batch, seq, cfg.target_hidden_size, generator=g),
        "position_ids": torch.arange(seq).expand(batch, seq),
    }


def ttt_logits(draft, batch, steps, teacher=None):
    """The logits of every TTT step at every position, captured from the batched unroll, and its stats."""
    captured = []
    original = draft.step

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)  # training asks for norm(out) and scores it through lm_head
        captured.append(out[1] if kwargs.get("head", True) else draft.lm_head(out[1]))
        return out

    draft.step = spy
    if teacher is None:
        teacher = Teacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size), draft.t2d)
    _, stats = ttt_forward(draft, batch, teacher, steps, 0.8, skip_unscored=False)  # every position, to compare them all
    draft.step = original
    return captured, stats


@torch.no_grad()
def chained_serving_logits(draft, batch, t, steps):
    """Draft a chain after prefix 0..t the way a server does, one position per step, with a KV cache."""
    ids, pos = batch["input_ids"], batch["position_ids"]
    feat = draft.project(batch["aux"][:, : t + 1])
    out, logits, (k, v) = draft.step(ids[:, 1 : t + 2], feat, pos[:, : t + 1])
    result = [logits[:, t]]
    feat = out[:, t : t + 1]
    for j in range(1, steps):
        out, logits, (nk, nv) = draft.step(ids[:, t + 1 + j : t + 2 + j], feat, pos[:, t : t + 1] + j,
                                           past_kv=(k, v))
        k, v = torch.cat([k, nk], 2), torch.cat([v, nv], 2)
        result.append(logits[:, 0])
        feat = out
    return result


def assert_unroll_equals_chained_drafting(draft, seq: int = 10, steps: int = 4):
    """TTT's batched unroll gives, at every position, the logits of drafting step by step."""
    batch = random_batch(draft, seq=seq)
    batched, _ = ttt_logits(draft, batch, steps)
    for t in range(0, seq - steps - 1):
        serial = chained_serving_logits(draft, batch, t, steps)
        for k in range(steps):
            torch.testing.assert_close(batched[k][:, t], serial[k], atol=1e-5, rtol=1e-4)


def test_ttt_unroll_equals_chained_drafting():
    assert_unroll_equals_chained_drafting(tiny_draft())


class CountingTeacher(Teacher):
    """Counts the rows it reads: through the target's whole head (`in_vocab`: which positions
    count) and through its draft-vocab rows (`probs`: the loss targets)."""

    head_rows = probs_rows = 0

    def in_vocab(self, last):
        self.head_rows += last.reshape(-1, last.shape[-1]).shape[0]
        return super().in_vocab(last)

    def probs(self, last):
        self.probs_rows += last.reshape(-1, last.shape[-1]).shape[0]
        return super().probs(last)


@torch.no_grad()
def test_each_step_is_scored_against_the_teacher_at_the_token_it_predicts():
    """Step k at position p: loss -sum(teacher(p+1+k) * log_softmax(logits_k(p))), correct when the
    argmaxes agree, over the positions it scores; the teacher's distribution is computed at the
    positions some step reads and nowhere else (prompt, padding and the row ends are not)."""
    draft = tiny_draft()
    batch = random_batch(draft, seq=14)
    batch["loss_mask"][:, :6] = False  # a prompt
    batch["loss_mask"][1, 11:] = False  # padding
    steps = 3
    teacher = CountingTeacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size), draft.t2d)
    logits, stats = ttt_logits(draft, batch, steps, teacher)

    probs, in_vocab = Teacher.probs(teacher, batch["last"]), teacher.in_vocab(batch["last"])  # every position
    read = torch.zeros_like(in_vocab)
    for k in range(steps):
        valid = shift(batch["loss_mask"], 2 + k, False) & shift(in_vocab, 1 + k, False)
        assert 0 < int(valid.sum()) < valid.numel()
        target = shift(probs, 1 + k)  # the teacher at p + 1 + k
        per_pos = -(target * logits[k].float().log_softmax(-1)).sum(-1)
        torch.testing.assert_close(stats[k].loss_sum, (per_pos * valid).sum(), rtol=1e-5, atol=1e-5)
        correct = (logits[k].argmax(-1) == target.argmax(-1)) & valid
        assert int(stats[k].positions) == int(valid.sum()) and int(stats[k].correct) == int(correct.sum())
        read |= torch.roll(valid, 1 + k, dims=1)  # no valid position reaches past the row's end
    assert teacher.probs_rows == int(read.sum()) < read.numel()


def test_shift_pads_the_end():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift(x, 2).tolist() == [[3, 4, 0, 0]]


def test_loss_decreases_and_accuracy_rises_when_fitting_one_batch():
    draft = tiny_draft()
    batch = random_batch(draft, seq=12)
    teacher = Teacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size), draft.t2d)
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss, stats = ttt_forward(draft, batch, teacher, 3, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if first is None:
            first = (float(loss.detach()), summarize(stats))
    last = summarize(stats)
    assert float(loss.detach()) < 0.5 * first[0]
    assert last["acc_0"] > first[1]["acc_0"]
    assert last["sim_accept_length"] > first[1]["sim_accept_length"]


def test_positions_where_target_argmax_is_outside_draft_vocab_do_not_count():
    draft = tiny_draft()
    batch = random_batch(draft, seq=8)
    # A head whose argmax is always target id 1, which is not in the draft vocab (even ids only).
    weight = torch.zeros(draft.config.vocab_size, draft.config.target_hidden_size)
    weight[1] = 100.0
    batch["last"] = batch["last"].abs()
    _, stats = ttt_forward(draft, batch, Teacher(weight, draft.t2d), 2, 0.8)
    assert all(int(s.positions) == 0 for s in stats)


def test_summarize_simulated_accept_length_is_product_rule():
    draft = tiny_draft()
    batch = random_batch(draft, seq=12)
    teacher = Teacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size), draft.t2d)
    _, stats = ttt_forward(draft, batch, teacher, 3, 0.8)
    s = summarize(stats)
    expected = 1 + s["acc_0"] + s["acc_0"] * s["acc_1"] + s["acc_0"] * s["acc_1"] * s["acc_2"]
    assert abs(s["sim_accept_length"] - expected) < 1e-12


def test_reach_weight_drops_the_steps_after_the_greedy_chain_missed():
    """reach_weight=1: a position counts at step k only if the draft's argmax was right at steps
    0..k-1. A draft that misses everywhere at step 0 then trains on step 0 alone."""
    draft = tiny_draft()
    with torch.no_grad():
        draft.lm_head.weight.zero_()  # every logit 0: the argmax is draft id 0 everywhere
    batch = random_batch(draft, seq=8)
    batch["last"] = batch["last"].abs()
    weight = torch.zeros(draft.config.vocab_size, draft.config.target_hidden_size)
    weight[2] = 100.0  # the teacher's argmax: target id 2 = draft id 1, never the draft's choice
    teacher = Teacher(weight, draft.t2d)
    plain_loss, plain = ttt_forward(draft, batch, teacher, 3, 0.8)
    same_loss, same = ttt_forward(draft, batch, teacher, 3, 0.8, reach_weight=0.0)
    assert torch.equal(plain_loss, same_loss)
    loss, stats = ttt_forward(draft, batch, teacher, 3, 0.8, reach_weight=1.0)
    assert int(stats[0].correct) == 0 and int(stats[1].positions) > 0
    assert all(float(s.loss_sum) == 0.0 for s in stats[1:]) and all(float(s.loss_sum) > 0 for s in plain[1:])
    torch.testing.assert_close(loss, stats[0].loss_sum / stats[0].positions)
    half, half_stats = ttt_forward(draft, batch, teacher, 3, 0.8, reach_weight=0.5)
    torch.testing.assert_close(half_stats[1].loss_sum, 0.5 * plain[1].loss_sum)
    with pytest.raises(ValueError, match="train.reach_weight"):
        ttt_forward(draft, batch, teacher, 3, 0.8, reach_weight=1.5)
