"""The optimizer of the draft (`train.optimizer`).

- adamw: torch's AdamW over every trainable parameter.
- muon: torch's Muon (momentum, then Newton-Schulz orthogonalisation of the update) for the
  hidden matrices (fc, attention and MLP projections), AdamW for the rest (lm_head, norms): the
  split Muon is published with. Its update is scaled to AdamW's RMS ("match_rms_adamw"), so the
  same learning rate and schedule serve both. It needs each matrix whole on a rank, so it runs
  with the single and ddp strategies only. torch runs the orthogonalisation in bf16; on a CPU
  without native bf16 matmul it runs in float32 here (`Muon`), as the models do there.
"""
from __future__ import annotations

import math

import torch

from specforge.config import OPTIMIZERS
from specforge.targets.loader import compute_dtype
# AdamW even when 2-D: the output head (a classifier, not a hidden map) and embeddings
NOT_MUON = ("lm_head", "embed")


def newton_schulz(grad: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of `grad`, in `dtype`:
    torch.optim.Muon's, which computes in bf16 alone."""
    a, b, c = coefficients
    x = grad.to(dtype)
    wide = grad.size(0) > grad.size(1)
    if wide:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


def lr_scale(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate factor for a matrix of `shape`."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


class Muon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):  # torch < 2.9 has none: MuonWithAdamW refuses
    """torch's Muon (its groups, state and update) with the Newton-Schulz iteration in `ns_dtype`.
    torch computes it in bf16, which a CPU without native bf16 multiplies with its reference GEMM:
    24 s of a ~26 s step of the demo on an AVX2 EPYC. In bf16 it is torch's update to the bit
    (tests/test_optimizer.py)."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # torch's: the momentum buffers
            for param, grad, buffer in zip(params, grads, buffers):
                buffer.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-group["lr"] * lr_scale(group["adjust_lr_fn"], param.shape))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer (one set of param groups for the LR scheduler, one state dict for
    checkpoints) over a Muon and an AdamW that share its groups and state."""

    def __init__(self, muon_params, adamw_params, lr: float, weight_decay: float):
        if not hasattr(torch.optim, "Muon"):  # pyproject allows torch >= 2.6; Muon came with 2.9
            raise ImportError(f"train.optimizer=muon needs torch >= 2.9 (torch.optim.Muon); this is torch "
                              f"{torch.__version__}: upgrade torch or set train.optimizer=adamw")
        muon_params = list(muon_params)
        device = muon_params[0].device if muon_params else torch.device("cpu")
        self.muon = Muon(muon_params, ns_dtype=compute_dtype(torch.bfloat16, device), lr=lr,
                         weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # replaces the groups and the state: share them again
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.muon.step(closure)  # evaluates the closure, if any, once
        self.adamw.step()
        return loss


def build_optimizer(named_params: list[tuple[str, torch.nn.Parameter]], tc) -> torch.optim.Optimizer:
    if tc.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named_params], lr=tc.lr, weight_decay=tc.weight_decay)
    if tc.optimizer == "muon":
        muon = [p for name, p in named_params if p.ndim == 2 and not any(k in name for k in NOT_MUON)]
        chosen = {id(p) for p in muon}
        rest = [p for _, p in named_params if id(p) not in chosen]
        return MuonWithAdamW(muon, rest, tc.lr, tc.weight_decay)
    raise ValueError(f"train.optimizer: {tc.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
