"""Stop requests from the scheduler: SIGTERM (Slurm preemption, `scancel`, torchrun forwarding it)
and SIGUSR1 (`sbatch --signal=USR1@<seconds>` before the time limit), plus submitit's own signal
(SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise) when the Hydra submitit launcher runs us.

The handler only sets a flag; the training loop looks at it between optimizer steps, where a state
can be saved consistently. The ranks agree through a tiny all-reduce (a signal may reach them a
step apart), all save together, and leave. When a handler was installed before ours (submitit's
requeue handler), `hand_over()` calls it after the state is saved, so the job is still requeued.
"""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from specforge.distributed.env import CleanStop, any_rank

EXIT_REQUEUE = 75  # EX_TEMPFAIL: state saved, run again (with train.resume=auto) to continue


class TrainingInterrupted(CleanStop):
    """Raised by the training loop after a stop request and a saved state."""

    exit_code = EXIT_REQUEUE

    def __init__(self, signal_name: str, state_dir):
        super().__init__(f"stopped by {signal_name} after saving the training state {state_dir}; "
                         "run again with train.resume=auto to continue")
        self.signal_name = signal_name
        self.state_dir = state_dir


def stop_signals() -> list[signal.Signals]:
    sigs = [signal.SIGTERM, signal.SIGUSR1]
    submitit = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    if "SUBMITIT_EXECUTOR" in os.environ and submitit is not None and submitit not in sigs:
        sigs.append(submitit)
    return sigs


class StopRequests:
    """Context manager: while inside, stop signals set a flag instead of killing the process."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            print(f"[train] received {self.received.name}: saving a training state at the end of this step",
                  flush=True)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in stop_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.received is not None:
            # leaving after a stop, state saved: ignore further stop signals until the process is
            # gone (srun --kill-on-bad-exit and torchrun SIGTERM the ranks still exiting when the
            # first one exits). SIG_IGN, not a Python handler: it also holds during interpreter
            # shutdown, so every rank exits with EXIT_REQUEUE; SIGKILL still ends a hung one.
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def requested(self) -> bool:
        """Whether ANY rank was asked to stop. A collective: every rank calls it at the same step."""
        return any_rank(self.received is not None)

    @property
    def signal_name(self) -> str:
        return self.received.name if self.received is not None else "a stop request on another rank"

    def hand_over(self) -> None:
        """Give the signal to the handler that was there before ours (submitit: requeue the job)."""
        if self.received is None:
            return
        previous = self._previous.get(self.received)
        if callable(previous):
            previous(int(self.received), None)
