"""The memory probe: the heaviest micro-batch a run can meet runs forward and backward before the
first step, so that one that does not fit fails at once, not hours into an epoch; the training
after it is the training without it (gradients dropped, random state restored)."""
from __future__ import annotations

import contextlib
import json
import random
import re

import pytest
import torch

from dist_helpers import checkpoint_weights, launch, metrics, prepared, reference_run
from specforge.errors import InvalidInput
from specforge.extract.store import HiddenStateStore
from specforge.train.batches import pack_rows
from specforge.train.memory_probe import describe, heaviest_micro_batch, probe_memory


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_target_dir):
    return prepared(tmp_path_factory, tiny_target_dir)


def test_the_heaviest_micro_batch_is_the_longest_samples_together():
    lengths = [5, 40, 12, 40, 7, 30]
    assert heaviest_micro_batch(lengths, 3) == [1, 3, 5]  # ties by index
    assert describe(lengths, [1, 3, 5], 0) == "3 samples of up to 40 tokens (120 padded)"
    assert heaviest_micro_batch(lengths, 10) == [1, 3, 5, 2, 4, 0]  # fewer samples than a batch: all
    # packed into rows of <= 50 tokens as full as they go (first fit, longest first): [40, 7] [40, 5]
    # [30, 12]; the fullest first, kept in the order packing cuts back into the same rows
    assert heaviest_micro_batch(lengths, 2, pack_tokens=50) == [1, 4, 3, 0]
    assert heaviest_micro_batch(lengths, 3, pack_tokens=50) == [1, 4, 3, 0, 5, 2]
    assert describe(lengths, [1, 4, 3, 0, 5, 2], 50) == "3 packed rows of up to 47 tokens (141 padded)"


def test_packed_the_probe_batch_is_cut_back_into_the_rows_it_was_made_of():
    g = random.Random(0)
    for _ in range(500):
        pack = g.randint(5, 60)
        lengths = [g.randint(1, pack) for _ in range(g.randint(1, 30))]
        batch_size = g.randint(1, 6)
        indices = heaviest_micro_batch(lengths, batch_size, pack)
        rows = pack_rows([lengths[i] for i in indices], pack)
        assert len(set(indices)) == len(indices) and len(rows) <= batch_size
        if len(indices) < len(lengths):  # rows left out: the batch is batch_size whole rows, none merged or cut
            assert len(rows) == batch_size


class Outgrowing(torch.nn.Module):
    """A module whose activations need a TiB per token: more than any machine running this has."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch):
        activations = torch.empty(batch["input_ids"].numel(), 1 << 38)  # 1 TiB of float32 per token
        return (activations.sum() * self.w).sum(), None


class Samples:
    """The prepared run's hidden-state store, read as training reads it (a TeacherMemo without
    the teacher's bits, which collate does not need)."""

    def __init__(self, store):
        self.store = store

    def samples(self, indices):
        return [self.store[i] for i in indices]


def test_a_batch_that_does_not_fit_is_refused_saying_what_to_lower(prep):
    """A real allocation failure (the CPU allocator's: on a GPU, torch.OutOfMemoryError) in the
    probe: refused naming the batch and the settings that shrink it, the module's gradients dropped."""
    store = HiddenStateStore(prep.outputs / "prepared" / "extract" / "train")
    heaviest = heaviest_micro_batch(store.lengths, 2)
    what = describe(store.lengths, heaviest, 0)
    module = Outgrowing()
    with pytest.raises(InvalidInput) as refused:
        probe_memory(module, Samples(store), heaviest, torch.device("cpu"), contextlib.nullcontext(), what)
    message = str(refused.value)
    assert message.startswith(f"train: the heaviest micro-batch of this run ({what}) does not fit on cpu: ")
    assert "can't allocate memory" in message and "Lower train.batch_size" in message
    assert "train.pack_tokens" in message and module.w.grad is None


