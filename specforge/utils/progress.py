"""One progress-bar style for every long stage (rich), with a free-text field for live metrics.

Where the console is not a terminal (a Slurm job's log, `make demo > log`) rich draws a bar once,
when it stops: a 10-minute stage would show nothing until its end. There each task prints a plain
line when it starts, every `every` seconds and when it completes instead."""
from __future__ import annotations

import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class LoggedProgress(Progress):
    def __init__(self, *columns, every: float = 30.0, **kwargs):
        super().__init__(*columns, **kwargs)
        self.every = every
        self._last_line: dict = {}  # task id -> when its last line was printed

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._log(task_id)

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log(task_id)

    def _log(self, task_id) -> None:
        if self.disable or self.console.is_terminal:
            return
        task = self._tasks[task_id]
        now = time.monotonic()
        last = self._last_line.get(task_id)
        if last == float("inf") or (last is not None and now - last < self.every and not task.finished):
            return
        self._last_line[task_id] = float("inf") if task.finished else now
        self.console.print(progress_line(task), markup=False, highlight=False)


def progress_line(task) -> str:
    """`description: 120/600 (20%), 1m05s elapsed, ~4m20s left, <fields>` for a log."""
    done = f"{task.completed:.0f}" + (f"/{task.total:.0f} ({task.percentage:.0f}%)" if task.total else "")
    parts = [f"{task.description}: {done}", f"{_duration(task.elapsed or 0.0)} elapsed"]
    if task.total and not task.finished and task.time_remaining is not None:
        parts.append(f"~{_duration(task.time_remaining)} left")
    fields = [_field(k, v) for k, v in task.fields.items() if v not in ("", None)]
    return ", ".join(parts + fields)


def _field(key: str, value) -> str:
    if key == "info":  # progress_bar's free text: as it is
        return str(value)
    return f"{key} {value:.0f}" if isinstance(value, float) else f"{key} {value}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_bar(disable: bool = False, columns: tuple = (), **kwargs) -> LoggedProgress:
    """The stages' bar; `columns` replace the default ones, `kwargs` go to rich (e.g. a console)."""
    columns = columns or (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    return LoggedProgress(*columns, disable=disable, **kwargs)
