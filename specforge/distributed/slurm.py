"""What Slurm tells a task about its job step, read from the environment it sets.

`srun` sets, for every task of a step: SLURM_PROCID (global rank), SLURM_LOCALID (rank on its node),
SLURM_NODEID (node index), SLURM_STEP_NUM_TASKS / SLURM_NTASKS (tasks in the step),
SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (compact host list such as `gpu[01-03,07]`),
SLURM_STEP_TASKS_PER_NODE (compact counts such as `8(x2)`), SLURM_JOB_ID.

The batch script itself (outside `srun`) also sees SLURM_PROCID=0 and SLURM_NTASKS=N but is ONE
process: it is a Slurm *step* only when SLURM_STEP_NUM_TASKS is set, so only then do we read it as
a distributed launch.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Mapping

from specforge.errors import InvalidInput

DEFAULT_PORT_BASE = 20000  # master port = base + job id % 10000 when MASTER_PORT is not set


class SlurmEnvError(InvalidInput):
    """A Slurm step whose environment does not say where each rank runs."""


def _expand_range(body: str, where: str) -> list[str]:
    """`01-03,07` -> ['01', '02', '03', '07'] (zero padding kept)."""
    out = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SlurmEnvError(f"{where}: cannot read range {part!r} in [{body}]")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise SlurmEnvError(f"{where}: range {part!r} goes backwards")
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list syntax -> host names, in order.

    `node[01-03,07]` -> node01 node02 node03 node07; `a1,b[2-3]` -> a1 b2 b3;
    `rack[1-2]-gpu[1-2]` -> rack1-gpu1 rack1-gpu2 rack2-gpu1 rack2-gpu2.
    """
    where = f"node list {nodelist!r}"
    hosts: list[str] = []
    token, depth = "", 0
    groups = []
    for ch in nodelist.strip():  # split on commas outside brackets
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"{where}: unbalanced ']'")
        if ch == "," and depth == 0:
            groups.append(token)
            token = ""
        else:
            token += ch
    if depth != 0:
        raise SlurmEnvError(f"{where}: unbalanced '['")
    groups.append(token)
    for group in groups:
        group = group.strip()
        if not group:
            raise SlurmEnvError(f"{where}: empty host name")
        names = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", group):
            names = [n + literal for n in names]
            if body:
                names = [n + s for n in names for s in _expand_range(body, where)]
        hosts.extend(names)
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """`8(x2),4` -> [8, 8, 4] (SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE)."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise SlurmEnvError(f"tasks per node {spec!r}: cannot read {part!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def first_host(nodelist: str, use_scontrol: bool = True) -> str:
    """The first host of a node list: `scontrol show hostnames` where Slurm is installed (it knows
    every syntax the cluster uses), our parser otherwise."""
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    return expand_nodelist(nodelist)[0]


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except KeyError:
        raise SlurmEnvError(f"Slurm step without {key} in the environment") from None
    except ValueError:
        raise SlurmEnvError(f"{key}={env[key]!r} is not an integer") from None


def is_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside an `srun` step (not in the batch script itself)."""
    return "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env


def slurm_dist_vars(env: Mapping[str, str], use_scontrol: bool = True) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT of this Slurm task,
    as torchrun would have set them. MASTER_ADDR/MASTER_PORT already in `env` win (a user or the
    sbatch script may pin them)."""
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    local_rank = _int(env, "SLURM_LOCALID")
    if not 0 <= rank < world:
        raise SlurmEnvError(f"SLURM_PROCID={rank} is outside [0, SLURM_STEP_NUM_TASKS={world})")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_spec:
        per_node = expand_tasks_per_node(per_node_spec)
        node = int(env.get("SLURM_NODEID", "0"))
        local_world = per_node[node] if node < len(per_node) else per_node[-1]
    else:
        local_world = world
    addr = env.get("MASTER_ADDR")
    if not addr:
        if not nodelist:
            raise SlurmEnvError("Slurm step without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: cannot find the "
                                "master host; set MASTER_ADDR")
        addr = first_host(nodelist, use_scontrol)
    port = env.get("MASTER_PORT")
    if not port:
        job = env.get("SLURM_JOB_ID")
        if not job or not job.isdigit():
            raise SlurmEnvError("Slurm step without SLURM_JOB_ID: set MASTER_PORT")
        port = str(DEFAULT_PORT_BASE + int(job) % 10000)
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
