"""Matmuls of a batch-1 engine on CPU: a few rows against a wide weight.

A decode step multiplies 1 row and a verify forward N rows by every weight of the target, a draft
step 1-K rows by the draft's. For so few rows the CPU BLAS computes x @ W^T as one matrix-vector
product per row, on one core and at about half the memory bandwidth, while W @ x^T with the same
numbers is a GEMM with a few columns that uses every core: on the 2-core CPU of docs/benchmarks.md
("Few-row matmuls"), SmolLM2's decode step went from 65 to 39 ms, a 5-8 node verify from 69-110 to
50-61 ms, a draft step from 1.8 to 1.3 ms. One row is given a copy as second column (one column is
a matrix-vector product again).
Only fp32 weights on CPU take this path (the lossless configuration); others, and more rows, use
`torch.nn.functional.linear` as before.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

# Up to this many rows: W @ x^T. Measured on SmolLM2's verify forward (2026-11-24, 2-core AVX2):
# 5-8 rows 50-61 ms against 69-110 ms; 10-16 rows within noise of the plain path, so it stops at 8.
COLUMN_ROWS = 8


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)`, as W @ x^T where that is faster."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n > COLUMN_ROWS or n == 0 or x.device.type != "cpu" or weight.dtype != torch.float32 \
            or x.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    if n == 1:
        rows = torch.cat([rows, rows])
    out = (weight @ rows.T).T[:n]
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class FewRowsLinear(torch.nn.Linear):
    """An nn.Linear whose forward is `few_rows_linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias)


def plain_linears(model: torch.nn.Module, subclasses: bool = False) -> list[torch.nn.Linear]:
    """The modules `few_rows_linears` switches: every plain nn.Linear of `model` (`subclasses`:
    every nn.Linear, for a model of ours whose subclasses only add a training-time call)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear or (subclasses and isinstance(m, torch.nn.Linear))]


@contextmanager
def few_rows_linears(linears: list[torch.nn.Linear]):
    """Run `linears` as FewRowsLinear inside the block, their own class again after it: the model
    may be shared (`specforge serve` extracts hidden states with it, and those must stay the
    extractor's numbers; the draft's lm_head is a DraftHead that training calls with teacher rows)."""
    classes = [module.__class__ for module in linears]
    for module in linears:
        module.__class__ = FewRowsLinear
    try:
        yield
    finally:
        for module, cls in zip(linears, classes):
            module.__class__ = cls
