"""The one writer, reader and validator of draft checkpoints (docs/contract.md §1).

SGLang reports none of the ways a checkpoint can be wrong: unknown names are dropped, missing ones
stay random, a reduced vocab without d2t is read as target ids. So we validate strictly on both
write and read and say exactly what is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specforge.config import check_eagle31_options
from specforge.errors import InvalidInput
from specforge.models.draft import ARCHITECTURE, VLLM_IDS_KEY, Eagle3Config, Eagle3Draft, vllm_layer_ids
from specforge.speculators_format import NORM_BEFORE_RESIDUAL
from specforge.targets.layers import check_aux_layer_ids
from specforge.targets.loader import deepstack_layers, text_config
from specforge.targets.vl import is_vl_config
from specforge.utils.io import atomic_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
OPTIONAL_KEYS = {"embed_tokens.weight"}
# config.json: the target the draft was trained for ({fingerprint, name, num_hidden_layers}).
# SGLang and vLLM read config.json into a transformers config, which keeps unknown keys unused.
TARGET_KEY = "specforge_target"


class CheckpointError(InvalidInput):
    """A checkpoint that cannot be read, written or served with this target."""


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attn = "midlayer.self_attn"
    eagle31 = {}  # the input norms of EAGLE 3.1, only when enabled
    if cfg.norm_before_fc:
        eagle31["input_norm.weight"] = (3 * cfg.target_hidden_size,)
    if cfg.fc_norm:
        eagle31.update({f"fc_norm.{j}.weight": (cfg.target_hidden_size,) for j in range(3)})
    return {
        **eagle31,
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        f"{attn}.q_proj.weight": (cfg.num_attention_heads * d, 2 * h),
        f"{attn}.k_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        f"{attn}.v_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        f"{attn}.o_proj.weight": (h, cfg.num_attention_heads * d),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, h),
    }


def validate_config(d: dict, where: str = CONFIG_NAME) -> Eagle3Config:
    def fail(msg):
        raise CheckpointError(f"{where}: {msg}")

    if d.get("architectures") != [ARCHITECTURE]:
        fail(f"architectures must be [{ARCHITECTURE!r}] (SGLang picks the class from it), "
             f"got {d.get('architectures')!r}")
    if d.get("model_type") != "llama":
        fail(f"model_type must be 'llama', got {d.get('model_type')!r}")
    if d.get("num_hidden_layers") != 1:
        fail(f"num_hidden_layers must be 1, got {d.get('num_hidden_layers')!r}")
    if d.get("tie_word_embeddings") is not False:
        fail("tie_word_embeddings must be false (true breaks the draft lm_head on reload)")
    if d.get("norm_before_residual"):  # vLLM would serve another layer than SGLang and our engine
        fail(NORM_BEFORE_RESIDUAL)
    for key in ("vocab_size", "draft_vocab_size", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "target_hidden_size"):
        if not isinstance(d.get(key), int) or d[key] <= 0:
            fail(f"{key} must be a positive integer, got {d.get(key)!r}")
    theta = d.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        # absent, our reader would take 10000 where a server reads the key (or rope_parameters)
        fail(f"rope_theta must be a positive number, got {d.get('rope_theta')!r}")
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and params["rope_theta"] != theta \
            and not d.get("rope_scaling"):  # transformers 5 (what servers parse configs with) reads rope_parameters
        fail(f"rope_theta {theta!r} and rope_parameters.rope_theta {params['rope_theta']!r} disagree: a server "
             "reading it with transformers 5 takes the second, our engine the first; keep one")
    if d["draft_vocab_size"] > d["vocab_size"]:
        fail(f"draft_vocab_size {d['draft_vocab_size']} > vocab_size {d['vocab_size']}")
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    try:  # the target's layer count is not recorded here: the engine checks the range on loading
        check_aux_layer_ids(ids, what="eagle_config.eagle_aux_hidden_state_layer_ids", count=3, min_id=None,
                            hint=" (any 3 ascending ids: their range is checked against the target when it is loaded)")
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if VLLM_IDS_KEY in d and d[VLLM_IDS_KEY] != vllm_layer_ids(ids):
        fail(f"{VLLM_IDS_KEY} (top level, vLLM's numbering: id L is the input of layer L) must be "
             f"eagle_config's ids + 1 = {vllm_layer_ids(ids)}, got {d[VLLM_IDS_KEY]!r}: vLLM would feed the "
             "draft other layers than SGLang reads and the draft was trained on (docs/contract.md §2)")
    if (d.get("eagle_config") or {}).get("use_aux_hidden_state") is not True:
        fail("eagle_config.use_aux_hidden_state must be true")
    try:
        check_eagle31_options(d)
        return Eagle3Config.from_json_dict(d)  # its own checks: attention heads, M-RoPE sections
    except ValueError as e:
        fail(str(e))


def validate_tensors(cfg: Eagle3Config, shapes: dict[str, tuple], where: str = WEIGHTS_NAME) -> None:
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(shapes) - OPTIONAL_KEYS)
    unknown = sorted(set(shapes) - set(want))
    wrong = [f"{k}: {tuple(shapes[k])} != expected {want[k]}"
             for k in sorted(set(want) & set(shapes)) if tuple(shapes[k]) != want[k]]
    problems = ([f"missing weights {missing}"] if missing else []) + \
               ([f"unknown weights {unknown} (a server would silently ignore them)"] if unknown else []) + wrong
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def validate_vocab(d2t: torch.Tensor, t2d: torch.Tensor, where: str = WEIGHTS_NAME) -> None:
    """d2t must map draft ids to strictly increasing target ids that are exactly the set t2d marks."""
    if d2t.dtype != torch.int64:
        raise CheckpointError(f"{where}: d2t must be int64, got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise CheckpointError(f"{where}: t2d must be bool, got {t2d.dtype}")
    target_ids = torch.arange(len(d2t)) + d2t
    if len(target_ids) and (target_ids.min() < 0 or target_ids.max() >= len(t2d)):
        raise CheckpointError(f"{where}: d2t maps draft ids outside the target vocab [0, {len(t2d)})")
    if len(target_ids) > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise CheckpointError(f"{where}: d2t target ids must be strictly increasing (sorted, no repeats)")
    if int(t2d.sum()) != len(d2t) or not bool(t2d[target_ids].all()):
        raise CheckpointError(f"{where}: t2d does not mark exactly the {len(d2t)} target ids of d2t")


def save_checkpoint(draft: Eagle3Draft, out_dir: str | Path, dtype=torch.bfloat16) -> Path:
    """Write a directory SGLang can serve as-is; validated before anything is renamed into place."""
    cfg_dict = draft.config.to_json_dict()
    cfg = validate_config(cfg_dict)
    tensors = {}
    for name, t in draft.state_dict().items():
        t = t.detach().cpu()
        tensors[name] = t if name in ("d2t", "t2d") else t.to(dtype)
    validate_tensors(cfg, {k: tuple(v.shape) for k, v in tensors.items()})
    validate_vocab(tensors["d2t"], tensors["t2d"])
    out_dir = Path(out_dir)
    broken = [name for name, t in sorted(tensors.items()) if t.is_floating_point() and not torch.isfinite(t).all()]
    if broken:  # a server would load it and draft nothing
        raise CheckpointError(f"{out_dir}: not written: {', '.join(broken)} hold inf/nan (training diverged)")
    with atomic_dir(out_dir) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, tmp / WEIGHTS_NAME,
                  metadata={"format": "pt"})
    return out_dir


def read_config_json(path: str | Path) -> dict:
    """The config.json of a draft directory as a dict (a JSON object), not yet validated."""
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path}: missing (a checkpoint is config.json + model.safetensors)")
    try:
        cfg_dict = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(cfg_dict, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object")
    return cfg_dict


def read_config(path: str | Path) -> Eagle3Config:
    """The validated config.json of a checkpoint directory, without reading its weights."""
    return validate_config(read_config_json(path), str(Path(path) / CONFIG_NAME))


def read_checkpoint(path: str | Path, weights: bool = True) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Config and tensors of a checkpoint directory, validated. weights=False: the same checks from
    the file's header and d2t/t2d alone (returned as the only tensors), for a check before work
    that does not read the weights a load reads again."""
    path = Path(path)
    weights_path = path / WEIGHTS_NAME
    cfg = read_config(path)
    if not weights_path.exists():
        raise CheckpointError(f"{weights_path}: missing (a checkpoint is config.json + model.safetensors)")

    def read(names=None):
        try:
            with safe_open(weights_path, framework="pt") as f:
                if names is None:
                    return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
                return {k: f.get_tensor(k) for k in names}
        except Exception as e:  # safetensors raises its own error types, naming no file
            raise CheckpointError(f"{weights_path}: not a readable safetensors file, truncated or corrupt "
                                  f"({type(e).__name__}: {e})") from None

    shapes = read()
    validate_tensors(cfg, shapes, str(weights_path))
    tensors = read(list(shapes) if weights else ["d2t", "t2d"])
    validate_vocab(tensors["d2t"], tensors["t2d"], str(weights_path))
    return cfg, tensors


