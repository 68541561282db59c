"""Refusals of what the user gave: a setting, a data file, a checkpoint, a busy run directory.

Their messages already name the key, file or line and say what to do, so `train.py` and
`evaluate.py` print the message alone (`error: ...`, exit status 2) where anything else, a bug or a
crash, keeps its traceback. Each kind is also the built-in exception callers already catch
(ValueError, FileNotFoundError, RuntimeError)."""
from __future__ import annotations

import os
import sys

INPUT_ERROR_EXIT = 2  # a refusal, as argparse's usage errors: a requeue would be refused again


class InputError(Exception):
    """The base of every refusal of the user's input."""


class InvalidInput(InputError, ValueError):
    """A setting or file's content that cannot work."""


class MissingInput(InputError, FileNotFoundError):
    """A file or directory the run was told to read is not there."""


class SpecForgeWarning(UserWarning):
    """A warning of ours: what the user gave runs, but maybe not as they meant. The command-line
    entry points print it as one line (plain_warnings)."""


def plain_warnings(prog: str) -> None:
    """Print SpecForgeWarning as `prog: warning: message`, one line as a refusal is, without
    Python's source file, line number and the `warnings.warn(` line; other warnings keep that."""
    import warnings

    python_format = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        if issubclass(category, SpecForgeWarning):
            return f"{prog}: warning: {message}\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning


def exit_refused(error: InputError, prog: str) -> None:
    """Print `error`'s message (on rank 0 of a distributed run: every rank refuses alike; a Slurm
    task's rank before the process group exports it) and exit."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(INPUT_ERROR_EXIT)
