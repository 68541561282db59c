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
- `onednn`: oneDNN's inner product on a copy of the weight in its own layout (`to_mkldnn`). On a
  2-core AVX-512 EPYC (Zen 4) SmolLM2's matmuls over 8 / 16 / 32 / 128 rows took 30 / 35 / 43 / 102
  ms against 36 / 50 / 72 / 252 with `column` and 46 / 56 / 76 / 197 with `plain` (1-4 rows:
  `column`, 15-20 ms; docs/benchmarks.md, "Few-row matmuls").
So the engine times the kernels on the model's own weights once per weight geometry and process
(`choose_kernels`: one pass over all of them per kernel and row count of TIMED_ROWS, as a forward
streams them) and takes, for each, the fastest (a count between two timed ones takes the choice of
the next one up); the planner's cost model stores the choice it was measured under and brings it
back with itself (`kernels_of`, `remember_kernels`). Only fp32 weights on CPU are considered (the
lossless configuration); others use `plain`. Every kernel gives torch's linear to rounding.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import time
from contextlib import contextmanager
from typing import Optional

import torch

# Row counts timed: the small ones of a CPU round's verify and draft steps, the trees' wider
# verifies, and 128 for more rows (a prefill, the planner's batched draft lanes). A count in between
# takes the choice of the next timed one up, more than 128 the choice for 128 (`timed_count`).
TIMED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 128)
PRUNE = 1.3  # after the first pass, a kernel slower than this x the fastest at a row count is dropped there
PACK_ROWS = (4, 8)  # a weight is packed for these row counts; fewer rows are padded up to one
KERNELS = ("plain", "column", "packed", "onednn")
COPIES = {"packed": len(PACK_ROWS), "onednn": 1}  # copies of every weight a kernel keeps
# Set to {rows: kernel} to bypass the timing (benchmarks/few_rows_bench.py compares each kernel
# alone with the timed choice).
OVERRIDE: Optional[dict] = None
_CHOSEN: dict[str, dict] = {}  # geometry(modules) -> {rows: kernel}


def packable() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_ready() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def timed_count(n: int) -> int:
    """The timed row count whose kernel `n` rows take: the next one up, or the largest."""
    return TIMED_ROWS[min(bisect.bisect_left(TIMED_ROWS, n), len(TIMED_ROWS) - 1)]


def pack_rows(n: int) -> int:
    return next(p for p in PACK_ROWS if p >= n)


