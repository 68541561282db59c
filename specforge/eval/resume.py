"""What an embedded evaluation (or the planner) that stopped half-way leaves for its next run.

Each finished configuration is written to a partial file at once (eval/stage.py) with a key of
everything its figures depend on: the target, the prompts (tokens and images), the settings that
change tokens or timings, the machine's dtype, device and threads, and the checkpoint's bytes (a
retrained epoch_3 is measured again). The next run of the same evaluation keeps a row whose key
it computes again and measures the rest, as the SGLang evaluation keeps a finished server's
benchmark (server_eval.finished_result).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specforge.utils.io import fingerprint, read_json, write_json

KEY = "resume_key"
# How the engine counts and stops, in every key: raised when that changes, so an earlier version's rows are measured
# again (2: the generation config's stop ids, drafts counted up to where a request finishes)
FIGURES = 2


def prompts_digest(prompts: list[dict]) -> str:
    """The prompts as the engine sees them: ids, suites, tokens and image tensors."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p["id"], p["suite"], [int(t) for t in p["input_ids"]]]).encode())
        for name, value in sorted((p.get("images") or {}).items()):
            h.update(name.encode())
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def settings(target: str, eval_cfg, prompts: list[dict], dtype_name: str, device: str, names: tuple[str, ...]) -> dict:
    """The part of every key that does not depend on the configuration: `target` is the target's
    fingerprint (loader.target_fingerprint), `names` the eval settings the figures depend on."""
    return {"target": target, "prompts": prompts_digest(prompts),
            "eval": {name: getattr(eval_cfg, name, None) for name in names}, "dtype": dtype_name,
            "device": device, "threads": torch.get_num_threads(), "torch": torch.__version__, "figures": FIGURES}


def config_key(common: dict, ckpt_fingerprint: str, *parts) -> str:
    """`common` (settings()), the checkpoint's bytes (file_fingerprint) and what else the row depends on."""
    return fingerprint(common, ckpt_fingerprint, *parts)


def read_partial(path: str | Path) -> dict | None:
    """An earlier run's partial file, or None (absent, or unreadable: then measured again)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        saved = read_json(path)
        if isinstance(saved, dict):
            return saved
    except (OSError, ValueError):
        pass
    print(f"[eval] {path} is not an earlier evaluation's partial results; everything is measured again", flush=True)
    return None


def rows(saved: dict | None, name: str) -> list[dict]:
    """The rows (dicts) of `saved[name]`; nothing for a file someone else wrote there."""
    found = (saved or {}).get(name)
    return [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []


class Partial:
    """A partial results file: what a run that stopped left there (`earlier`, read once), rewritten
    as work finishes (`save`, atomic), removed when the work ended (`remove`)."""

    def __init__(self, path: str | Path, what: str) -> None:
        self.path, self.what = Path(path), what
        self.earlier = read_partial(self.path)

    def save(self, record: dict) -> None:
        write_json(self.path, record)

    def say_kept(self) -> None:
        if self.path.exists():
            print(f"[eval] failed; {self.what} finished so far are kept in {self.path}", flush=True)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
