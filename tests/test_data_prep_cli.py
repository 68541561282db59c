"""The data_prep command lines as a user runs them: a corrupted weather set with known breakage, then
the standalone fixer, whose report must match the known counts exactly."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_unrepairable_toon_kept_as_written_is_counted(tmp_path):
    """--toon-unrepairable keep: the rows the corruption made unrepairable are kept, as written, and
    the report names them instead of quarantining them."""
    run("data_prep/weather.py", "--out", tmp_path / "raw", "--train", 300, "--eval", 2, "--corrupt", 0.02)
    run("data_prep/fix.py", tmp_path / "raw" / "train.jsonl", "--out", tmp_path / "clean", "--toon",
        "--toon-unrepairable", "keep")
    expected = json.loads((tmp_path / "raw" / "train.jsonl.expected.json").read_text())
    report = json.loads((tmp_path / "clean" / "train.report.json").read_text())
    broken = expected["by_reason"]["toon_unrepairable"]
    assert broken > 0 and "toon_unrepairable" not in report["by_reason"]
    assert report["by_kept_as_written"] == {"toon_unrepairable": broken}
    assert report["quarantined"] == expected["quarantined"] - broken
    rows = [json.loads(line) for line in (tmp_path / "clean" / "train.jsonl").read_text().splitlines()]
    assert sum(r["kept_as_written"] == ["toon_unrepairable"] for r in rows) == broken
    assert "## Kept as written" in (tmp_path / "clean" / "train.report.md").read_text()


def test_weather_with_images_corrupted_then_fixed(tmp_path):
    """Image rows through both command lines: the missing-image breakage is counted like the others,
    and the fixed file (written elsewhere) names absolute paths of real PNGs."""
    raw, clean = tmp_path / "raw", tmp_path / "clean"
    run("data_prep/weather.py", "--out", raw, "--train", 300, "--eval", 2, "--corrupt", 0.02,
        "--images", 0.5, "--image-size", 96)
    run("data_prep/fix.py", raw / "train.jsonl", "--out", clean, "--toon")
    expected = json.loads((raw / "train.jsonl.expected.json").read_text())
    report = json.loads((clean / "train.report.json").read_text())
    assert report == expected and report["by_reason"]["image_missing"] == 6
    quarantined = [json.loads(q) for q in (clean / "train.quarantine.jsonl").read_text().splitlines()]
    missing = [q for q in quarantined if q["reason"].startswith("image_missing: ")]
    assert all(f"missing_images/{q['row']['id']}.png (resolved to {raw.resolve()}/missing_images/" in q["reason"]
               for q in missing) and len(missing) == 6
    rows = [json.loads(line) for line in (clean / "train.jsonl").read_text().splitlines()]
    images = [p["image"] for r in rows for m in r["messages"] if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image"]
    assert len(images) > 100 and all(Path(p).is_absolute() and Path(p).is_file() for p in images)
    assert any(sum(isinstance(m["content"], list) and len(m["content"]) == 3 for m in r["messages"]) for r in rows)


def test_regenerate_refuses_an_unknown_dtype_before_writing_anything(tmp_path):
    """It used to write the resume log's header, then fail loading the target."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    proc = subprocess.run([sys.executable, "data_prep/regenerate.py", str(data), "--out", str(tmp_path / "out.jsonl"),
                           "--target", str(tmp_path / "never_read"), "--dtype", "fp17"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "argument --dtype: invalid choice: 'fp17'" in proc.stderr and "bfloat16" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl"]


def test_weather_refuses_negative_counts_and_writes_no_empty_split(tmp_path, capsys):
    """An empty eval.jsonl would be refused by the data stage: --eval 0 leaves none (an old one goes)."""
    from data_prep.weather import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--train", "-5"])
    assert "--train: a number of conversations, >= 0, got -5" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--train", "3", "--eval", "2"]) == 0
    assert main(["--out", str(tmp_path), "--train", "3", "--eval", "0"]) == 0
    assert (tmp_path / "train.jsonl").stat().st_size > 0 and not (tmp_path / "eval.jsonl").exists()


def test_fix_py_writes_rows_as_the_data_stage_keeps_them_with_text_and_tools(tmp_path):
    """fix.py wrote {"id", "messages", ...} whatever the row: --format text crashed with KeyError 'messages',
    and a tool-calling trace lost its `tools`, so its calls rendered against no definitions afterwards."""
    from data_prep.fix import main

    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    (tmp_path / "text.jsonl").write_text(json.dumps({"id": "a", "text": text}) + "\n")
    assert main([str(tmp_path / "text.jsonl"), "--out", str(tmp_path / "clean"), "--format", "text"]) == 0
    assert [json.loads(line) for line in (tmp_path / "clean" / "text.jsonl").read_text().splitlines()] == [
        {"id": "a", "text": text, "fixes": [], "kept_as_written": []}]
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": {}}}]
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "forecast", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    (tmp_path / "tools.jsonl").write_text(json.dumps({"id": "t1", "tools": tools, "messages": messages}) + "\n")
    assert main([str(tmp_path / "tools.jsonl"), "--out", str(tmp_path / "clean")]) == 0
    assert [json.loads(line) for line in (tmp_path / "clean" / "tools.jsonl").read_text().splitlines()] == [
        {"id": "t1", "messages": messages, "tools": tools, "fixes": [], "kept_as_written": []}]
