"""One pipeline per run directory at a time.

Two `python train.py` of the same experiment (a second terminal, a requeued job whose predecessor
still runs) would interleave metrics, checkpoints and hidden-state shards in one directory. The
pipeline's rank 0 holds an exclusive lock on `<run>/.lock` while it runs; the kernel drops it when
the process ends, however it ends, so a crash never leaves a stale lock. The file keeps the
holder's pid, host, start time and command for the message a second run gets.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from specforge.errors import InputError, InvalidInput


class RunDirBusy(InputError, RuntimeError):
    """Another process holds the run directory."""


class RunDirLock:
    """`what` the lock guards (default: the lock file's directory) and `advice`: what the refused
    process may do instead of waiting (the pipeline: another run_name; an evaluation: another
    out_dir), for the message."""

    def __init__(self, path: str | Path, what: str | None = None, advice: str = "give this run another run_name") -> None:
        self.path = Path(path)
        self.what = what or str(self.path.parent)
        self.advice = advice
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only file system, a directory of another user, /proc
            raise InvalidInput(f"{self.what}: cannot write in {self.path.parent} ({e.strerror}); "
                               f"{self.advice}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 65536, 0))
            os.close(fd)
            raise RunDirBusy(f"{self.what}: in use by another run ({holder}); wait for it to end or "
                               f"stop it, or {self.advice}") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw)
        return f"pid {info['pid']} on {info['host']} since {info['started']}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        return "its details are not readable"
