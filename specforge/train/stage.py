"""Pipeline stage `train`: the EAGLE3 head from the extracted hidden states."""
from pathlib import Path

from specforge import distributed as dist
from specforge.train.loop import train


def run(cfg, run_dir: Path, fingerprint: str) -> dict:
    """`fingerprint`: this stage's, from the pipeline (its training states carry it)."""
    summary = train(cfg, run_dir, fingerprint)
    if dist.current().is_main:
        from specforge.run_report import write_run_report

        write_run_report(run_dir)
    return summary
