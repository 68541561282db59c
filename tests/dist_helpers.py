"""Shared by test_distributed.py, test_resume.py and test_slurm.py: one prepared run directory (data
and extract stages of the tiny target, done once per session) and real `train.py` launches on it,
single-process or through torchrun with 2 processes (gloo on CPU).

Reference runs are cached for the session, so each is computed once whichever test asks first.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
EPOCHS, TTT, BATCH = 2, 3, 2  # 24 samples -> 12 micro-batches of 2 -> 6 steps/epoch at a global batch of 4
_PREPARED: dict[str, "Prepared"] = {}
_RUNS: dict[str, Path] = {}


@dataclass
class Prepared:
    root: Path
    overrides: list[str]  # what every launch passes (paths, tiny target, small data)

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"


def base_overrides(root: Path, target_dir: Path) -> list[str]:
    return [
        "+exp=smollm2_weather",
        f"output_dir={root / 'outputs'}",
        f"cache_dir={root / 'cache'}",
        f"target.path={target_dir}",
        "target.fetch=null",
        "target.dtype=float32",
        "target.aux_layer_ids=[0,1,3]",
        f"data.train_files=[{root / 'train.jsonl'}]",
        f"data.eval_files=[{root / 'eval.jsonl'}]",
        "data.regenerate.enabled=false",  # the tiny random target would answer nothing
        "draft.draft_vocab_size=128",
        "extract.shard_samples=5",  # 5 shards of the 24 train samples: something to share between ranks
        # every strategy (FSDP and ZeRO shard the matrices Muon needs whole) on one optimizer;
        # the exp's Muon is tested with ddp on its own (test_distributed.py)
        "train.optimizer=adamw",
        # the learning rate the strategies' tolerances below were set at, whatever the demo exp's
        "train.lr=1e-3",
    ]


def prepared(tmp_path_factory, target_dir: Path) -> Prepared:
    """Data + extract of 24 train / 8 eval weather conversations, run in-process once."""
    if "p" not in _PREPARED:
        from hydra import compose, initialize_config_dir

        from data_prep.weather import generate
        from specforge.config import register_configs
        from specforge.pipeline import run_pipeline
        from specforge.utils.io import write_jsonl

        root = tmp_path_factory.mktemp("dist")
        write_jsonl(root / "train.jsonl", generate(24, seed=0, split="train"))
        write_jsonl(root / "eval.jsonl", generate(8, seed=0, split="eval"))
        overrides = base_overrides(root, target_dir)
        register_configs()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose("config", overrides=[*overrides, "run_name=prepared", "stages=[data,extract]"])
        run_pipeline(cfg)
        _PREPARED["p"] = Prepared(root, overrides)
    return _PREPARED["p"]


def env() -> dict[str, str]:
    e = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def new_run(p: Prepared, name: str) -> Path:
    """A run directory holding the prepared data and hidden states (train has not run)."""
    run = p.outputs / name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(p.outputs / "prepared", run)
    return run


def train_command(p: Prepared, name: str, nproc: int, *overrides: str, stages: str = "[train]") -> list[str]:
    args = ["train.py", *p.overrides, f"run_name={name}", f"stages={stages}", f"train.epochs={EPOCHS}",
            f"train.ttt_length={TTT}", f"train.batch_size={BATCH}", "train.log_every=1", "train.num_threads=1",
            "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none", *overrides]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def start(p: Prepared, name: str, nproc: int, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(train_command(p, name, nproc, *overrides), cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def launch(p: Prepared, name: str, nproc: int, *overrides: str, fresh: bool = True, stages: str = "[train]",
           expect_rc: int = 0) -> str:
    """Run `stages` (the train stage: on a copy of the prepared run) to the end; returns the output."""
    if fresh and stages == "[train]":
        new_run(p, name)
    elif fresh:
        shutil.rmtree(p.outputs / name, ignore_errors=True)
    t0 = time.time()
    proc = subprocess.run(train_command(p, name, nproc, *overrides, stages=stages), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, f"train.py exited {proc.returncode} (expected {expect_rc}):\n{out[-6000:]}"
    print(f"[{name}] {nproc} process(es), {time.time() - t0:.1f} s")
    return out


def reference_run(p: Prepared, key: str, nproc: int, *overrides: str) -> Path:
    """An uninterrupted run, computed once per session."""
    if key not in _RUNS:
        launch(p, key, nproc, *overrides)
        _RUNS[key] = p.outputs / key
    return _RUNS[key]


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Poll until `path` exists; fails if the process ends first."""
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"process ended (rc {proc.returncode}) before {path} appeared:\n"
                                 f"{proc.stdout.read()[-4000:]}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def master_weights(run: Path, state: str = f"epoch_{EPOCHS}") -> dict[str, torch.Tensor]:
    """fp32 weights of a run's training state (torch strategies)."""
    return torch.load(run / "state" / state / "model_optim.pt", map_location="cpu", weights_only=True)["model"]


def checkpoint_weights(run: Path, epoch: int = EPOCHS) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / f"epoch_{epoch}" / "model.safetensors")


def metrics(run: Path) -> list[dict]:
    from specforge.utils.metrics_log import read_metrics

    return read_metrics(run / "metrics.jsonl")
