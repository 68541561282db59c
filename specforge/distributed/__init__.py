"""Distributed runs: the process group from the launcher's environment (torchrun, accelerate,
Slurm), training strategies (single, ddp, fsdp, deepspeed) and stop requests from the scheduler.

env.py: who am I, init/shutdown, the few collectives the stages use; slurm.py: the Slurm
environment and node lists; strategy.py: model wrapping, kept out of the training loop;
preemption.py: SIGTERM/SIGUSR1 -> save a state and exit.
"""
from specforge.distributed.env import (DistEnv, all_reduce_sum, any_rank, barrier, broadcast_object, broadcast_tensor, current,
                                gather_objects, init_distributed, rank_errors, run_on_main, shutdown)

__all__ = ["DistEnv", "all_reduce_sum", "any_rank", "barrier", "broadcast_object", "broadcast_tensor", "current",
           "gather_objects", "init_distributed", "rank_errors", "run_on_main", "shutdown"]
