"""The target's verify cost curve: t_verify(N), one forward over N draft tokens after a prefix, as
the engine runs it (TargetRunner.tree: the tree mask over the KV cache, aux states out).

Speculative decoding pays t_verify(N) per round for about accept-length tokens, so the tree to
ship is where tokens per round stop outgrowing t_verify(N) / t_decode. The planner times the
trees of its grid on the run's own target (eval.planner); this prints the whole curve for any
geometry, from a checkpoint or from a config with random weights (timings depend on the shapes
alone: `--config benchmarks/targets/llama-3.1-8b` on a GPU where no checkpoint can travel).
Each N runs on a chain of N tokens (the work is the same for any tree of N nodes) and the cache is
rewound to the prefix after it.

    python benchmarks/verify_cost_bench.py --config benchmarks/targets/llama-3.1-8b   # on a GPU
    python benchmarks/verify_cost_bench.py --tiny                                        # seconds, any CPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from geometry import default_device, load_any  # noqa: E402
from specforge.targets.loader import text_config  # noqa: E402

NS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a target checkpoint directory (HF format)")
    where.add_argument("--config", help="a directory with a config.json: random weights at that geometry")
    where.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke run)")
    p.add_argument("--device", default=default_device())
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix", type=int, default=1024, help="tokens in the cache before the draft tokens")
    p.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=NS, help="draft tokens N")
    p.add_argument("--repeats", type=int, default=10, help="timed forwards per N (median), after one warm-up")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "verify_cost.json"))
    return p.parse_args(argv)


def verify_curve(runner, prefix_len: int, ns: list[int], repeats: int) -> tuple[float, dict[int, float]]:
    """(t_decode, {N: t_verify(N)}) in seconds, medians over `repeats`, after a prefix of random
    tokens; the runner's cache holds only the prefix afterwards."""
    device, vocab = runner.device, text_config(runner.model.config).vocab_size
    gen = torch.Generator().manual_seed(0)
    runner.reset(prefix_len + max(ns) + 1)
    runner.prefill(torch.randint(0, vocab, (prefix_len,), generator=gen))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for i in range(repeats + 1):  # the first warms up kernels and the allocator
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i:
                times.append(time.perf_counter() - t0)
            for layer in runner.cache.layers:  # rewind: entries past the prefix are scratch
                layer.length = prefix_len
        return statistics.median(times)

    t_decode = timed(lambda: runner.decode(torch.randint(0, vocab, (1,), generator=gen)))
    curve = {}
    for n in ns:
        tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)
        depth = torch.arange(n, device=device)
        chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        curve[n] = timed(lambda: runner.tree(tokens, depth, chain))
    return t_decode, curve


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    from specforge.engine.target import TargetRunner
    from specforge.eval.cost_model import describe_device
    from specforge.targets.loader import default_aux_layer_ids
    from specforge.utils.io import write_json

    tmp = None
    model_dir = args.model
    if args.tiny:
        from specforge.targets.tiny import build_tiny_llama

        tmp = tempfile.TemporaryDirectory()
        model_dir = build_tiny_llama(Path(tmp.name) / "tiny", num_hidden_layers=8)
    model, name = load_any(model_dir, args.config, args.dtype, args.device)
    cfg = text_config(model.config)
    runner = TargetRunner(model, default_aux_layer_ids(cfg.num_hidden_layers))
    t_decode, curve = verify_curve(runner, args.prefix, args.ns, args.repeats)
    rows = [{"n": n, "t_verify_ms": round(t * 1e3, 3), "vs_decode": round(t / t_decode, 2)} for n, t in curve.items()]
    report = {
        "target": name,
        "geometry": {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
                     "vocab_size": cfg.vocab_size},
        "device": describe_device(runner.device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prefix_len": args.prefix,
        "repeats": args.repeats,
        "t_decode_ms": round(t_decode * 1e3, 3),
        "rows": rows,
        "command": " ".join(["python benchmarks/verify_cost_bench.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    write_json(args.out, report)
    print(f"{name} on {report['device']}, {report['dtype']}, prefix {args.prefix}: "
          f"t_decode {report['t_decode_ms']} ms\n\n| N | t_verify(N) ms | / t_decode |\n|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['t_verify_ms']} | {r['vs_decode']} |")
    print(f"\nwritten: {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
