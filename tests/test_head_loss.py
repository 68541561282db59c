"""The chunked head loss gives the loss, argmax and gradients of the plain computation (logits for
every row, log-softmax, cross-entropy against the teacher) in fp32, for any chunk size."""
import pytest
import torch

from specforge.models.head_loss import DraftHead, TeacherRows


def problem(rows=23, hidden=16, vocab=40, teacher_rows=31, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = DraftHead(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))
    probs = torch.randn(teacher_rows, vocab, generator=g).mul(3).softmax(-1)
    index = torch.randint(0, teacher_rows, (rows,), generator=g)  # some teacher rows twice, some never
    h = torch.randn(rows, hidden, generator=g)
    return head, probs, index, h


def plain(head, probs, index, h):
    logits = head(h)
    loss = -(probs[index] * logits.float().log_softmax(-1)).sum()
    return loss, logits.argmax(-1)


def loss_and_grads(fn, head, h):
    h = h.clone().requires_grad_()
    head.zero_grad()
    loss, predicted = fn(h)
    (2.5 * loss).backward()  # a scale on the way back, as the TTT step weights put there
    return loss.detach(), predicted, h.grad, head.weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 5, 23, 1024])
def test_chunked_head_loss_equals_the_plain_one(chunk):
    head, probs, index, h = problem()
    got = loss_and_grads(lambda x: head(x, TeacherRows(probs, index, chunk)), head, h)
    want = loss_and_grads(lambda x: plain(head, probs, index, x), head, h)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-6)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=1e-5)


def test_chunked_head_loss_under_bf16_autocast_stays_close():
    head, probs, index, h = problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(lambda x: head(x, TeacherRows(probs, index, 7)), head, h)
        want = loss_and_grads(lambda x: plain(head, probs, index, x), head, h)
    assert got[3].dtype == torch.float32  # the master weight's gradient stays fp32
    for a, w in zip(got[::2], want[::2]):
        torch.testing.assert_close(a.float(), w.float(), atol=0.05, rtol=0.02)


def test_no_scored_rows_is_a_zero_in_the_graph():
    head, probs, _, _ = problem()
    empty = torch.empty(0, dtype=torch.long)
    h = torch.empty(0, 16, requires_grad=True)
    loss, predicted = head(h, TeacherRows(probs, empty))
    loss.backward()
    assert float(loss.detach()) == 0.0 and predicted.numel() == 0
    assert torch.count_nonzero(head.weight.grad) == 0


def test_without_teacher_rows_it_is_the_plain_head():
    head, _, _, h = problem()
    torch.testing.assert_close(head(h), h @ head.weight.T)


def test_row_weights_scale_each_rows_loss_and_gradients():
    head, probs, index, h = problem()
    weight = torch.rand(h.shape[0], generator=torch.Generator().manual_seed(3))
    got = loss_and_grads(lambda x: head(x, TeacherRows(probs, index, 5, weight)), head, h)

    def weighted(x):
        logits = head(x)
        return -(weight[:, None] * probs[index] * logits.float().log_softmax(-1)).sum(), logits.argmax(-1)

    want = loss_and_grads(weighted, head, h)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_the_same_hidden_gradient():
    head, probs, index, h = problem()
    trained = loss_and_grads(lambda x: head(x, TeacherRows(probs, index, 5)), head, h)
    head.zero_grad()
    head.requires_grad_(False)
    x = h.clone().requires_grad_()
    loss, predicted = head(x, TeacherRows(probs, index, 5))
    (2.5 * loss).backward()
    assert head.weight.grad is None
    torch.testing.assert_close(x.grad, trained[2], atol=0, rtol=0)
    assert torch.equal(predicted, trained[1])
