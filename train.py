"""Entry point: `python train.py +exp=smollm2_weather [stages=[data,extract]] [key=value ...]`.

Also the entry of every process of a distributed run: `torchrun --nproc_per_node N train.py ...`,
`srun python train.py ...` or `python train.py -m ... hydra/launcher=slurm` (docs/multinode.md).
A run stopped by SIGTERM/SIGUSR1 saves a training state and exits with code 75; run the same
command with train.resume=auto to continue it. A refused input (a setting, data file, checkpoint)
prints `train.py: error: ...` and exits with code 2; a crash keeps its traceback (exit code 1).
What runs but maybe not as meant prints one line, `train.py: warning: ...`.
"""
import os
import sys

if __name__ == "__main__":  # first: re-executes once with mimalloc (SPECFORGE_ALLOCATOR=system: glibc's)
    from specforge.utils.allocator import preload_mimalloc

    preload_mimalloc()

import hydra

from specforge.cli_args import quote_trees
from specforge.config import register_configs

register_configs()
sys.argv = quote_trees(sys.argv)  # T_K_N trees stay text (see cli_args)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg) -> None:
    from specforge.distributed.preemption import TrainingInterrupted
    from specforge.errors import InputError, exit_refused, plain_warnings
    from specforge.pipeline import run_pipeline

    plain_warnings("train.py")
    try:
        run_pipeline(cfg)
    except InputError as e:  # a setting, file or checkpoint refused: its message says which
        exit_refused(e, "train.py")
    except TrainingInterrupted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"[train] {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
