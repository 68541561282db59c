"""Entry point: `python train.py +exp=smollm2_weather [stages=[data,extract]] [key=value ...]`."""
import hydra

from specforge.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg) -> None:
    from specforge.pipeline import run_pipeline

    run_pipeline(cfg)


if __name__ == "__main__":
    main()
