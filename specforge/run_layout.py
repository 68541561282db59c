"""Where every file of a run lives: `outputs/<run_name>/`, one object that every stage, the
evaluation and the reports read their paths from (the table in docs/design.md describes it).

Plain paths only: building a layout creates nothing, and this module imports nothing of ours.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_EPOCH_DIR = re.compile(r"epoch_(\d+)")


def epoch_of(path: str | Path) -> int | None:
    """k of an `epoch_<k>` directory name, else None."""
    m = _EPOCH_DIR.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunLayout:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    # -- the pipeline
    @property
    def config(self) -> Path:
        """The resolved config of the last invocation."""
        return self.root / "config.yaml"

    def marker(self, stage: str) -> Path:
        """Fingerprint + summary of a finished stage."""
        return self.root / f".stage_{stage}.json"

    @property
    def lock(self) -> Path:
        """Held by the pipeline's rank 0 while it runs (specforge/utils/run_lock.py)."""
        return self.root / ".lock"

    @property
    def rank_probe(self) -> Path:
        """Written by rank 0, read by every rank: is the run directory shared?"""
        return self.root / ".rank_probe"

    # -- data stage
    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def samples(self, split: str) -> Path:
        """`{"id", "input_ids", "loss_mask"}` rows of a split."""
        return self.data_dir / f"{split}.jsonl"

    def conversations(self, split: str) -> Path:
        """The clean conversations of a split (the evaluation's prompts come from `eval`)."""
        return self.data_dir / f"{split}.conversations.jsonl"

    @property
    def embedded_images(self) -> Path:
        """The images the data came with as bytes (data: URIs, table image columns), one file each."""
        return self.data_dir / "images"

    @property
    def quarantine(self) -> Path:
        return self.data_dir / "quarantine.jsonl"

    @property
    def data_report_md(self) -> Path:
        return self.data_dir / "report.md"

    @property
    def data_report_json(self) -> Path:
        return self.data_dir / "report.json"

    @property
    def vocab(self) -> Path:
        """d2t / t2d of the draft vocabulary."""
        return self.data_dir / "vocab.safetensors"

    # -- extract stage
    @property
    def extract_dir(self) -> Path:
        return self.root / "extract"

    def store(self, split: str) -> Path:
        """The hidden-state store of a split."""
        return self.extract_dir / split

    def extract_logs(self, rank_dir: str) -> Path:
        """The extraction servers' logs of one rank (`rank<r>of<N>`)."""
        return self.extract_dir / "logs" / rank_dir

    # -- train stage
    def checkpoint(self, epoch: int) -> Path:
        """The servable draft checkpoint of an epoch."""
        return self.root / f"epoch_{epoch}"

    def checkpoints(self) -> list[Path]:
        """Every `epoch_<k>/` of the run, by epoch."""
        found = [p for p in self.root.glob("epoch_*") if p.is_dir() and epoch_of(p) is not None]
        return sorted(found, key=epoch_of)

    @property
    def states_dir(self) -> Path:
        """Training states for resuming (train/state.py), beside the checkpoints."""
        return self.root / "state"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    # -- reports
    @property
    def report(self) -> Path:
        return self.root / "report.md"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    # -- eval stage
    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    @property
    def eval_report(self) -> Path:
        return self.eval_dir / "report.md"

    @property
    def eval_choice(self) -> Path:
        """{"epoch", "tree", "chain"}: what the last evaluation recommends shipping (the run report's
        commands that serve it; "chain" is the epoch's fastest chain, for vLLM, or null)."""
        return self.eval_dir / "ship.json"

    @property
    def planner(self) -> Path:
        """Every epoch x tree from the planner, the recommended one (eval.planner=true)."""
        return self.eval_dir / "planner.json"

    @property
    def cost_model(self) -> Path:
        """The round costs measured on this machine, per target x dtype x device x threads."""
        return self.eval_dir / "cost_model.json"

    @property
    def serving_dir(self) -> Path:
        """Results of the serving benchmark (eval.engine=server | sglang)."""
        return self.eval_dir / "serving"
