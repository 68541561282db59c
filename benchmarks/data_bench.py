"""Data stage throughput: rows/s and peak memory of the in-process loop vs data.num_proc workers.

Generates --rows synthetic weather conversations once (data_prep/weather.py) with a small share
of known breakage (data_prep/corrupt.py: invalid JSON, broken TOON, duplicates, ... so the fix and
quarantine paths run), writes them as JSONL under --work-dir, then runs the data stage's
`process_split` on them once per configuration, each in its own process with its own empty
cache (no configuration reads another's results), with the SmolLM2 target's tokenizer as the
pipeline loads it. It checks that every configuration accounts for every row identically
(samples, conversations, quarantine, counts), prints a table and writes --out.

    .venv/bin/python benchmarks/data_bench.py                 # 100K rows: run it on a quiet machine
    .venv/bin/python benchmarks/data_bench.py --rows 2000     # a quick check

rows_per_s counts input rows over the wall time of `process_split` (reading to samples; not the
tokenizer load). peak_rss_mb is the main process's peak RSS (ru_maxrss), peak_worker_rss_mb the
largest worker's; workers share the parent's pages copy-on-write, so the sum overstates memory.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = {"loop": 0, "num_proc=1": 1, "num_proc=2": 2}
DEFAULT_TARGET = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
BREAKAGE_RATE = 0.002  # per breakage kind: ~3% of the rows are broken in one of 13 ways


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="clean conversations to generate (breakage adds a few)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="SmolLM2 directory (fetched by ensure_smollm2 if missing)")
    p.add_argument("--work-dir", default=str(ROOT / ".cache" / "data_bench"), help="where the generated JSONL is kept")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_scale.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one configuration
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_input(rows: int, work_dir: Path) -> tuple[Path, dict]:
    """The generated JSONL (reused when there) and the fix report corrupt.py expects of it."""
    from data_prep.corrupt import OUTCOMES, corrupt, write_jsonl_lines
    from data_prep.weather import generate

    path = work_dir / f"weather_{rows}.jsonl"
    expected_path = path.with_suffix(".expected.json")
    if path.is_file() and expected_path.is_file():
        return path, json.loads(expected_path.read_text())
    t0 = time.perf_counter()
    rates = {name: BREAKAGE_RATE for name in OUTCOMES if name != "missing_image"}  # no image files here
    out, expected = corrupt(generate(rows, seed=0, split="train"), rates, seed=0)
    work_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_lines(path, out)
    expected_path.write_text(json.dumps(expected))
    print(f"generated {len(out)} rows in {time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    return path, expected


def make_cfg(target: str, input_path: Path, cache_dir: str, num_proc: int):
    """The pipeline's own config, as conf/data/weather.yaml + data.fix.toon=true set it."""
    from omegaconf import OmegaConf

    from specforge.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.run_name, cfg.cache_dir = "data_bench", cache_dir
    cfg.target.name, cfg.target.path = "smollm2", target
    cfg.data.name, cfg.data.train_files = "weather", [str(input_path)]
    cfg.data.max_length, cfg.data.fix.toon, cfg.data.num_proc = 1024, True, num_proc
    return cfg


def run_child(args) -> None:
    """One configuration in this process: time process_split, record its result's digest."""
    from specforge.data.stage import process_split
    from specforge.targets.loader import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="data_bench_cache_") as cache:
        cfg = make_cfg(args.target, Path(args.input), cache, CONFIGS[args.child])
        tokenizer = load_tokenizer(cfg.target)
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        result = process_split(cfg, "train", list(cfg.data.train_files), tokenizer)
        seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    digest = hashlib.sha256()
    for key in ("samples", "conversations", "quarantine", "counts"):
        digest.update(json.dumps(result[key], sort_keys=True).encode())
    Path(args.result).write_text(json.dumps({
        "seconds": seconds, "cpu_seconds": cpu, "counts": result["counts"], "digest": digest.hexdigest(),
        "peak_rss_mb": _maxrss_mb(resource.RUSAGE_SELF), "peak_worker_rss_mb": _maxrss_mb(resource.RUSAGE_CHILDREN),
    }))


def _cpu_seconds() -> float:
    """User + system CPU of this process and its finished workers."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _maxrss_mb(who) -> float:
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)  # KiB on Linux


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    from specforge.targets.smollm2 import ensure_smollm2

    target = str(ensure_smollm2(args.target))
    path, expected = make_input(args.rows, Path(args.work_dir))
    results = {}
    with tempfile.TemporaryDirectory(prefix="data_bench_") as tmp:
        for name in args.configs:
            out = Path(tmp) / f"{CONFIGS[name]}.json"
            cmd = [sys.executable, __file__, "--child", name, "--input", str(path), "--result", str(out),
                   "--target", target]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            results[name] = json.loads(out.read_text())
            r = results[name]
            print(f"{name}: {r['seconds']:.1f} s, {r['counts']['input_rows'] / r['seconds']:.0f} rows/s", flush=True)

    loop = results.get("loop")
    rows = []
    for name, r in results.items():
        rows.append({
            "config": name, "num_proc": CONFIGS[name], "seconds": round(r["seconds"], 2),
            "rows_per_s": round(r["counts"]["input_rows"] / r["seconds"], 1),
            "cpu_seconds": round(r["cpu_seconds"], 2),
            "peak_rss_mb": r["peak_rss_mb"], "peak_worker_rss_mb": r["peak_worker_rss_mb"],
            "speedup_vs_loop": round(loop["seconds"] / r["seconds"], 2) if loop else None,
        })
    counts = next(iter(results.values()))["counts"]
    identical = len({r["digest"] for r in results.values()}) == 1
    report = {
        "rows": rows,
        "input_rows": counts["input_rows"],
        "identical_accounting": identical,
        # the fix report corrupt.py predicts (rendering may quarantine a few more, e.g. over-length)
        "fix_matches_expected": counts["by_fix"] == expected["by_fix"],
        "counts": counts,
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/data_bench.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "tokenizer": target,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{counts['input_rows']} input rows ({counts['quarantined']} quarantined, {counts['fixed']} fixed); "
          f"identical accounting: {identical}")
    print(f"{'config':<12} {'rows/s':>9} {'seconds':>9} {'cpu s':>8} {'speed-up':>9} {'RSS MB':>8} {'worker MB':>10}")
    for r in rows:
        speedup = f"{r['speedup_vs_loop']:.2f}x" if r["speedup_vs_loop"] is not None else "-"
        print(f"{r['config']:<12} {r['rows_per_s']:>9.1f} {r['seconds']:>9.2f} {r['cpu_seconds']:>8.1f} {speedup:>9} "
              f"{r['peak_rss_mb']:>8.0f} {r['peak_worker_rss_mb']:>10.0f}")
    print(f"wrote {out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
