"""The peer trainer, speculators 0.9.0's EAGLE-3 draft, built the way its own trainer builds it.

Shared by the peer workers (peer_train_worker.py: throughput; peer_quality_worker.py: a full
training run). Runs in the peer's virtualenv (`make peer-venv`); imports torch, transformers and
speculators only, never specforge.

- config: `speculators.train.config.TrainConfig` with its defaults, overridden only by the
  caller's `flat` keys (flag names of its CLI);
- model: `speculators.train.cli.build_draft_model` -> `Eagle3DraftModel.from_training_args`
  (embeddings / lm_head / verifier norm from the target dir, lm_head pruned to the draft vocab);
- optimizers and schedulers: `build_optimizers` and the schedule its `Trainer` makes;
- a step: the body of `Trainer.train_epoch` (forward under autocast with its hidden-states dtype,
  zero_grad, backward, clip_grad_norm_(1.0), every optimizer, every scheduler).
Its Trainer itself is not instantiated: it wants a DataLoader and a checkpoint directory, and on a
CPU its autocast would name "cuda". The callers move the model where it trains, as it does (to
accelerator 0: `Module.to` keeps the parameters the optimizers hold).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch


@dataclass
class Peer:
    model: torch.nn.Module
    args: argparse.Namespace  # its flattened TrainConfig, as its cli passes it around
    train_kwargs: dict
    optimizers: list
    schedulers: list = field(default_factory=list)

    @property
    def hs_dtype(self) -> torch.dtype:
        return getattr(torch, self.args.hidden_states_dtype)

    def step(self, batch: dict, device_type: str = "cpu"):
        """One optimizer step on a collated batch (on the model's device) -> (draft_tokens, loss,
        metrics). Autocast on `device_type`, as its trainer's on its accelerator."""
        autocast = self.hs_dtype != torch.float32  # autocast to float32 is a disabled no-op (or refused)
        with torch.autocast(device_type, dtype=self.hs_dtype, enabled=autocast):
            draft_tokens, loss, metrics = self.model(**batch, **self.train_kwargs)
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for opt in self.optimizers:
            opt.step()
        for sched in self.schedulers:
            sched.step()
        return draft_tokens, loss, metrics


def build_peer(flat: dict, t2d: torch.Tensor, d2t: torch.Tensor, n_steps: int,
               schedule: bool = True) -> Peer:
    """`flat`: its TrainConfig keys (verifier_name_or_path, draft_vocab_size, ttt_steps, ...).
    schedule=False: no scheduler (the caller sets each step's learning rate itself)."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import build_draft_model, set_seed
    from speculators.train.config import TrainConfig
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    cfg = TrainConfig.from_flat({**flat, "max_steps": n_steps})
    targs = argparse.Namespace(**cfg.flatten())  # as speculators.train.cli.main does
    set_seed(targs.seed)
    model = build_draft_model(targs, Eagle3DraftModel, t2d, d2t, d2t.shape[0])
    model.train()
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(targs))
    trainer_config = TrainerConfig(
        num_epochs=targs.epochs,
        save_path=targs.save_path,
        lr=targs.lr,
        train_call_kwargs=train_kwargs,
        optimizer=targs.optimizer,
        weight_decay=targs.weight_decay,
        muon_lr=targs.muon_lr,
        muon_momentum=targs.muon_momentum,
        muon_weight_decay=targs.muon_weight_decay,
        muon_ns_steps=targs.muon_ns_steps,
        muon_adjust_lr_fn=targs.muon_adjust_lr_fn,
        scheduler_type=targs.scheduler_type,
        scheduler_warmup_steps=targs.scheduler_warmup_steps,
        scheduler_warmup_ratio=targs.scheduler_warmup_ratio,
        scheduler_total_steps=targs.scheduler_total_steps,
        scheduler_num_cosine_cycles=targs.scheduler_num_cosine_cycles,
        hidden_states_dtype=getattr(torch, targs.hidden_states_dtype),
        max_steps=targs.max_steps,
    )
    optimizers = build_optimizers(model, trainer_config)  # Trainer.setup_optimizer
    schedulers = []
    if schedule and trainer_config.scheduler_type != "none":
        warm, total = _resolve_scheduler_steps(trainer_config, n_steps)
        for opt in optimizers:
            if trainer_config.scheduler_type == "linear":
                schedulers.append(get_linear_schedule_with_warmup(opt, warm, total))
            else:
                schedulers.append(get_cosine_schedule_with_warmup(
                    opt, warm, total, num_cycles=trainer_config.scheduler_num_cosine_cycles))
    return Peer(model, targs, train_kwargs, optimizers, schedulers)


def collate_documents(documents: list[dict], hidden_size: int, hs_dtype: torch.dtype) -> dict:
    """Documents of raw tokens (`hidden_states`, `input_ids`, `verifier_last_hidden_states`,
    `loss_mask`, `lengths`, `position_ids`, as its BaseDataset yields them) -> one packed row
    through its CollateFn with its eagle3 `shift_batch`, exactly as long as they are."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.recovery import RECOVERY_METADATA_KEY

    total = sum(int(d["input_ids"].shape[0]) - 1 for d in documents)  # shift_batch drops one per document
    collate = CollateFn(max_len=total, hidden_size=hidden_size, num_target_layers=3, dtype=hs_dtype,
                        preprocess=shift_batch)
    batch = collate(documents)
    batch.pop(RECOVERY_METADATA_KEY, None)  # BatchRecoveryCoordinator.consume
    return batch
