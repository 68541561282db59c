"""The data_prep command lines as a user runs them: a corrupted weather set with known breakage, then
the standalone fixer, whose report must match the known counts exactly."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    subprocess.run([sys.executable, *map(str, args)], check=True, cwd=ROOT, capture_output=True, text=True)


def test_corrupted_weather_then_fix_reconciles_exactly(tmp_path):
    run("data_prep/weather.py", "--out", tmp_path / "raw", "--train", 300, "--eval", 2, "--corrupt", 0.02)
    run("data_prep/fix.py", tmp_path / "raw" / "train.jsonl", "--out", tmp_path / "clean", "--toon")
    expected = json.loads((tmp_path / "raw" / "train.jsonl.expected.json").read_text())
    report = json.loads((tmp_path / "clean" / "train.report.json").read_text())
    assert report == expected
    assert report["input_rows"] == report["kept"] + report["fixed"] + report["quarantined"]
    assert report["fixed"] > 0 and report["quarantined"] > 0
    clean = (tmp_path / "clean" / "train.jsonl").read_text().splitlines()
    quarantined = (tmp_path / "clean" / "train.quarantine.jsonl").read_text().splitlines()
    assert len(clean) == report["kept"] + report["fixed"] and len(quarantined) == report["quarantined"]
    assert all({"file", "line", "reason"} <= set(json.loads(q)) for q in quarantined)
