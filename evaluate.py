"""Measure checkpoints: `python evaluate.py ckpt=outputs/<run>/epoch_3` (one) or
`python evaluate.py ckpt=outputs/<run>` (every epoch, or `eval.epochs=[5,10]`), with any `eval.*` override, e.g.
`eval.trees=[5_1_6,8_2_16] eval.num_prompts=32`. The target and data come from the run's config."""

import sys

if __name__ == "__main__":  # first: re-executes once with mimalloc (SPECFORGE_ALLOCATOR=system: glibc's)
    from specforge.utils.allocator import preload_mimalloc

    preload_mimalloc()

import hydra

from specforge.cli_args import quote_trees
from specforge.config import register_configs

register_configs()
sys.argv = quote_trees(sys.argv)  # T_K_N trees stay text (see cli_args)


@hydra.main(version_base=None, config_path="conf", config_name="evaluate")
def main(cfg) -> None:
    from omegaconf import OmegaConf

    from specforge.errors import InputError, InvalidInput, exit_refused, plain_warnings
    from specforge.eval.engine_eval import find_checkpoints, load_run_config
    from specforge.eval.stage import check_eval, run_evaluation

    plain_warnings("evaluate.py")
    try:
        if OmegaConf.is_missing(cfg, "ckpt"):
            raise InvalidInput("ckpt: missing; name a checkpoint or a run: python evaluate.py ckpt=outputs/<run>[/epoch_<k>]")
        check_eval(cfg.eval)  # before anything is read or loaded
        run_dir, _ = find_checkpoints(cfg.ckpt)
        run_evaluation(load_run_config(run_dir), cfg.ckpt, cfg.eval, cfg.out_dir)
    except InputError as e:  # the message names the setting or file; exit code 2, no traceback
        exit_refused(e, "evaluate.py")


if __name__ == "__main__":
    main()
