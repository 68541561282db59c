"""The demo's speed-up: its checkpoint against the base model, fp32 (lossless), batch 1, T=0.

Runs the evaluation stage's own code (`eval_with_engine`: base before and after, same prompts,
same warm-up) over the held-out prompts for a few trees, takes the fastest tree among those whose
output equals the base model's on every request, and writes `benchmarks/results/demo_speedup.json`
({"tree", "speedup", "accept_length", "lossless_share", "dtype", "command"} plus every tree's row).
Each row also gives the bound accept length x t_base / t_round (the speed-up if the decode rounds
were all the time spent: the prefill and the base model's other costs out), and how far the
measured speed-up is from it. Both models find the system prompt that every held-out prompt starts
with cached (eval.shared_prefix, as SGLang's radix cache serves them); `--no-shared-prefix`
prefills every prompt whole.

    .venv/bin/python benchmarks/demo_speedup.py --ckpt outputs/smollm2_weather/epoch_6

Timings are only meaningful on a quiet machine: the 1-min load average is recorded. It runs on
the allocator evaluate.py runs with (mimalloc; SPECFORGE_ALLOCATOR=system: glibc's), recorded too.
"""
from __future__ import annotations

if __name__ == "__main__":  # as evaluate.py: re-executes once with mimalloc preloaded
    from specforge.utils.allocator import preload_mimalloc

    preload_mimalloc()

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CKPT = ROOT / "outputs" / "smollm2_weather"
CPU_TREES = ["2_1_3", "3_1_4", "3_2_4", "2_2_4", "4_2_8"]  # 1-4 row verifies are cheap on a CPU (few_rows.py)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="a checkpoint, or a run directory (its last epoch)")
    p.add_argument("--trees", nargs="+", default=CPU_TREES, help="trees T_K_N")
    p.add_argument("--num-prompts", type=int, default=40, help="held-out prompts (at most the split's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-shared-prefix", action="store_true",
                   help="prefill every prompt whole (default: the system prompt all share stays cached, eval.shared_prefix)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "demo_speedup.json"))
    return p.parse_args(argv)


def bound(row: dict, base: dict) -> float:
    """accept length x t_base / t_round: decode tokens per round over the rounds' cost in base steps."""
    return row["accept_length"] * base["ms_per_step"] / row["ms_per_round"]


def main(argv=None) -> int:
    args = parse_args(argv)
    from omegaconf import OmegaConf

    from specforge.config import EvalConfig
    from specforge.eval.engine_eval import eval_with_engine, find_checkpoints, load_run_config
    from specforge.eval.report import best_config
    from specforge.utils.allocator import running_allocator
    from specforge.utils.io import write_json

    try:
        run_dir, ckpts = find_checkpoints(args.ckpt)
    except FileNotFoundError as e:
        print(f"{e}\nrun the demo first (make demo) or pass --ckpt DIR", file=sys.stderr)
        return 2
    ckpt = ckpts[-1]
    run_cfg = load_run_config(run_dir)
    eval_cfg = OmegaConf.structured(EvalConfig(trees=list(args.trees), num_prompts=args.num_prompts,
                                               max_new_tokens=args.max_new_tokens, dtype="float32",
                                               shared_prefix=not args.no_shared_prefix))
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    results = eval_with_engine(run_cfg, [ckpt], eval_cfg)
    load_after = os.getloadavg()[0]
    base = results["base"]
    rows = []
    for r in results["configs"]:
        b = bound(r, base)
        rows.append({"tree": r["tree"], "accept_length": r["accept_length"], "speedup": r["speedup"],
                     "decode_speedup": r["decode_speedup"], "round_cost_steps": r["round_cost_steps"],
                     "verify_cost_steps": r["verify_cost_steps"], "draft_cost_steps": r["draft_cost_steps"],
                     "bound": b, "of_bound": r["speedup"] / b, "lossless_share": r["lossless"],
                     "tok_s": r["tok_s"]})
    best = best_config(results)
    if best is None or best["all_lossy"]:
        print("no tree reproduced the base model's output on every request: nothing to record", file=sys.stderr)
        return 1
    top = next(r for r in rows if r["tree"] == best["tree"])
    record = {"tree": top["tree"], "speedup": top["speedup"], "accept_length": top["accept_length"],
              "lossless_share": top["lossless_share"], "dtype": results["meta"]["dtype"],
              "command": "python benchmarks/demo_speedup.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "bound": top["bound"], "checkpoint": str(ckpt), "prompts": results["meta"]["prompts"],
              "max_new_tokens": args.max_new_tokens, "base_tok_s": base["tok_s"],
              "shared_prefix_tokens": results["meta"]["shared_prefix_tokens"].get("heldout", 0),
              "base_ms_per_step": base["ms_per_step"], "rows": rows,
              "cpu": platform.processor() or platform.machine(), "threads": results["meta"]["threads"],
              "allocator": running_allocator(),
              "load_avg_1m": [round(load_before, 2), round(load_after, 2)],
              "total_s": round(time.perf_counter() - t0, 1)}
    write_json(args.out, record)
    print(f"\n{ckpt}: {record['prompts']} held-out prompts x {args.max_new_tokens} new tokens, "
          f"{record['dtype']}, batch 1, T=0; base {base['tok_s']:.1f} tok/s ({base['ms_per_step']:.1f} ms/step)\n")
    print("| tree | accept length | round cost (steps) | bound | speed-up | of bound | lossless |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mark = "**" if r is top else ""
        print(f"| {mark}{r['tree']}{mark} | {r['accept_length']:.3f} | {r['round_cost_steps']:.2f} | "
              f"{r['bound']:.2f}x | {mark}{r['speedup']:.2f}x{mark} | {100 * r['of_bound']:.0f}% | "
              f"{r['lossless_share']:.3f} |")
    if max(load_before, load_after) > results["meta"]["threads"] + 0.5:
        print(f"\nwarning: 1-min load average {max(load_before, load_after):.1f}: other processes competed "
              "for the CPU, timings are pessimistic", file=sys.stderr)
    print(f"\nwritten: {args.out} (total {record['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
