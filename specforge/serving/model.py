"""Loading `specforge serve`'s model: the target (+ an EAGLE3 draft checkpoint and its tree) as a
SpeculativeEngine, with the tokenizer, eos ids, hidden-state extractor and image processor that
the HTTP handler needs. Separate so that the engine thread and the tests load models the same way
without pulling in HTTP. Also what `serve` checks of a draft before it opens its port.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

_LOAD_LOCK = threading.Lock()


@dataclass
class LoadedModel:
    engine: object  # SpeculativeEngine
    tokenizer: object
    info: dict  # server_info fields: model_path, speculative_*, dtype, ...
    eos_token_ids: list[int]
    vocab_size: int
    max_context: int | None
    hidden_state_extractor: object = None  # EmbeddedExtractor when hidden states may be returned
    vl: tuple | None = None  # (image processor, VLInfo) of a vision-language target


def load_model(target_path, draft_path=None, tree: str | None = None, *, dtype: str = "bfloat16",
               device: str = "cpu", exact_ancestor_attention: bool = False, return_hidden_states: bool = False,
               aux_hidden_state_layer_ids=None, image_min_pixels: int | None = None,
               image_max_pixels: int | None = None) -> LoadedModel:
    """Target (+ draft checkpoint) as a streaming engine, with the tokenizer and the eos ids.
    `return_hidden_states`: answer `return_hidden_states` requests with the final post-norm
    states, or with the outputs of decoder layers `aux_hidden_state_layer_ids` concatenated.
    A vision-language target (by its config.json) loads with its image processor (pixel bounds:
    `image_*_pixels`, as data.image_*_pixels; None: the processor's own)."""
    import torch
    from transformers import AutoTokenizer

    from specforge.checkpoint import check_fits_target, load_draft, read_config
    from specforge.engine.tree import TreeSpec
    from specforge.targets.loader import (compute_dtype, from_pretrained_whole, model_class, stop_token_ids,
                                          text_config, torch_dtype)
    from specforge.targets.vl import is_vl_config, load_image_processor, vl_info

    if draft_path is not None and tree is None:
        raise ValueError("serve: a draft needs a tree T_K_N (e.g. --tree 8_2_16)")
    spec = TreeSpec.parse(tree) if draft_path is not None else None
    torch_type = compute_dtype(torch_dtype(dtype), device)  # float32 for bf16 on a CPU without it
    config_file = Path(target_path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    kind = config["model_type"] if is_vl_config(config) else "causal_lm"
    if kind != "causal_lm" and return_hidden_states:
        raise ValueError("hidden states of vision-language targets: use the embedded extract backend")
    with _LOAD_LOCK:  # from_pretrained's meta-device init is process-global: one load at a time
        target = from_pretrained_whole(model_class(kind), str(target_path), dtype=torch_type)
    target.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    draft = None
    if draft_path is not None:
        check_fits_target(read_config(draft_path), target.config, draft_path)
        draft = load_draft(draft_path, device=device, dtype=torch_type,
                           embed_tokens=target.get_input_embeddings().weight.detach())
    from specforge.engine.speculative import SpeculativeEngine

    engine = SpeculativeEngine(target, draft, spec or "1_1_2", exact_ancestor_attention=exact_ancestor_attention)
    if aux_hidden_state_layer_ids is not None and not return_hidden_states:
        raise ValueError("aux hidden states are returned through return_hidden_states: enable it too")
    hidden = None
    if return_hidden_states:
        from specforge.extract.embedded import EmbeddedExtractor

        # float32 rows: a bf16 target's values come back exactly, as SGLang's .tolist() gives them
        hidden = EmbeddedExtractor(target, list(aux_hidden_state_layer_ids or []), batch_tokens=1 << 30,
                                   storage_dtype=torch.float32)

    eos = stop_token_ids(target, tokenizer)
    info = {
        "model_path": str(target_path),
        "speculative_algorithm": "EAGLE3" if draft is not None else None,
        "speculative_draft_model_path": str(draft_path) if draft_path is not None else None,
        "speculative_num_steps": spec.steps if spec else None,
        "speculative_eagle_topk": spec.topk if spec else None,
        "speculative_num_draft_tokens": spec.num_draft_tokens if spec else None,
        "exact_ancestor_attention": exact_ancestor_attention,
        "enable_return_hidden_states": return_hidden_states,
        "enable_return_aux_hidden_states": aux_hidden_state_layer_ids is not None,
        "return_aux_hidden_state_layer_ids": list(aux_hidden_state_layer_ids) if aux_hidden_state_layer_ids is not None else None,
        "dtype": dtype,
        "device": device,
        "torch_num_threads": torch.get_num_threads(),
    }
    cfg = text_config(target.config)
    vl = None
    if kind != "causal_lm":
        vl = (load_image_processor(target_path, image_min_pixels, image_max_pixels), vl_info(target.config))
    return LoadedModel(engine, tokenizer, info, eos, cfg.vocab_size, getattr(cfg, "max_position_embeddings", None),
                       hidden, vl)


def check_draft_checkpoint(draft_path, target_path) -> None:
    """What `serve` checks before it listens: the checkpoint (checkpoint.read_checkpoint) and its fit
    with the target's config.json; a draft recorded for another target is only warned about.
    Raises CheckpointError (a ValueError) naming the file and the field."""
    from transformers import AutoConfig

    from specforge.checkpoint import CONFIG_NAME, check_fits_target, read_checkpoint
    from specforge.targets.loader import target_fingerprint

    cfg, _ = read_checkpoint(draft_path, weights=False)  # loading reads the weights later
    try:
        target_config = AutoConfig.from_pretrained(str(target_path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{Path(target_path) / CONFIG_NAME}: cannot be read as a model config ({e})") from None
    check_fits_target(cfg, target_config, draft_path, target_fingerprint(target_path), allow_other_target=True)
