"""The memory probe: the heaviest micro-batch a run can meet runs forward and backward before the
first step, so that one that does not fit fails at once, not hours into an epoch; the training
after it is the training without it (gradients dropped, random state restored)."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

from dist_helpers import checkpoint_weights, launch, metrics, prepared, reference_run
from specforge.errors import InvalidInput
from specforge.extract.store import HiddenStateStore
from specforge.train.memory_probe import describe, heaviest_micro_batch, probe_memory


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_target_dir):
    return prepared(tmp_path_factory, tiny_target_dir)


def test_the_heaviest_micro_batch_is_the_longest_samples_together():
    lengths = [5, 40, 12, 40, 7, 30]
    assert heaviest_micro_batch(lengths, 3) == [1, 3, 5]  # ties by index
    assert describe(lengths, [1, 3, 5], 0) == "3 samples of up to 40 tokens (120 padded)"
    assert heaviest_micro_batch(lengths, 10) == [1, 3, 5, 2, 4, 0]  # fewer samples than a batch: all
    # packed into rows of <= 50 tokens, longest first: [40] [40] [30, 12, 7] [5]
    assert heaviest_micro_batch(lengths, 2, pack_tokens=50) == [1, 3]
    assert heaviest_micro_batch(lengths, 3, pack_tokens=50) == [1, 3, 5, 2, 4]
    assert describe(lengths, [1, 3, 5, 2, 4], 50) == "3 packed rows of up to 49 tokens (147 padded)"


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
    """train.memory_probe=true on the CPU (on by default on GPUs only), with feature noise (random
    numbers drawn in every forward): the same checkpoints and metrics as without the probe, and
    the probe's line in the output, the stage's summary and the run's report."""
    ref = reference_run(prep, "noise_no_probe", 1, "train.feature_noise=0.05")
    out = launch(prep, "noise_probe", 1, "train.feature_noise=0.05", "train.memory_probe=true")
    run = prep.outputs / "noise_probe"
    store = HiddenStateStore(run / "extract" / "train")
    what = describe(store.lengths, heaviest_micro_batch(store.lengths, 2), 0)
    assert f"[train] memory probe, the heaviest micro-batch: {what}: fits" in out
    for name, tensor in checkpoint_weights(ref).items():
        assert torch.equal(checkpoint_weights(run)[name], tensor), name
    drop = ("tokens_per_s", "time")
    assert [{k: v for k, v in m.items() if not k.startswith(drop)} for m in metrics(run)] == \
           [{k: v for k, v in m.items() if not k.startswith(drop)} for m in metrics(ref)]
    summary = json.loads((run / ".stage_train.json").read_text())["summary"]
    assert summary["memory_probe"] == f"{what}: fits"
    assert f"Memory probe, the heaviest micro-batch before the first step: {what}: fits." in (run / "report.md").read_text()
    assert "memory probe" not in launch(prep, "noise_default", 1, "train.feature_noise=0.05")  # a CPU: off
