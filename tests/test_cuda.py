"""On a CUDA device: the TTT attention kernels that train off the CPU (`sdpa` -> SDPA's flash /
memory-efficient kernels with the sink key, `flex` compiled, `eager`) against the dense mask on the
CPU, forward and gradients; a whole TTT step on the GPU against the same step on the CPU; and what
`sdpa` keeps for the backward at 4,096 tokens against the eager split; DDP and FSDP2 over a
one-rank NCCL group. Skipped without CUDA, but for the script that runs these checks where a GPU is
(benchmarks/gpu_check.sh) and the one-rank strategies on gloo."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge.models.attention import TTTMask, attend
from specforge.train.batches import collate
from specforge.train.ttt import Teacher, scored_slots
from tests.test_attention import _documents, _output_and_grads, _qkv
from tests.test_packing import documents, loss_and_grads
from tests.test_ttt import tiny_draft
from tests.test_ttt_slots import _qkv as _qkv_at_slots

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


CASES = [(64, 0, 4, 2, 16, False), (97, 3, 4, 4, 32, False), (200, 6, 8, 2, 64, False), (300, 6, 16, 8, 128, False),
         (64, 0, 4, 2, 16, True), (200, 3, 8, 2, 64, True), (300, 6, 6, 3, 128, True)]


# flex compiles per shape (tens of seconds each): two of the cases
FLEX_CASES = [pytest.param("flex", *c, id=f"flex-{c[0]}-{c[-1]}") for c in (CASES[3], CASES[6])]


@needs_cuda
@pytest.mark.parametrize("impl, seq, step, heads, kv_heads, dim, packed",
                         [(impl, *c) for impl in ("sdpa", "eager") for c in CASES] + FLEX_CASES)
def test_ttt_attention_on_cuda_equals_the_dense_mask(impl, seq, step, heads, kv_heads, dim, packed):
    q, k, v = _qkv(seq, step, heads, kv_heads, dim)
    mask = TTTMask(seq, step, _documents(2, seq) if packed else None)
    want = _output_and_grads("dense", q, k, v, mask)
    for got, ref in zip(_output_and_grads(impl, q, k, v, mask, CUDA), want):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


@needs_cuda
@pytest.mark.parametrize("impl, packed", [("sdpa", False), ("sdpa", True), ("eager", True), ("flex", True)])
def test_ttt_attention_on_cuda_in_bf16_is_as_close_as_the_eager_split(impl, packed):
    """bf16 on the GPU (flash for sdpa): each tensor's relative error (in norm) within 2x of the
    eager split's own in bf16."""
    seq, step = 512, 6
    q, k, v = _qkv(seq, step, 16, 8, 128, batch=1)
    mask = TTTMask(seq, step, _documents(1, seq) if packed else None)
    exact = _output_and_grads("dense", q.double(), k.double(), v.double(), mask)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    eager = _output_and_grads("eager", q, k, v, mask, CUDA)
    for got, base, ref in zip(_output_and_grads(impl, q, k, v, mask, CUDA), eager, exact):
        err, base_err = ((t - ref).norm().item() / ref.norm().item() for t in (got, base))
        assert err <= 2 * base_err + 1e-3, (err, base_err)


@needs_cuda
@pytest.mark.parametrize("impl, packed, step", [("sdpa", p, s) for p in (False, True) for s in (0, 3)]
                         + [("flex", True, 3)])
def test_ttt_attention_on_cuda_at_scored_slots_equals_the_dense_mask(impl, packed, step):
    """Prompts first and unscored ends: sdpa runs the slots' span, causal to the lower right."""
    seq = 160
    needed = torch.rand(2, seq, generator=torch.Generator().manual_seed(2)) < 0.4
    needed[0, :50], needed[1, :71], needed[:, 140:] = False, False, False
    slots = scored_slots(needed)
    mask = TTTMask(seq, step, _documents(2, seq) if packed else None, slots)
    q, k, v = _qkv_at_slots(slots, seq, step, heads=8, kv_heads=2, dim=64)
    want = _output_and_grads("dense", q, k, v, mask)
    for got, ref in zip(_output_and_grads(impl, q, k, v, mask, CUDA), want):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def _draft(attention):
    """head_dim 32: flex on CUDA wants at least 16."""
    draft = tiny_draft(vocab=96, draft_vocab=40, hidden=128, target_hidden=48, head_dim=32)
    draft.attention = attention
    return draft


@needs_cuda
@pytest.mark.parametrize("attention, packed", [("sdpa", False), ("sdpa", True), ("flex", True)])
def test_a_ttt_step_on_cuda_gives_the_cpu_loss_and_gradients(attention, packed):
    """fp32: the unroll (TTT 4, prompts unscored, so the slots path runs) on the GPU, against the
    same draft and batch on the CPU's eager split."""
    cpu, gpu = _draft("eager"), _draft(attention).to(CUDA)
    gpu.load_state_dict(cpu.state_dict())
    torch.manual_seed(2)
    head = torch.randn(96, 48)
    docs = documents(cpu, [90, 140, 60, 110])
    batch = collate(docs, pack_tokens=400) if packed else collate(docs)
    want = loss_and_grads(cpu, batch, Teacher(head, cpu.t2d), skip_unscored=True)
    got = loss_and_grads(gpu, {k: v.to(CUDA) for k, v in batch.items()}, Teacher(head.to(CUDA), gpu.t2d),
                         skip_unscored=True)
    torch.testing.assert_close(got[0].cpu(), want[0], atol=1e-4, rtol=1e-4)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name].cpu(), grad, atol=2e-4, rtol=2e-3, msg=name)


