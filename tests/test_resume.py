"""Resume: a run killed in the middle of an epoch and started again with train.resume=auto ends with
the weights of an uninterrupted run (from a store, and with extract=online); SIGTERM saves a state first; a half-written or foreign state is
never picked; resuming does not change the train stage's fingerprint.

The reference is one process, batch_size 2, grad_accum 2 (tests/dist_helpers.py). The resumed run
restores fp32 weights, optimizer, scheduler and data position, so the match is exact (asserted with
atol 1e-6 on fp32 master weights, and the logged metrics equal)."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from dist_helpers import (EPOCHS, checkpoint_weights, launch, master_weights, metrics, new_run, prepared,
                          reference_run, start, wait_for)
from specforge.train.state import MANIFEST, STATE_NAME, find_resume_state

STEP_2 = "state/step_00000002/state.json"


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_target_dir):
    return prepared(tmp_path_factory, tiny_target_dir)


def uninterrupted(prep):
    return reference_run(prep, "single_accum2", 1, "train.grad_accum=2")


def test_sigkill_mid_epoch_then_resume_auto_ends_with_the_uninterrupted_weights(prep):
    ref = uninterrupted(prep)
    run = new_run(prep, "killed")
    proc = start(prep, "killed", 1, "train.grad_accum=2", "train.save_state_every=2")
    wait_for(run / STEP_2, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to save anything more
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (run / ".stage_train.json").exists() and not (run / f"epoch_{EPOCHS}").exists()

    out = launch(prep, "killed", 1, "train.grad_accum=2", "train.save_state_every=2", "train.resume=auto",
                 fresh=False)
    assert "[train] resuming from" in out and "/state/step_" in out  # a mid-epoch state
    weights, ref_weights = master_weights(run), master_weights(ref)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=0, atol=1e-6, msg=k)
    ck, ck_ref = checkpoint_weights(run), checkpoint_weights(ref)
    for k in ck_ref:
        assert torch.equal(ck[k], ck_ref[k]), k
    # the metrics file reads as if nothing happened (rows logged after the state were dropped)
    assert [(m["split"], m["step"], round(m.get("loss", 0), 6)) for m in metrics(run)] == \
           [(m["split"], m["step"], round(m.get("loss", 0), 6)) for m in metrics(ref)]
    states = sorted(p.name for p in (run / "state").iterdir())
    assert states == [f"epoch_{e}" for e in range(1, EPOCHS + 1)]  # step states pruned, no temp dirs


def test_a_run_moved_to_twice_the_processes_with_half_the_grad_accum_resumes(prep):
    """docs/multinode.md: a job requeued on other GPUs keeps its global batch through train.grad_accum. The
    changed grad_accum changed the train fingerprint, so resume=auto passed every state over and removed them
    all: training started again from step 0. Now a state resumes a run that splits the same global batch."""
    ref = uninterrupted(prep)
    run = new_run(prep, "moved")
    proc = start(prep, "moved", 1, "train.grad_accum=2", "train.save_state_every=2")
    wait_for(run / STEP_2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    out = launch(prep, "moved", 2, "train.strategy=ddp", "train.grad_accum=1", "train.save_state_every=2",
                 "train.resume=auto", fresh=False)
    assert "[train] resuming from" in out and "/state/step_" in out and "removed earlier states" not in out
    weights, ref_weights = master_weights(run), master_weights(ref)
    for k in ref_weights:  # two processes sum the gradients in another order: not bit-exact
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=0, atol=1e-5, msg=k)


def test_two_ranks_with_feature_noise_resume_each_with_its_own_random_state(prep):
    """A state held rank 0's random state alone and every rank restored it: with train.feature_noise the other
    ranks drew rank 0's noise after a resume, and the run ended elsewhere than an uninterrupted one. (Two
    processes run this tiny training in about a second, too fast to kill on time: the resumed run starts from
    a copy of the uninterrupted run's first epoch state.)"""
    noisy = ("train.strategy=ddp", "train.feature_noise=0.05")
    ref = new_run(prep, "noisy_ref")
    launch(prep, "noisy_ref", 2, *noisy, fresh=False)
    run = new_run(prep, "noisy_resumed")
    shutil.copytree(ref / "state" / "epoch_1", run / "state" / "epoch_1")
    out = launch(prep, "noisy_resumed", 2, *noisy, "train.resume=auto", fresh=False)
    assert "[train] resuming from" in out and "/state/epoch_1" in out
    weights, ref_weights = master_weights(run), master_weights(ref)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=0, atol=1e-6, msg=k)


