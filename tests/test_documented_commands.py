"""The `python train.py +exp=...` commands the README and the exp files' headers give pass the
checks `train.py` runs before its first stage: an exp that cannot run as documented is caught here,
not by a user after a GPU allocation."""
from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specforge.config import check_config, register_configs
from specforge.launch.sglang_commands import NEWEST_CHECKED
from specforge.pipeline import STAGES

ROOT = Path(__file__).resolve().parents[1]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, overrides) of every train.py command naming a real exp (lines ending in a backslash
    joined with the next)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "conf" / "exp").glob("*.yaml"))]:
        lines = path.read_text().splitlines()
        for start, line in enumerate(lines, 1):
            n = start
            while line.rstrip().endswith("\\") and n < len(lines):
                line = line.rstrip()[:-1] + " " + lines[n]
                n += 1
            if "train.py" not in line or "+exp=" not in line:
                continue
            command = re.split(r"[`#]", line.split("train.py", 1)[1])[0]  # up to inline code's end or a comment
            words = shlex.split(command)
            overrides = [w for w in words if w != "-m" and not w.startswith("hydra/")]  # the launcher's own
            if any(re.fullmatch(r"\+exp=[a-z0-9_]+", w) and w != "+exp=NAME" for w in overrides):
                found.append((f"{path.relative_to(ROOT)}:{start}", overrides))
    return found


COMMANDS = documented_commands()


def test_the_commands_are_found():
    exps = {w for _, o in COMMANDS for w in o if w.startswith("+exp=")}
    assert {f"+exp={p.stem}" for p in (ROOT / "conf" / "exp").glob("*.yaml")} <= exps  # every exp is shown


# Where SGLang is not installed (CPU machines), the commands are checked as on a machine with the
# newest SGLang whose flags were checked: the up-front checks refuse an engine missing here.
AS_ON_A_GPU = ([] if importlib.util.find_spec("sglang") else
               [f"++{section}.sglang_version={NEWEST_CHECKED}" for section in ("extract", "eval")])


@pytest.mark.parametrize("where, overrides", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_passes_the_up_front_checks(where, overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[*overrides, *AS_ON_A_GPU])
    check_config(cfg)
    for name in cfg.stages:
        check = STAGES[name].entry("check")
        if check is not None:
            check(cfg)
