"""The training loop of the EAGLE3 head, top to bottom: setup, epochs of TTT steps, a held-out
evaluation and a servable checkpoint at every epoch end, training states for resuming.

One loop for every `train.strategy`: how the model is spread over processes lives in
specforge/distributed/strategy.py. What is distributed-aware here: each rank reads its own micro-batches
(batches.py), metrics are summed over ranks before rank 0 logs them, rank 0 alone writes files.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from specforge import distributed as dist
from specforge.checkpoint import TARGET_KEY, check_fits_target, read_checkpoint, save_checkpoint
from specforge.config import IMAGE_EMBEDDINGS, PRECISIONS
from specforge.distributed.preemption import StopRequests, TrainingInterrupted
from specforge.distributed.strategy import make_strategy
from specforge.errors import InvalidInput
from specforge.extract.store import HiddenStateStore
from specforge.models.draft import EAGLE31_OPTIONS, Eagle3Config, Eagle3Draft
from specforge.targets.loader import compute_dtype, load_embedding_and_head, torch_dtype
from specforge.train.batches import collate, epoch_batches, eval_batches, global_batches, steps_per_epoch
from specforge.train.memory_probe import describe, heaviest_micro_batch, probe_memory, state_bytes
from specforge.run_layout import RunLayout
from specforge.train.state import StateManager, TrainState
from specforge.train.ttt import StepStats, Teacher, TeacherMemo, add_stats, summarize, ttt_forward
from specforge.utils.metrics_log import MetricsLogger
from specforge.utils.progress import progress_bar


# Optimizer steps in a row with an inf/nan gradient norm (each skipped) before training stops: one
# is a bad batch, this many is a run that has diverged or reads broken hidden states.
MAX_SKIPPED_IN_A_ROW = 10


def cosine_with_warmup(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def autocast_for(precision: str, device: torch.device):
    """bf16 compute over fp32 master weights, where the device has bf16; fp32 otherwise."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"train.precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return contextlib.nullcontext()
    if compute_dtype(torch.bfloat16, device) != torch.bfloat16:  # a CPU without native bf16 matmul
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def fresh_draft_config(cfg, target_config, aux_layer_ids, draft_vocab_size: int) -> Eagle3Config:
    """A fresh draft's geometry (the target's, with the draft.* settings over it), refused naming
    the setting where this trainer cannot train it or a server would not serve the data's lengths.
    The train stage's up-front check and build_draft both ask: a shape error at the first step
    would come after the extract stage's hours."""
    try:
        draft_cfg = Eagle3Config.from_target(target_config, aux_layer_ids, cfg.draft, draft_vocab_size=draft_vocab_size)
    except ValueError as e:
        raise InvalidInput(f"the draft's geometry (the target's, with the draft.* settings over it): {e}") from None
    check_trainable_width(draft_cfg, "draft.hidden_size")
    if draft_cfg.max_position_embeddings < cfg.data.max_length:
        raise InvalidInput(f"draft.max_position_embeddings={draft_cfg.max_position_embeddings} is below "
                           f"data.max_length={cfg.data.max_length}: the checkpoint would declare fewer positions than "
                           "its training samples hold, and servers read it as the longest sequence the draft serves "
                           "(docs/contract.md §1); raise it or leave it unset (the target's)")
    return draft_cfg


def check_trainable_width(draft_cfg: Eagle3Config, what: str) -> None:
    """Training embeds the draft's tokens with the target's embedding, frozen (docs/contract.md §1),
    so the draft must be as wide as the target."""
    if draft_cfg.hidden_size != draft_cfg.target_hidden_size:
        raise InvalidInput(f"{what}: the draft is {draft_cfg.hidden_size} wide, the target "
                           f"{draft_cfg.target_hidden_size}: training embeds the draft's tokens with the target's "
                           "embedding, frozen, as SGLang and vLLM serve it in the draft's place "
                           "(docs/contract.md §1); a draft of another width would need an embedding of its own, "
                           "which this trainer does not train. Leave draft.hidden_size unset (the target's)")


