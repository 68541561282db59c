"""Pipeline stage `train`: the EAGLE3 head from the extracted hidden states."""
from pathlib import Path

from specforge.checkpoint import read_config
from specforge.targets.loader import aux_layer_ids, local_target_config
from specforge.train.loop import check_init_from, train


def check(cfg) -> None:
    """The pipeline's check before its first stage: a draft to fine-tune (draft.init_from) that
    cannot go on in this run (another target, other layers or options) is refused now, not after
    the data and extract stages."""
    if not cfg.draft.init_from or (target_config := local_target_config(cfg.target)) is None:
        return  # nothing to fine-tune, or a target still to fetch: build_draft checks it then
    check_init_from(cfg, read_config(cfg.draft.init_from), aux_layer_ids(cfg.target, target_config), target_config)


def run(cfg, run_dir: Path, fingerprint: str) -> dict:
    """`fingerprint`: this stage's, from the pipeline (its training states carry it; the pipeline
    writes the run's report once this stage's summary is recorded)."""
    return train(cfg, run_dir, fingerprint)
