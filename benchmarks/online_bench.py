"""Training from a hidden-state store (extract, then train) against `extract=online` (no store: the
train stage computes each micro-batch's states), on the demo's target and data.

Each way is a fresh `python train.py +exp=smollm2_weather` run of stages data, extract and train on
the same generated conversations (answers not regenerated: the same rows for both), one after the
other. Reports each stage's seconds (from the stage markers), the bytes the store holds on disk,
and the held-out simulated accept length of the last epoch (the same training: equal up to
rounding).

    .venv/bin/python benchmarks/online_bench.py --conversations 128 --epochs 3   # -> benchmarks/results/online.json
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep.weather import generate  # noqa: E402
from specforge.run_layout import RunLayout  # noqa: E402
from specforge.utils.io import read_json, write_json, write_jsonl  # noqa: E402
from specforge.utils.metrics_log import read_metrics  # noqa: E402

MODES = {"store": [], "online": ["extract=online"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--eval-conversations", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--work", default="/tmp/online_bench", help="data and run directories (replaced)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "online.json"))
    return p.parse_args(argv)


def run(mode: str, args, work: Path) -> dict:
    command = [sys.executable, "train.py", "+exp=smollm2_weather", f"run_name={mode}", f"output_dir={work / 'outputs'}",
               f"data.train_files=[{work / 'train.jsonl'}]", f"data.eval_files=[{work / 'eval.jsonl'}]",
               "data.regenerate.enabled=false", f"train.epochs={args.epochs}", "stages=[data,extract,train]",
               "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none", *MODES[mode]]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    layout = RunLayout(work / "outputs" / mode)
    seconds = {stage: read_json(layout.marker(stage))["summary"]["seconds"] for stage in ("data", "extract", "train")}
    stored = sum(f.stat().st_size for f in layout.extract_dir.rglob("*") if f.is_file()) \
        if layout.extract_dir.exists() else 0
    evals = [m for m in read_metrics(layout.metrics) if m.get("split") == "eval"]
    return {"mode": mode, "extract_s": seconds["extract"], "train_s": seconds["train"],
            "extract_plus_train_s": round(seconds["extract"] + seconds["train"], 2), "stored_bytes": stored,
            "sim_accept_length": round(evals[-1]["sim_accept_length"], 4)}


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    write_jsonl(work / "train.jsonl", generate(args.conversations, seed=0, split="train"))
    write_jsonl(work / "eval.jsonl", generate(args.eval_conversations, seed=0, split="eval"))
    rows = [run(mode, args, work) for mode in MODES]
    store, online = rows
    print(f"{args.conversations} conversations, {args.epochs} epochs, SmolLM2-135M target")
    print("| mode | extract s | train s | extract + train s | stored MB | held-out sim accept length |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['extract_s']} | {r['train_s']} | {r['extract_plus_train_s']} | "
              f"{r['stored_bytes'] / 1e6:.1f} | {r['sim_accept_length']} |")
    ratio = online["extract_plus_train_s"] / store["extract_plus_train_s"]
    print(f"online / store: {ratio:.3f} of the time, no store")
    write_json(Path(args.out), {"rows": rows, "online_over_store_time": round(ratio, 3),
                                "conversations": args.conversations, "epochs": args.epochs,
                                "command": shlex.join(["python", "benchmarks/online_bench.py", *(argv or sys.argv[1:])])})


if __name__ == "__main__":
    main()
