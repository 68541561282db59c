"""Matmul throughput per dtype on this CPU, at the shapes of the demo (SmolLM2-135M: H = 576,
MLP 1,536, vocab 49,152), and what `compute_dtype` (specforge/targets/loader.py) picks here; then
Muon's Newton-Schulz orthogonalisation of the demo draft's hidden matrices, one optimizer step, in
bf16 (what torch.optim.Muon runs) and float32 (what the training runs where bf16 is not native).

Why: without native half-precision support (AVX2 only: no AVX512 / AMX) torch's CPU matmul takes
a reference GEMM for bf16, and a bf16 demo runs for hours; the pipeline computes in float32 there.

    .venv/bin/python benchmarks/cpu_dtype_bench.py
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [(512, 576, 1536), (512, 1536, 576), (64, 576, 49152)]  # rows x in x out: MLP up, down, the head


def gflops(dtype, rows, k, n, repeats):
    a, b = torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * rows * k * n / statistics.median(times) / 1e9


def newton_schulz_seconds(repeats: int) -> list[dict]:
    """Seconds of the Newton-Schulz iteration per matrix Muon takes in the demo's draft (SmolLM2
    geometry, build_optimizer's choice), bf16 and float32, best of `repeats`."""
    from specforge.distributed.optimizer import NOT_MUON, Muon, newton_schulz
    from specforge.models.draft import Eagle3Config, Eagle3Draft

    cfg = Eagle3Config(vocab_size=49152, draft_vocab_size=2048, hidden_size=576, intermediate_size=1536,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, target_hidden_size=576,
                       aux_layer_ids=[1, 14, 26])
    matrices = [(n, p) for n, p in Eagle3Draft(cfg).named_parameters()
                if p.ndim == 2 and not any(k in n for k in NOT_MUON)]
    rows = []
    for name, param in matrices:
        grad = torch.randn(param.shape)
        settings = Muon([param]).defaults  # torch's coefficients, steps and eps
        row = {"matrix": name, "shape": list(param.shape)}
        for dtype in (torch.bfloat16, torch.float32):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                newton_schulz(grad, settings["ns_coefficients"], settings["ns_steps"], settings["eps"], dtype)
                times.append(time.perf_counter() - t0)
            row[f"{str(dtype).removeprefix('torch.')}_s"] = round(min(times), 4)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_dtype.json"))
    args = p.parse_args(argv)
    from specforge.eval.cost_model import describe_device
    from specforge.targets.loader import compute_dtype, cpu_has_fast, dtype_name

    rows = []
    print("| shape (rows x in x out) | float32 GFLOP/s | bfloat16 GFLOP/s | float16 GFLOP/s |\n|---|---|---|---|")
    for shape in SHAPES:
        row = {"shape": list(shape), **{dtype_name(d): round(gflops(d, *shape, args.repeats), 2)
                                        for d in (torch.float32, torch.bfloat16, torch.float16)}}
        rows.append(row)
        print(f"| {' x '.join(map(str, shape))} | {row['float32']} | {row['bfloat16']} | {row['float16']} |", flush=True)
    print("\n| Muon's Newton-Schulz, one step | shape | bfloat16 s | float32 s |\n|---|---|---|---|")
    muon = newton_schulz_seconds(args.repeats)
    for r in muon + [{"matrix": "all", "shape": "", **{k: round(sum(m[k] for m in muon), 3)
                                                        for k in ("bfloat16_s", "float32_s")}}]:
        print(f"| {r['matrix']} | {' x '.join(map(str, r['shape']))} | {r['bfloat16_s']} | {r['float32_s']} |")
    out = {"device": describe_device("cpu"), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.machine(),
           "native": {dtype_name(d): cpu_has_fast(d) for d in (torch.bfloat16, torch.float16)},
           "compute_dtype": {dtype_name(d): dtype_name(compute_dtype(d, "cpu")) for d in (torch.bfloat16, torch.float16)},
           "rows": rows, "muon_newton_schulz": muon, "command": shlex.join([".venv/bin/python", "benchmarks/cpu_dtype_bench.py", *(argv or sys.argv[1:])])}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nnative: {out['native']}; computes in: {out['compute_dtype']}\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
