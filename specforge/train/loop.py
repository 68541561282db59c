"""The training loop of the EAGLE3 head, top to bottom: setup, epochs of TTT steps, a held-out
evaluation and a servable checkpoint at every epoch end."""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from specforge.checkpoint import read_checkpoint, save_checkpoint
from specforge.extract.store import HiddenStateStore
from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.targets.loader import load_target
from specforge.train.batches import collate, epoch_batches
from specforge.train.state import save_training_state
from specforge.train.ttt import Teacher, add_stats, summarize, ttt_forward
from specforge.utils.metrics_log import MetricsLogger
from specforge.utils.progress import progress_bar


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
        raise ValueError(f"train.precision: {precision!r} is not one of bf16, fp32")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def build_draft(cfg, target_config, aux_layer_ids, vocab: dict, embed: torch.Tensor) -> Eagle3Draft:
    """A fresh draft (or `draft.init_from`, keeping ITS vocab map) with the target's embedding."""
    if cfg.draft.init_from:
        ckpt_cfg, tensors = read_checkpoint(cfg.draft.init_from)
        if ckpt_cfg.aux_layer_ids != list(aux_layer_ids):
            raise ValueError(f"draft.init_from: {cfg.draft.init_from} reads layers {ckpt_cfg.aux_layer_ids}, "
                             f"the extracted data has {list(aux_layer_ids)}")
        draft = Eagle3Draft(ckpt_cfg, attention=cfg.train.attention)
        tensors.setdefault("embed_tokens.weight", embed)
        draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    else:
        draft_cfg = Eagle3Config.from_target(target_config, aux_layer_ids, cfg.draft,
                                             draft_vocab_size=len(vocab["d2t"]))
        draft = Eagle3Draft(draft_cfg, attention=cfg.train.attention)
        draft.set_vocab_mapping(vocab["d2t"], vocab["t2d"])
    draft.embed_tokens.weight.data.copy_(embed)
    draft.embed_tokens.requires_grad_(False)
    return draft


@torch.no_grad()
def evaluate(draft, store: HiddenStateStore, teacher: Teacher, cfg, device, amp) -> dict:
    draft.eval()
    stats = None
    for idx in epoch_batches(store.lengths, cfg.train.batch_size, cfg.seed, 0, shuffle=False):
        batch = {k: v.to(device) for k, v in collate([store[i] for i in idx]).items()}
        with amp:
            _, step_stats = ttt_forward(draft, batch, teacher, cfg.train.ttt_length, cfg.train.step_weight)
        stats = add_stats(stats, step_stats)
    draft.train()
    return summarize(stats) if stats else {}


def train(cfg, run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    tc = cfg.train
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(tc.num_threads or os.cpu_count())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = autocast_for(tc.precision, device)

    train_store = HiddenStateStore(run_dir / "extract" / "train")
    eval_dir = run_dir / "extract" / "eval"
    eval_store = HiddenStateStore(eval_dir) if (eval_dir / "manifest.json").exists() else None
    vocab = load_file(run_dir / "data" / "vocab.safetensors")

    target = load_target(cfg.target)
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    teacher_weight = target.get_output_embeddings().weight.detach().to(device)
    target_config = target.config
    del target

    draft = build_draft(cfg, target_config, train_store.meta["aux_layer_ids"], vocab, embed).to(device)
    teacher = Teacher(teacher_weight, draft.t2d)
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    batches_per_epoch = len(epoch_batches(train_store.lengths, tc.batch_size, cfg.seed, 0))
    steps_per_epoch = max(1, batches_per_epoch // tc.grad_accum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(tc.epochs * steps_per_epoch, tc.warmup_ratio, tc.min_lr_ratio))
    logger = MetricsLogger(run_dir / "metrics.jsonl", cfg.logging, cfg.run_name)
    print(f"[train] {len(train_store)} samples, {train_store.num_tokens} tokens, "
          f"{steps_per_epoch} steps/epoch x {tc.epochs} epochs, "
          f"global batch {tc.batch_size * tc.grad_accum} samples, device {device}", flush=True)

    step, window, tokens_seen = 0, None, 0
    summary = {"epochs": []}
    import time

    t_start = time.time()
    with progress_bar() as bar:
        for epoch in range(1, tc.epochs + 1):
            batches = epoch_batches(train_store.lengths, tc.batch_size, cfg.seed, epoch)
            task = bar.add_task(f"train epoch {epoch}", total=len(batches), info="")
            for i, idx in enumerate(batches):
                batch = {k: v.to(device) for k, v in collate([train_store[j] for j in idx]).items()}
                with amp:
                    loss, stats = ttt_forward(draft, batch, teacher, tc.ttt_length, tc.step_weight)
                (loss / tc.grad_accum).backward()
                window = add_stats(window, stats)
                tokens_seen += int(batch["loss_mask"].numel())
                if (i + 1) % tc.grad_accum == 0:
                    grad_norm = torch.nn.utils.clip_grad_norm_(draft.trainable_parameters(), tc.grad_clip)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    step += 1
                    if step % tc.log_every == 0 or i + 1 == len(batches):
                        row = {"split": "train", "epoch": epoch, "step": step, "lr": scheduler.get_last_lr()[0],
                               "grad_norm": float(grad_norm),
                               "tokens_per_s": tokens_seen / (time.time() - t_start), **summarize(window)}
                        row["loss"] = sum(tc.step_weight**k * row[f"loss_{k}"] for k in range(tc.ttt_length))
                        logger.log(row)
                        window = None
                        bar.update(task, info=f"loss {row['loss']:.3f} acc_0 {row['acc_0']:.2f} "
                                              f"sim-accept {row['sim_accept_length']:.2f}")
                bar.advance(task)
            epoch_row = {"split": "eval", "epoch": epoch, "step": step}
            if eval_store is not None:
                epoch_row.update(evaluate(draft, eval_store, teacher, cfg, device, amp))
                logger.log(epoch_row)
                print(f"[train] epoch {epoch}: held-out sim accept length "
                      f"{epoch_row['sim_accept_length']:.3f}, acc_0 {epoch_row['acc_0']:.3f}", flush=True)
            ckpt = save_checkpoint(draft, run_dir / f"epoch_{epoch}")
            save_training_state(run_dir / "state" / f"epoch_{epoch}", optimizer, scheduler,
                                epoch=epoch, step=step, batch_in_epoch=len(batches))
            summary["epochs"].append({"epoch": epoch, "checkpoint": str(ckpt), **epoch_row})
    elapsed = time.time() - t_start
    summary.update(steps=step, seconds=round(elapsed, 1), train_tokens_per_s=round(tokens_seen / elapsed, 1))
    logger.close()
    return summary