def check_init_from(cfg, ckpt_cfg: Eagle3Config, aux_layer_ids, target_config) -> None:
    """`draft.init_from` can go on training in this run: it fits the target, reads the layers the
    hidden states hold, and has the EAGLE 3.1 options asked for (a fine-tuned draft keeps its
    checkpoint's architecture). The train stage's up-front check and build_draft both ask."""
    where = cfg.draft.init_from
    check_fits_target(ckpt_cfg, target_config, where)
    check_trainable_width(ckpt_cfg, f"draft.init_from: {where}")
    if ckpt_cfg.aux_layer_ids != list(aux_layer_ids):
        raise InvalidInput(f"draft.init_from: {where} reads layers {ckpt_cfg.aux_layer_ids}, the hidden states "
                           f"hold {list(aux_layer_ids)} (target.aux_layer_ids)")
    wanted = {key: bool(getattr(cfg.draft, key, False)) for key in EAGLE31_OPTIONS}
    if ckpt_cfg.eagle31_options != wanted:
        fix = " ".join(f"draft.{key}={str(value).lower()}" for key, value in ckpt_cfg.eagle31_options.items()
                       if value != wanted[key])
        raise InvalidInput(f"draft.init_from: {where} has the EAGLE 3.1 options {ckpt_cfg.eagle31_options}, the "
                           f"config asks for {wanted}; a fine-tuned draft keeps its checkpoint's architecture: set "
                           f"{fix} (or select the matching draft= group)")


def build_draft(cfg, target_config, aux_layer_ids, vocab: dict, embed: torch.Tensor,
                head: torch.Tensor | None = None) -> Eagle3Draft:
    """A fresh draft (or `draft.init_from`, keeping ITS vocab map) with the target's embedding;
    `head`: the target's lm_head, for draft.lm_head_init=target."""
    if cfg.draft.init_from:
        ckpt_cfg, tensors = read_checkpoint(cfg.draft.init_from)
        check_init_from(cfg, ckpt_cfg, aux_layer_ids, target_config)
        draft = Eagle3Draft(ckpt_cfg, attention=cfg.train.attention)
        tensors.setdefault("embed_tokens.weight", embed)
        draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    else:
        draft_cfg = fresh_draft_config(cfg, target_config, aux_layer_ids, len(vocab["d2t"]))
        draft = Eagle3Draft(draft_cfg, attention=cfg.train.attention)
        draft.set_vocab_mapping(vocab["d2t"], vocab["t2d"])
        if str(cfg.draft.lm_head_init) == "target":
            init_head_from_target(draft, head)
        if str(cfg.draft.layer_init) == "identity":
            init_layer_as_identity(draft)
    draft.embed_tokens.weight.data.copy_(embed)
    draft.embed_tokens.requires_grad_(False)
    if cfg.train.freeze_lm_head:  # as speculators trains its head: the target's rows, never updated
        draft.lm_head.requires_grad_(False)
    return draft


def init_head_from_target(draft: Eagle3Draft, head: torch.Tensor | None) -> None:
    """The draft's lm_head starts as the target's rows of the draft vocab (sorted target ids, the
    order of the draft ids): at step 0 the draft already scores tokens as the target would from
    a target-like state."""
    width = draft.lm_head.weight.shape[1]
    if head is None or head.shape[1] != width:
        raise ValueError(f"draft.lm_head_init=target: the target's lm_head is {None if head is None else tuple(head.shape)}, "
                         f"the draft's hidden size is {width}; it needs draft.hidden_size equal to the target's")
    with torch.no_grad():
        draft.lm_head.weight.copy_(head[draft.t2d.to(head.device)].float())


def init_layer_as_identity(draft: Eagle3Draft) -> None:
    """The draft starts as the identity on the target's highest captured state: fc passes it
    through, and the layer's output projections (o_proj, down_proj) start at zero, so that step 0
    reads the target's own head off a late layer's state (with lm_head_init=target, a logit lens)
    before anything is learnt. The other weights keep their random start and get gradients as soon
    as the output projections move."""
    width, top = draft.config.hidden_size, draft.config.target_hidden_size  # equal (check_trainable_width)
    ids = draft.config.aux_layer_ids  # fc's input: the captured states in this order
    chunk = max(range(len(ids)), key=lambda i: ids[i])
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, chunk * top : (chunk + 1) * top].copy_(torch.eye(width))
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()