class _Listed:
    """Samples held in a list, read as the training's TeacherMemo reads a store."""

    def __init__(self, docs):
        self.docs = docs

    def samples(self, indices):
        return [self.docs[i] for i in indices]


@needs_cuda
def test_the_memory_probe_on_cuda_reports_the_peak_and_refuses_what_does_not_fit():
    """train.memory_probe's default on a GPU: a TTT module that fits reports its peak of the device's
    memory; one whose activations outgrow the device (torch.OutOfMemoryError) is refused, saying what
    to lower, and the device's memory is free again."""
    import contextlib

    from specforge.errors import InvalidInput
    from specforge.train.loop import TTTModule
    from specforge.train.memory_probe import describe, heaviest_micro_batch, probe_memory

    draft = _draft("sdpa").to(CUDA)
    docs = _Listed(documents(draft, [90, 140, 60, 110]))
    lengths = [len(d["input_ids"]) for d in docs.docs]
    heaviest = heaviest_micro_batch(lengths, 2)
    what = describe(lengths, heaviest, 0)
    module = TTTModule(draft, Teacher(torch.randn(96, 48, device=CUDA), draft.t2d), 4, 0.8)
    line = probe_memory(module, docs, heaviest, CUDA, contextlib.nullcontext(), what)
    assert line.startswith(f"{what}: peak ") and line.endswith(" GiB on cuda")
    assert all(p.grad is None for p in module.parameters())

    class Outgrowing(torch.nn.Module):
        def forward(self, batch):  # 1 TiB of float32 per token
            return torch.empty(batch["input_ids"].numel(), 1 << 38, device=CUDA).sum(), None

    held = torch.cuda.memory_allocated()
    with pytest.raises(InvalidInput, match=rf"heaviest micro-batch of this run \({what}\) does not fit on cuda: "
                                           r".*Lower train.batch_size"):
        probe_memory(Outgrowing(), docs, heaviest, CUDA, contextlib.nullcontext(), what)
    assert torch.cuda.memory_allocated() == held
    # the optimizer's state to come, held aside: a batch that fits alone but not beside it is refused
    free = torch.cuda.mem_get_info()[0]
    with pytest.raises(InvalidInput, match=r"does not fit on cuda beside the optimizer state to come"):
        probe_memory(module, docs, heaviest, CUDA, contextlib.nullcontext(), what, reserve=free)
    assert torch.cuda.memory_allocated() == held


def _kept_mb(impl, seq, packed=False):
    """What the allocator holds between the forward and the backward of one call (TTT step 6,
    bf16, the Qwen3-VL-2B draft's 16 / 8 heads of 128), beyond the inputs."""
    q, k, v = (t.to(CUDA, torch.bfloat16).requires_grad_() for t in _qkv(seq, 6, 16, 8, 128, batch=1))
    mask = TTTMask(seq, 6, _documents(1, seq).to(CUDA) if packed else None)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = attend(q, k, v, mask, impl)
    kept = (torch.cuda.memory_allocated() - base) / 2**20
    out.sum().backward()
    return kept


@needs_cuda
def test_sdpa_on_cuda_keeps_a_tenth_of_the_eager_split_for_the_backward():
    """The eager split keeps [B, h, S, S] fp32 scores and probabilities; sdpa's kernels keep O(S)."""
    seq = 4096
    eager, sdpa = _kept_mb("eager", seq), _kept_mb("sdpa", seq)
    assert eager > 16 * seq * seq * 4 / 2**20  # at least one [h, S, S] fp32 tensor
    assert sdpa < eager / 5, (sdpa, eager)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_on_cuda_runs_a_fused_kernel_never_the_math_path(dtype, packed):
    """With SDPA's math path ruled out, the call still runs (forward and backward): a fused kernel
    takes it, with and without documents, in bf16 and fp32 (the head dim with the sink's two, 130,
    kept the memory-efficient kernel out until it was padded to 136)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq = 256
    q, k, v = (t.to(CUDA, dtype).requires_grad_() for t in _qkv(seq, 6, 16, 8, 128, batch=1))
    mask = TTTMask(seq, 6, _documents(1, seq).to(CUDA) if packed else None)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        attend(q, k, v, mask, "sdpa").float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@needs_cuda
def test_sdpa_on_cuda_keeps_under_a_fifth_of_the_eager_split_on_packed_rows_too():
    """A document mask rules flash out; the memory-efficient kernel takes it once the head dim (130
    with the sink's) is padded to a multiple of 8. Unpadded, SDPA fell to its math path on an
    H200: 4.2 GB for one call at 4,096 tokens."""
    seq = 4096
    eager, sdpa = _kept_mb("eager", seq, packed=True), _kept_mb("sdpa", seq, packed=True)
    assert sdpa < eager / 5, (sdpa, eager)


def test_the_gpu_check_script_is_sound_and_refuses_a_machine_without_cuda(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks/gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    if shellcheck:
        subprocess.run([shellcheck, str(script)], check=True)
    if torch.cuda.is_available():
        return
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # python3: this one
    done = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "gpu_check: no CUDA GPU here" in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_ddp_and_fsdp2_over_one_rank_step_like_one_process(device):
    """NCCL on the GPU (gloo here): the wrappers over a one-rank group, one step each, against the
    plain step (tests/one_rank_strategies.py, in a process of its own)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "tests/one_rank_strategies.py"), device],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == ("nccl" if device == "cuda" else "gloo") and result["step_moved"] > 1e-3
    for name in ("ddp", "fsdp"):
        assert result[name]["loss"] == pytest.approx(result["loss"], rel=1e-6), name
        assert result[name]["max_weight_diff"] < 1e-6, (name, result[name])
