"""A tiny evaluation run (a run directory as the pipeline leaves it, without training) for the
evaluation tests and the `--tiny` smoke runs of the planner's benchmarks. It lives above
checkpoint/, models/ and targets/ (it writes a draft checkpoint of a tiny target), hence in eval/."""
from __future__ import annotations

from pathlib import Path


def build_tiny_run(run: str | Path, target_dir: str | Path, num_prompts: int = 3, random_draft: bool = True) -> Path:
    """A run directory as the pipeline leaves it, without training: config.yaml naming the tiny
    target, `num_prompts` held-out weather conversations and (`random_draft`) one random draft
    checkpoint `epoch_1` (seed 0)."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    from specforge.checkpoint import save_checkpoint
    from specforge.models.draft import Eagle3Config, Eagle3Draft
    from specforge.utils.io import write_jsonl

    run = Path(run)
    run.mkdir(parents=True)
    spec = {"name": "tiny", "path": str(target_dir), "dtype": "float32", "aux_layer_ids": [0, 1, 2]}
    OmegaConf.save(OmegaConf.create({"run_name": "tiny", "target": spec}), run / "config.yaml")
    write_jsonl(run / "data" / "eval.conversations.jsonl", [
        {"id": f"e{i}", "messages": [{"role": "user", "content": f"What is the weather in city {i}?"},
                                     {"role": "assistant", "content": "sunny"}]} for i in range(num_prompts)])
    if random_draft:
        torch.manual_seed(0)
        draft = Eagle3Draft(Eagle3Config.from_target(AutoConfig.from_pretrained(target_dir), [0, 1, 2]))
        save_checkpoint(draft, run / "epoch_1", dtype=torch.float32)
    return run
