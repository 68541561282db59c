"""Distributed training on CPU (gloo, 2 processes through torchrun): DDP, FSDP2 and DeepSpeed ZeRO-2
compute what one process computes with the same global batch.

The reference is ONE process with batch_size 2 and grad_accum 2 (global batch 4); the distributed
runs use batch_size 2 on each of 2 processes, no accumulation (global batch 4). Each step sees the
same micro-batches (batches.py deals them round-robin), so the curves agree to float round-off.
Tolerances (measured: DDP bit-identical, FSDP 4e-7, ZeRO-2 on the order of 1e-7 on the first hosts; on a Zen 5
EPYC FSDP and ZeRO-2 reach 2.3e-5 in a weight and 1.03e-4 in a gradient norm: the ranks' gradients are summed
in another order, and AdamW turns a round-off in a near-zero gradient into a visible share of a step):
- fp32 master weights after 12 steps: max |diff| <= 5e-5;
- logged loss per step: relative 1e-5; gradient norm: relative 3e-4;
- servable bf16 checkpoints: within a few bf16 rounding steps (rtol 1e-2, atol 5e-5).
"""
from __future__ import annotations

import pytest
import torch

from dist_helpers import BATCH, EPOCHS, checkpoint_weights, launch, master_weights, metrics, prepared, reference_run
from specforge.distributed.env import DistEnv
from specforge.train.batches import epoch_batches, eval_batches, global_batches, steps_per_epoch


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_target_dir):
    return prepared(tmp_path_factory, tiny_target_dir)


def one_process(prep):
    return reference_run(prep, "single_accum2", 1, "train.grad_accum=2")


