"""Run by test_cuda.py in a process of its own: DDP and FSDP2 over a process group of one rank
(NCCL on a GPU, gloo on the CPU) take one optimizer step on a tiny draft; prints the loss and the
largest weight difference of each from the plain single-process step, as JSON. One GPU cannot host
two NCCL ranks, and train.py runs `single` for one process, so this is where the wrappers and
NCCL's set-up meet CUDA on a one-GPU machine.

    python tests/one_rank_strategies.py cuda|cpu
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specforge.config import TrainConfig  # noqa: E402
from specforge.distributed.env import DistEnv  # noqa: E402
from specforge.distributed.strategy import DDPStrategy, FSDPStrategy, Strategy  # noqa: E402
from specforge.launch.process import free_port  # noqa: E402
from specforge.train.loop import TTTModule  # noqa: E402
from specforge.train.ttt import Teacher  # noqa: E402
from tests.test_ttt import random_batch, tiny_draft  # noqa: E402


def one_step(strategy_class, env, device) -> tuple[float, dict[str, torch.Tensor]]:
    draft = tiny_draft().to(device)
    head = torch.randn(draft.config.vocab_size, draft.config.target_hidden_size,
                       generator=torch.Generator().manual_seed(3)).to(device)
    module = TTTModule(draft, Teacher(head, draft.t2d), ttt_length=3, step_weight=0.8)
    strategy = strategy_class(module, TrainConfig(lr=1e-2), env, device)
    batch = {k: v.to(device) for k, v in random_batch(draft).items()}
    with strategy.grad_sync(last=True):
        loss, _ = strategy.model(batch)
        strategy.backward(loss)
    strategy.step()
    return float(loss), strategy.full_state_dict()


def main(device_name: str) -> None:
    backend = "nccl" if device_name == "cuda" else "gloo"
    env = DistEnv(0, 1, 0, 1, "torchrun", backend)
    device = env.device if backend == "nccl" else torch.device("cpu")  # with its index: set_device needs one
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            **({"device_id": device} if backend == "nccl" else {}))
    start = {k: v.detach().cpu() for k, v in TTTModule(tiny_draft(), None, 3, 0.8).state_dict().items()}
    want_loss, want = one_step(Strategy, env, device)
    result = {"backend": backend, "loss": want_loss,  # the step moved the weights: the comparison means something
              "step_moved": max(float((want[k].float() - start[k].float()).abs().max()) for k in want)}
    for cls in (DDPStrategy, FSDPStrategy):
        loss, got = one_step(cls, env, device)
        assert got.keys() == want.keys(), (cls.name, sorted(got.keys() ^ want.keys()))
        result[cls.name] = {"loss": loss, "max_weight_diff": max(float((got[k].float() - want[k].float()).abs().max())
                                                                 for k in want)}
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