def target_head(cfg) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The target's input embedding (fp32) and output head (its dtype), on CPU, with its config.
    Rank 0 reads them (from the target's safetensors alone where it can) and sends them to the
    other ranks."""
    env = dist.current()
    embed = head = config = None
    if env.is_main:
        embed, head, config = load_embedding_and_head(cfg.target)
    if not env.distributed:
        return embed, head, config
    shapes = dist.broadcast_object((embed.shape, head.shape, head.dtype, config) if env.is_main else None)
    embed = dist.broadcast_tensor(embed, shapes[0], torch.float32)
    head = dist.broadcast_tensor(head, shapes[1], shapes[2])
    return embed, head, shapes[3]


def open_stores(cfg, layout: RunLayout, device) -> tuple:
    """The train and (if any) eval split's samples: the extracted stores, or with extract=online the
    data stage's rows with the target loaded here to compute their states (specforge/extract/online.py)."""
    if cfg.extract.backend != "online":
        eval_dir = layout.store("eval")
        return (HiddenStateStore(layout.store("train")),
                HiddenStateStore(eval_dir) if (eval_dir / "manifest.json").exists() else None)
    from specforge.extract.embedded import EmbeddedExtractor
    from specforge.extract.online import OnlineStates
    from specforge.extract.stage import split_rows, store_meta
    from specforge.extract.store import handoff_dtype
    from specforge.targets.loader import load_target, resolve_target_path

    target = load_target(cfg.target, device=device)
    meta = store_meta(cfg, target.config, resolve_target_path(cfg.target))
    extractor = EmbeddedExtractor(target, meta["aux_layer_ids"], batch_tokens=cfg.extract.batch_tokens,
                                  storage_dtype=handoff_dtype(cfg.extract.dtype, target.dtype))
    train_rows = split_rows(layout.samples("train"), "train", meta["vocab_size"])
    eval_path = layout.samples("eval")
    eval_rows = split_rows(eval_path, "eval", meta["vocab_size"]) if eval_path.exists() else []
    return (OnlineStates(train_rows, extractor, dict(meta, split="train")),
            OnlineStates(eval_rows, extractor, dict(meta, split="eval")) if eval_rows else None)


def noisy_features(aux: torch.Tensor, scale: float) -> torch.Tensor:
    """The target's states with uniform noise of `scale` x each state's RMS per token (EAGLE's
    feature noise, relative because residual streams differ in size by layer and token): the draft
    learns from states a little off the ones it saw, as its own later steps are."""
    noisy = [x + scale * x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype) * (2 * torch.rand_like(x) - 1)
             for x in aux.chunk(3, dim=-1)]
    return torch.cat(noisy, dim=-1)


class TTTModule(torch.nn.Module):
    """What a strategy wraps: forward(batch) is the TTT unroll of the draft -> (loss, stats)."""

    def __init__(self, draft: Eagle3Draft, teacher: Teacher, ttt_length: int, step_weight: float,
                 feature_noise: float = 0.0, reach_weight: float = 0.0):
        super().__init__()
        self.draft = draft
        self.teacher = teacher  # frozen target head: not a parameter, not in any state dict
        self.ttt_length, self.step_weight = ttt_length, step_weight
        self.feature_noise = feature_noise
        self.reach_weight = reach_weight

    def forward(self, batch: dict):
        if self.training and self.feature_noise:
            batch = {**batch, "aux": noisy_features(batch["aux"], self.feature_noise)}
        return ttt_forward(self.draft, batch, self.teacher, self.ttt_length, self.step_weight,
                           reach_weight=self.reach_weight if self.training else 0.0)  # eval loss: unweighted

    def shard_units(self) -> list[torch.nn.Module]:
        """Submodules FSDP shards as units of their own (the root takes the rest)."""
        return [self.draft.midlayer]


