"""Matmuls of a batch-1 engine on CPU: a few rows against a wide weight.

A decode step multiplies 1 row and a verify forward N rows by every weight of the target, a draft
step 1-K rows by the draft's. For so few rows the kernels that compute the same x @ W^T run at
very different speeds, and which one wins depends on the CPU:
- `plain`: torch's linear. Its GEMM re-packs the whole weight at every call, and on some BLAS
  builds a single row is a matrix-vector product on one core.
- `column`: W @ x^T, a GEMM with a few columns (one row gets a copy as second column). On the
  2-core AVX2 EPYC of docs/benchmarks.md ("Few-row matmuls") it took SmolLM2's decode step from 65
  to 39 ms; on a 2-core AVX-512 Xeon it made it 76 ms against 34.
- `packed`: MKL's GEMM on a weight packed once (`cblas_sgemm_pack`, what torch's CPU inductor
  uses for frozen fp32 linears), rows padded up to the packed row count (PACK_ROWS). On that Xeon,
  SmolLM2's linears over 4 / 8 rows: 31 / 38 ms against 44 / 60 with `plain`.
So the engine times the kernels on the model's own weights once per weight geometry and process
(`choose_kernels`: one pass over all of them per kernel and row count, as a forward streams them)
and takes, for each row count up to MAX_ROWS, the fastest; the planner's cost model stores the
choice it was measured under and brings it back with itself (`kernels_of`, `remember_kernels`).
Only fp32 weights on CPU are considered (the lossless configuration); others, and more rows, use
`plain`. Every kernel gives torch's linear to rounding.
"""
from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from typing import Optional

import torch

MAX_ROWS = 8  # beyond 8 rows W @ x^T was within noise of `plain` on the AVX2 EPYC; packing for more is unmeasured
PACK_ROWS = (4, 8)  # a weight is packed for these row counts; fewer rows are padded up to one
KERNELS = ("plain", "column", "packed")
# Set to {rows: kernel} to bypass the timing (benchmarks/few_rows_bench.py compares each kernel
# alone with the timed choice).
OVERRIDE: Optional[dict] = None
_CHOSEN: dict[str, dict] = {}  # geometry(modules) -> {rows: kernel}


