"""Where the time goes in speculative decoding: per-phase profile of the embedded engine.

Runs the base model and the speculative engine (one checkpoint x each tree) on the run's held-out
prompts with the evaluation code itself (`specforge.eval.engine_eval.eval_with_engine`: base before
and after, same prompts, same warm-up), then prints per verify round the ms of each phase (draft,
verify, accept, cache, other), the base model's ms per decode step, and the cost of a round in
base decode steps: decode speed-up ~= accept length / round cost. Writes the figures as JSON.

    .venv/bin/python benchmarks/engine_profile.py --ckpt outputs/smollm2_weather/epoch_3 \\
        --trees 5_1_6 8_2_16 --num-prompts 8 --max-new-tokens 128 --dtype bfloat16

A run directory as --ckpt profiles its last epoch (--all-epochs: every one). Timings are only
meaningful on a quiet machine: the 1-min load average is recorded and a warning printed.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CKPT = ROOT / "outputs" / "smollm2_weather"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="a checkpoint directory or a run directory")
    p.add_argument("--all-epochs", action="store_true", help="with a run directory: every epoch, not the last")
    p.add_argument("--trees", nargs="+", default=["5_1_6", "8_2_16"], help="trees T_K_N")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default=None, help="engine dtype of target and draft (default: the run's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_profile.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from omegaconf import OmegaConf

    from specforge.config import EvalConfig
    from specforge.eval.report import profile_lines
    from specforge.eval.engine_eval import eval_with_engine, find_checkpoints, load_run_config
    from specforge.utils.io import write_json

    try:
        run_dir, ckpts = find_checkpoints(args.ckpt)
    except FileNotFoundError as e:
        print(f"{e}\nrun the demo first (make demo) or pass --ckpt DIR", file=sys.stderr)
        return 2
    if not args.all_epochs:
        ckpts = ckpts[-1:]
    run_cfg = load_run_config(run_dir)
    eval_cfg = OmegaConf.structured(EvalConfig(
        trees=list(args.trees), num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        dtype=args.dtype, temperature=args.temperature))

    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    results = eval_with_engine(run_cfg, ckpts, eval_cfg)
    for row in results["configs"]:
        row.pop("requests_detail", None)  # per-token times: results.json of evaluate.py keeps them
    load_after = os.getloadavg()[0]
    report = {
        "run": str(run_dir),
        "checkpoints": [str(c) for c in ckpts],
        "trees": list(args.trees),
        **results["meta"],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "cpu": platform.processor() or platform.machine(),
        "total_s": round(time.perf_counter() - t_start, 1),
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(load_after, 2),
        "base": results["base"],
        "configs": results["configs"],
    }
    write_json(args.out, report)
    meta = results["meta"]
    print(f"\n{run_dir.name}: {meta['prompts']} prompts x {meta['max_new_tokens']} new tokens, "
          f"{meta['dtype']} on {meta['device']} ({meta['threads']} threads), torch {report['torch']}\n")
    print("\n".join(profile_lines(results)))
    busiest = max(load_before, load_after)
    if meta["device"] == "cpu" and busiest > meta["threads"] + 0.5:
        print(f"\nwarning: 1-min load average reached {busiest:.1f} on {os.cpu_count()} cores: other processes "
              "competed for the CPU, timings are pessimistic", file=sys.stderr)
    print(f"\nwritten: {args.out} (total {report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
