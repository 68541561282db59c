"""Pipeline stage `train`: the EAGLE3 head from the extracted hidden states."""
from pathlib import Path

from specforge.train.loop import train


def run(cfg, run_dir: Path, fingerprint: str) -> dict:
    """`fingerprint`: this stage's, from the pipeline (its training states carry it; the pipeline
    writes the run's report once this stage's summary is recorded)."""
    return train(cfg, run_dir, fingerprint)
