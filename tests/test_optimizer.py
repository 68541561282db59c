"""train.optimizer: AdamW, or Muon for the draft's hidden matrices with AdamW for the rest. Muon's
groups follow the LR schedule, its training state resumes to the same weights, and the
strategies that shard a matrix refuse it before anything runs."""
import types

import pytest
import torch

from specforge.config import check_config
from specforge.distributed.env import DistEnv
from specforge.distributed.strategy import Strategy
from specforge.distributed.optimizer import MuonWithAdamW, build_optimizer
from tests.test_eagle31 import compose_cfg
from tests.test_ttt import random_batch, tiny_draft


def train_config(**kw):
    base = dict(optimizer="muon", lr=1e-2, weight_decay=0.0, grad_accum=1, grad_clip=0.5, strategy="single")
    return types.SimpleNamespace(**{**base, **kw})


class DraftLoss(torch.nn.Module):
    """What a strategy wraps: forward(batch) -> (loss, stats); here the draft's step-0 logits."""

    def __init__(self):
        super().__init__()
        self.draft = tiny_draft()

    def forward(self, batch):
        features = self.draft.project(batch["aux"])
        positions = torch.arange(batch["input_ids"].shape[1])[None]
        _, logits, _ = self.draft.step(batch["input_ids"], features, positions)
        return logits.float().logsumexp(-1).mean() - logits.float().mean(), {}


def test_muon_takes_the_hidden_matrices_and_adamw_the_head_and_norms():
    draft = tiny_draft()
    named = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    opt = build_optimizer(named, train_config())
    assert isinstance(opt, MuonWithAdamW)
    by_id = {id(p): n for n, p in named}
    muon = {by_id[id(p)] for p in opt.muon.param_groups[0]["params"]}
    adamw = {by_id[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon == {n for n, p in named if p.ndim == 2 and "lm_head" not in n and "embed" not in n}
    assert {"lm_head.weight", "embed_tokens.weight"} <= adamw and any("norm" in n for n in adamw)
    assert any(n.startswith("fc.") for n in muon) and any("mlp" in n for n in muon)
    assert muon | adamw == set(by_id.values()) and not muon & adamw
    plain = build_optimizer(named, train_config(optimizer="adamw"))
    assert type(plain) is torch.optim.AdamW and len(plain.param_groups[0]["params"]) == len(named)


def test_the_lr_schedule_drives_both_halves_and_the_update_moves_every_parameter():
    module = DraftLoss()
    opt = build_optimizer(list(module.named_parameters()), train_config())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.25)
    assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[0]["lr"] == 0.25e-2
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    loss, _ = module(random_batch(module.draft))
    loss.backward()
    opt.step()
    sched.step()
    moved = {n for n, p in module.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert moved == set(before)


def steps(strategy, batches):
    for batch in batches:
        loss, _ = strategy.model(batch)
        strategy.backward(loss)
        strategy.step()


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_training_state_resumes_to_the_uninterrupted_weights(tmp_path, optimizer):
    tc = train_config(optimizer=optimizer)
    batches = [random_batch(DraftLoss().draft, seed=s) for s in range(4)]
    whole = Strategy(DraftLoss(), tc, DistEnv(), torch.device("cpu"))
    steps(whole, batches)

    first = Strategy(DraftLoss(), tc, DistEnv(), torch.device("cpu"))
    steps(first, batches[:2])
    first.save_state(tmp_path)
    resumed = Strategy(DraftLoss(), tc, DistEnv(), torch.device("cpu"))  # fresh weights, empty state
    resumed.load_state(tmp_path, {"state_format": "torch"})
    if optimizer == "muon":  # still one optimizer over both halves, sharing groups and state
        assert resumed.optimizer.muon.state is resumed.optimizer.state
        assert resumed.optimizer.muon.param_groups[0] is resumed.optimizer.param_groups[0]
    steps(resumed, batches[2:])
    for (name, p), q in zip(whole.inner.named_parameters(), resumed.inner.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_step_with_an_inf_or_nan_gradient_is_skipped(optimizer):
    """A batch whose loss is nan (inf states, a blown-up step) leaves the weights and the optimizer
    state as they were: the good steps around it give the weights of a run without it."""
    tc = train_config(optimizer=optimizer)
    batches = [random_batch(DraftLoss().draft, seed=s) for s in range(3)]
    poisoned = {**batches[1], "aux": batches[1]["aux"].clone()}
    poisoned["aux"][0, 0, 0] = float("nan")
    clean = Strategy(DraftLoss(), tc, DistEnv(), torch.device("cpu"))
    steps(clean, [batches[0], batches[2]])
    hit = Strategy(DraftLoss(), tc, DistEnv(), torch.device("cpu"))
    steps(hit, batches[:1])
    loss, _ = hit.model(poisoned)
    hit.backward(loss)
    assert torch.isnan(loss) and torch.isnan(torch.tensor(hit.step()))
    assert all(p.grad is None for p in hit.inner.parameters())
    steps(hit, batches[2:])
    for (name, p), q in zip(clean.inner.named_parameters(), hit.inner.parameters()):
        assert torch.equal(p, q), name


def test_unknown_optimizer_and_muon_with_a_sharding_strategy_are_refused():
    with pytest.raises(ValueError, match="train.optimizer: must be one of adamw, muon, got 'sgd'"):
        check_config(compose_cfg("train.optimizer=sgd"))
    for strategy in ("fsdp", "deepspeed"):
        with pytest.raises(ValueError, match=f"train.strategy={strategy} shards them"):
            check_config(compose_cfg("train.optimizer=muon", f"train.strategy={strategy}"))
    check_config(compose_cfg("train.optimizer=muon", "train.strategy=ddp"))


def _muon_steps(make, steps=3):
    """A few Muon steps on two matrices (one wide, one tall) with fixed gradients -> the weights."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((24, 40), (40, 24))]
    opt = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


def test_our_muon_is_torchs_in_bf16_and_close_to_it_in_fp32():
    """The Newton-Schulz iteration in bf16 is torch's update to the bit; in fp32 (CPUs without native
    bf16, where torch's bf16 runs the reference GEMM) it differs by bf16 rounding only."""
    from specforge.distributed.optimizer import Muon

    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    theirs = _muon_steps(lambda ps: torch.optim.Muon(ps, **kw))
    for ours, want in zip(_muon_steps(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw)), theirs):
        assert torch.equal(ours, want)
    start = _muon_steps(lambda ps: torch.optim.SGD(ps, lr=0.0))  # where every run starts
    for ours, want, first in zip(_muon_steps(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw)), theirs, start):
        moved, diff = (want - first).abs().max(), (ours - want).abs().max()
        assert moved > 0.02 and diff < 0.05 * moved, (moved, diff)
    original = _muon_steps(lambda ps: torch.optim.Muon(ps, lr=0.02, adjust_lr_fn="original"))
    for ours, want in zip(_muon_steps(lambda ps: Muon(ps, lr=0.02, adjust_lr_fn="original")), original):
        assert torch.equal(ours, want)


def test_muon_orthogonalises_in_the_dtype_the_device_multiplies_fast():
    from specforge.targets.loader import compute_dtype

    draft = tiny_draft()
    opt = build_optimizer([(n, p) for n, p in draft.named_parameters() if p.requires_grad], train_config())
    assert opt.muon.ns_dtype == compute_dtype(torch.bfloat16, torch.device("cpu"))
