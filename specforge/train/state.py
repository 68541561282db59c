"""Training states (model, optimizer, scheduler, RNG, position in the data, metrics window, wandb run
id) live beside the servable checkpoints, never inside them: `run_dir/state/<name>/`.

- `epoch_<k>/` after every epoch (kept), `step_<n>/` every `train.save_state_every` steps and on a
  stop signal (only the newest is kept).
- A state directory holds `training_state.pt` (what the loop owns), the strategy's model +
  optimizer files (strategy.py) and `state.json`, written last: the position, the train fingerprint
  and the size of every file.
- Atomic: everything is written into `.<name>.tmp/`, and only a complete directory is renamed to its
  name. A half-written state therefore never carries a state name, and `find_resume_state` also
  validates the manifest and file sizes before trusting one (then falls back to the next newest).
- Read with `weights_only=True`: plain tensors and containers only.

`TrainState` is everything a state holds, as one object (model and optimizer through the strategy,
scheduler, RNG, meter, position in the data); `StateManager` saves and restores it (as torchtitan's
Stateful trainer and CheckpointManager divide the work). The loop only says when.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specforge import distributed as dist
from specforge.distributed import barrier, current
from specforge.run_layout import RunLayout
from specforge.utils.io import read_json, replace_dir, write_json
from specforge.utils.metrics_log import read_metrics, write_metrics

STATE_NAME = "training_state.pt"
MANIFEST = "state.json"
FORMAT = "specforge-train-state"
VERSION = 1


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_training_state(states_dir: str | Path, name: str, strategy, trainer_state: dict, meta: dict) -> Path:
    """Write the state `name` under `states_dir`. Every rank calls it (the strategy's part may be a
    collective or written by every rank); rank 0 writes the rest and renames."""
    states_dir = Path(states_dir)
    final, tmp = states_dir / name, states_dir / f".{name}.tmp"
    main = current().is_main
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    strategy.save_state(tmp)
    if main:
        torch.save(trainer_state, tmp / STATE_NAME)
    barrier()  # every rank's files are in place
    if main:
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        write_json(tmp / MANIFEST, {"format": FORMAT, "version": VERSION, **meta, "files": files})
        replace_dir(tmp, final)  # durable: every file, then the rename, on the disk
    barrier()
    return final


def validate_state(path: str | Path) -> dict:
    """The manifest of a complete state directory; raises ValueError saying what is wrong."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise ValueError(f"{path}: no {MANIFEST} (an interrupted or foreign directory)")
    try:
        meta = read_json(manifest)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{manifest}: unreadable ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{manifest}: format {meta.get('format')!r} v{meta.get('version')}, "
                         f"expected {FORMAT!r} v{VERSION}")
    files = meta.get("files") or {}
    if STATE_NAME not in files:
        raise ValueError(f"{manifest}: does not list {STATE_NAME}")
    for rel, size in files.items():
        p = path / rel
        if not p.is_file():
            raise ValueError(f"{path}: {rel} is missing")
        if p.stat().st_size != size:
            raise ValueError(f"{path}: {rel} has {p.stat().st_size} bytes, the manifest says {size}")
    return meta


def list_states(states_dir: str | Path) -> list[Path]:
    states_dir = Path(states_dir)
    if not states_dir.is_dir():
        return []
    return [p for p in states_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]


