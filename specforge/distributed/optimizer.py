"""The optimizer of the draft (`train.optimizer`).

- adamw: torch's AdamW over every trainable parameter.
- muon: torch's Muon (momentum, then Newton-Schulz orthogonalisation of the update) for the
  hidden matrices (fc, attention and MLP projections), AdamW for the rest (lm_head, norms): the
  split Muon is published with. Its update is scaled to AdamW's RMS ("match_rms_adamw"), so the
  same learning rate and schedule serve both. It needs each matrix whole on a rank, so it runs
  with the single and ddp strategies only.
"""
from __future__ import annotations

import torch

from specforge.config import OPTIMIZERS
# AdamW even when 2-D: the output head (a classifier, not a hidden map) and embeddings
NOT_MUON = ("lm_head", "embed")


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer (one set of param groups for the LR scheduler, one state dict for
    checkpoints) over a Muon and an AdamW that share its groups and state."""

    def __init__(self, muon_params, adamw_params, lr: float, weight_decay: float):
        if not hasattr(torch.optim, "Muon"):  # pyproject allows torch >= 2.6; Muon came with 2.9
            raise ImportError(f"train.optimizer=muon needs torch >= 2.9 (torch.optim.Muon); this is torch "
                              f"{torch.__version__}: upgrade torch or set train.optimizer=adamw")
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
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
