"""Memory that one TTT attention call keeps for the backward: the eager split against
`ttt_sdpa_attention` (what `train.attention=sdpa` runs off the CPU, on GPUs).

The eager split holds the causal block's [B, h, S, S] scores and probabilities in fp32 (on GPUs it
was `sdpa`'s path until SDPA's own kernels took the diagonals as a sink key); the SDPA path holds
O(S) per head: its padded query, keys and values, output and log-sum-exp, and the diagonals'
weights. Counted with autograd's saved-tensor hooks (each storage once, the call's own inputs
excluded), so the figure is the device's, though it runs here on the CPU's SDPA (there a boolean
[S, S + 1] mask stands in for the lower-right causal flag that GPU kernels take; it is counted).
TTT step 6 (the 7th: the most later keys), batch 1, bf16; the eager split only up to the sizes this
machine's memory holds (`--max-eager-gb`).

    python benchmarks/attention_memory_bench.py   # -> benchmarks/results/attention_memory.json
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge.models.attention import TTTMask, ttt_eager_attention, ttt_sdpa_attention  # noqa: E402
from specforge.utils.io import write_json  # noqa: E402

# (query heads, key heads, head dim) of the drafts of these targets (their attention geometry).
GEOMETRIES = {"SmolLM2-135M": (9, 3, 64), "Qwen3-VL-2B": (16, 8, 128)}
KERNELS = {"eager": ttt_eager_attention, "sdpa-off-cpu": ttt_sdpa_attention}


def saved_mb(kernel, heads: int, kv_heads: int, dim: int, seq: int, step: int) -> float:
    """MB that autograd keeps from one call for its backward, beyond the call's inputs."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, dim, generator=gen).bfloat16().requires_grad_()
    keys = [torch.randn(1, kv_heads, seq, dim, generator=gen).bfloat16().requires_grad_() for _ in range(step + 1)]
    values = [torch.randn(1, kv_heads, seq, dim, generator=gen).bfloat16().requires_grad_() for _ in range(step + 1)]
    inputs = {t.untyped_storage().data_ptr() for t in (q, *keys, *values)}
    held: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = kernel(q, keys, values, TTTMask(seq, step))
    size = sum(held.values()) / 2**20
    del out
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 8192])
    ap.add_argument("--step", type=int, default=6)
    ap.add_argument("--max-eager-gb", type=float, default=8.0, help="skip the eager split above this estimate (GB)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attention_memory.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'geometry':<14} {'S':>6} {'eager MB':>10} {'sdpa-off-cpu MB':>16} {'ratio':>7}")
    for name, (heads, kv_heads, dim) in GEOMETRIES.items():
        for seq in args.seq_lens:
            row = {"geometry": name, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "seq_len": seq,
                   "step": args.step}
            for kernel, fn in KERNELS.items():
                too_big = kernel == "eager" and 4 * heads * seq * seq * 4 / 2**30 > args.max_eager_gb
                row[f"{kernel}_saved_mb"] = None if too_big else round(saved_mb(fn, heads, kv_heads, dim, seq, args.step), 1)
            eager, sdpa = row["eager_saved_mb"], row["sdpa-off-cpu_saved_mb"]
            row["eager_over_sdpa"] = None if eager is None else round(eager / sdpa, 1)
            rows.append(row)
            print(f"{name:<14} {seq:>6} {eager if eager is not None else '-':>10} {sdpa:>16} "
                  f"{row['eager_over_sdpa'] if eager is not None else '-':>7}", flush=True)
    command = "python benchmarks/attention_memory_bench.py" + "".join(f" {a}" for a in sys.argv[1:])
    write_json(Path(args.out), {"rows": rows, "command": command, "torch": torch.__version__,
                                "machine": platform.processor() or platform.machine()})
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
