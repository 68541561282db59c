"""The stages' progress bar where its output is a log, not a terminal (Slurm, `make demo > log`):
plain lines at the start, every `every` seconds and at the end, since rich draws the bar only once
there, when it stops."""
from __future__ import annotations

import io

from rich.console import Console

from specforge.utils.progress import progress_bar


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=160), out


def _lines(out: io.StringIO, prefix: str) -> list[str]:
    return [line for line in out.getvalue().splitlines() if line.startswith(prefix)]


def test_a_log_gets_a_line_at_the_start_every_interval_and_at_the_end():
    console, out = _console(terminal=False)
    with progress_bar(console=console, every=3600) as bar:
        task = bar.add_task("regenerate train", total=10, info="")
        bar.advance(task)  # the first update: a line
        bar.advance(task)  # within the interval: none
        bar.update(task, info="212 tok/s")
        bar.every = 0  # the interval has passed
        bar.advance(task)
        bar.update(task, completed=10)  # done: a last line, then nothing more
        bar.update(task, info="late")
    lines = _lines(out, "regenerate train: ")
    assert [line.split(",")[0] for line in lines] == ["regenerate train: 1/10 (10%)", "regenerate train: 3/10 (30%)",
                                                      "regenerate train: 10/10 (100%)"]
    assert lines[1].endswith("left, 212 tok/s") and "elapsed" in lines[1]
    assert "left" not in lines[2] and not any("late" in line for line in lines)


def test_tasks_are_logged_each_on_their_own_with_their_fields():
    console, out = _console(terminal=False)
    with progress_bar(console=console) as bar:
        a = bar.add_task("extract train", total=4000, rate=0.0, info="")
        b = bar.add_task("extract eval", total=500, rate=0.0, info="")
        bar.update(a, advance=1000, rate=1234.4)
        bar.update(b, advance=500, rate=980.0)
    assert _lines(out, "extract train: ")[0].startswith("extract train: 1000/4000 (25%)")
    assert _lines(out, "extract train: ")[0].endswith("rate 1234")
    assert _lines(out, "extract eval: ")[0].startswith("extract eval: 500/500 (100%)")


def test_a_terminal_gets_the_bar_alone_and_a_disabled_bar_nothing():
    console, out = _console(terminal=True)
    with progress_bar(console=console) as bar:
        bar.advance(bar.add_task("data train", total=3, info=""), 3)
    assert not _lines(out, "data train: ") and "3/3" in out.getvalue()
    console, out = _console(terminal=False)
    with progress_bar(disable=True, console=console) as bar:
        bar.advance(bar.add_task("data train", total=3, info=""), 3)
    assert out.getvalue() == ""
