"""Metrics go to `metrics.jsonl` in the run directory (always) and to wandb (when configured)."""
from __future__ import annotations

import json
import os
from pathlib import Path


SYNCING_MODES = ("online", "shared")  # wandb modes that send to a server, and need a key for it


def check_wandb_login(logging_cfg) -> None:
    """logging.wandb in a mode that syncs needs credentials, found as wandb finds them
    (WANDB_API_KEY, a settings file, ~/.netrc from `wandb login`); without them wandb.init fails
    as training starts, after the stages before it ran. Asked of wandb itself, without a prompt or
    a network call."""
    from specforge.errors import InvalidInput

    mode = os.environ.get("WANDB_MODE", logging_cfg.wandb_mode)  # as MetricsLogger sets it
    if logging_cfg.wandb and mode != logging_cfg.wandb_mode:
        import warnings

        from specforge.errors import SpecForgeWarning

        warnings.warn(f"WANDB_MODE={mode} in the environment overrules logging.wandb_mode={logging_cfg.wandb_mode}; "
                      "unset it to log as the setting says", SpecForgeWarning, stacklevel=2)
    if not logging_cfg.wandb or mode not in SYNCING_MODES:
        return
    import wandb

    try:
        found = wandb.login(verify=False, prompt=False)
    except TypeError:  # a wandb without `prompt`: it would ask; nothing to check here
        return
    if not found:
        raise InvalidInput(f"logging.wandb=true, wandb_mode={mode}: wandb finds no API key here (WANDB_API_KEY, or "
                           "`wandb login`), so training would fail as it starts; log in, or set "
                           "logging.wandb_mode=offline and `wandb sync` the run's wandb/ folder later")


class MetricsLogger:
    def __init__(self, path: str | Path, logging_cfg=None, run_name: str = "", config: dict | None = None,
                 enabled: bool = True, fresh: bool = True, run_id: str | None = None):
        """`run_id`: a wandb run to continue (a resumed training passes the id it saved)."""
        self.path = Path(path)
        self.enabled = enabled
        self.wandb = None
        self.run_id = run_id
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and self.path.exists():
            self.path.unlink()
        if logging_cfg is not None and logging_cfg.wandb:
            os.environ.setdefault("WANDB_MODE", logging_cfg.wandb_mode)
            import wandb

            self.wandb = wandb.init(project=logging_cfg.project, name=run_name, config=config,
                                    dir=str(self.path.parent), id=run_id,
                                    resume="allow" if run_id else None)
            self.run_id = self.wandb.id

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({f"{row.get('split', 'train')}/{k}": v for k, v in row.items()
                            if isinstance(v, (int, float))})

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(path: str | Path, rows: list[dict]) -> None:
    """Replace the rows of a metrics file (a resumed run drops the rows logged after its state)."""
    from specforge.utils.io import write_jsonl

    write_jsonl(path, rows)
