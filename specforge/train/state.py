"""Training state (optimizer, scheduler, RNG, position) lives beside the servable checkpoints, never
inside them. Written atomically; read with weights_only=True."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from specforge.utils.io import atomic_path

STATE_NAME = "training_state.pt"


def save_training_state(path: str | Path, optimizer, scheduler, **position) -> Path:
    path = Path(path) / STATE_NAME
    state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": list(random.getstate()[1]),
        **position,
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path


def load_training_state(path: str | Path) -> dict:
    return torch.load(Path(path) / STATE_NAME, map_location="cpu", weights_only=True)
