"""The engine with and without its few-row matmul path (specforge/engine/few_rows.py), one process.

Runs `engine_profile.py` (the evaluation code: base passes before and after, then each tree) with
each of the kernels of specforge/engine/few_rows.py alone (`few_rows.OVERRIDE`: `plain`, torch's
linear; `column`, W @ x^T for 1-8 rows; `packed`, MKL's GEMM on weights packed once, for 2-8 rows) and with
the engine's default (`timed`: the fastest per row count on this machine, `choose_kernels`), in
turn, --repeats times, and prints per run the base decode step and each tree's speed-up, accept
length and lossless share. Timings are meaningful only on a quiet machine.

    .venv/bin/python benchmarks/few_rows_bench.py --ckpt outputs/smollm2_weather/epoch_10
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
    p.add_argument("--ckpt", default=str(ROOT / "outputs" / "smollm2_weather" / "epoch_10"))
    p.add_argument("--trees", nargs="+", default=["2_1_3", "3_1_4", "5_1_6", "4_2_8"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "few_rows.json"))
    args = p.parse_args(argv)

    import engine_profile
    from specforge.engine import few_rows
    from specforge.utils.io import read_json, write_json

    every = range(1, few_rows.MAX_ROWS + 1)
    modes = {"plain": {}, "column": {n: "column" for n in every}, "timed": None}
    if few_rows.packable():
        modes["packed"] = {n: "packed" for n in every if n > 1}  # one row: plain (packing is for GEMMs)
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


if __name__ == "__main__":
    sys.exit(main())
