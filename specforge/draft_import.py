"""A draft trained elsewhere, written as our checkpoint: `specforge import-draft SRC DST --target T`.

Why: measuring another trainer's draft with our engine on the same prompts as ours
(`python evaluate.py ckpt=DST out_dir=...`) or fine-tuning it (`draft.init_from=DST`) needs a
checkpoint our strict reader accepts, meaning exactly what a server makes of the original. What a
layout leaves implicit is filled in as the server fills it, never guessed:
- SpecForge / the EAGLE repository (`LlamaForCausalLMEagle3`): without `eagle_config` ids SGLang
  captures its default layers, our [1, N//2-1, N-4]; ids it takes as layer inputs (DeepSeek-style
  targets whose first id is not 1) become ours minus one (docs/contract.md §2); `target_hidden_size`
  defaults to `hidden_size` and `head_dim` to hidden / heads, as the servers read them; RoPE from
  `rope_parameters` over `rope_theta` unless `rope_scaling` is set (transformers 5's order);
  `draft_vocab_size: null` drafts with the target's lm_head over the whole vocab (SGLang's
  load_lm_head_from_target, e.g. nvidia/gpt-oss-120b-Eagle3); weights in model.safetensors or
  pytorch_model.bin.
- vLLM's speculators (`speculators_model_type: eagle3`): the Llama layer's config under
  `transformer_layer_config`, ids in vLLM's numbering (ours + 1; ids our layout cannot give SGLang,
  e.g. ours not starting at 1 on a DeepSeek-style target, are refused), `layers.0.*` names
  (specforge/speculators_format.py); a sliding window (`layer_types`) stays in config.json for vLLM,
  with a warning (SGLang has none). Checked on what speculators 0.9.0's save_pretrained writes.
- `norm_before_residual: true` (vLLM's residual after hidden_norm) has no SGLang form and is refused.
- `t2d` is rebuilt from `d2t`; a reduced vocab without `d2t` is refused (a server would read its
  draft ids as target ids). Where `target_hidden_size == hidden_size` the embedding is the target's,
  as SGLang serves it (set_embed; read from the target's weights): a file's own trained one is
  replaced, with a warning (vLLM would keep it).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from specforge.checkpoint import (CONFIG_NAME, WEIGHTS_NAME, check_fits_target, read_config_json, save_checkpoint,
                                  validate_config, validate_tensors, validate_vocab)
from specforge.errors import SpecForgeWarning
from specforge.models.draft import ARCHITECTURE, VLLM_IDS_KEY, Eagle3Draft
from specforge.speculators_format import from_speculators, options_of
from specforge.targets.loader import (SGLANG_FIRST_ID_ONE, default_aux_layer_ids, deepstack_layers, sglang_adds_one,
                                      text_config)
from specforge.targets.vl import is_vl_config


def import_draft(src: str | Path, dst: str | Path, target_cfg) -> Path:
    """Write the draft in directory `src` as our checkpoint `dst`, checked against the target of
    `target_cfg` (a TargetConfig: path, kind, trust_remote_code)."""
    from transformers import AutoConfig

    from specforge.targets.loader import resolve_target_path

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst}: exists; give a new directory")
    config, where = read_config_json(src), src / CONFIG_NAME
    tensors, weights_path = _read_weights(src)
    target_config = AutoConfig.from_pretrained(resolve_target_path(target_cfg),
                                               trust_remote_code=bool(target_cfg.trust_remote_code))
    speculators = config.get("speculators_model_type") is not None
    if speculators:
        config, tensors = _speculators_layout(config, tensors, where)
    elif config.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"{where}: architectures {config.get('architectures')!r}: not an EAGLE-3 draft "
                         f"([{ARCHITECTURE!r}], or a speculators config with speculators_model_type eagle3)")
    # SGLang's llama_eagle3: a null (not absent) draft_vocab_size loads the target's lm_head (sglang #9739)
    head_from_target = not speculators and "draft_vocab_size" in config and config["draft_vocab_size"] is None
    config = _as_served(config, target_config, where, sglang_ids=not speculators)
    if head_from_target and "d2t" in tensors and (len(tensors["d2t"]) != config["vocab_size"]
                                                  or bool(tensors["d2t"].any())):
        raise ValueError(f"{weights_path}: d2t maps a reduced vocab, but {where} has draft_vocab_size null: SGLang "
                         "then drafts with the target's whole lm_head, and d2t must be the identity")
    tensors = _vocab_maps(config, tensors, where)
    tensors = _served_embedding_and_head(config, tensors, target_cfg, src, weights_path, head_from_target)
    # the checkpoint reader's checks, on the source's names
    cfg = validate_config(config, str(where))
    validate_tensors(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, str(weights_path))
    validate_vocab(tensors["d2t"], tensors["t2d"], str(weights_path))
    check_fits_target(cfg, target_config, src)
    draft = Eagle3Draft(cfg)
    draft.load_state_dict(tensors, strict=True)
    return save_checkpoint(draft, dst, dtype=tensors["fc.weight"].dtype)  # the source's precision


def _read_weights(src: Path) -> tuple[dict[str, torch.Tensor], Path]:
    from safetensors.torch import load_file

    if (src / WEIGHTS_NAME).is_file():
        return load_file(src / WEIGHTS_NAME), src / WEIGHTS_NAME
    if (src / "pytorch_model.bin").is_file():  # the EAGLE repository's releases
        state = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return dict(state), src / "pytorch_model.bin"
    raise FileNotFoundError(f"{src}: neither {WEIGHTS_NAME} nor pytorch_model.bin")


def _speculators_layout(config: dict, tensors: dict, where: Path) -> tuple[dict, dict]:
    """Its config and tensors in SGLang's layout (vLLM reads the same draft this way: docs/contract.md §7b)."""
    if config["speculators_model_type"] != "eagle3":
        raise ValueError(f"{where}: speculators_model_type {config['speculators_model_type']!r}: only eagle3 "
                         "drafts have SGLang's EAGLE-3 layout")
    try:
        options = options_of(config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    layer = dict(config.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: transformer_layer_config.model_type {layer.get('model_type')!r}: vLLM serves it "
                         "with its own layer (e.g. Qwen3's q/k norms); SGLang's EAGLE-3 layer is Llama's")
    if "sliding_attention" in (layer.get("layer_types") or []):  # kept in config.json: vLLM applies it
        warnings.warn(f"{where}: the draft attends within a sliding window of {layer.get('sliding_window')} tokens "
                      "(as speculators trained it and vLLM serves it); SGLang and our engine attend to the whole "
                      "context, the same numbers on shorter ones", category=SpecForgeWarning, stacklevel=2)
    ours = {**layer, **options, "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "draft_vocab_size": config.get("draft_vocab_size"), "tie_word_embeddings": False}
    if config.get("target_hidden_size") is not None:
        ours["target_hidden_size"] = config["target_hidden_size"]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:  # vLLM's numbering: the input of layer L is the output of our layer L - 1
        ours["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in ids],
                                "use_aux_hidden_state": True}
    try:
        return ours, from_speculators(tensors)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _as_served(config: dict, target_config, where: Path, sglang_ids: bool) -> dict:
    """The keys a server assumes when they are absent, written out; ids as SGLang captures them
    (`sglang_ids`: the file's ids are SGLang's; else they are ours already, from vLLM's)."""
    config = dict(config)
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    config.setdefault("target_hidden_size", hidden)
    config.setdefault("tie_word_embeddings", False)
    rope = config.pop("rope_parameters", None)  # transformers 5 writes RoPE as one dict
    if isinstance(rope, dict):
        # transformers 5 (what servers parse configs with) reads rope_parameters over a top-level
        # rope_theta, unless rope_scaling is set: then rope_scaling replaces rope_parameters
        scaled = bool(config.get("rope_scaling"))
        if rope.get("rope_theta") is not None and not (scaled and "rope_theta" in config):
            config["rope_theta"] = rope["rope_theta"]
        rest = {k: v for k, v in rope.items() if k != "rope_theta"}
        if not scaled and (rest.get("rope_type", rest.get("type", "default")) != "default" or "mrope_section" in rest):
            config["rope_scaling"] = rest
    config.setdefault("rope_theta", 10000.0)  # LlamaConfig's default: what a server reads then
    if config.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        config["head_dim"] = hidden // heads
    if config.get("draft_vocab_size") is None:  # servers take the whole vocab then
        config["draft_vocab_size"] = config.get("vocab_size")
    eagle = dict(config.get("eagle_config") or {})
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    valid = isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)
    if valid and not sglang_adds_one(target_config, ids):
        arch = target_config.architectures[0]
        if not sglang_ids:  # ours already (vLLM's minus one): SGLang would read them one layer early
            rule = "only when the first id is 1" if arch in SGLANG_FIRST_ID_ONE else "only when the last id is " \
                f"below its layer count {text_config(target_config).num_hidden_layers}"
            raise ValueError(
                f"{where}: eagle_aux_hidden_state_layer_ids {[i + 1 for i in ids]} (vLLM's numbering: the outputs "
                f"of layers {ids}): SGLang serves a {arch} target's draft the output of layer L for id L {rule}; "
                f"otherwise it reads each id as a layer's input, one layer earlier than the draft was trained on, "
                "so our checkpoint cannot give SGLang these layers (docs/contract.md §2); vLLM serves the "
                "original as it is")
        # SGLang takes these ids as layer inputs for this target (docs/contract.md §2): ours are one lower
        eagle["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
        config.pop(VLLM_IDS_KEY, None)  # rewritten from them on save
    if not ids:
        if config.get(VLLM_IDS_KEY):
            raise ValueError(f"{where}: {VLLM_IDS_KEY} {config[VLLM_IDS_KEY]} at the top level only: SGLang ignores "
                             "it (its default layers) where vLLM reads it (layer inputs); add eagle_config's ids, "
                             "the outputs of the layers the draft was trained on (docs/contract.md §2)")
        if is_vl_config(target_config):
            raise ValueError(f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids: for a vision-language "
                             "target SGLang has no default layers (docs/contract.md §1); add the ids the draft "
                             "was trained on")
        n = text_config(target_config).num_hidden_layers
        first = max(1, deepstack_layers(target_config))
        eagle["eagle_aux_hidden_state_layer_ids"] = default_aux_layer_ids(n, first=first)
    eagle.setdefault("use_aux_hidden_state", True)
    config["eagle_config"] = eagle  # a top-level key beside it must agree (the reader checks)
    return config


def _vocab_maps(config: dict, tensors: dict, where: Path) -> dict:
    """d2t (draft id -> target id offset) and t2d as our reader wants them."""
    tensors = dict(tensors)
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
    if not (isinstance(vocab, int) and isinstance(draft_vocab, int) and 0 < draft_vocab <= vocab):
        raise ValueError(f"{where}: vocab_size {vocab!r} and draft_vocab_size {draft_vocab!r} must be positive "
                         "integers, the draft's no larger")
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise ValueError(f"{where}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but the weights have "
                             "no d2t: a server would read its draft ids as target ids")
        tensors["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    d2t = tensors["d2t"].to(torch.int64)
    target_ids = torch.arange(len(d2t)) + d2t
    if len(d2t) != draft_vocab or (len(d2t) and (target_ids.min() < 0 or target_ids.max() >= vocab)):
        raise ValueError(f"{where}: d2t has {len(d2t)} entries for draft_vocab_size {draft_vocab}, mapping to target "
                         f"ids [{int(target_ids.min())}, {int(target_ids.max())}] of a vocab of {vocab}")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    tensors.update(d2t=d2t, t2d=t2d)
    return tensors


def _served_embedding_and_head(config: dict, tensors: dict, target_cfg, src: Path, weights_path: Path,
                               head_from_target: bool) -> dict:
    """embed_tokens (and, with `head_from_target`, lm_head) as SGLang serves them: the target's
    wherever the widths match (set_embed / set_embed_and_head), so that our engine evaluates what
    SGLang serves."""
    from specforge.targets.loader import load_embedding_and_head

    tensors = dict(tensors)
    width, target_width = config["hidden_size"], config["target_hidden_size"]
    if target_width != width:
        if "embed_tokens.weight" not in tensors:
            raise ValueError(f"{src}: no embed_tokens.weight, and the target's embedding is {target_width} wide "
                             f"where the draft's is {width}")
        if head_from_target:
            raise ValueError(f"{src / CONFIG_NAME}: draft_vocab_size null: SGLang gives the draft the target's "
                             f"lm_head, {target_width} wide where the draft's is {width}")
        return tensors
    embed, head, _ = load_embedding_and_head(target_cfg)
    theirs = tensors.get("embed_tokens.weight")
    if theirs is None or not _same(theirs, embed, head.dtype):
        if theirs is not None:
            warnings.warn(f"{weights_path}: embed_tokens.weight is not the target's embedding: SGLang serves the "
                          "draft with the target's (target_hidden_size == hidden_size), which is written and "
                          "evaluated; vLLM would have kept the draft's own", category=SpecForgeWarning, stacklevel=3)
        tensors["embed_tokens.weight"] = embed
    if head_from_target:
        warnings.warn(f"{src / CONFIG_NAME}: draft_vocab_size null: SGLang drafts with the target's lm_head over "
                      f"the whole vocab ({config['vocab_size']}), which is written as lm_head.weight"
                      + (" in place of the file's own" if "lm_head.weight" in tensors else ""),
                      category=SpecForgeWarning, stacklevel=3)
        tensors["lm_head.weight"] = head
    return tensors


def _same(theirs: torch.Tensor, target: torch.Tensor, target_dtype: torch.dtype) -> bool:
    """Whether a file's tensor is the target's, at the coarser of the two precisions (a bf16 copy of
    an fp32 target's weights is the target's)."""
    coarse = target_dtype if torch.finfo(target_dtype).eps > torch.finfo(theirs.dtype).eps else theirs.dtype
    return theirs.shape == target.shape and torch.equal(theirs.to(coarse), target.to(coarse))
