"""One gpu.json from what benchmarks/gpu_check.sh left in its output folders: the device and the
versions, every figure (extraction tokens/s, the draft's training tokens/s per kernel, the verify
cost curve, the attention kernels), the tests' outcome from their JUnit files and each part's exit
status. Several folders (a check split over calls) merge, the later one winning per file; a part
that did not run is listed under "missing", never filled in. Where a part's file did not come
back from the machine, the gpu.json gpu_check wrote there stands in for it; where a test part was
cut off by its limit before pytest wrote its JUnit file, its counts come from its log (`cut_off`).

    python benchmarks/gpu_summary.py OUT [OUT2 ...] --out benchmarks/results/gpu.json
    python benchmarks/gpu_summary.py --env OUT/env.json      # what gpu_check records first
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge.utils.io import write_json  # noqa: E402

PARTS = ["test_cuda", "extract", "verify", "train_length", "attention", "stages", "train_vs_peer"]
FIGURES = {"extract": "extract_gpu.json", "verify": "verify_cost_gpu.json",
           "train_length": "train_length_gpu.json", "attention": "attention_device.json",
           "train_vs_peer": "train_vs_peer_gpu.json"}
TESTS = {"test_cuda": "test_cuda.xml", "stages": "stages.xml"}


def environment() -> dict:
    """The device and the versions the figures were measured on (gpu_check writes it first)."""
    import subprocess

    import torch
    import transformers

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__}
    if not torch.cuda.is_available():
        return {"device": "cpu", "memory_gib": None, **env, "driver": None}
    props = torch.cuda.get_device_properties(0)
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    return {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1), **env, "driver": driver}


def latest(folders: list[Path], name: str) -> Path | None:
    found = [f / name for f in folders if (f / name).is_file()]
    return found[-1] if found else None


def from_summaries(folders: list[Path], *keys: str):
    """The value at `keys` in the latest gpu.json (gpu_check's own summary, written on the machine)
    that has one."""
    for folder in reversed(folders):
        path = folder / "gpu.json"
        if path.is_file():
            value = json.loads(path.read_text())
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                return value
    return None


def exit_status(log: Path | None):
    """The part's exit status from the last `rc=N` of its log: 0 passed, 124 timed out; None: cut off."""
    if log is None:
        return None
    codes = re.findall(r"(?:^|\s)rc=(\d+)$", log.read_text(errors="replace"), re.M)  # also after a cut-off line
    return int(codes[-1]) if codes else None


def junit(path: Path) -> dict:
    """Counts and the names of the failed tests of a pytest --junitxml file."""
    root = ET.parse(path).getroot()
    failed, skipped, passed = [], 0, 0
    for case in root.iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif "skipped" in outcome:
            skipped += 1
        else:
            passed += 1
    return {"passed": passed, "failed": len(failed), "skipped": skipped, "failures": failed}


def counted_in_log(path: Path) -> dict:
    """A pytest -v log's outcomes per test, for a run cut off before its JUnit file was written."""
    outcomes = {}
    for line in path.read_text(errors="replace").splitlines():
        found = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED)\b", line)
        test = re.search(r"(\S+\.py::\S+)", line)
        if found and test:
            outcomes[test.group(1)] = found.group(1)
    failed = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
    values = list(outcomes.values())
    return {"passed": values.count("PASSED"), "failed": len(failed), "skipped": values.count("SKIPPED"),
            "failures": failed, "cut_off": True}


def extraction(d: dict) -> dict:
    return {"target": d["model"], "hidden_size": d["hidden_size"], "num_layers": d["num_layers"],
            "rows": [{k: r.get(k) for k in ("dtype", "batch_tokens", "writes", "tokens", "forward_tok_s",
                                             "end_to_end_tok_s", "padding_efficiency")} for r in d["results"]]}


def training(d: dict) -> dict:
    return {"target": d["target"], "ttt": d["ttt"], "draft_vocab": d["draft_vocab"],
            "rows": [{k: r.get(k) for k in ("attention", "precision", "batch", "seq", "tokens_per_s", "step_s",
                                             "peak_gpu_mb", "error", "top_ops")} for r in d["rows"]]}


def vs_peer(d: dict) -> dict:
    return {k: d.get(k) for k in ("ttt", "draft_vocab", "ours", "peer", "rows")}


def verify(d: dict) -> dict:
    return {k: d[k] for k in ("target", "dtype", "prefix_len", "t_decode_ms", "rows")}


def attention(d: dict) -> dict:
    return {"geometry": d["geometry"], "rows": d["rows"]}


READERS = {"extract": ("extraction", extraction), "verify": ("verify", verify),
           "train_length": ("training", training), "attention": ("attention", attention),
           "train_vs_peer": ("training_vs_peer", vs_peer)}


def summarize(folders: list[Path]) -> dict:
    env_file = latest(folders, "env.json")
    env = json.loads(env_file.read_text()) if env_file else {}
    summary = {"device": env.get("device"), "memory_gib": env.get("memory_gib"),
               "versions": {k: env.get(k) for k in ("torch", "cuda", "transformers", "driver")},
               "parts": {p: exit_status(latest(folders, f"{p}.log")) for p in PARTS}}
    for part, status in summary["parts"].items():
        if status is None:
            summary["parts"][part] = from_summaries(folders, "parts", part)
    missing = [] if env else ["env"]
    for part, (key, read) in READERS.items():
        path = latest(folders, FIGURES[part])
        summary[key] = read(json.loads(path.read_text())) if path else from_summaries(folders, key)
        if summary[key] is None:
            missing.append(part)
    summary["tests"] = {}
    for part, name in TESTS.items():
        path, log = latest(folders, name), latest(folders, f"{part}.log")
        if path:
            summary["tests"][part] = junit(path)
        else:
            summary["tests"][part] = from_summaries(folders, "tests", part) or (counted_in_log(log) if log else None)
        if summary["tests"][part] is None:
            missing.append(part)
    summary["missing"] = missing
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="*", type=Path)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    p.add_argument("--env", type=Path, help="only write this machine's device and versions to this file")
    args = p.parse_args(argv)
    if args.env:
        write_json(args.env, environment())
        print(args.env.read_text().strip())
        return 0
    if not args.folders:
        p.error("give the output folders of benchmarks/gpu_check.sh")
    absent = [str(f) for f in args.folders if not f.is_dir()]
    if absent:
        print(f"gpu_summary: no such folder: {', '.join(absent)}", file=sys.stderr)
        return 2
    summary = summarize(args.folders)
    summary["command"] = "bash benchmarks/gpu_check.sh; python benchmarks/gpu_summary.py " + " ".join(
        str(f) for f in args.folders)
    write_json(args.out, summary)
    tests = ", ".join(f"{k}: {v['passed']} passed, {v['failed']} failed" for k, v in summary["tests"].items() if v)
    print(f"{summary['device']}: parts {summary['parts']}; tests {tests or 'none'}; "
          f"missing {summary['missing'] or 'nothing'} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