def serves(kernel: str, n: int) -> bool:
    """Whether `kernel` computes `n` rows (the weight is packed for at most PACK_ROWS[-1])."""
    return kernel != "packed" or n <= PACK_ROWS[-1]


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: dict | None = None, packed: dict | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)` by the kernel `kernels` names for x's row
    count (`plain` where it names none); `packed` holds the weight's copies of the kernels that
    keep one (`_copy`: per PACK_ROWS for `packed`, "onednn" for `onednn`)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    kernel = (kernels or {}).get(timed_count(n), "plain")
    if kernel == "plain" or x.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    if not serves(kernel, n):
        return torch.nn.functional.linear(x, weight, bias)
    if kernel == "onednn":
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed["onednn"], bias, "none", [None], "")
        return out.reshape(*x.shape[:-1], weight.shape[0])
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


def _copies_fit(modules: list[torch.nn.Module], copies: int) -> bool:
    """`copies` more copies of every weight: kept only while they take at most a quarter of the
    memory available now (a 2B fp32 target on a 24 GB machine would not fit twice more)."""
    need = copies * sum(m.weight.numel() * m.weight.element_size() for m in modules)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return False
    return need <= free / 4


def _copy(modules: list[torch.nn.Module], kernels: set[str]) -> None:
    """Give every module the copies of its weight that `kernels` read (`few_rows_packed`), and
    free those of other kernels."""
    for m in modules:
        have = getattr(m, "few_rows_packed", None) or {}
        keep = {}
        if "packed" in kernels:
            keep.update({p: have.get(p) if p in have else torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), p)
                         for p in PACK_ROWS})
        if "onednn" in kernels:
            keep["onednn"] = have["onednn"] if "onednn" in have else m.weight.detach().to_mkldnn()
        m.few_rows_packed = keep or None


def geometry(modules: list[torch.nn.Module]) -> str:
    """What a kernel choice depends on besides the machine: the weights' shapes, in order, and
    torch's thread count. Two models of one geometry (a target loaded twice, every epoch's draft)
    share a choice, so every engine over them in a process runs the same kernels."""
    shapes = ";".join(f"{tuple(m.weight.shape)}" for m in modules)
    return hashlib.sha1(f"threads {torch.get_num_threads()}|{shapes}".encode()).hexdigest()[:16]


def _timeable(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    return [m for m in modules if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


def choose_kernels(modules: list[torch.nn.Module], repeats: int = 3) -> dict:
    """{rows: kernel} per row count of TIMED_ROWS (`plain` where none is named; other counts: see
    `timed_count`): the fastest kernel on this machine over `modules` (a
    model's fp32 matmuls with a `.weight`, in forward order), timed once per `geometry` and
    process (or set by `remember_kernels`, e.g. with a stored cost model measured under it). Every
    pass runs all of them in turn, so a model larger than the caches is timed streaming from
    memory as its forward does; the fastest of `repeats` passes per kernel and row count,
    interleaved. The weight copies a kernel reads (`packed`: one per PACK_ROWS, `onednn`: one)
    stay on the modules (`few_rows_packed`) only where that kernel wins some row count."""
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
    # a remembered choice may name a kernel this process cannot run, or whose copies do not fit now
    usable = _usable(modules, [k for k in KERNELS if k in chosen.values()])
    runnable = {n: k for n, k in chosen.items() if k in usable and serves(k, n)}
    _copy(modules, set(runnable.values()))
    return chosen if runnable == chosen else runnable


def _runs_here(kernel: str) -> bool:
    return {"packed": packable, "onednn": onednn_ready}.get(kernel, lambda: True)()


def _usable(modules: list[torch.nn.Module], kernels: list[str]) -> list[str]:
    """Of `kernels`, those that run here and whose weight copies are on the modules or fit in
    memory (`packed`, two copies, given up first)."""
    usable = [k for k in kernels if _runs_here(k)]
    missing = [k for k in usable if k in COPIES and not all(_has_copy(m, k) for m in modules)]
    while missing and not _copies_fit(modules, sum(COPIES[k] for k in missing)):
        usable.remove(missing.pop(0))
    return usable


def _has_copy(module: torch.nn.Module, kernel: str) -> bool:
    have = getattr(module, "few_rows_packed", None) or {}
    return all(p in have for p in PACK_ROWS) if kernel == "packed" else kernel in have


def _time_kernels(modules: list[torch.nn.Module], repeats: int) -> dict:
    kernels = _usable(modules, list(KERNELS))
    _copy(modules, set(kernels))
    best = pass_seconds(modules, kernels, repeats, prune=PRUNE)
    fastest = {n: min((k for k in kernels if (n, k) in best), key=lambda k: best[n, k]) for n in TIMED_ROWS}
    return {n: k for n, k in fastest.items() if k != "plain"}


def pass_seconds(modules: list[torch.nn.Module], kernels: list[str], repeats: int,
                 prune: float | None = None) -> dict:
    """{(rows, kernel): the fastest of `repeats` passes over all of `modules`} per row count of
    TIMED_ROWS that the kernel serves, after a warm-up pass per kernel (first touch of the weights
    and their copies, which `kernels` must already have: `_copy`); passes interleaved. `prune`: after
    the first pass, a kernel slower than this x the fastest at a row count is not timed again there."""
    with torch.inference_mode():
        inputs = {n: {m.weight.shape[1]: torch.randn(n, m.weight.shape[1]) for m in modules} for n in TIMED_ROWS}

        def one_pass(n: int, kernel: str) -> float:
            start = time.perf_counter()
            for m in modules:
                few_rows_linear(inputs[n][m.weight.shape[1]], m.weight, None, {n: kernel},
                                getattr(m, "few_rows_packed", None))
            return time.perf_counter() - start

        for kernel in kernels:
            one_pass(PACK_ROWS[-1], kernel)
        best = {(n, k): float("inf") for n in TIMED_ROWS for k in kernels if serves(k, n)}
        for r in range(repeats):
            fastest = {n: min(t for (m, _), t in best.items() if m == n) for n in TIMED_ROWS}
            for n, k in best:
                if r == 0 or prune is None or best[n, k] < prune * fastest[n]:
                    best[n, k] = min(best[n, k], one_pass(n, k))
    return best


def kernels_of(modules: list[torch.nn.Module]) -> dict:
    """{geometry: {rows: kernel}} as `choose_kernels` chose it for `modules` in this process (empty
    if it has not, or nothing of them is timed); JSON-ready, for `remember_kernels`."""
    modules = _timeable(modules)
    key = geometry(modules) if modules else None
    return {key: {str(n): k for n, k in sorted(_CHOSEN[key].items())}} if key in _CHOSEN else {}


def remember_kernels(stored: dict) -> None:
    """Take choices stored by `kernels_of` (a cost model measured under them) as this process's:
    engines built afterwards over those geometries run them, untimed (a kernel that cannot run
    here, or whose copies no longer fit, gives way to `plain`)."""
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
