"""Drafts trained by vLLM's `speculators` (its EAGLE-3 model) in our checkpoint layout, and back.

Why: to evaluate such a draft with our engine (SGLang's semantics) it must be an exact copy of the
same function under our names. The two layouts differ only in names and in what is saved:
- its single decoder layer is `layers.0.*`, ours (SGLang's spelling) `midlayer.*`;
- it carries the target's final norm and pruned head for its loss (`verifier_norm.weight`,
  `verifier_lm_head.weight`), which a served draft does not have; its own save drops them too.
Every other tensor (fc, the EAGLE 3.1 norms, norm, lm_head, embed_tokens, d2t, t2d) has the same
name, shape and meaning, so the mapping is a rename and the round trip is bit-identical.

Only drafts our layout can express convert: one decoder layer, and the residual of that layer
taken before `hidden_norm` (`norm_before_residual: false`), as SGLang's llama_eagle3 computes it
(docs/contract.md §3). speculators' own default is `norm_before_residual: true`.
"""
from __future__ import annotations

import torch

from specforge.config import EAGLE31_OPTIONS

LAYER_PREFIX = ("layers.0.", "midlayer.")
TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")
# vLLM's llama_eagle3 reads the key from any config.json: our reader refuses it too (checkpoint.py)
NORM_BEFORE_RESIDUAL = ("norm_before_residual: true (speculators' default) takes the layer's residual after "
                        "hidden_norm; SGLang's llama_eagle3 takes it before, so such a draft does not convert exactly: "
                        "train it with --no-norm-before-residual")


def from_speculators(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Its state dict (or saved weights) -> our tensor names; the training-only tensors are left out."""
    theirs, ours = LAYER_PREFIX
    out = {}
    for name, tensor in state.items():
        if name in TRAINING_ONLY:
            continue
        if name.startswith("layers.") and not name.startswith(theirs):
            raise ValueError(f"{name}: a draft with more than one decoder layer has no SGLang EAGLE-3 layout")
        out[ours + name[len(theirs):] if name.startswith(theirs) else name] = tensor
    return out


def to_speculators(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensor names -> its (what its save writes: no training-only tensors)."""
    theirs, ours = LAYER_PREFIX
    return {theirs + name[len(ours):] if name.startswith(ours) else name: t for name, t in tensors.items()}


def options_of(config: dict) -> dict[str, bool]:
    """The EAGLE 3.1 options of its config.json (an `Eagle3SpeculatorConfig` as a dict), after
    refusing what our layout cannot express."""
    layers = config.get("transformer_layer_config", {}).get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"transformer_layer_config.num_hidden_layers: {layers}; our layout (SGLang's "
                         "llama_eagle3) has exactly one decoder layer")
    if config.get("norm_before_residual", False):
        raise ValueError(NORM_BEFORE_RESIDUAL)
    return {key: bool(config.get(key) or False) for key in EAGLE31_OPTIONS}
