"""Evaluation refuses broken or foreign checkpoints before any model runs, naming the file and the
field, and keeps every configuration it finished when it dies later. One tiny trained run (2
epochs) is shared; each test corrupts its own copy."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from specforge.checkpoint import TARGET_KEY, CheckpointError, save_checkpoint
from specforge.eval.engine_eval import load_run_config
from specforge.eval.stage import PARTIAL_NAME, run_evaluation
from specforge.extract.store import HiddenStateStore
from specforge.pipeline import run_pipeline
from specforge.utils.io import read_json, write_jsonl
from tests.test_pipeline import CONF, compose_cfg
from tests.test_ttt import tiny_draft

REPO = Path(CONF).parent


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_target_dir):
    from data_prep.weather import generate

    root = tmp_path_factory.mktemp("hostile_eval")
    write_jsonl(root / "train.jsonl", generate(16, seed=0, split="train"))
    write_jsonl(root / "eval.jsonl", generate(4, seed=0, split="eval"))
    run_pipeline(compose_cfg(root, tiny_target_dir, "train.epochs=2", "stages=[data,extract,train]"))
    return root / "outputs" / "smollm2_weather"


@pytest.fixture
def run(trained_run, tmp_path):
    copy = tmp_path / "smollm2_weather"
    shutil.copytree(trained_run, copy)
    return copy


def eval_cfg(run_dir, *overrides):
    from omegaconf import OmegaConf

    cfg = load_run_config(run_dir).eval
    for item in ("num_prompts=2", "max_new_tokens=6", "trees=['2_1_3']", *overrides):
        key, value = item.split("=", 1)
        OmegaConf.update(cfg, key, OmegaConf.create(f"v: {value}").v)
    return cfg


def nothing_written(run_dir: Path) -> bool:
    return not (run_dir / "eval").exists()


def test_a_checkpoint_records_its_target_where_servers_ignore_it(trained_run):
    meta = HiddenStateStore(trained_run / "extract" / "train").meta
    config = json.loads((trained_run / "epoch_1" / "config.json").read_text())
    recorded = config[TARGET_KEY]
    assert recorded["fingerprint"] == meta["target_fingerprint"] and recorded["num_hidden_layers"] == meta["num_layers"]
    loaded = transformers.LlamaConfig.from_pretrained(trained_run / "epoch_1")  # as SGLang reads it
    assert loaded.num_hidden_layers == 1 and loaded.vocab_size == meta["vocab_size"]


def test_a_truncated_later_epoch_is_refused_before_the_base_model_runs(run):
    weights = run / "epoch_2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = subprocess.run([sys.executable, "evaluate.py", f"ckpt={run}", "eval.num_prompts=2",
                           "eval.max_new_tokens=4", "eval.trees=['2_1_3']"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{weights}: not a readable safetensors file, truncated or corrupt" in proc.stderr
    assert nothing_written(run)


def test_a_draft_of_another_target_is_refused_naming_the_field(run):
    shutil.rmtree(run / "epoch_2")
    save_checkpoint(tiny_draft(), run / "epoch_2")  # vocab 50, hidden 24: another target's draft
    where = re.escape(str(run / "epoch_2" / "config.json"))
    with pytest.raises(CheckpointError, match=rf"{where}: the draft does not fit the target: .*vocab_size 50 != the target's"):
        run_evaluation(load_run_config(run), run, eval_cfg(run))
    assert nothing_written(run)


def test_aux_layers_beyond_the_target_are_refused(run):
    path = run / "epoch_1" / "config.json"
    config = json.loads(path.read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 9]
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 10]  # vLLM's numbering, kept consistent
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"eagle_aux_hidden_state_layer_ids.*the target has 4 decoder layers"):
        run_evaluation(load_run_config(run), run, eval_cfg(run))
    assert nothing_written(run)


def test_same_shapes_but_another_target_is_refused_unless_allowed(run, capsys):
    for epoch in (1, 2):
        path = run / f"epoch_{epoch}" / "config.json"
        config = json.loads(path.read_text())
        config[TARGET_KEY]["fingerprint"] = "0123456789abcdef"
        path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"trained for target .* \(fingerprint 0123456789abcdef\), this target has fingerprint"):
        run_evaluation(load_run_config(run), run, eval_cfg(run))
    assert nothing_written(run)
    summary = run_evaluation(load_run_config(run), run, eval_cfg(run, "allow_other_target=true", "epochs=[1]"))
    assert summary["configs"] == 1
    assert "[warning]" in capsys.readouterr().out


def test_a_second_evaluation_writing_the_same_output_is_refused(run):
    """evaluate.py while another one (or the pipeline's eval stage) writes the run's eval/: refused
    before any model runs, naming the holder; another out_dir is free."""
    import os

    from specforge.utils.run_lock import RunDirBusy, RunDirLock

    with RunDirLock(run / ".eval.lock"):  # as a first evaluation holds it
        with pytest.raises(RunDirBusy, match=rf"{re.escape(str(run / 'eval'))} \(an evaluation's output\): in use by "
                                             rf"another run \(pid {os.getpid()} .*give this evaluation another out_dir="):
            run_evaluation(load_run_config(run), run, eval_cfg(run))
        assert nothing_written(run)
        summary = run_evaluation(load_run_config(run), run, eval_cfg(run, "epochs=[1]"), run / "elsewhere")
    assert summary["configs"] == 1 and (run / "elsewhere" / "results.json").exists()
    # an out_dir where nothing can be written (even by root: /proc), before any model runs
    from specforge.errors import InvalidInput

    with pytest.raises(InvalidInput, match=r"^/proc/x \(an evaluation's output\): cannot write in /proc \(.+\); give "
                                           r"this evaluation another out_dir=$"):
        run_evaluation(load_run_config(run), run, eval_cfg(run, "epochs=[1]"), "/proc/x")


def test_a_killed_evaluation_keeps_the_configurations_it_finished_and_the_next_run_measures_the_rest(run):
    trees = "['2_1_3','2_2_4','3_1_4','3_2_6','4_1_5','4_2_8','5_1_6','5_2_10']"
    settings = [f"ckpt={run}", "eval.num_prompts=2", "eval.max_new_tokens=48"]
    proc = subprocess.Popen([sys.executable, "evaluate.py", *settings, f"eval.trees={trees}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = run / "eval" / PARTIAL_NAME
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if partial.exists() and read_json(partial)["configs"]:
                proc.send_signal(signal.SIGKILL)  # no chance to clean up
                break
            time.sleep(0.05)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the evaluation ended before a configuration was kept"
    kept = read_json(partial)
    assert kept["base"]["tok_s"] > 0
    assert kept["configs"] and all(c["speedup"] > 0 and c["lossless"] == 1.0 for c in kept["configs"])
    assert not (run / "eval" / "results.json").exists()

    # the same evaluation again, of the first tree (kept) and the last (not reached) on epoch 1
    again = subprocess.run([sys.executable, "evaluate.py", *settings, "eval.trees=['2_1_3','5_2_10']", "eval.epochs=[1]"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[eval] 1 of 2 configurations measured by an earlier run of this evaluation that stopped, kept: " \
           "epoch_1 2_1_3" in again.stdout
    results = read_json(run / "eval" / "results.json")
    first, last = results["configs"]
    assert (first["tree"], first.get("resumed"), last["tree"], last.get("resumed")) == ("2_1_3", True, "5_2_10", None)
    earlier = kept["configs"][0]
    for key in ("accept_length", "tok_s", "lossless", "requests_detail", "resume_key"):
        assert first[key] == earlier[key]
    assert first["speedup"] == pytest.approx(first["tok_s"] / results["base"]["tok_s"])  # this run's base
    assert results["meta"]["resumed"] == 1 and last["lossless"] == 1.0
    assert "Measured by an earlier run of this evaluation that stopped, and kept" in (run / "eval" / "report.md").read_text()
    assert not (run / "eval" / PARTIAL_NAME).exists()


def test_a_run_of_another_version_is_evaluated_passing_over_what_this_one_lacks(tmp_path):
    """A run's config.yaml written by an earlier SpecForge: a setting since removed (session 16's
    `train.prompt_weight`) or typed otherwise (`train.memory_probe: null`) was a raw omegaconf error
    before evaluate.py read anything; now each is passed over with a warning naming it, the rest read."""
    from omegaconf import OmegaConf

    from specforge.config import Config

    saved = OmegaConf.to_container(OmegaConf.structured(Config))
    saved.update(run_name="old", output_dir=str(tmp_path))
    saved["target"].update(name="tiny", path="/models/tiny")
    saved["data"].update(name="weather", train_files=["a.jsonl"])
    saved["train"].update(prompt_weight=0.3, memory_probe=None, lr=3e-3)
    saved["eval"]["trees"] = ["3_1_4"]
    run = tmp_path / "old"
    run.mkdir()
    OmegaConf.save(OmegaConf.create(saved), run / "config.yaml")
    with pytest.warns(UserWarning) as said:
        cfg = load_run_config(run)
    message = str(said[0].message)
    assert message.startswith(f"{run / 'config.yaml'}: written by another version of SpecForge; these settings are "
                              "not this version's and were passed over: train.memory_probe=None (field "
                              "'train.memory_probe' is not Optional); train.prompt_weight (not a setting any more)")
    assert (cfg.target.path, cfg.train.lr, list(cfg.eval.trees), cfg.train.memory_probe) == \
           ("/models/tiny", 3e-3, ["3_1_4"], True)
    assert cfg.output_dir == str(tmp_path) and cfg.run_name == "old"
    # as evaluate.py prints it: one line, as a refusal is, not Python's file, line and source line
    said = subprocess.run([sys.executable, "-c", "from specforge.errors import plain_warnings; "
                           "from specforge.eval.engine_eval import load_run_config; "
                           f"plain_warnings('evaluate.py'); load_run_config({str(run)!r})"],
                          capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    assert said.stderr == f"evaluate.py: warning: {message}\n"


def test_the_prompts_digest_sees_tokens_and_image_bytes():
    from specforge.eval.resume import prompts_digest

    def prompt(tokens, pixels):
        return {"id": "p0", "suite": "heldout", "input_ids": tokens,
                "images": {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 2]])}}

    pixels = torch.linspace(0, 1, 12, dtype=torch.bfloat16).reshape(4, 3)
    same = prompts_digest([prompt([1, 2, 3], pixels)])
    assert prompts_digest([prompt(torch.tensor([1, 2, 3]), pixels.clone())]) == same  # a tensor or a list
    assert prompts_digest([prompt([1, 2, 4], pixels)]) != same
    assert prompts_digest([prompt([1, 2, 3], pixels.flip(0))]) != same  # another image, the same tokens


def test_a_partial_file_that_is_not_ours_is_measured_again(tmp_path, capsys):
    from specforge.eval.resume import read_partial, rows

    path = tmp_path / PARTIAL_NAME
    path.write_text('{"configs": [{"tree": "2_1_3"')  # cut short
    assert read_partial(path) is None and "everything is measured again" in capsys.readouterr().out
    path.write_text("[1, 2]")
    assert read_partial(path) is None
    assert read_partial(tmp_path / "absent.json") is None
    assert rows({"configs": "2_1_3"}, "configs") == rows(None, "configs") == rows({}, "configs") == []
    assert rows({"configs": [{"tree": "2_1_3"}, 3, None]}, "configs") == [{"tree": "2_1_3"}]


def test_rows_an_earlier_version_counted_otherwise_are_measured_again(run, monkeypatch, capsys):
    """A partial file keeps finished configurations for the next run of the same evaluation; one written before
    the engine's counting changed (the generation config's stop ids, drafts cut where a request finishes) was
    kept with its old figures. Every key holds the figures' version (resume.FIGURES)."""
    from specforge.eval import resume

    cfg = eval_cfg(run, "epochs=[1]")
    run_evaluation(load_run_config(run), run, cfg)
    results = read_json(run / "eval" / "results.json")
    stopped = {"base": results["base"], "configs": results["configs"]}  # as if it had stopped before results.json
    for version, kept in ((resume.FIGURES - 1, False), (resume.FIGURES, True)):
        (run / "eval" / PARTIAL_NAME).write_text(json.dumps(stopped))
        monkeypatch.setattr(resume, "FIGURES", version)
        capsys.readouterr()
        run_evaluation(load_run_config(run), run, cfg)
        said = "measured by an earlier run of this evaluation that stopped, kept" in capsys.readouterr().out
        assert said == kept, version
        monkeypatch.undo()
