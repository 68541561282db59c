"""The process group of a run: who am I, how many are we, and the few collectives the stages use.

Launchers tell a process its place through the environment:
- torchrun / `accelerate launch` / `python -m torch.distributed.run`: RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
- Slurm `srun` (one task per GPU, or the submitit launcher): SLURM_* (see slurm.py), turned into the
  torchrun variables so that everything downstream (torch.distributed, DeepSpeed) reads one set;
- nothing of the above: one process, no process group.

`init_distributed()` is called once per process (by the pipeline); the backend is nccl on CUDA and
gloo on CPU. Every stage then asks `current()`. `shutdown()` frees what the caller hands it and
collects garbage BEFORE destroying the group: gloo/DDP processes otherwise sometimes abort at
interpreter exit ("terminate called without an active exception").
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from specforge.distributed.slurm import is_slurm_step, slurm_dist_vars
from specforge.errors import InputError, InvalidInput

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"  # none | torchrun | slurm
    backend: str | None = None  # gloo | nccl when a process group is up

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size})"


class DistEnvError(RuntimeError):
    pass


class CleanStop(Exception):
    """A deliberate stop (e.g. a scheduler's signal, state saved): not reported as a rank failure."""


def env_from(environ: Mapping[str, str], use_scontrol: bool = True) -> tuple[DistEnv, dict[str, str]]:
    """Where this process stands, and the torchrun-style variables to export (empty for torchrun,
    where they are set already). Pure: reads `environ`, changes nothing."""
    if "RANK" in environ and "WORLD_SIZE" in environ:  # torchrun, accelerate, or an explicit setting
        try:
            rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
            local_rank = int(environ.get("LOCAL_RANK", rank))
            local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
        except ValueError as e:
            raise DistEnvError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers ({e})") from None
        if not 0 <= rank < world:
            raise DistEnvError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
        if world > 1 and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
            raise DistEnvError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set; launch with torchrun")
        return DistEnv(rank, world, local_rank, local_world, "torchrun"), {}
    if is_slurm_step(environ):
        exported = slurm_dist_vars(environ, use_scontrol=use_scontrol)
        return DistEnv(int(exported["RANK"]), int(exported["WORLD_SIZE"]), int(exported["LOCAL_RANK"]),
                       int(exported["LOCAL_WORLD_SIZE"]), "slurm"), exported
    return DistEnv(), {}


_CURRENT = DistEnv()
_COORD_GROUP = None  # gloo group for CPU-side coordination (object broadcasts, barriers)


def current() -> DistEnv:
    return _CURRENT


def init_distributed(timeout_minutes: float = 60.0) -> DistEnv:
    """Read the launcher's environment and, for more than one process, join the process group.
    Idempotent: a second call returns the group already joined."""
    global _CURRENT, _COORD_GROUP
    if dist.is_available() and dist.is_initialized():
        return _CURRENT
    env, exported = env_from(os.environ)
    if not env.distributed:
        _CURRENT = env
        return env
    os.environ.update(exported)  # torch.distributed and DeepSpeed read the torchrun variables
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env.device)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    try:
        dist.init_process_group(backend=backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=timeout,
                                **({"device_id": env.device} if backend == "nccl" else {}))
    except Exception as e:
        raise DistEnvError(
            f"[{env.describe()}] cannot join the process group at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} ({backend}): {e}") from e
    _COORD_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _CURRENT = DistEnv(env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher, backend)
    return _CURRENT


def shutdown(*objects: Any) -> None:
    """Leave the process group. Drop the caller's references first (pass nothing, the caller `del`s
    its own), then collect: a model or optimizer still alive at destroy time can abort the process."""
    global _CURRENT, _COORD_GROUP
    del objects
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier(group=_COORD_GROUP)
        dist.destroy_process_group()
    _COORD_GROUP = None
    _CURRENT = DistEnv()


# -- collectives the stages use (no-ops for one process) ------------------------------------------

def barrier() -> None:
    if _CURRENT.distributed:
        dist.barrier(group=_COORD_GROUP)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` of rank `src`, on every rank (picklable objects; CPU side, any backend)."""
    if not _CURRENT.distributed:
        return obj
    box = [obj if _CURRENT.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=_COORD_GROUP)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _CURRENT.distributed:
        return [obj]
    out: list[Any] = [None] * _CURRENT.world_size
    dist.all_gather_object(out, obj, group=_COORD_GROUP)
    return out


def broadcast_tensor(t: torch.Tensor | None, shape=None, dtype=None, src: int = 0) -> torch.Tensor:
    """Rank `src`'s tensor on every rank, on CPU (the others pass None plus its shape and dtype).
    Goes through the main group, so through the GPU with NCCL."""
    if not _CURRENT.distributed:
        return t
    device = _CURRENT.device if _CURRENT.backend == "nccl" else torch.device("cpu")
    buf = t.to(device) if _CURRENT.rank == src else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src=src)
    return buf.cpu()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place, on the tensor's device (the main group's backend)."""
    if _CURRENT.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (a collective: all ranks call it)."""
    if not _CURRENT.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_CURRENT.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def run_on_main(fn, *args, what: str = "work", **kwargs):
    """Run `fn` on rank 0 only; every rank returns its result, or raises when it failed there
    (the other ranks wait instead of hanging in their next collective)."""
    result, error = None, None
    if _CURRENT.is_main:
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # told to the others, then re-raised here
            error = e
    kind = "ok" if error is None else "refused" if isinstance(error, InputError) else "error"
    outcome = broadcast_object((kind, result if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    if outcome[0] != "ok":  # a refusal stays one on every rank (train.py prints it once, no traceback)
        raise (RefusedOnRankZero if outcome[0] == "refused" else RuntimeError)(
            f"[{_CURRENT.describe()}] {what} failed on rank 0: {outcome[1]}")
    return outcome[1]


class RefusedOnRankZero(InvalidInput):
    """Rank 0's refusal as the other ranks learn it (run_on_main): rank 0 prints it."""


@contextlib.contextmanager
def rank_errors(what: str = "") -> Iterator[None]:
    """Name the rank in every error that leaves the block: the message gets a note, and a one-line
    summary goes to stderr (the interleaved logs of many ranks stay readable)."""
    try:
        yield
    except CleanStop:
        raise
    except Exception as e:
        env = _CURRENT
        if env.distributed or env.launcher != "none":
            tag = f"[{env.describe()}]" + (f" {what}" if what else "")
            if hasattr(e, "add_note"):
                e.add_note(f"raised on {env.describe()}")
            # rank 0's refusals are printed by train.py, once; another rank's own are printed here
            if not isinstance(e, InputError) or not (env.is_main or isinstance(e, RefusedOnRankZero)):
                print(f"{tag} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
