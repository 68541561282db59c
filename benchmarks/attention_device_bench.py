"""The TTT attention paths on an accelerator: one call of each (forward + backward) at TTT step 6
(the 7th: the most later keys), its time, peak memory and agreement with `sdpa`. The device check
to run where a GPU is lent (one short call); on the CPU it runs small shapes as a smoke test.

- eager: `ttt_eager_attention`, the split in plain torch ([B, h, S, S] fp32 scores kept);
- sdpa: `ttt_sdpa_attention`, what train.attention=sdpa runs off the CPU (SDPA's fused kernels,
  the later steps' diagonals as one sink key per query);
- flex: FlexAttention, compiled, over the concatenated steps' keys with the TTT block mask, with
  the tiles train.attention=flex runs (`flex_kernel_options`);
- flex-torch-tiles: the same with torch's default tiles (on an H200 their forward did not compile
  for bf16 document-packed rows: a failure is recorded as the row's error).

Peak memory is the device's allocator peak over the call beyond its inputs (CUDA only); an
out-of-memory is recorded as such and the next configuration runs. Agreement: the largest
absolute difference from `sdpa` in the output and the query's gradient.

    python benchmarks/attention_device_bench.py                  # a GPU: 4,096 and 8,192 tokens
    python benchmarks/attention_device_bench.py --documents 4       # rows of 4 packed documents
    python benchmarks/attention_device_bench.py --device cpu --seq-lens 256 --impls eager,sdpa
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge.models.attention import TTTMask, flex_attention, ttt_eager_attention, ttt_sdpa_attention  # noqa: E402
from specforge.utils.io import write_json  # noqa: E402

IMPLS = {
    "eager": ttt_eager_attention,
    "sdpa": ttt_sdpa_attention,
    "flex": lambda q, keys, values, mask: flex_attention(q, torch.cat(keys, 2), torch.cat(values, 2), mask),
    "flex-torch-tiles": lambda q, keys, values, mask: flex_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                                     mask, kernel_options=None),
}
OOM = getattr(torch.cuda, "OutOfMemoryError", MemoryError)


def _inputs(args, seq, device):
    gen = torch.Generator().manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]

    def tensor(heads):
        return torch.randn(args.batch, heads, seq, args.head_dim, generator=gen).to(device, dtype).requires_grad_()

    keys = [tensor(args.kv_heads) for _ in range(args.step + 1)]
    values = [tensor(args.kv_heads) for _ in range(args.step + 1)]
    return tensor(args.heads), keys, values


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, q, keys, values, mask, repeats, device) -> dict:
    """Best-of-`repeats` seconds of forward + backward after a warm-up call (flex compiles in it)."""
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, q.dtype)

    def call():
        out = fn(q, keys, values, mask)
        dq, = torch.autograd.grad(out, [q], grad)
        return out.detach(), dq

    out, dq = call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    return {"ms": round(1e3 * min(times), 2), "peak_mb": None if peak is None else round(peak, 1),
            "out": out.float(), "dq": dq.float()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192])
    ap.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    ap.add_argument("--heads", type=int, default=16, help="the Qwen3-VL-2B draft's: 16 / 8 / 128")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--step", type=int, default=6)
    ap.add_argument("--documents", type=int, default=0, help="packed documents of equal length per row (0: none)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attention_device.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    print(f"{'S':>6} {'impl':<6} {'ms':>9} {'peak MB':>9} {'|out - sdpa|':>13} {'|dq - sdpa|':>12}")
    for seq in args.seq_lens:
        q, keys, values = _inputs(args, seq, device)
        doc_ids = None
        if args.documents:
            doc_ids = (torch.arange(seq, device=device) * args.documents // seq).expand(args.batch, seq)
        mask = TTTMask(seq, args.step, doc_ids)
        results = {}
        for impl in args.impls:
            try:
                results[impl] = measure(IMPLS[impl], q, keys, values, mask, args.repeats, device)
            except OOM:
                results[impl] = {"ms": None, "peak_mb": None, "error": "out of memory"}
                torch.cuda.empty_cache()
            except Exception as e:  # flex: no backward on CPU; a kernel that does not compile
                results[impl] = {"ms": None, "peak_mb": None, "error": str(e).splitlines()[0][:160]}
        ref = results.get("sdpa", {})
        for impl, r in results.items():
            row = {"seq_len": seq, "impl": impl, "ms": r["ms"], "peak_mb": r["peak_mb"], "error": r.get("error")}
            if "out" in r and "out" in ref:
                row["out_diff"] = round((r["out"] - ref["out"]).abs().max().item(), 5)
                row["dq_diff"] = round((r["dq"] - ref["dq"]).abs().max().item(), 5)
            rows.append(row)
            print(f"{seq:>6} {impl:<6} {row['ms'] if row['ms'] is not None else '-':>9} "
                  f"{row['peak_mb'] if row['peak_mb'] is not None else '-':>9} {row.get('out_diff', '-'):>13} "
                  f"{row.get('dq_diff', '-'):>12} {row['error'] or ''}", flush=True)
        del q, keys, values, results
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    command = "python benchmarks/attention_device_bench.py" + "".join(f" {a}" for a in sys.argv[1:])
    write_json(Path(args.out), {"rows": rows, "device": device_name, "torch": torch.__version__,
                                "geometry": {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim", "batch",
                                                                          "step", "dtype", "documents")},
                                "command": command})
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
