"""Targets for benchmarks: a checkpoint directory, or random weights at the geometry of a config
(benchmarks/targets/<name>/config.json). A GPU machine can neither download nor receive an 8B
checkpoint, but its throughput depends on the shapes alone, so it builds one there from the config."""
from __future__ import annotations

from pathlib import Path

import torch


def random_target(config_dir: str | Path, dtype: str = "bfloat16", device: str | torch.device = "cpu"):
    """The causal LM of `config_dir`/config.json with random weights, built on `device` in `dtype`
    (where the device computes in it: compute_dtype), in eval mode without gradients."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specforge.targets.loader import compute_dtype, torch_dtype

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype(torch_dtype(dtype), torch.device(device)))
    return model.eval().requires_grad_(False)


def load_any(model_dir: str | Path | None, config_dir: str | Path | None, dtype: str, device: str):
    """A checkpoint (`model_dir`) or random weights at a geometry (`config_dir`) -> (model, name)."""
    if config_dir:
        return random_target(config_dir, dtype, device), f"{Path(config_dir).name} (random weights)"
    from omegaconf import OmegaConf

    from specforge.config import TargetConfig
    from specforge.targets.loader import load_target

    tcfg = OmegaConf.structured(TargetConfig(name="bench", path=str(model_dir), dtype=dtype))
    return load_target(tcfg, device), Path(model_dir).name


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