def assert_same_training(ref, run, ref_weights=None, weights=None):
    m_ref, m_run = metrics(ref), metrics(run)
    assert [(m["split"], m["step"]) for m in m_run] == [(m["split"], m["step"]) for m in m_ref]
    assert len(m_ref) == EPOCHS * 6 + EPOCHS  # every step logged once, by rank 0 only
    for a, b in zip(m_ref, m_run):
        key = "loss" if a["split"] == "train" else "loss_0"
        assert b[key] == pytest.approx(a[key], rel=1e-5), (a, b)
        if a["split"] == "train":
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=3e-4), (a["step"], a["grad_norm"], b["grad_norm"])
            assert b["lr"] == pytest.approx(a["lr"], rel=1e-6)
            assert b["positions"] == a["positions"]  # same tokens, summed over ranks
    if ref_weights is not None:
        assert sorted(weights) == sorted(ref_weights)
        for k in ref_weights:
            torch.testing.assert_close(weights[k], ref_weights[k], rtol=0, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")
    ck_ref, ck_run = checkpoint_weights(ref), checkpoint_weights(run)
    assert sorted(ck_ref) == sorted(ck_run)
    for k in ck_ref:
        torch.testing.assert_close(ck_run[k].float(), ck_ref[k].float(), rtol=1e-2, atol=5e-5,
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_micro_batches_dealt_round_robin_equal_one_process_with_accumulation():
    lengths = [(i * 37) % 101 + 5 for i in range(61)]
    for world, accum in [(2, 1), (2, 3), (4, 2)]:
        ranks = [epoch_batches(lengths, 3, seed=7, epoch=2, rank=r, world_size=world) for r in range(world)]
        assert len({len(r) for r in ranks}) == 1
        one = global_batches(lengths, 3, seed=7, epoch=2)
        steps = steps_per_epoch(len(one), accum, world)
        assert steps == len(one) // (accum * world) and steps > 0
        for s in range(steps):
            mine = [b for r in ranks for b in r[s * accum:(s + 1) * accum]]
            assert sorted(mine) == sorted(one[s * accum * world:(s + 1) * accum * world])
    # held-out batches: every batch once over the ranks, the same count on each rank (fillers not counted)
    shards = [eval_batches(lengths, 4, r, 3) for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    counted = sorted(i for s in shards for b, c in s if c for i in b)
    assert counted == list(range(len(lengths)))


def test_one_strategy_needs_one_process():
    from specforge.config import TrainConfig
    from specforge.distributed.strategy import make_strategy

    with pytest.raises(ValueError, match="train.strategy=single but 2 processes"):
        make_strategy(torch.nn.Linear(2, 2), TrainConfig(strategy="single"), DistEnv(0, 2, 0, 2, "torchrun"),
                      torch.device("cpu"))
    with pytest.raises(ValueError, match="is not one of"):
        make_strategy(torch.nn.Linear(2, 2), TrainConfig(strategy="megatron"), DistEnv(), torch.device("cpu"))


def test_ddp_matches_one_process(prep):
    ref, run = one_process(prep), reference_run(prep, "ddp", 2, "train.strategy=ddp")
    assert_same_training(ref, run, master_weights(ref), master_weights(run))


def test_ddp_with_muon_matches_one_process_with_muon(prep):
    """Every rank orthogonalises the same all-reduced gradient: the same update as one process."""
    ref = reference_run(prep, "single_accum2_muon", 1, "train.grad_accum=2", "train.optimizer=muon")
    run = reference_run(prep, "ddp_muon", 2, "train.strategy=ddp", "train.optimizer=muon")
    assert_same_training(ref, run, master_weights(ref), master_weights(run))


def test_two_ranks_run_the_whole_pipeline_like_one_process(prep):
    """torchrun, 2 processes, data -> extract -> train with FSDP2: rank 0 alone writes the data, the
    ranks extract alternate shards into their own stores merged by one manifest, and everything
    equals the one-process pipeline: data files, stored hidden states (same samples, same order,
    bit for bit), training (FSDP2 tolerances above)."""
    from specforge.extract.store import HiddenStateStore

    ref = one_process(prep)
    out = launch(prep, "pipeline2", 2, "train.strategy=fsdp", stages="[data,extract,train]")
    run, one = prep.outputs / "pipeline2", prep.outputs / "prepared"
    assert out.count("[pipeline] data: running") == 1 and "extract: running on 2 processes" in out
    assert out.count("[train] 24 samples") == 1  # rank 0 alone reports
    assert f"global batch 4 samples (batch_size {BATCH} x grad_accum 1 x 2 processes)" in out
    for f in ["data/train.jsonl", "data/eval.jsonl", "data/vocab.safetensors"]:
        assert (run / f).read_bytes() == (one / f).read_bytes(), f
    for split in ["train", "eval"]:
        a, b = HiddenStateStore(one / "extract" / split), HiddenStateStore(run / "extract" / split)
        assert b.meta == a.meta and b.ids == a.ids
        for i in range(len(a)):
            for key, t in a[i].items():
                assert torch.equal(b[i][key], t), (split, i, key)
    shards = [s["name"] for s in HiddenStateStore(run / "extract" / "train").shards]
    assert [n.split("/")[0] for n in shards] == ["rank00000of00002", "rank00001of00002"] * 2 + ["rank00000of00002"]
    assert_same_training(ref, run, master_weights(ref), master_weights(run))

    # idempotent: extracting again (here in one process) finds every sample stored, changes nothing
    from hydra import compose, initialize_config_dir

    from dist_helpers import REPO
    from specforge.config import register_configs
    from specforge.extract.stage import run as extract

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[*prep.overrides, "run_name=pipeline2"])
    again = extract(cfg, run)
    assert again["extracted_tokens"] == 0 and again["splits"]["train"]["resumed_samples"] == 24
    assert [s["name"] for s in HiddenStateStore(run / "extract" / "train").shards] == shards


def test_two_ranks_train_online_like_one_process_from_the_store(prep):
    """extract=online under torchrun: no store; each rank loads the target and computes the states of
    its own micro-batches. The training is the one-process run's from the bf16 store (states rounded
    to bf16 alike; a store's batches pad otherwise, which may move a rounding: relative 1e-4)."""
    ref = one_process(prep)
    out = launch(prep, "ddp_online", 2, "train.strategy=ddp", "extract=online", stages="[data,extract,train]")
    run = prep.outputs / "ddp_online"
    assert "extract: running on 2 processes" in out and not (run / "extract" / "train").exists()
    m_ref, m_run = metrics(ref), metrics(run)
    assert [(m["split"], m["step"]) for m in m_run] == [(m["split"], m["step"]) for m in m_ref]
    for a, b in zip(m_ref, m_run):
        key = "loss" if a["split"] == "train" else "loss_0"
        assert b[key] == pytest.approx(a[key], rel=1e-4), (a, b)
        assert b.get("positions") == a.get("positions")


def test_deepspeed_zero2_matches_and_writes_a_servable_checkpoint(prep):
    from specforge.checkpoint import load_draft

    ref = one_process(prep)
    out = launch(prep, "zero2", 2, "train.strategy=deepspeed", "train.zero_stage=2")
    run = prep.outputs / "zero2"
    assert "strategy deepspeed" in out
    assert_same_training(ref, run)
    draft = load_draft(run / f"epoch_{EPOCHS}")
    assert draft.config.draft_vocab_size == 128
    state = run / "state" / f"epoch_{EPOCHS}"
    assert (state / "deepspeed" / "state").is_dir() and (state / "state.json").is_file()


def test_a_refusal_on_rank_0_is_one_line_for_all_ranks(prep):
    """stages=[train] on a run without its data and hidden states: rank 0 refuses in run_on_main
    and rank 1 learns it as a refusal (when torchrun has not stopped it first): the message is
    printed once, by rank 0, and no rank prints a traceback of ours."""
    out = launch(prep, "no_inputs", 2, stages="[train]", fresh=False, expect_rc=1)  # torchrun: a worker failed
    assert out.count("train.py: error:") == 1, out[-4000:]
    assert "stage 'train' needs the output of ['data', 'extract']" in out
    assert "exitcode  : 2" in out and "specforge/pipeline.py" not in out  # rank 0 exits 2; no frames of ours


def test_errors_name_their_rank(monkeypatch, capsys):
    import specforge.distributed.env as dist_env
    from specforge.distributed.preemption import TrainingInterrupted

    monkeypatch.setattr(dist_env, "_CURRENT", DistEnv(3, 8, 1, 4, "slurm", "gloo"))
    with pytest.raises(ValueError) as err:
        with dist_env.rank_errors("pipeline"):
            raise ValueError("bad shard")
    assert "raised on rank 3/8 (local 1/4)" in getattr(err.value, "__notes__", [""])[0]
    assert "[rank 3/8 (local 1/4)] pipeline failed: ValueError: bad shard" in capsys.readouterr().err
    from specforge.errors import InvalidInput

    with pytest.raises(InvalidInput):  # a refusal of this rank's own: train.py prints rank 0's only
        with dist_env.rank_errors("pipeline"):
            raise InvalidInput("no such shard")
    assert "[rank 3/8 (local 1/4)] pipeline failed: InvalidInput: no such shard" in capsys.readouterr().err
    with pytest.raises(InvalidInput):  # rank 0's, relayed by run_on_main: rank 0 prints it
        with dist_env.rank_errors("pipeline"):
            raise dist_env.RefusedOnRankZero("[rank 3/8] stage 'data' failed on rank 0: InvalidInput: x")
    assert "failed" not in capsys.readouterr().err
    with pytest.raises(TrainingInterrupted):  # a requested stop is not reported as a failure
        with dist_env.rank_errors("pipeline"):
            raise TrainingInterrupted("SIGTERM", "state/step_1")
    assert "failed" not in capsys.readouterr().err
