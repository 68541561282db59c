"""How the model is spread over the processes (`train.strategy`), kept out of the training loop.

The loop only ever does, per optimizer step:

    for j, batch in enumerate(micro_batches):
        with strategy.grad_sync(last=j == len(micro_batches) - 1):
            loss, stats = strategy.model(batch)
            strategy.backward(loss)
    grad_norm = strategy.step()

and asks the strategy for full weights (`full_state_dict`, for the servable checkpoint) and for the
model + optimizer part of a training state (`save_state` / `load_state`).

- single: the module as it is.
- ddp: DistributedDataParallel; gradients are averaged over ranks at the last micro-batch.
- fsdp: FSDP2 `fully_shard` (the decoder layer its own unit, then the root); params, grads and
  optimizer state sharded; full weights gathered to rank 0 for checkpoints.
- deepspeed: ZeRO stage `train.zero_stage` (1, 2 or 3) around a plain torch AdamW (no compiled
  optimizer op); DeepSpeed accumulates, clips and steps.

Every strategy trains fp32 master weights under the same torch autocast (train.precision), and the
same optimizer (train.optimizer, optimizer.py: AdamW everywhere, Muon for single and ddp), so their
loss curves agree with one process to float round-off.

The model/optimizer part of a training state is one `model_optim.pt` of FULL state dicts keyed by
parameter names for single/ddp/fsdp (resumable with any of the three and any world size), and
DeepSpeed's own checkpoint directory for deepspeed.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from specforge.config import STRATEGIES
from specforge.distributed.optimizer import build_optimizer

TORCH_STATE = "model_optim.pt"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"


def _optimizer(module, tc):
    return build_optimizer([(n, p) for n, p in module.named_parameters() if p.requires_grad], tc)


def _trainable(module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class Strategy:
    """Single process: the base every strategy refines."""

    name = "single"
    state_format = "torch"

    def __init__(self, module: torch.nn.Module, tc, env, device: torch.device):
        self.tc, self.env, self.device = tc, env, device
        self.inner = module.to(device)  # the unwrapped module: forward(batch) -> (loss, stats)
        self.model = self.wrap(self.inner)
        self.optimizer = _optimizer(self.inner, tc)

    def wrap(self, module):
        return module

    # -- one optimizer step ----------------------------------------------------------------------

    def grad_sync(self, last: bool):
        """Context of one micro-batch; gradients are reduced across ranks only when `last`."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.tc.grad_accum).backward()

    def step(self) -> float:
        """Clip, update, zero the gradients; returns the gradient norm before clipping. A step whose
        norm is inf or nan is skipped, as a loss scaler skips one (every rank sees the same norm)."""
        params = _trainable(self.inner)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        norm = self._full(norm)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return float(norm)
        if self.tc.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.tc.grad_clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @staticmethod
    def _full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # -- weights and state -----------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole module's state dict on CPU, on rank 0 ({} elsewhere). A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not dist.is_initialized():
            return {k: v.detach().cpu() for k, v in self.inner.state_dict().items()}
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.env.is_main else {}

    def save_state(self, directory: Path) -> None:
        """Write model + optimizer into `directory` (rank 0 writes; every rank must call)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        if dist.is_initialized():
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = {"model": get_model_state_dict(self.model, options=opts),
                     "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=opts)}
        else:
            opts = StateDictOptions(full_state_dict=True)
            state = {"model": get_model_state_dict(self.inner, options=opts),
                     "optimizer": get_optimizer_state_dict(self.inner, self.optimizer, options=opts)}
        if self.env.is_main:
            torch.save(state, Path(directory) / TORCH_STATE)

    def load_state(self, directory: Path, meta: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        if meta.get("state_format") != self.state_format:
            raise ValueError(f"{directory}: a training state written by the {meta.get('strategy')!r} strategy "
                             f"cannot be resumed with train.strategy={self.tc.strategy!r}; resume with the same "
                             "strategy or start over with train.resume=never")
        if dist.is_initialized():
            # rank 0 reads the file, the tensors are broadcast and sharded/replicated as needed
            state = (torch.load(Path(directory) / TORCH_STATE, map_location="cpu", weights_only=True)
                     if self.env.is_main else {"model": {}, "optimizer": {}})
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, state["model"], options=opts)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        else:
            state = torch.load(Path(directory) / TORCH_STATE, map_location="cpu", weights_only=True)
            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.inner, state["model"], options=opts)
            set_optimizer_state_dict(self.inner, self.optimizer, state["optimizer"], options=opts)

    def close(self) -> None:
        self.model = self.inner = self.optimizer = None


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, module):
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        # the buffers (vocab map, RoPE) are equal on every rank and never change: no sync per forward
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        return DistributedDataParallel(module, device_ids=ids, **no_sync)

    def grad_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDPStrategy(Strategy):
    name = "fsdp"

    def wrap(self, module):
        import warnings

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the layer returns its new (k, v) as transposed views; the TTT unroll only concatenates
        # them (out of place), which is what this warning asks for
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        # the decoder layer is its own unit, kept gathered between the k calls of the TTT unroll
        # (freed after backward); the root holds fc, norm, lm_head and the frozen embedding
        for unit in module.shard_units():
            fully_shard(unit, mesh=mesh, reshard_after_forward=False)
        return fully_shard(module, mesh=mesh)

    def grad_sync(self, last: bool):
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    state_format = "deepspeed"

    def __init__(self, module, tc, env, device):
        if tc.zero_stage not in (1, 2, 3):
            raise ValueError(f"train.zero_stage: {tc.zero_stage!r} is not 1, 2 or 3")
        try:
            import deepspeed
        except ImportError:
            raise ImportError("train.strategy=deepspeed needs DeepSpeed: pip install 'specforge-eagle3[deepspeed]'") from None
        if device.type == "cpu":
            # DeepSpeed's CPU backend JIT-compiles a shared-memory kernel (~100 s) that only its
            # inference all-reduce uses; training communicates through torch.distributed (gloo)
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.tc, self.env, self.device = tc, env, device
        module = module.to(device)
        params = _trainable(module)
        config = {
            "train_micro_batch_size_per_gpu": tc.batch_size,
            "gradient_accumulation_steps": tc.grad_accum,
            "train_batch_size": tc.batch_size * tc.grad_accum * env.world_size,
            "gradient_clipping": max(tc.grad_clip, 0.0),
            "zero_optimization": {"stage": tc.zero_stage},
            "zero_allow_untested_optimizer": True,  # a plain torch AdamW: no compiled optimizer op
            "steps_per_print": 1 << 30,
        }
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(module, tc),
                                               model_parameters=params, config=config)
        self.engine = self.model = engine
        self.inner = engine.module
        self.optimizer = engine.optimizer.optimizer  # the torch AdamW: LR schedulers act on its groups

    def backward(self, loss):
        self.engine.backward(loss)  # scaled by 1/gradient_accumulation_steps inside
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # advances DeepSpeed's micro-step counter; no update

    def step(self) -> float | None:
        """The engine's step; its gradient norm, or None where DeepSpeed computes none (not a
        diverged step: the loop stops only on a known inf/nan norm)."""
        if not self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError("deepspeed: step() off a gradient accumulation boundary")
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def full_state_dict(self):
        import deepspeed

        params = list(self.inner.parameters())
        ctx = (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.tc.zero_stage == 3
               else contextlib.nullcontext())
        with ctx:
            if not self.env.is_main:
                return {}
            return {k: v.detach().cpu().clone() for k, v in self.inner.state_dict().items()}

    def save_state(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(Path(directory) / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                    save_latest=False)

    def load_state(self, directory: Path, meta: dict) -> None:
        if meta.get("state_format") != self.state_format:
            raise ValueError(f"{directory}: a training state written by the {meta.get('strategy')!r} strategy "
                             "cannot be resumed with train.strategy=deepspeed; resume with the same strategy "
                             "or start over with train.resume=never")
        if meta.get("world_size") != self.env.world_size:
            raise ValueError(f"{directory}: DeepSpeed states resume on the same number of processes "
                             f"(written by {meta.get('world_size')}, now {self.env.world_size})")
        path, _ = self.engine.load_checkpoint(str(Path(directory) / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"{directory}: DeepSpeed could not load its checkpoint")

    def close(self) -> None:
        self.engine = self.model = self.inner = self.optimizer = None


def make_strategy(module: torch.nn.Module, tc, env, device: torch.device) -> Strategy:
    """The strategy `train.strategy` names, for this process group. One process runs `single`
    whatever was asked (DDP/FSDP/ZeRO over one process is the same computation)."""
    if tc.strategy not in STRATEGIES:
        raise ValueError(f"train.strategy: {tc.strategy!r} is not one of {list(STRATEGIES)}")
    if tc.strategy == "single" and env.world_size > 1:
        raise ValueError(f"train.strategy=single but {env.world_size} processes were launched "
                         f"({env.launcher}); use train.strategy=ddp, fsdp or deepspeed")
    if env.world_size == 1:
        return Strategy(module, tc, env, device)
    return {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "deepspeed": DeepSpeedStrategy}[tc.strategy](
        module, tc, env, device)
