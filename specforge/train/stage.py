"""Pipeline stage `train`: the EAGLE3 head from the extracted hidden states."""
from pathlib import Path

from specforge import distributed as dist
from specforge.checkpoint import read_config
from specforge.run_layout import RunLayout
from specforge.targets.loader import aux_layer_ids, local_target_config
from specforge.train.loop import check_batch_shape, check_init_from, fresh_draft_config, train
from specforge.utils.io import read_json


def check(cfg) -> None:
    """The pipeline's check before its first stage: a draft this run cannot train (a geometry the
    target's embedding or the data's lengths do not fit; a draft.init_from of another target, other
    layers or options) is refused now, not after the data and extract stages."""
    if (target_config := local_target_config(cfg.target)) is None:
        return  # a target still to fetch: preflight asks once the data stage has fetched it
    ids = aux_layer_ids(cfg.target, target_config)
    if cfg.draft.init_from:
        check_init_from(cfg, read_config(cfg.draft.init_from), ids, target_config)
    else:
        fresh_draft_config(cfg, target_config, ids, cfg.draft.draft_vocab_size)


def preflight(cfg, run_dir) -> str | None:
    """The checks that need the data stage's output, run once it is final (before the extract
    stage spends its hours; check_only too): `check` again (a fetched target is here now) and the
    batch against the training split's sample count and longest sample (and, unpacked, this run's
    processes: check_only on a login node counts one). -> the epoch's steps, where known."""
    check(cfg)
    marker = RunLayout(Path(run_dir)).marker("data")
    split = (read_json(marker).get("summary") or {}).get("train") or {} if marker.exists() else {}
    if "samples" not in split or "max_tokens" not in split:  # a data stage of an older version
        return None
    tc, world = cfg.train, dist.current().world_size
    steps = check_batch_shape(tc, split["samples"], split["max_tokens"], world)
    if steps is None:  # packed: the rows are known once packed
        return None
    return (f"{split['samples']} training samples: {steps} optimizer steps per epoch x {tc.epochs} epochs, a global "
            f"batch of {tc.batch_size * tc.grad_accum * world} samples on {world} process{'es' * (world > 1)}")


def run(cfg, run_dir: Path, fingerprint: str, split_free: str | None = None) -> dict:
    """`fingerprint`: this stage's, from the pipeline (its training states carry it; the pipeline
    writes the run's report once this stage's summary is recorded); `split_free`: the same without
    train.grad_accum (a state resumes a run that splits the same global batch otherwise)."""
    return train(cfg, run_dir, fingerprint, split_free)