def test_the_training_time_of_a_resumed_run_counts_the_time_before_it(prep):
    """The pipeline overwrote the train stage's own total with this invocation's wall time: a job preempted
    after hours and resumed for minutes reported all its steps in minutes."""
    run = new_run(prep, "long")
    proc = start(prep, "long", 1, "train.grad_accum=2", "train.save_state_every=2")
    wait_for(run / STEP_2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    step = run / STEP_2.rsplit("/", 1)[0]
    state = torch.load(step / STATE_NAME, weights_only=True)
    state["position"]["seconds"] += 3600.0  # as if it had trained an hour before the preemption
    torch.save(state, step / STATE_NAME)
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"][STATE_NAME] = (step / STATE_NAME).stat().st_size
    (step / MANIFEST).write_text(json.dumps(manifest))
    launch(prep, "long", 1, "train.grad_accum=2", "train.save_state_every=2", "train.resume=auto", fresh=False)
    seconds = json.loads((run / ".stage_train.json").read_text())["summary"]["seconds"]
    assert 3600 < seconds < 3600 + 300
    assert f"in {seconds:.1f} s" in (run / "report.md").read_text()


def test_online_training_killed_mid_epoch_resumes_to_the_uninterrupted_weights(prep):
    """extract=online: no store to resume from; the resumed run computes the states of the
    remaining micro-batches again, with the same forwards, and ends where an uninterrupted one does."""
    online = ("train.grad_accum=2", "extract=online")
    ref = reference_run(prep, "online_accum2", 1, *online)
    run = new_run(prep, "online_killed")
    proc = start(prep, "online_killed", 1, *online, "train.save_state_every=2")
    wait_for(run / STEP_2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    out = launch(prep, "online_killed", 1, *online, "train.save_state_every=2", "train.resume=auto", fresh=False)
    assert "[train] resuming from" in out and "/state/step_" in out
    weights, ref_weights = master_weights(run), master_weights(ref)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=0, atol=1e-6, msg=k)


def test_sigterm_saves_a_state_then_exits_75(prep):
    run = new_run(prep, "terminated")
    proc = start(prep, "terminated", 1, "train.grad_accum=2", "train.save_state_every=2")
    wait_for(run / STEP_2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    assert "received SIGTERM" in out and "train.resume=auto" in out
    path, state, _ = find_resume_state(run / "state", fingerprint=None)
    assert state["meta"]["reason"] == "signal" and state["meta"]["step"] > 2, state["meta"]
    assert not (run / ".stage_train.json").exists()


def test_a_half_written_or_foreign_state_is_never_picked(prep, tmp_path):
    ref = uninterrupted(prep)
    states = tmp_path / "state"
    shutil.copytree(ref / "state", states)
    good = f"epoch_{EPOCHS}"
    fp = find_resume_state(states, None)[1]["meta"]["fingerprint"]

    def newer_copy(name, **changes):  # a copy of the good state that claims to be newer
        d = states / name
        shutil.copytree(states / good, d)
        meta = json.loads((d / MANIFEST).read_text())
        meta.update(step=int(name.split("_")[1].split(".")[0]), **changes)
        (d / MANIFEST).write_text(json.dumps(meta))
        return d

    with open(newer_copy("step_99999990") / "model_optim.pt", "r+b") as f:  # shorter than listed
        f.truncate(100)
    garbled = newer_copy("step_99999991")  # right sizes, damaged bytes
    (garbled / STATE_NAME).write_bytes(b"\0" * (garbled / STATE_NAME).stat().st_size)
    (newer_copy("step_99999992") / MANIFEST).unlink()  # what a crash before the manifest would leave
    newer_copy(".step_99999993.tmp")  # an interrupted write
    newer_copy("step_99999994", fingerprint="0" * len(fp))  # another configuration's state

    path, state, notes = find_resume_state(states, fp)
    assert path == states / good and state["meta"]["step"] == EPOCHS * 6
    joined = "\n".join(notes)
    assert "step_99999990: model_optim.pt has 100 bytes" in joined
    assert "step_99999991: training_state.pt does not load" in joined
    assert "step_99999992: no state.json" in joined
    assert "step_99999994: written by a different training configuration" in joined
    assert ".step_99999993.tmp" not in joined  # temp directories are not even candidates


def test_resume_and_execution_knobs_do_not_change_the_train_fingerprint(prep):
    from hydra import compose, initialize_config_dir

    from dist_helpers import REPO
    from specforge.config import register_configs
    from specforge.pipeline import STAGES, stage_fingerprint

    def fp(*extra):
        register_configs()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose("config", overrides=[*prep.overrides, "run_name=prepared", *extra])
        return stage_fingerprint(cfg, STAGES["train"], prep.outputs / "prepared")

    base = fp()
    assert fp("train.resume=auto", "train.save_state_every=5", "train.strategy=fsdp", "train.zero_stage=3",
              "train.num_threads=3", "train.memory_probe=false", "train.keep_epoch_states=1",
              "draft.min_vocab_coverage=0") == base  # the last: the data stage's refusal
    assert fp("train.lr=3e-3") != base and fp("train.grad_accum=2") != base


def test_only_the_newest_epoch_states_are_kept_when_asked(prep):
    """train.keep_epoch_states=1: the newest epoch's training state alone stays (each holds the
    weights and the optimizer's moments); every epoch's servable checkpoint stays, as trained."""
    run = new_run(prep, "keep_one")
    launch(prep, "keep_one", 1, "train.grad_accum=2", "train.keep_epoch_states=1", "train.save_state_every=2",
           fresh=False)
    assert sorted(p.name for p in (run / "state").iterdir()) == [f"epoch_{EPOCHS}"]
    assert all((run / f"epoch_{e}" / "model.safetensors").is_file() for e in range(1, EPOCHS + 1))
    for k, v in checkpoint_weights(uninterrupted(prep)).items():  # pruning changes nothing trained
        assert torch.equal(checkpoint_weights(run)[k], v), k
