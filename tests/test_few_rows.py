"""The engine's few-row matmul path: the numbers of torch's linear, only inside the engine's forwards."""
from __future__ import annotations

import pytest
import torch

from specforge.engine.few_rows import COLUMN_ROWS, FewRowsLinear, few_rows_linear, few_rows_linears, plain_linears


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_linear_is_torch_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 64, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(1, rows, 64, generator=g)  # [batch, rows, in] as the models call it
    got = few_rows_linear(x, w, b)
    assert got.shape == (1, rows, 300) and got.is_contiguous()
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_torch_linear():
    w, x = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(few_rows_linear(x, w), torch.nn.functional.linear(x, w))
    assert COLUMN_ROWS >= 1


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def test_linears_are_switched_inside_the_block_only(tiny_model):
    linears = plain_linears(tiny_model)
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        want = tiny_model(ids).logits
        with few_rows_linears(linears):
            assert all(type(m) is FewRowsLinear for m in linears)
            got = tiny_model(ids).logits
    assert all(type(m) is torch.nn.Linear for m in linears)  # a shared model is handed back as it was
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError), few_rows_linears(linears):
        raise RuntimeError("a failing forward")
    assert all(type(m) is torch.nn.Linear for m in linears)


def test_a_subclass_gets_its_own_class_back():
    """The draft's lm_head (DraftHead, called with teacher rows in training) runs the few-row path
    in the engine and is a DraftHead again after it."""
    from specforge.models.head_loss import DraftHead

    head, plain = DraftHead(16, 32, bias=False), torch.nn.Linear(16, 8)
    model = torch.nn.Sequential(head, torch.nn.Linear(32, 16), plain)
    assert plain_linears(model) == [model[1], plain]
    linears = plain_linears(model, subclasses=True)
    assert linears[0] is head and len(linears) == 3
    x = torch.randn(3, 16)
    with few_rows_linears(linears):
        assert type(head) is FewRowsLinear
        torch.testing.assert_close(head(x), x @ head.weight.T, rtol=1e-5, atol=1e-5)
    assert type(head) is DraftHead and type(plain) is torch.nn.Linear