class GatheredDraft:
    """A draft's config and full weights, as `save_checkpoint` reads them from a draft module."""

    def __init__(self, config: Eagle3Config, module_state: dict[str, torch.Tensor]):
        self.config = config
        self._tensors = {k.removeprefix("draft."): v for k, v in module_state.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._tensors


@dataclass
class Meter:
    """TTT statistics since the last log row and padded tokens seen. Each rank adds its own; `sync`
    (a collective) folds every rank's counts into rank 0's, so what rank 0 logs covers all ranks."""

    ttt_length: int
    window: list[StepStats] | None = None
    tokens: int = 0

    def add(self, stats: list[StepStats], tokens: int) -> None:
        self.window = add_stats(self.window, stats)
        self.tokens += tokens

    def sync(self, device) -> None:
        env = dist.current()
        if not env.distributed:
            return
        packed = torch.zeros(self.ttt_length * 5 + 1, dtype=torch.float64, device=device)
        if self.window is not None:
            packed[:-1] = torch.stack([torch.stack([t.double() for t in vars(s).values()])
                                       for s in self.window]).flatten()
        packed[-1] = self.tokens
        dist.all_reduce_sum(packed)
        if env.is_main:
            rows = packed[:-1].view(self.ttt_length, 5)
            self.window = [StepStats(*rows[k]) for k in range(self.ttt_length)]
            self.tokens = int(packed[-1])
        else:
            self.window, self.tokens = None, 0

    def state(self) -> dict:
        """After `sync`: rank 0's totals, for a training state."""
        window = None if self.window is None else torch.stack(
            [torch.stack([t.double().cpu() for t in vars(s).values()]) for s in self.window])
        return {"window": window, "tokens": self.tokens}

    def load(self, state: dict, is_main: bool) -> None:
        if is_main:
            w = state["window"]
            self.window = None if w is None else [StepStats(*w[k]) for k in range(w.shape[0])]
            self.tokens = int(state["tokens"])


def override_token(cfg, store: HiddenStateStore) -> int | None:
    """The image placeholder id whose draft embedding is the target's merged input embedding
    (draft.image_embeddings=merged on a vision-language store), else None."""
    mode = cfg.draft.image_embeddings
    if mode not in IMAGE_EMBEDDINGS:
        raise ValueError(f"draft.image_embeddings: {mode!r} is not one of {list(IMAGE_EMBEDDINGS)}")
    return int(store.meta["image_token_id"]) if store.vl and mode == "merged" else None


def optimizer_step(strategy, micro_batches: list[list[int]], samples: TeacherMemo, device, amp,
                   meter: Meter, image_token_id: int | None = None, pack_tokens: int = 0) -> float | None:
    """One optimizer step over this rank's micro-batches; returns the gradient norm (None: unknown)."""
    for j, idx in enumerate(micro_batches):
        batch = {k: v.to(device) for k, v in collate(samples.samples(idx), image_token_id=image_token_id,
                                                     pack_tokens=pack_tokens).items()}
        with strategy.grad_sync(last=j == len(micro_batches) - 1):
            with amp:
                loss, stats = strategy.model(batch)
            strategy.backward(loss)
        meter.add(stats, int(batch["loss_mask"].numel()))
    return strategy.step()


def check_batch_shape(tc, samples: int, longest: int, world_size: int,
                      micro_batches: int | None = None) -> int | None:
    """A batch the data cannot give: more samples than there are (every step would see all of
    them, not train.batch_size), packed rows shorter than a sample (it would be a row of its own,
    longer than train.pack_tokens says), or fewer micro-batches than one optimizer step takes.
    `samples`: the training split's count, `longest`: its longest sample's tokens (the data stage's
    summary has both, so the pipeline asks before extracting); `micro_batches`: an epoch's, where
    known (packed rows: once packed). -> the optimizer steps of an epoch, where known."""
    if not tc.pack_tokens and tc.batch_size > samples:
        raise InvalidInput(f"train.batch_size={tc.batch_size} is more than the {samples} training samples: every "
                           f"step would be one micro-batch of all of them; lower train.batch_size")
    if tc.pack_tokens and longest > tc.pack_tokens:
        raise InvalidInput(f"train.pack_tokens={tc.pack_tokens} is shorter than the longest of the {samples} training "
                           f"samples ({longest} tokens), which would be a row of its own, longer than that. Set "
                           f"train.pack_tokens >= {longest} (data.max_length bounds every sample)")
    if micro_batches is None and not tc.pack_tokens:
        micro_batches = -(-samples // tc.batch_size)
    if micro_batches is None:
        return None
    steps = steps_per_epoch(micro_batches, tc.grad_accum, world_size)
    if steps == 0:
        unit = f"rows of <= {tc.pack_tokens} tokens" if tc.pack_tokens else "samples"
        raise InvalidInput(f"train: {samples} samples make {micro_batches} micro-batches of {tc.batch_size} {unit}, "
                           f"fewer than one optimizer step takes (train.grad_accum={tc.grad_accum} x {world_size} "
                           "processes); lower train.batch_size or train.grad_accum, or use fewer processes")
    return steps


def plateaued(epochs: list[dict], patience: int, min_delta: float) -> str | None:
    """Why training stops here (train.early_stop_patience), or None: the last `patience` epochs'
    held-out sim accept length none above the best before them by more than `min_delta`."""
    scores = [e.get("sim_accept_length") for e in epochs]
    if not patience or len(scores) <= patience or None in scores:
        return None
    best_before = max(scores[:-patience])
    if max(scores[-patience:]) > best_before + min_delta:
        return None
    best = max(range(len(scores)), key=lambda i: scores[i])
    return (f"held-out sim accept length has not beaten {best_before:.4f} by more than {min_delta} for {patience} "
            f"epoch(s); the best is epoch {epochs[best]['epoch']} ({scores[best]:.4f})")


def diverged_message(tc, epoch: int, position, in_a_row: int, layout: RunLayout) -> str:
    kept = [str(e["checkpoint"]) for e in position.epochs] or ["none yet"]
    return (f"train: {in_a_row} optimizer steps in a row had an inf/nan gradient norm (epoch {epoch}, step "
            f"{position.step}; {position.skipped_steps} skipped in all). Each was skipped, so the weights are those "
            f"before them, but training has diverged or reads broken hidden states: lower train.lr (now {tc.lr}) "
            f"or raise train.warmup_ratio, or check {layout.metrics} for where the loss left. Checkpoints written: "
            f"{', '.join(kept)}")


def train_row(tc, epoch: int, step: int, lr: float, grad_norm: float | None, meter: Meter,
              seconds: float) -> dict:
    row = {"split": "train", "epoch": epoch, "step": step, "lr": lr, "grad_norm": grad_norm,
           "tokens_per_s": meter.tokens / seconds, **summarize(meter.window)}
    row["loss"] = sum(tc.step_weight**k * row[f"loss_{k}"] for k in range(tc.ttt_length))
    return row


@torch.no_grad()
def heldout_metrics(strategy, samples: TeacherMemo, cfg, device, amp) -> dict:
    """Held-out TTT metrics, each rank on its share of the batches, summed over ranks."""
    env = dist.current()
    strategy.train(False)
    meter = Meter(cfg.train.ttt_length)
    image_token_id = override_token(cfg, samples.store)
    for idx, counted in eval_batches(samples.store.lengths, cfg.train.batch_size, env.rank, env.world_size):
        batch = {k: v.to(device) for k, v in collate(samples.samples(idx), image_token_id=image_token_id).items()}
        with amp:
            _, stats = strategy.model(batch)
        if counted:
            meter.add(stats, 0)
    strategy.train(True)
    meter.sync(device)
    return summarize(meter.window) if meter.window else {}


def train(cfg, run_dir: Path, fingerprint: str, split_free: str | None = None) -> dict:
    """`fingerprint`: the train stage's, from the pipeline; a training state resumes only a run with
    the same one, or the same `split_free` one (without train.grad_accum) and the same global batch."""
    layout = RunLayout(run_dir)
    tc = cfg.train
    env = dist.current()
    device = env.device
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(tc.num_threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    amp = autocast_for(tc.precision, device)
    main = env.is_main

    # -- inputs: hidden states, vocab map, the target's embedding and head -------------------------
    train_store, eval_store = open_stores(cfg, layout, device)
    vocab = load_file(layout.vocab)
    # packed rows differ per epoch (and so may their number): every epoch takes as many steps as the
    # shortest; unpacked, every epoch has the same number of micro-batches
    epochs = range(1, tc.epochs + 1) if tc.pack_tokens else [1]
    micro_batches = min(len(global_batches(train_store.lengths, tc.batch_size, cfg.seed, epoch,
                                           pack_tokens=tc.pack_tokens)) for epoch in epochs)
    per_epoch = check_batch_shape(tc, len(train_store.lengths), max(train_store.lengths, default=0), env.world_size,
                                  micro_batches)
    global_batch = tc.batch_size * tc.grad_accum * env.world_size
    unit = f"rows of <= {tc.pack_tokens} tokens" if tc.pack_tokens else "samples"

    image_token_id = override_token(cfg, train_store)
    embed, teacher_weight, target_config = target_head(cfg)
    # the target's dtype, or float32 on a CPU without native bf16 (loading on the CPU may have widened it)
    teacher_weight = teacher_weight.to(device, compute_dtype(torch_dtype(cfg.target.dtype), device))

    # -- the draft, spread over the processes by the strategy ---------------------------------------
    draft = build_draft(cfg, target_config, train_store.meta["aux_layer_ids"], vocab, embed, teacher_weight).to(device)
    if train_store.vl:  # the engine feeds image positions the way the draft was trained (docs/design.md)
        draft.config.extra["image_embeddings"] = cfg.draft.image_embeddings
    meta = train_store.meta  # which target: evaluation and serving refuse a draft of another one
    draft.config.extra[TARGET_KEY] = {"fingerprint": meta["target_fingerprint"], "name": Path(str(cfg.target.path)).name,
                                      "num_hidden_layers": meta["num_layers"]}
    draft_config = draft.config
    teacher = Teacher(teacher_weight, draft.t2d, hard_weight=tc.hard_label_weight)
    train_samples = TeacherMemo(train_store, teacher, device)
    eval_samples = None if eval_store is None else TeacherMemo(eval_store, teacher, device)
    module = TTTModule(draft, teacher, tc.ttt_length, tc.step_weight, tc.feature_noise, tc.reach_weight)
    probed = None
    if tc.memory_probe:
        heaviest = heaviest_micro_batch(train_store.lengths, tc.batch_size, tc.pack_tokens)
        what = describe(train_store.lengths, heaviest, tc.pack_tokens)
        if main:  # said first: on a CPU, running out of memory is a kill, not an error
            print(f"[train] memory probe: the heaviest micro-batch ({what}), forward and backward", flush=True)
        probed = probe_memory(module, train_samples, heaviest, device, amp, what, image_token_id, tc.pack_tokens,
                              reserve=state_bytes(module, tc.strategy, env.world_size))
        if main:
            print(f"[train] memory probe: {probed}", flush=True)
    strategy = make_strategy(module, tc, env, device)
    del draft, module

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        strategy.optimizer, cosine_with_warmup(tc.epochs * per_epoch, tc.warmup_ratio, tc.min_lr_ratio))

    # -- where to start: from scratch or from the newest valid training state -----------------------
    state = TrainState(strategy, scheduler, Meter(tc.ttt_length), device)
    states = StateManager(layout, fingerprint, tc, split_free)
    states.restore(state)
    position, meter = state.position, state.meter

    logger = MetricsLogger(layout.metrics, cfg.logging, cfg.run_name, enabled=main,
                           fresh=position.step == 0, run_id=position.wandb_run_id)
    position.wandb_run_id = logger.run_id
    if main:
        print(f"[train] {len(train_store)} samples, {train_store.num_tokens} tokens, "
              f"{per_epoch} steps/epoch x {tc.epochs} epochs, global batch {global_batch} {unit} "
              f"(batch_size {tc.batch_size} x grad_accum {tc.grad_accum} x {env.world_size} processes), "
              f"strategy {strategy.name}, device {device}", flush=True)

    skipped_in_a_row = 0
    try:
        with StopRequests() as stop, progress_bar(disable=not main) as bar:
            for epoch in range(position.epoch, tc.epochs + 1):
                # rank 0 holds the held-out metrics; a resumed run decides from the epochs before it too
                plateau = dist.run_on_main(plateaued, position.epochs, tc.early_stop_patience,
                                           tc.early_stop_min_delta, what="the early-stop check")
                if plateau:
                    position.stopped_early = plateau
                    if main:
                        print(f"[train] early stop before epoch {epoch}: {plateau}", flush=True)
                    break
                mine = epoch_batches(train_store.lengths, tc.batch_size, cfg.seed, epoch, rank=env.rank,
                                     world_size=env.world_size, pack_tokens=tc.pack_tokens)
                start = position.step_in_epoch if epoch == position.epoch else 0
                task = bar.add_task(f"train epoch {epoch}", total=per_epoch, completed=start, info="")
                for s in range(start, per_epoch):
                    micro = mine[s * tc.grad_accum : (s + 1) * tc.grad_accum]
                    grad_norm = optimizer_step(strategy, micro, train_samples, device, amp, meter, image_token_id,
                                               tc.pack_tokens)
                    scheduler.step()
                    position.step += 1
                    diverged = grad_norm is not None and not math.isfinite(grad_norm)  # None: not known
                    skipped_in_a_row = skipped_in_a_row + 1 if diverged else 0
                    position.skipped_steps += skipped_in_a_row > 0
                    if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                        raise RuntimeError(diverged_message(tc, epoch, position, skipped_in_a_row, layout))
                    last_of_epoch = s + 1 == per_epoch
                    if position.step % tc.log_every == 0 or last_of_epoch:
                        meter.sync(device)
                        if main:
                            row = train_row(tc, epoch, position.step, scheduler.get_last_lr()[0], grad_norm,
                                            meter, state.elapsed())
                            row["skipped_steps"] = position.skipped_steps
                            logger.log(row)
                            bar.update(task, info=f"loss {row['loss']:.3f} acc_0 {row['acc_0']:.2f} "
                                                  f"sim-accept {row['sim_accept_length']:.2f}")
                        meter.window = None
                    bar.advance(task)
                    if stop.requested():  # a collective: every rank stops at this same step
                        state.resume_at(epoch, s + 1)
                        saved = states.save(state, f"step_{position.step:08d}", "signal")
                        stop.hand_over()
                        raise TrainingInterrupted(stop.signal_name, saved)
                    if tc.save_state_every and position.step % tc.save_state_every == 0 and not last_of_epoch:
                        state.resume_at(epoch, s + 1)
                        states.save(state, f"step_{position.step:08d}", "periodic")

                epoch_row = {"split": "eval", "epoch": epoch, "step": position.step}
                if eval_samples is not None:
                    epoch_row.update(heldout_metrics(strategy, eval_samples, cfg, device, amp))
                    if main:
                        logger.log(epoch_row)
                        print(f"[train] epoch {epoch}: held-out sim accept length "
                              f"{epoch_row['sim_accept_length']:.3f}, acc_0 {epoch_row['acc_0']:.3f}", flush=True)
                weights = strategy.full_state_dict()  # a collective; the full weights land on rank 0
                ckpt = layout.checkpoint(epoch)
                if main:
                    save_checkpoint(GatheredDraft(draft_config, weights), ckpt)
                del weights
                position.epochs.append({"epoch": epoch, "checkpoint": str(ckpt), **epoch_row})
                state.resume_at(epoch + 1, 0)
                states.save(state, f"epoch_{epoch}", "epoch_end")
        seconds = state.elapsed()
        meter.sync(device)
    finally:  # free the model before the process group goes (gloo/DDP can abort otherwise)
        logger.close()
        strategy.close()
    return {"epochs": position.epochs, "steps": position.step, "skipped_steps": position.skipped_steps,
            **({"stopped_early": position.stopped_early} if position.stopped_early else {}),
            **({"memory_probe": probed} if probed else {}),
            "seconds": round(seconds, 1),
            "train_tokens_per_s": round(meter.tokens / seconds, 1) if seconds else None,
            "world_size": env.world_size, "global_batch": global_batch, "strategy": strategy.name}
