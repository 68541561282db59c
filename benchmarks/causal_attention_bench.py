"""The causal block of TTT attention on CPU: torch's flash kernel against the GEMMs it cannot avoid.

At long sequences the causal block is the one part of a training step whose cost per token grows
with S (docs/benchmarks.md, "Training throughput"). This times, on the SmolLM2 draft's geometry
(9 query heads, 3 key heads, head dim 64, batch 1), the kernels the `sdpa` TTT path runs: the flash
forward and our `causal_flash_backward` (in pieces when the heads do not divide among the threads).
Beside them, the ceiling of any kernel written as plain GEMMs: the forward's two matmuls alone
(Q K^T and P V over the causal half, row blocks of 512 queries with the grouped query heads side
by side), without the softmax between them. A kernel that must add the softmax's element-wise
passes to that can only win where the ceiling is well below the flash kernel's time.

    python benchmarks/causal_attention_bench.py     # -> benchmarks/results/causal_attention.json
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge.models.attention import causal_flash_backward  # noqa: E402
from specforge.utils.io import write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 512
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_ceiling(q, k, v):
    """The forward's matmuls over the causal half, as a GEMM kernel would issue them."""
    seq, group = q.shape[2], HEADS // KV_HEADS
    qg = q.unflatten(1, (KV_HEADS, group))  # [B, kvh, r, S, d]
    for start in range(0, seq, BLOCK):
        end = min(start + BLOCK, seq)
        rows = qg[:, :, :, start:end].flatten(2, 3)  # [B, kvh, r*n, d]
        scores = rows @ k[:, :, :end].transpose(-1, -2)
        scores @ v[:, :, :end]


def measure(seq: int, dtype: str, repeats: int) -> dict:
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    q = torch.randn(1, HEADS, seq, HEAD_DIM, dtype=dt)
    k, v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, dtype=dt) for _ in range(2))
    scale = 1.0 / math.sqrt(HEAD_DIM)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = forward(q, k, v, 0.0, True, scale=scale)
    grad = torch.randn_like(out)
    fwd_s = best_of(lambda: forward(q, k, v, 0.0, True, scale=scale), repeats)
    bwd_s = best_of(lambda: causal_flash_backward(grad, q, k, v, out, lse, None, scale), repeats)
    gemm_s = best_of(lambda: gemm_ceiling(q, k, v), repeats)
    flops = 2 * 2 * HEADS * HEAD_DIM * seq * (seq + 1) / 2  # Q K^T and P V over the causal half
    return {"seq_len": seq, "dtype": dtype, "flash_fwd_ms": round(fwd_s * 1e3, 2),
            "flash_bwd_ms": round(bwd_s * 1e3, 2), "gemm_fwd_ceiling_ms": round(gemm_s * 1e3, 2),
            "flash_fwd_gflops": round(flops / fwd_s / 1e9, 1),
            "flash_bwd_gflops": round(2.5 * flops / bwd_s / 1e9, 1),  # 5 matmuls against 2
            "gemm_gflops": round(flops / gemm_s / 1e9, 1),
            "fwd_per_token_us": round(fwd_s / seq * 1e6, 2), "bwd_per_token_us": round(bwd_s / seq * 1e6, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 4096])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=3, help="best of N after a warm-up call")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "causal_attention.json"))
    args = ap.parse_args(argv)
    rows = [measure(s, d, args.repeats) for d in args.dtypes for s in args.seq_lens]
    print("| S | dtype | flash fwd ms | flash bwd ms | GEMM-only fwd ms | flash fwd GFLOP/s | flash bwd GFLOP/s "
          "| GEMM GFLOP/s | fwd + bwd us / token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']} | {r['dtype']} | {r['flash_fwd_ms']} | {r['flash_bwd_ms']} | {r['gemm_fwd_ceiling_ms']} "
              f"| {r['flash_fwd_gflops']} | {r['flash_bwd_gflops']} | {r['gemm_gflops']} "
              f"| {r['fwd_per_token_us'] + r['bwd_per_token_us']:.1f} |")
    write_json(args.out, {"rows": rows, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "cpu": platform.processor() or platform.machine(), "load_1min": os.getloadavg()[0],
                          "command": "python benchmarks/causal_attention_bench.py"})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