def test_the_probe_leaves_the_training_as_it_was(prep):
    """train.memory_probe (on by default), with feature noise (random numbers drawn in every
    forward): the same checkpoints and metrics as without the probe; the probe says what it runs
    before it runs it (on a CPU, memory that runs out is a kill) and its peak after, in the output,
    the stage's summary and the run's report."""
    ref = reference_run(prep, "noise_no_probe", 1, "train.feature_noise=0.05", "train.memory_probe=false")
    out = launch(prep, "noise_probe", 1, "train.feature_noise=0.05")
    run = prep.outputs / "noise_probe"
    store = HiddenStateStore(run / "extract" / "train")
    what = describe(store.lengths, heaviest_micro_batch(store.lengths, 2), 0)
    before = out.index(f"[train] memory probe: the heaviest micro-batch ({what}), forward and backward\n")
    after = re.search(rf"\[train\] memory probe: {re.escape(what)}: peak RSS (\d+\.\d) GiB of (\d+\.\d) GiB on the CPU\n", out)
    assert after and before < after.start() and 0 < float(after[1]) <= float(after[2])
    for name, tensor in checkpoint_weights(ref).items():
        assert torch.equal(checkpoint_weights(run)[name], tensor), name
    drop = ("tokens_per_s", "time")
    assert [{k: v for k, v in m.items() if not k.startswith(drop)} for m in metrics(run)] == \
           [{k: v for k, v in m.items() if not k.startswith(drop)} for m in metrics(ref)]
    summary = json.loads((run / ".stage_train.json").read_text())["summary"]
    assert summary["memory_probe"] == after[0].removeprefix("[train] memory probe: ").strip()
    assert f"Memory probe, the heaviest micro-batch before the first step: {summary['memory_probe']}." in \
           (run / "report.md").read_text()
    assert "memory probe" not in (prep.outputs / "noise_no_probe" / "report.md").read_text().lower()


def test_a_batch_the_data_cannot_give_is_refused_before_training(prep):
    """More samples per micro-batch than the split has (a micro-batch of all 24 each step, the log
    claiming 1,000), or packed rows shorter than samples (each its own, longer row)."""
    store = HiddenStateStore(prep.outputs / "prepared" / "extract" / "train")
    out = launch(prep, "too_big", 1, "train.batch_size=1000", expect_rc=2)
    assert ("train.py: error: train.batch_size=1000 is more than the 24 training samples: every step would be one "
            "micro-batch of all of them; lower train.batch_size") in out
    short = sorted(store.lengths)[len(store.lengths) // 2]
    out = launch(prep, "short_rows", 1, f"train.pack_tokens={short}", expect_rc=2)
    assert (f"train.py: error: train.pack_tokens={short} is shorter than the longest of the 24 training samples "
            f"({max(store.lengths)} tokens), which would be a row of its own, longer than that. Set "
            f"train.pack_tokens >= {max(store.lengths)}") in out
    assert not (prep.outputs / "short_rows" / "epoch_1").exists()


def test_the_optimizer_state_to_come_is_counted_for_the_strategy_that_will_hold_it():
    """The probe ran before the optimizer existed: AdamW's two fp32 moments per trainable value (and DDP's
    gradient buckets) were not held while it measured, so a batch within that much of a GPU's memory passed it
    and ran out hours in. On a GPU that much is held aside during the probe (state_bytes)."""
    from specforge.train.memory_probe import state_bytes

    module = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 8))
    module[0].weight.requires_grad_(False)  # frozen, as the target's embedding: no moments
    trainable = 8 * 8 + 8
    assert state_bytes(module, "single", 1) == 2 * 4 * trainable
    assert state_bytes(module, "ddp", 2) == 3 * 4 * trainable
    assert state_bytes(module, "fsdp", 4) == 2 * 4 * trainable // 4
    assert state_bytes(module, "deepspeed", 2) == 2 * 4 * trainable // 2
