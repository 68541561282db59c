"""The planner's cost: a grid of trees from one greedy pass (specforge/eval/planner.py) against ONE
tree's engine evaluation on the same prompts (issue #13 asks for a 20-tree grid in <= 2x of it).

Also checks the planner against that engine run: the share of requests whose per-round accepted
drafts are identical (1.0 expected at fp32; bf16 rounding can move a near-tie).

    .venv/bin/python benchmarks/planner_bench.py --ckpt outputs/smollm2_weather/epoch_6 \\
        --num-prompts 16 --max-new-tokens 128 --engine-tree 5_1_6
    .venv/bin/python benchmarks/planner_bench.py --tiny   # smoke run: tiny random target and draft

Writes benchmarks/results/planner.json (--out).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GRID = ["1_1_2", "2_1_3", "3_1_4", "4_1_5", "5_1_6", "6_1_7", "8_1_9",
        "3_2_4", "4_2_8", "5_2_8", "6_2_12", "8_2_16",
        "3_4_8", "4_4_16", "5_4_16", "6_4_24", "8_4_32",
        "4_8_16", "6_8_32", "8_8_64"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="a checkpoint directory (epoch_<k>) or a run directory (its last epoch)")
    p.add_argument("--tiny", action="store_true", help="tiny random target + random draft (smoke run)")
    p.add_argument("--trees", nargs="+", default=GRID)
    p.add_argument("--engine-tree", default="5_1_6", help="the one tree the engine evaluates")
    p.add_argument("--decode-trajectory", action="store_true",
                   help="greedy tokens by target decoding (default: by the engine with --engine-tree)")
    p.add_argument("--batch", type=int, default=256, help="draft lanes per batched forward (0: per round start)")
    p.add_argument("--check-trees", nargs="*", default=[],
                   help="also run the engine (untimed) on these trees of the grid to report their exact share")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default=None, help="target and draft dtype (default: the run's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner.json"))
    return p.parse_args(argv)


def load_tiny(num_prompts: int):
    from transformers import AutoModelForCausalLM

    from specforge.models.draft import Eagle3Config, Eagle3Draft
    from specforge.targets.tiny import build_tiny_llama

    path = build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny")
    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.from_target(target.config, [0, 1, 2])).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.config.vocab_size, (12,), generator=g).tolist() for _ in range(num_prompts)]
    return target, draft, prompts, None, "tiny random llama (fp32)"


def load_run(ckpt: str, num_prompts: int, dtype_name: str | None):
    from specforge.checkpoint import load_draft
    from specforge.eval.engine_eval import find_checkpoints, load_run_config
    from specforge.eval.prompts import heldout_prompts
    from specforge.run_layout import RunLayout
    from specforge.targets.loader import load_target, load_tokenizer, torch_dtype

    run_dir, ckpts = find_checkpoints(ckpt)
    run_cfg = load_run_config(run_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = dtype_name or run_cfg.target.dtype
    run_cfg.target.dtype = dtype_name
    tokenizer = load_tokenizer(run_cfg.target)
    target = load_target(run_cfg.target, device)
    draft = load_draft(ckpts[-1], device=device, dtype=torch_dtype(dtype_name))
    prompts = [p["input_ids"] for p in heldout_prompts(RunLayout(run_dir).conversations("eval"), tokenizer, num_prompts)]
    return target, draft, prompts, tokenizer.eos_token_id, f"{ckpts[-1]} ({dtype_name}, {device})"


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    from specforge.engine.speculative import SpeculativeEngine
    from specforge.eval.planner import plan, summarize
    from specforge.utils.io import read_json, write_json

    if not args.tiny and not args.ckpt:
        print("pass --ckpt DIR (a trained run) or --tiny", file=sys.stderr)
        return 2
    target, draft, prompts, eos, what = (load_tiny(args.num_prompts) if args.tiny
                                         else load_run(args.ckpt, args.num_prompts, args.dtype))
    trees = list(dict.fromkeys([*args.trees, args.engine_tree]))
    device = next(draft.parameters()).device
    engine = SpeculativeEngine(target, draft, args.engine_tree)
    engine.generate(prompts[0], 8, eos_token_id=eos)  # warm-up, as engine_eval does
    source = None if args.decode_trajectory else args.engine_tree
    plan(target, draft, prompts[:1], trees[:2], 8, eos, batch=args.batch, trajectory_tree=source)

    sync(device)
    t0 = time.perf_counter()
    runs = [engine.generate(p, args.max_new_tokens, eos_token_id=eos) for p in prompts]
    sync(device)
    engine_s = time.perf_counter() - t0
    plans = plan(target, draft, prompts, trees, args.max_new_tokens, eos, batch=args.batch, trajectory_tree=source)
    sync(device)
    planner_s = time.perf_counter() - t0 - engine_s

    def exact_share(tree, engine_runs):
        same = [p.stats.accepted_drafts == s.accepted_drafts and p.tokens == o.tolist()
                for p, (o, s) in zip(plans[tree], engine_runs)]
        return sum(same) / len(same)

    rows = [summarize(t, plans[t]) for t in trees]
    for row in rows:
        if row["tree"] == args.engine_tree:
            row["exact_share"] = exact_share(args.engine_tree, runs)
        elif row["tree"] in args.check_trees:
            check = SpeculativeEngine(target, draft, row["tree"])
            row["exact_share"] = exact_share(row["tree"], [check.generate(p, args.max_new_tokens, eos_token_id=eos)
                                                           for p in prompts])
    report = {"model": what, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2),
              "engine_tree": args.engine_tree, "trajectory": source or "decode", "batch": args.batch,
              "engine_s": engine_s, "planner_s": planner_s,
              "planner_trees": len(trees), "ratio": planner_s / engine_s,
              "trees": rows}
    out = Path(args.out)  # merged: benchmarks/cost_model_bench.py writes its figures into the same file
    write_json(out, {**(read_json(out) if out.exists() else {}), **report})

    print(f"{what}: {len(prompts)} prompts x {args.max_new_tokens} new tokens\n")
    print(f"{'tree':>8} {'accept_len':>10} {'accept_rate':>11} {'depth':>6} {'=engine':>7}  nodes per depth")
    for r in rows:
        widths = " ".join(f"{w:.1f}" for w in r.get("nodes_per_depth", []))
        exact = f"{r['exact_share']:.2f}" if "exact_share" in r else ""
        print(f"{r['tree']:>8} {r['accept_length']:>10.3f} {r['accept_rate']:>11.3f} "
              f"{r.get('tree_depth', float('nan')):>6.2f} {exact:>7}  {widths}")
    print(f"\nengine, one tree ({args.engine_tree}): {engine_s:.2f} s; planner, {len(trees)} trees: "
          f"{planner_s:.2f} s ({planner_s / engine_s:.2f}x)\n'=engine': share of requests whose every round "
          f"the planner reproduced (engine runs of --engine-tree and --check-trees)\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
