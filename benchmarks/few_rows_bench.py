"""The engine with and without its few-row matmul path (specforge/engine/few_rows.py), one process.

Runs `engine_profile.py` (the evaluation code: base passes before and after, then each tree) with
each of the kernels of specforge/engine/few_rows.py alone (`few_rows.OVERRIDE`: `plain`, torch's
linear; `column`, W @ x^T; `packed`, MKL's GEMM on weights packed once, for 2-8 rows;
`onednn`, oneDNN's inner product) and with
the engine's default (`timed`: the fastest per row count on this machine, `choose_kernels`), in
turn, --repeats times, and prints per run the base decode step and each tree's speed-up, accept
length and lossless share. Timings are meaningful only on a quiet machine.

    .venv/bin/python benchmarks/few_rows_bench.py --ckpt outputs/smollm2_weather/epoch_6

`--linears` times the target's matmuls alone instead (every linear of the model and its fp32
output head, one pass over all of them per kernel and row count, fastest of --passes after a
warm-up, `few_rows.pass_seconds` without pruning): the table `choose_kernels` decides on, in ms per pass, written to benchmarks/results/few_rows_linears.json.

    .venv/bin/python benchmarks/few_rows_bench.py --linears --ckpt outputs/smollm2_weather/epoch_6
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=str(ROOT / "outputs" / "smollm2_weather" / "epoch_8"))
    p.add_argument("--trees", nargs="+", default=["2_1_3", "3_1_4", "5_1_6", "4_2_8"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="default: benchmarks/results/few_rows.json (few_rows_linears.json)")
    p.add_argument("--linears", action="store_true", help="the target's matmuls alone, per kernel and row count")
    p.add_argument("--passes", type=int, default=7, help="--linears: fastest of this many passes")
    args = p.parse_args(argv)
    if args.linears:
        return linears(args, argv)
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "few_rows.json")

    import engine_profile
    from specforge.engine import few_rows
    from specforge.utils.io import read_json, write_json

    every = few_rows.TIMED_ROWS
    modes = {"plain": {}, "column": {n: "column" for n in every}, "timed": None}
    if few_rows.packable():  # one row: plain (packing is for GEMMs); packed for at most 8 rows
        modes["packed"] = {n: "packed" for n in every if 1 < n <= few_rows.PACK_ROWS[-1]}
    if few_rows.onednn_ready():
        modes["onednn"] = {n: "onednn" for n in every}
    runs = []
    for rep in range(args.repeats):
        for mode, override in modes.items():
            few_rows.OVERRIDE = override
            out = Path(args.out).with_suffix(f".{mode}_{rep}.tmp.json")
            engine_profile.main(["--ckpt", args.ckpt, "--trees", *args.trees, "--num-prompts", str(args.num_prompts),
                                 "--max-new-tokens", str(args.max_new_tokens), "--dtype", "float32",
                                 "--out", str(out)])
            d = read_json(out)
            out.unlink()
            runs.append({"mode": mode, "repeat": rep, "kernels": d["meta"]["few_rows_kernels"],
                         "decode_ms": round(d["base"]["decode_ms_per_step"], 2),
                         "trees": {c["tree"]: {"speedup": round(c["speedup"], 3), "accept_length": round(c["accept_length"], 3),
                                               "lossless": c["lossless"]} for c in d["configs"]}})
    few_rows.OVERRIDE = None
    print("\n| mode | kernel per row count | repeat | decode ms | " + " | ".join(f"{t} speed-up" for t in args.trees) + " |")
    print("|---|---|---|---|" + "---|" * len(args.trees))
    for r in runs:
        print(f"| {r['mode']} | {r['kernels']} | {r['repeat']} | {r['decode_ms']:.1f} | "
              + " | ".join(f"{r['trees'][t]['speedup']:.2f}" for t in args.trees) + " |")
    write_json(args.out, {"runs": runs, "dtype": "float32", "num_prompts": args.num_prompts,
                          "max_new_tokens": args.max_new_tokens,
                          "command": "python benchmarks/few_rows_bench.py " + " ".join(map(shlex.quote, argv or sys.argv[1:]))})
    print(f"written: {args.out}")
    return 0


def linears(args, argv) -> int:
    """ms per pass over the target's fp32 matmuls, per kernel x row count of few_rows.TIMED_ROWS."""
    import torch

    from specforge.engine import few_rows
    from specforge.engine.target import TargetRunner
    from specforge.eval.cost_model import describe_device
    from specforge.eval.engine_eval import find_checkpoints, load_run_config
    from specforge.targets.loader import load_target
    from specforge.utils.io import write_json

    run_dir, _ = find_checkpoints(args.ckpt)
    target_cfg = load_run_config(run_dir).target
    target_cfg.dtype = "float32"
    runner = TargetRunner(load_target(target_cfg, "cpu"), [])  # its timed choice, and its modules
    modules = few_rows._timeable(runner.kernel_modules)
    kernels = [k for k in few_rows.KERNELS if few_rows._runs_here(k)]
    few_rows._copy(modules, set(kernels))
    table = {}
    for (n, kernel), seconds in few_rows.pass_seconds(modules, kernels, args.passes).items():
        table.setdefault(kernel, {})[n] = round(1000 * seconds, 2)
    print(f"{describe_device('cpu')}, {torch.get_num_threads()} threads: ms per pass over {len(modules)} matmuls\n")
    print("| rows | " + " | ".join(map(str, few_rows.TIMED_ROWS)) + " |")
    print("|---|" + "---|" * len(few_rows.TIMED_ROWS))
    for kernel, row in table.items():
        print(f"| {kernel} | " + " | ".join(f"{row[n]:.1f}" if n in row else "-" for n in few_rows.TIMED_ROWS) + " |")
    chosen = {str(n): k for n, k in sorted(runner.kernels.items())}
    print(f"\nchosen by the engine (rows: kernel; plain elsewhere): {chosen}")
    out = args.out or str(ROOT / "benchmarks" / "results" / "few_rows_linears.json")
    write_json(out, {"device": describe_device("cpu"), "threads": torch.get_num_threads(), "matmuls": len(modules),
                     "ms_per_pass": table, "passes": args.passes, "chosen": chosen,
                     "command": "python benchmarks/few_rows_bench.py " + " ".join(map(shlex.quote, argv or sys.argv[1:]))})
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
