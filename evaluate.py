"""Measure checkpoints: `python evaluate.py ckpt=outputs/<run>/epoch_3` (one) or
`python evaluate.py ckpt=outputs/<run>` (every epoch), with any `eval.*` override, e.g.
`eval.trees=[5_1_6,8_2_16] eval.num_prompts=32`. The target and data come from the run's config."""

import sys

import hydra
from omegaconf import OmegaConf

from specforge.cli_args import quote_trees
from specforge.config import Config, register_configs

register_configs()
sys.argv = quote_trees(sys.argv)  # T_K_N trees stay text (see cli_args)


@hydra.main(version_base=None, config_path="conf", config_name="evaluate")
def main(cfg) -> None:
    from specforge.eval.run import find_checkpoints
    from specforge.eval.stage import evaluate

    run_dir, _ = find_checkpoints(cfg.ckpt)
    saved = run_dir / "config.yaml"
    if not saved.exists():
        raise FileNotFoundError(f"{saved}: the run's resolved config is needed to know its target and data")
    run_cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(saved))
    run_cfg.output_dir, run_cfg.run_name = str(run_dir.parent), run_dir.name
    evaluate(run_cfg, cfg.ckpt, cfg.eval, cfg.out_dir)


if __name__ == "__main__":
    main()