def packable() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def pack_rows(n: int) -> int:
    return next(p for p in PACK_ROWS if p >= n)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: dict | None = None, packed: dict | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)` by the kernel `kernels` names for x's row
    count (`plain` where it names none); `packed` holds the weight packed per PACK_ROWS."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    kernel = (kernels or {}).get(n, "plain")
    if kernel == "plain" or x.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    if kernel == "packed":
        p = pack_rows(n)
        if n < p:
            rows = torch.cat([rows, rows.new_zeros(p - n, rows.shape[1])])
        out = torch.ops.mkl._mkl_linear(rows.contiguous(), packed[p], weight, bias, p)[:n]
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if n == 1:
        rows = torch.cat([rows, rows])
    out = (weight @ rows.T).T[:n]
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def _packs_fit(modules: list[torch.nn.Module]) -> bool:
    """One packed copy per PACK_ROWS of every weight: tried only while they take at most a quarter
    of the memory available now (a 2B fp32 target on a 24 GB machine would not fit twice more)."""
    need = len(PACK_ROWS) * sum(m.weight.numel() * m.weight.element_size() for m in modules)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return False
    return need <= free / 4


def _pack(modules: list[torch.nn.Module]) -> None:
    for m in modules:
        if getattr(m, "few_rows_packed", None) is None:
            m.few_rows_packed = {p: torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), p) for p in PACK_ROWS}


def geometry(modules: list[torch.nn.Module]) -> str:
    """What a kernel choice depends on besides the machine: the weights' shapes, in order, and
    torch's thread count. Two models of one geometry (a target loaded twice, every epoch's draft)
    share a choice, so every engine over them in a process runs the same kernels."""
    shapes = ";".join(f"{tuple(m.weight.shape)}" for m in modules)
    return hashlib.sha1(f"threads {torch.get_num_threads()}|{shapes}".encode()).hexdigest()[:16]


def _timeable(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    return [m for m in modules if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


def choose_kernels(modules: list[torch.nn.Module], repeats: int = 3) -> dict:
    """{rows: kernel} for 1..MAX_ROWS rows: the fastest kernel on this machine over `modules` (a
    model's fp32 matmuls with a `.weight`, in forward order), timed once per `geometry` and
    process (or set by `remember_kernels`, e.g. with a stored cost model measured under it). Every
    pass runs all of them in turn, so a model larger than the caches is timed streaming from
    memory as its forward does; the fastest of `repeats` passes per kernel and row count,
    interleaved. The packed copies (one per PACK_ROWS, so the weights' memory x3) stay on the
    modules (`few_rows_packed`) only where `packed` wins some row count."""
    modules = _timeable(modules)
    if not modules:
        return {}
    if OVERRIDE is not None:
        chosen = dict(OVERRIDE)
    else:
        key = geometry(modules)
        if key not in _CHOSEN:
            _CHOSEN[key] = _time_kernels(modules, repeats)
        chosen = _CHOSEN[key]
    if "packed" in chosen.values() and not all(getattr(m, "few_rows_packed", None) for m in modules):
        if OVERRIDE is None and not (packable() and _packs_fit(modules)):  # a remembered choice, no room now
            return {n: k for n, k in chosen.items() if k != "packed"}
        _pack(modules)
    if "packed" not in chosen.values():
        for m in modules:  # not used: give the memory back
            m.few_rows_packed = None
    return chosen


def _time_kernels(modules: list[torch.nn.Module], repeats: int) -> dict:
    kernels = [k for k in KERNELS if k != "packed" or (packable() and _packs_fit(modules))]
    if "packed" in kernels:
        _pack(modules)
    with torch.inference_mode():
        inputs = {n: {m.weight.shape[1]: torch.randn(n, m.weight.shape[1]) for m in modules} for n in range(1, MAX_ROWS + 1)}

        def one_pass(n: int, kernel: str) -> float:
            start = time.perf_counter()
            for m in modules:
                few_rows_linear(inputs[n][m.weight.shape[1]], m.weight, None, {n: kernel},
                                getattr(m, "few_rows_packed", None))
            return time.perf_counter() - start

        for kernel in kernels:  # warm-up: first touch of the weights and their packed copies
            one_pass(MAX_ROWS, kernel)
        best = {(n, k): float("inf") for n in range(1, MAX_ROWS + 1) for k in kernels}
        for _ in range(repeats):
            for n, k in best:
                best[n, k] = min(best[n, k], one_pass(n, k))
    chosen = {n: min(kernels, key=lambda k: best[n, k]) for n in range(1, MAX_ROWS + 1)}
    return {n: k for n, k in chosen.items() if k != "plain"}


def kernels_of(modules: list[torch.nn.Module]) -> dict:
    """{geometry: {rows: kernel}} as `choose_kernels` chose it for `modules` in this process (empty
    if it has not, or nothing of them is timed); JSON-ready, for `remember_kernels`."""
    modules = _timeable(modules)
    key = geometry(modules) if modules else None
    return {key: {str(n): k for n, k in sorted(_CHOSEN[key].items())}} if key in _CHOSEN else {}


def remember_kernels(stored: dict) -> None:
    """Take choices stored by `kernels_of` (a cost model measured under them) as this process's:
    engines built afterwards over those geometries run them, untimed."""
    for key, chosen in stored.items():
        if not set(chosen.values()) <= set(KERNELS):
            raise ValueError(f"stored few-row kernels {chosen}: not among {KERNELS}")
        _CHOSEN[key] = {int(n): k for n, k in chosen.items()}


class FewRowsLinear(torch.nn.Linear):
    """An nn.Linear whose forward is `few_rows_linear` (same parameters, same state dict); its
    kernels per row count are set by `few_rows_linears`."""

    kernels: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias, self.kernels, getattr(self, "few_rows_packed", None))


def plain_linears(model: torch.nn.Module, subclasses: bool = False) -> list[torch.nn.Linear]:
    """The modules `few_rows_linears` switches: every plain nn.Linear of `model` (`subclasses`:
    every nn.Linear, for a model of ours whose subclasses only add a training-time call)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear or (subclasses and isinstance(m, torch.nn.Linear))]


@contextmanager
def few_rows_linears(linears: list[torch.nn.Linear], kernels: dict):
    """Run `linears` as FewRowsLinear (`kernels`: {rows: kernel}) inside the block, their own
    class again after it: the model may be shared (`specforge serve` extracts hidden states with
    it, and those must stay the extractor's numbers; the draft's lm_head is a DraftHead that
    training calls with teacher rows)."""
    classes = [module.__class__ for module in linears]
    for module in linears:
        module.__class__ = FewRowsLinear
        module.kernels = kernels
    try:
        yield
    finally:
        for module, cls in zip(linears, classes):
            module.__class__ = cls
            del module.kernels
