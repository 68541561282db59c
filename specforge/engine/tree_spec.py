"""`TreeSpec`: the shape of a draft tree (`T_K_N`), a plain value; imports no torch, so that
launch code and configs can use it. The tree itself is built in specforge/engine/tree.py."""
from __future__ import annotations

import re
from dataclasses import dataclass

from specforge.errors import InvalidInput


@dataclass(frozen=True)
class TreeSpec:
    """`T_K_N`: draft steps T, top-k K, draft tokens N (the root counts as one of the N)."""

    steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self):
        t, k, n = self.steps, self.topk, self.num_draft_tokens
        for name, v in (("steps", t), ("topk", k), ("num_draft_tokens", n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidInput(f"tree {self.name}: {name} must be a positive integer, got {v!r}")
        if n < 2:
            raise InvalidInput(f"tree {self.name}: num_draft_tokens N={n} must be >= 2 (root + one draft)")
        if k == 1 and n != t + 1:
            raise InvalidInput(
                f"tree {self.name}: topk K=1 is a chain, so N must be T+1={t + 1} (got N={n})"
            )
        if n - 1 > self.num_candidates:
            raise InvalidInput(
                f"tree {self.name}: N-1={n - 1} draft tokens but only K+(T-1)*K*K="
                f"{self.num_candidates} candidates exist; lower N or raise T/K"
            )

    @classmethod
    def parse(cls, text: str) -> "TreeSpec":
        m = re.fullmatch(r"\s*(\d+)_(\d+)_(\d+)\s*", str(text))
        if not m:
            hint = (" (YAML and Hydra read an unquoted 5_1_6 as the number 516: quote it)"
                    if str(text).isdigit() else "")
            raise InvalidInput(f"tree {text!r}: expected 'T_K_N' (steps_topk_numdrafttokens), e.g. '8_2_16'{hint}")
        return cls(*(int(g) for g in m.groups()))

    @classmethod
    def parse_list(cls, texts, setting: str, extra: str = "") -> list["TreeSpec"]:
        """The trees of a setting (eval.trees, eval.planner_trees), each named once: a bad one or a
        repeat (measured twice, reported once) is refused naming `setting`; `extra` ends the latter."""
        try:
            specs = [cls.parse(t) for t in texts]
        except InvalidInput as e:
            raise InvalidInput(f"{setting}: {e}") from None
        names = [s.name for s in specs]
        if repeated := sorted({n for n in names if names.count(n) > 1}):
            raise InvalidInput(f"{setting}: {', '.join(repeated)} listed more than once; name each tree once{extra}")
        return specs

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.steps - 1) * self.topk * self.topk

    @property
    def name(self) -> str:
        return f"{self.steps}_{self.topk}_{self.num_draft_tokens}"

    def __str__(self) -> str:
        return self.name
