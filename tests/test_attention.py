"""The TTT mask and the three attention kernels that must agree on it."""
import pytest
import torch

from specforge.models.attention import TTTMask, attend, causal_mask


def test_ttt_mask_step0_is_causal():
    assert torch.equal(TTTMask(4, 0).dense(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_ttt_mask_step2_golden():
    # keys: [step0 pos 0..3 | step1 pos 0..3 | step2 pos 0..3]
    expected = torch.tensor([
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(TTTMask(4, 2).dense(), expected)


def test_causal_mask_with_past():
    assert torch.equal(causal_mask(2, 3), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))


def _qkv(seq, step, heads=4, kv_heads=2, dim=16, batch=2):
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq, dim)
    k = torch.randn(batch, kv_heads, seq * (step + 1), dim)
    v = torch.randn(batch, kv_heads, seq * (step + 1), dim)
    return q, k, v


@pytest.mark.parametrize("step", [0, 1, 3])
def test_sdpa_matches_eager_on_ttt_mask(step):
    q, k, v = _qkv(9, step)
    mask = TTTMask(9, step)
    torch.testing.assert_close(attend(q, k, v, mask, "sdpa"), attend(q, k, v, mask, "eager"),
                               atol=1e-5, rtol=1e-5)


def test_sdpa_gradients_match_eager():
    q, k, v = _qkv(7, 2)
    grads = []
    for impl in ("sdpa", "eager"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        attend(qq, kk, vv, TTTMask(7, 2), impl).square().sum().backward()
        grads.append([t.grad for t in (qq, kk, vv)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_flex_forward_matches_sdpa():
    """Flex is the GPU training kernel; its forward also runs on CPU, so parity is checked here."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv(16, 2)
    mask = TTTMask(16, 2)
    try:
        out = attend(q, k, v, mask, "flex")
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - platform without flex
        pytest.skip(f"flex attention unavailable here: {e}")
    torch.testing.assert_close(out, attend(q, k, v, mask, "sdpa"), atol=1e-4, rtol=1e-4)
    assert flex is not None


def test_unknown_impl_is_refused():
    q, k, v = _qkv(3, 0)
    with pytest.raises(ValueError, match="train.attention"):
        attend(q, k, v, TTTMask(3, 0), "magic")