def load_draft(path: str | Path, device="cpu", dtype=torch.float32, attention: str = "sdpa",
               embed_tokens: torch.Tensor | None = None) -> Eagle3Draft:
    """An Eagle3Draft from a checkpoint; `embed_tokens` supplies the target's embedding when the
    checkpoint does not carry one (as a server does)."""
    cfg, tensors = read_checkpoint(path)
    if "embed_tokens.weight" not in tensors:
        if embed_tokens is None:
            raise CheckpointError(f"{path}: no embed_tokens.weight; pass the target's embedding")
        tensors["embed_tokens.weight"] = embed_tokens
    draft = Eagle3Draft(cfg, attention=attention)
    draft.load_state_dict(tensors, strict=True)
    return draft.to(device=device, dtype=dtype).requires_grad_(False).eval()


def check_fits_target(cfg: Eagle3Config, target_config, where: str | Path, target_fingerprint: str | None = None,
                      allow_other_target: bool = False) -> None:
    """Refuse a draft (checkpoint directory `where`) that cannot run on the target: every field of
    its config.json that disagrees with the target's transformers config, in one error; otherwise
    a wrong width fails at the first request as a shape error, and a wrong vocab or layer never
    fails at all, it only drafts garbage. With `target_fingerprint`, a draft recorded as trained for
    another target is refused too (shapes that happen to match would measure nonsense), or only
    warned about with `allow_other_target`."""
    where = Path(where) / CONFIG_NAME
    t = text_config(target_config)
    problems = []
    if cfg.target_hidden_size != t.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != the target's hidden_size "
                        f"{t.hidden_size} (fc reads the target's aux states, 3 x its width)")
    if cfg.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != the target's vocab_size {t.vocab_size} "
                        "(d2t maps draft ids to target ids; t2d has one entry per target id)")
    depth = deepstack_layers(target_config)
    try:
        check_aux_layer_ids(cfg.aux_layer_ids, t.num_hidden_layers, what="eagle_config.eagle_aux_hidden_state_layer_ids",
                            count=3, min_id=depth, hint=f" (the target has {t.num_hidden_layers} decoder layers)",
                            why_min=f"its output carries the target's deepstack visual features (layers 0..{depth - 1})"
                            if depth else None)
    except ValueError as e:
        problems.append(str(e))
    vl = is_vl_config(target_config)
    if vl != cfg.uses_mrope:
        problems.append("rope_scaling.mrope_section: " + ("missing, but the target uses M-RoPE positions" if vl
                        else f"{cfg.mrope_section}, but the target is a text model (1-D positions)"))
    if problems:
        raise CheckpointError(f"{where}: the draft does not fit the target: " + "; ".join(problems))
    recorded = cfg.extra.get(TARGET_KEY) or {}
    if target_fingerprint is None or recorded.get("fingerprint") in (None, target_fingerprint):
        return
    msg = (f"{where}: trained for target {recorded.get('name')!r} (fingerprint {recorded['fingerprint']}), "
           f"this target has fingerprint {target_fingerprint}")
    if not allow_other_target:
        raise CheckpointError(msg + "; if the two are the same model (e.g. copied files), "
                              "set eval.allow_other_target=true")
    print(f"[warning] {msg}; going on anyway", flush=True)