def find_resume_state(states_dir: str | Path, fingerprint: str | None, split_free: str | None = None,
                      global_batch: int | None = None) -> tuple[Path | None, dict | None, list[str]]:
    """The newest valid state whose train fingerprint matches (any when `fingerprint` is None), or whose
    fingerprint without train.grad_accum (`split_free`) does and that split the same `global_batch`
    (grad_accum x world size micro-batches per step: the run moved to other GPUs, as docs/multinode.md says).
    Returns (path, trainer_state with its manifest under "meta", notes on what was passed over)."""
    candidates, notes = [], []
    for p in list_states(states_dir):
        try:
            meta = validate_state(p)
        except ValueError as e:
            notes.append(f"skipped {p.name}: {e}")
            continue
        resplit = (split_free is not None and meta.get("split_free") == split_free
                   and meta.get("grad_accum", 1) * meta.get("world_size", 1) == global_batch)
        if fingerprint is not None and meta.get("fingerprint") != fingerprint and not resplit:
            notes.append(f"skipped {p.name}: written by a different training configuration or data")
            continue
        candidates.append((int(meta["step"]), p.name.startswith("epoch_"), p, meta))
    for _, _, p, meta in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        try:
            state = torch.load(p / STATE_NAME, map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged file of the right size
            notes.append(f"skipped {p.name}: {STATE_NAME} does not load ({type(e).__name__}: {e})")
            continue
        state["meta"] = meta
        return p, state, notes
    return None, None, notes


def load_training_state(path: str | Path) -> dict:
    """One state directory, validated (for `train.resume=<path>`)."""
    meta = validate_state(path)
    state = torch.load(Path(path) / STATE_NAME, map_location="cpu", weights_only=True)
    state["meta"] = meta
    return state


def prune_states(states_dir: str | Path, newest_step: int, keep_epochs: int | None = None) -> None:
    """After a state of step `newest_step` is written: drop older `step_*` states and leftovers of
    interrupted writes. Epoch states are kept: all, or the newest `keep_epochs`
    (train.keep_epoch_states; each holds the weights and the optimizer's moments, GBs for a large
    target's draft, beside the servable `epoch_<k>/` checkpoints that are always kept)."""
    epochs = []
    for p in Path(states_dir).iterdir() if Path(states_dir).is_dir() else []:
        if p.name.startswith(".") and p.name.endswith((".tmp", ".old")):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir() and p.name.startswith(("step_", "epoch_")):
            try:
                step = int(read_json(p / MANIFEST)["step"])
            except (OSError, ValueError, KeyError):
                step = -1
            if p.name.startswith("epoch_"):
                epochs.append((step, p))
            elif step < newest_step:
                shutil.rmtree(p, ignore_errors=True)
    if keep_epochs is not None:
        for _, p in sorted(epochs, key=lambda e: e[0], reverse=True)[keep_epochs:]:
            shutil.rmtree(p, ignore_errors=True)


def clear_states(states_dir: str | Path) -> list[str]:
    """A fresh run owns `state/`: remove what an earlier run left there."""
    removed = []
    for p in Path(states_dir).iterdir() if Path(states_dir).is_dir() else []:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def clear_earlier_outputs(layout: RunLayout) -> list[str]:
    """A fresh run owns its `epoch_<k>/` checkpoints and what recommends one: remove an earlier run's (another
    configuration's), or its epochs past this run's end and its evaluation's choice would be served."""
    removed = []
    for p in layout.checkpoints():
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    for p in (layout.eval_choice, layout.eval_report):
        if p.exists():
            p.unlink()
            removed.append(str(p.relative_to(layout.root)))
    return removed


@dataclass
class Position:
    """Where training stands: a resumed run starts at (epoch, step_in_epoch)."""

    epoch: int = 1
    step_in_epoch: int = 0
    step: int = 0
    seconds: float = 0.0  # training time before this process started (for tokens/s)
    epochs: list = field(default_factory=list)  # per-epoch summaries so far
    wandb_run_id: str | None = None
    skipped_steps: int = 0  # optimizer steps skipped for an inf/nan gradient norm
    stopped_early: str | None = None  # why training stopped before train.epochs (early stop)


class TrainState:
    """What a training state holds, in one object: the model and optimizer (the strategy writes and
    reads their files itself), the LR scheduler, the RNG, the metrics meter and the position."""

    def __init__(self, strategy, scheduler, meter, device):
        self.strategy, self.scheduler, self.meter, self.device = strategy, scheduler, meter, device
        self.position = Position()
        self.started = time.time()

    def elapsed(self) -> float:
        """Training seconds, those before a resume included."""
        return self.position.seconds + time.time() - self.started

    def resume_at(self, epoch: int, step_in_epoch: int) -> None:
        """Where a state saved now resumes (the loop says it before saving)."""
        self.position.epoch, self.position.step_in_epoch = epoch, step_in_epoch

    def state_dict(self) -> dict:
        """The loop's part (the strategy writes its own); a collective: the meter is synced first."""
        self.meter.sync(self.device)  # rank 0 holds the window of every rank from here on
        position = Position(**{**vars(self.position), "seconds": self.elapsed(),
                               "epochs": list(self.position.epochs)})
        return {"scheduler": self.scheduler.state_dict(), "rng": dist.gather_objects(rng_state()),  # every rank's
                "meter": self.meter.state(), "position": vars(position)}

    @staticmethod
    def _restore_rng(saved, step: int) -> None:
        """Each rank its own random state (feature noise draws differ by rank: their batches pad alike only by
        chance). A state of another number of processes (or of an earlier version: rank 0's alone) cannot be
        continued exactly: rank 0's, the others reseeded apart from it."""
        states = saved if isinstance(saved, list) else [saved]
        env = current()
        if len(states) == env.world_size:
            set_rng_state(states[env.rank])
            return
        set_rng_state(states[0])
        if env.rank:
            torch.manual_seed(1_000_003 * (step + 1) + env.rank)

    def load_state_dict(self, state: dict, path: Path) -> None:
        self.strategy.load_state(path, state["meta"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._restore_rng(state["rng"], state["position"]["step"])
        self.meter.load(state["meter"], current().is_main)
        self.position = Position(**state["position"])
        self.started = time.time()


class StateManager:
    """Saves `TrainState`s under the run's `state/` and restores the newest valid one, per
    `train.resume`: auto (the newest whose train-stage fingerprint matches), never, or a path."""

    def __init__(self, layout: RunLayout, fingerprint: str, tc, split_free: str | None = None):
        self.layout, self.fingerprint, self.tc, self.split_free = layout, fingerprint, tc, split_free
        self.states_dir = layout.states_dir

    def save(self, state: TrainState, name: str, reason: str) -> Path:
        """Every rank calls it (collectives inside)."""
        env = current()
        trainer_state = state.state_dict()
        p = state.position
        meta = {"step": p.step, "epoch": p.epoch, "step_in_epoch": p.step_in_epoch,
                "reason": reason, "fingerprint": self.fingerprint, "split_free": self.split_free,
                "strategy": state.strategy.name,
                "state_format": state.strategy.state_format, "world_size": env.world_size,
                "batch_size": self.tc.batch_size, "grad_accum": self.tc.grad_accum}
        out = save_training_state(self.states_dir, name, state.strategy, trainer_state, meta)
        if env.is_main:
            prune_states(self.states_dir, p.step, self.tc.keep_epoch_states)
        return out

    def restore(self, state: TrainState) -> Path | None:
        """Load the state to resume into `state`, or clear the states of an earlier run (None).
        Every rank calls it; rank 0 looks for the state."""
        env = current()
        path, saved = dist.run_on_main(self._find, what="finding a training state")
        if saved is None:
            if env.is_main:
                removed = clear_states(self.states_dir)
                if removed:
                    print(f"[train] starting from scratch; removed earlier states {sorted(removed)}", flush=True)
                if outputs := clear_earlier_outputs(self.layout):
                    print(f"[train] removed the earlier run's checkpoints and evaluation choice {outputs}", flush=True)
            barrier()
            return None
        self._check_resumable(saved["meta"], env, path)
        state.load_state_dict(saved, path)
        if env.is_main:  # rows logged after that state was written will be logged again
            metrics = self.layout.metrics
            write_metrics(metrics, [r for r in read_metrics(metrics) if r.get("step", 0) <= state.position.step])
            print(f"[train] resuming from {path} (epoch {state.position.epoch}, step {state.position.step})",
                  flush=True)
        barrier()
        return path

    def _find(self):
        """(path, trainer state) to resume from, or (None, None), per `train.resume`."""
        resume = self.tc.resume
        if resume == "never":
            return None, None
        if resume == "auto":
            path, saved, notes = find_resume_state(self.states_dir, self.fingerprint, self.split_free,
                                                   self.tc.grad_accum * current().world_size)
            for note in notes:
                print(f"[train] resume: {note}", flush=True)
            return path, saved
        path = Path(resume)
        saved = load_training_state(path)
        if saved["meta"].get("fingerprint") != self.fingerprint:
            print(f"[train] resume: {path} was written with a different training configuration or data; "
                  "resuming from it as asked", flush=True)
        return path, saved

    def _check_resumable(self, meta: dict, env, path) -> None:
        """A state resumes exactly only with the same micro-batches and global batch."""
        tc = self.tc
        was = (meta.get("batch_size"), meta.get("grad_accum", 1) * meta.get("world_size", 1))
        now = (tc.batch_size, tc.grad_accum * env.world_size)
        if was != now:
            raise ValueError(
                f"{path}: written with batch_size {was[0]} and grad_accum x world_size = {was[1]}, now "
                f"{now[0]} and {now[1]}; resume with the same global batch (set train.grad_accum) or start "
                "over with train.resume=never")
