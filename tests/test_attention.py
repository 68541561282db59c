"""The TTT mask and the attention kernels that must agree on it: the split O(S^2 + kS) ones
(sdpa on CPU, sdpa's path off the CPU run here on the CPU's SDPA, eager), flex, and the dense mask
they are checked against."""
import pytest
import torch

from specforge.models.attention import (TTTMask, attend, causal_flash_backward, causal_mask, flex_kernel_options,
                                       ttt_sdpa_attention)

# The split on SDPA's fused kernels that `sdpa` runs off the CPU (GPUs); here on the CPU's SDPA.
OFF_CPU = pytest.param(ttt_sdpa_attention, id="sdpa-off-cpu")


def test_ttt_mask_step0_is_causal():
    assert torch.equal(TTTMask(4, 0).dense()[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_ttt_mask_step2_golden():
    # keys: [step0 pos 0..3 | step1 pos 0..3 | step2 pos 0..3]
    expected = torch.tensor([
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(TTTMask(4, 2).dense(), expected[None])


def test_causal_mask_with_past():
    assert torch.equal(causal_mask(2, 3), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))


def test_ttt_mask_with_documents_golden():
    # two documents packed in one row: positions 0-2 and 3-4; step 1
    mask = TTTMask(5, 1, doc_ids=torch.tensor([[0, 0, 0, 1, 1]])).dense()
    causal = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
                          dtype=torch.bool)
    assert torch.equal(mask, torch.cat([causal, torch.eye(5, dtype=torch.bool)], dim=1)[None])


def _qkv(seq, step, heads=4, kv_heads=2, dim=16, batch=2, dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq * (step + 1), dim, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq * (step + 1), dim, dtype=dtype)
    return q, k, v


def _documents(batch, seq):
    """Rows of 3 documents of different lengths, the last row one document."""
    doc_ids = torch.zeros(batch, seq, dtype=torch.long)
    doc_ids[0, seq // 4 :] = 1
    doc_ids[0, seq // 2 + 1 :] = 2
    return doc_ids


def _output_and_grads(impl, q, k, v, mask, device=None):
    """impl: a name for `attend`, or an attention function itself; device: where it runs (a GPU in
    tests/test_cuda.py); the output and the gradients come back to the CPU."""
    q, k, v = (t.to(device).clone().requires_grad_() for t in (q, k, v))
    if device is not None and (mask.doc_ids is not None or mask.slots is not None):
        moved = (None if t is None else t.to(device) for t in (mask.doc_ids, mask.slots))
        mask = TTTMask(mask.seq_len, mask.step, *moved)
    out = impl(q, k, v, mask) if callable(impl) else attend(q, k, v, mask, impl)
    # drawn in fp32, then cast: torch < 2.13 draws other numbers for the same seed in bf16
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return [t.cpu() for t in (out.detach(), *torch.autograd.grad((out * weights).sum(), [q, k, v]))]


@pytest.mark.parametrize("impl", ["sdpa", "eager", OFF_CPU])
@pytest.mark.parametrize("seq, step, heads, kv_heads, packed", [
    (9, 0, 4, 2, False), (9, 1, 4, 4, False), (13, 3, 4, 2, False), (33, 6, 6, 2, False),
    (64, 6, 4, 1, False), (9, 0, 4, 2, True), (13, 3, 4, 2, True), (40, 6, 6, 3, True)])
def test_split_ttt_attention_equals_the_dense_mask(impl, seq, step, heads, kv_heads, packed):
    """The O(S^2 + kS) kernels give the dense (k+1) x S mask's output and gradients (q, k, v)."""
    q, k, v = _qkv(seq, step, heads, kv_heads)
    mask = TTTMask(seq, step, _documents(2, seq) if packed else None)
    for got, want in zip(_output_and_grads(impl, q, k, v, mask), _output_and_grads("dense", q, k, v, mask)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dim", [6, 12])
@pytest.mark.parametrize("step, packed", [(0, False), (0, True), (3, False), (3, True)])
def test_off_the_cpu_sdpa_pads_the_head_dim_and_still_equals_the_dense_mask(dim, step, packed):
    """The head dim SDPA sees off the CPU (dim, the sink's two, zeros up to a multiple of 8) gives
    the dense mask's numbers, whatever padding that takes (12 -> 16 at step 0, 6 + 2 -> 8 none)."""
    q, k, v = _qkv(21, step, dim=dim)
    mask = TTTMask(21, step, _documents(2, 21) if packed else None)
    got = _output_and_grads(ttt_sdpa_attention, q, k, v, mask)
    for a, b in zip(got, _output_and_grads("dense", q, k, v, mask)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_per_step_keys_give_what_concatenated_keys_give():
    """Training keeps the keys of each TTT step apart (a list); the dense layout concatenates them."""
    q, k, v = _qkv(13, 3)
    mask = TTTMask(13, 3)
    for impl in ("sdpa", "eager", "dense"):
        listed = attend(q, list(k.split(13, dim=2)), list(v.split(13, dim=2)), mask, impl)
        torch.testing.assert_close(listed, attend(q, k, v, mask, impl), atol=0, rtol=0)
    with pytest.raises(ValueError, match="TTT step 3 needs 4 steps"):
        attend(q, list(k.split(13, dim=2))[:3], list(v.split(13, dim=2))[:3], mask, "sdpa")


@pytest.mark.parametrize("dtype, packed", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_flash_backward_in_pieces_sums_to_the_whole(dtype, packed):
    """The backward split into two triangles and a rectangle (for heads that do not divide among
    the threads) gives the one-call kernel's gradients, with and without a document mask."""
    seq, gen = 64, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, seq, 16, dtype=dtype, generator=gen) for h in (6, 2, 2))
    mask = None
    if packed:
        allowed = TTTMask(seq, 0, _documents(1, seq)).causal_block()[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=mask, scale=0.25)
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    whole = causal_flash_backward(grad, q, k, v, out, lse, mask, 0.25, pieces=False)
    pieces = causal_flash_backward(grad, q, k, v, out, lse, mask, 0.25, pieces=True)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for got, want in zip(pieces, whole):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_split_ttt_attention_with_heads_that_do_not_divide_among_threads():
    """1 x 3 heads on 2 threads: the backward goes in pieces, and still equals the dense mask."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = _qkv(256, 2, heads=3, kv_heads=1, batch=1)
        for packed in (False, True):
            mask = TTTMask(256, 2, _documents(1, 256) if packed else None)
            got, want = _output_and_grads("sdpa", q, k, v, mask), _output_and_grads("dense", q, k, v, mask)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_split_ttt_attention_in_bf16_stays_close_to_fp32():
    q, k, v = _qkv(48, 4, dtype=torch.bfloat16)
    mask = TTTMask(48, 4, _documents(2, 48))
    want = _output_and_grads("dense", q.float(), k.float(), v.float(), mask)
    for impl in ("sdpa", "eager", ttt_sdpa_attention):
        for got, ref in zip(_output_and_grads(impl, q, k, v, mask), want):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)


def test_sdpa_off_cpu_carries_a_large_sink_score_without_rounding_it_in_bf16():
    """Scores near 25 everywhere (queries and keys along one direction, head dim 128): the
    diagonals' log-sum-exp times sqrt(128) is ~300, where bf16's step is 2; one bf16 query
    dimension would move the sink's score by up to 0.09 and the output by ~10x bf16's own error.
    Carried as hi + lo it stays as close to the exact output as the other splits."""
    gen = torch.Generator().manual_seed(0)
    seq, step, dim = 32, 2, 128
    direction = torch.randn(dim, generator=gen)
    direction = 16.8 * direction / direction.norm()
    q = direction + 0.3 * torch.randn(1, 2, seq, dim, generator=gen)
    k = direction + 0.3 * torch.randn(1, 1, seq * (step + 1), dim, generator=gen)
    v = torch.randn(1, 1, seq * (step + 1), dim, generator=gen)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    mask = TTTMask(seq, step)
    exact = attend(q.double(), k.double(), v.double(), mask, "dense")
    errors = {impl: (attend(q, k, v, mask, impl).double() - exact).abs().max().item() for impl in ("sdpa", "eager")}
    got = (ttt_sdpa_attention(q, k, v, mask).double() - exact).abs().max().item()
    assert got < 2 * max(errors.values()), (got, errors)


def test_engine_masks_still_go_to_sdpa_and_eager():
    q, k, v = _qkv(5, 0)
    mask = causal_mask(5, 0)[None]
    torch.testing.assert_close(attend(q, k, v, mask, "sdpa"), attend(q, k, v, mask, "eager"), atol=1e-5, rtol=1e-5)


def test_flex_forward_matches_sdpa():
    """Flex is the GPU training kernel; its forward also runs on CPU, so parity is checked here."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv(16, 2)
    mask = TTTMask(16, 2, _documents(2, 16))
    try:
        out = attend(q, k, v, mask, "flex")
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - platform without flex
        pytest.skip(f"flex attention unavailable here: {e}")
    torch.testing.assert_close(out, attend(q, k, v, mask, "dense"), atol=1e-4, rtol=1e-4)
    assert flex is not None


@pytest.mark.parametrize("device, dtype, head_dim, packed, tiles", [
    ("meta", torch.bfloat16, 128, True, 64), ("meta", torch.float16, 96, True, 64),  # meta stands in for a GPU
    ("meta", torch.bfloat16, 128, False, None), ("meta", torch.bfloat16, 64, True, None),
    ("meta", torch.float32, 128, True, None), ("cpu", torch.bfloat16, 128, True, None)])
def test_flex_takes_tiles_of_64_for_packed_16_bit_heads_wider_than_64_off_the_cpu(device, dtype, head_dim, packed,
                                                                                   tiles):
    """torch's default tiles for such rows overran an H200's shared memory; without documents they ran."""
    mask = TTTMask(8, 1, _documents(1, 8) if packed else None)
    options = flex_kernel_options(torch.empty(1, 2, 8, head_dim, device=device, dtype=dtype), mask)
    if tiles is None:
        assert options is None
    else:
        assert options == {name: tiles for name in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
                                                     "BLOCK_N2")}


def test_unknown_impl_is_refused():
    q, k, v = _qkv(3, 0)
    with pytest.raises(ValueError, match="train.attention"):
        attend(q, k, v, TTTMask(3, 0), "magic")
