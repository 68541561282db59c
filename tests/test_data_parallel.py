"""data.num_proc: the per-row work in datasets.map workers gives exactly what the in-process loop
gives (samples, conversations, quarantine with reasons/file/line, counts), and re-runs hit its cache."""
from __future__ import annotations

import json

import pytest

from data_prep.corrupt import corrupt, write_jsonl_lines
from data_prep.weather import generate, generate_samples, to_row, write_images
from specforge.data import stage
from specforge.utils.io import read_jsonl
from test_data_stage import make_cfg

BREAKAGE = {"invalid_json": 3, "array_length": 2, "row_field_count": 2, "json_instead_of_toon": 2,
            "unrepairable_toon": 2, "sharegpt_roles": 2, "consecutive_turns": 2, "empty_turn": 2,
            "no_assistant": 2, "duplicate": 4, "missing_image": 2}


@pytest.fixture
def messy(tmp_path):
    """Weather rows with every breakage corrupt.py knows, rows with images (some missing), bad
    lines, a row of unknown shape, one too many characters long and answers of any length."""
    samples = generate_samples(30, seed=3, split="train", images=0.3)
    write_images(samples, tmp_path)
    rows, _ = corrupt([to_row(s) for s in samples] + generate(30, seed=4, split="eval"), BREAKAGE, seed=1)
    rows[5:5] = ["[1, 2]", json.dumps({"messages": [{"role": "bot", "content": "hi"}]}),
                 json.dumps({"id": "long", "messages": [{"role": "user", "content": "x" * 5000},
                                                         {"role": "assistant", "content": "y"}]})]
    path = tmp_path / "train.jsonl"
    write_jsonl_lines(path, rows)
    with open(path, "a") as f:
        f.write('{"messages": [{"role": "user"\n\n')  # a broken last line after a blank one
    return path


def _process(tmp_path, tiny_target_dir, tokenizer, path, num_proc, **data):
    cfg = make_cfg(tmp_path, tiny_target_dir, path, None, num_proc=num_proc, **data)
    return stage.process_split(cfg, "train", [str(path)], tokenizer)


# max_length 225: some answers are truncated, others lose every loss token (dropped)
CASES = {
    "fix": {"fix.toon": True, "max_length": 225, "max_chars_per_row": 4000},
    "max_samples": {"fix.toon": True, "max_samples": 40, "max_length": 480, "overlength": "drop"},
    "no_fix": {"fix.enabled": False, "max_length": 225},
}


@pytest.mark.parametrize("case", list(CASES))
def test_workers_account_for_every_row_exactly_like_the_loop(tmp_path, tiny_target_dir, tiny_tokenizer, messy, case):
    loop = _process(tmp_path, tiny_target_dir, tiny_tokenizer, messy, 0, **CASES[case])
    mapped = _process(tmp_path, tiny_target_dir, tiny_tokenizer, messy, 2, **CASES[case])

    counts = loop["counts"]
    assert len(counts["by_reason"]) >= 5 and counts["samples"] > 20  # the input really is messy
    if case != "no_fix":
        assert {"duplicate", "invalid_json", "image_missing", "toon_unrepairable"} <= set(counts["by_reason"])
        assert len(counts["by_fix"]) >= 3
    if case == "fix":
        assert counts["truncated"] and counts["by_reason"]["no_loss_tokens_after_truncation"]
        assert counts["by_reason"]["row_too_long"] == 1 and "template_error" in counts["by_reason"]  # image rows
    if case == "max_samples":
        assert counts["skipped_max_samples"] and counts["by_reason"]["overlength"]
    assert mapped["counts"] == counts
    assert mapped["quarantine"] == loop["quarantine"]  # reasons, file, line, row, in the same order
    assert mapped["samples"] == loop["samples"]
    assert mapped["conversations"] == loop["conversations"]


def test_a_rerun_loads_the_workers_results_from_the_cache(tmp_path, tiny_target_dir, tiny_tokenizer, messy):
    first = _process(tmp_path, tiny_target_dir, tiny_tokenizer, messy, 2)
    cache = tmp_path / "cache" / "datasets"
    mapped = sorted(p.name for p in cache.glob("fix-*.arrow"))
    assert len(mapped) == 2  # one file per worker
    stamps = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    again = _process(tmp_path, tiny_target_dir, tiny_tokenizer, messy, 1)  # another num_proc: same files
    assert again == first
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps  # nothing recomputed

    _process(tmp_path, tiny_target_dir, tiny_tokenizer, messy, 2, max_length=100)  # another config: new files
    assert len(list(cache.glob("fix-*.arrow"))) == 4


def test_stage_writes_the_same_files_with_workers(tmp_path, tiny_target_dir, messy):
    outputs = {}
    for n in (0, 2):
        cfg = make_cfg(tmp_path, tiny_target_dir, messy, None, num_proc=n, max_quarantined_share=1.0)
        cfg.cache_dir = str(tmp_path / f"cache{n}")  # both miss the vocab cache: identical reports
        run_dir = tmp_path / f"run{n}"
        summary = stage.run(cfg, run_dir)
        data = run_dir / "data"
        outputs[n] = (summary, [(data / name).read_bytes() for name in
                                ("train.jsonl", "train.conversations.jsonl", "quarantine.jsonl", "report.md")])
    assert outputs[2] == outputs[0]
    assert len(list(read_jsonl(tmp_path / "run2" / "data" / "quarantine.jsonl"))) == outputs[0][0]["train"]["quarantined"]


def test_num_proc_must_not_be_negative(tmp_path, tiny_target_dir, messy):
    cfg = make_cfg(tmp_path, tiny_target_dir, messy, None, num_proc=-1)
    with pytest.raises(ValueError, match="data.num_proc: must be >= 0"):
        stage.run(cfg, tmp_path / "run")


def test_vision_language_rows_render_alike_in_workers(tmp_path, tiny_vl_dir):
    """Image rows through the tiny Qwen3-VL's processor: image tokens and grids come back alike."""
    from data_prep.weather import main as weather_main
    from test_pipeline_vl import compose_cfg

    assert weather_main(["--out", str(tmp_path / "data"), "--train", "30", "--eval", "2", "--seed", "0",
                         "--images", "0.6", "--image-size", "160", "--corrupt", "0.04"]) == 0
    outputs = {}
    for n in (0, 2):
        cfg = compose_cfg(tmp_path, tiny_vl_dir, f"data.num_proc={n}", f"cache_dir={tmp_path / f'cache{n}'}",
                          "data.max_quarantined_share=1.0")
        summary = stage.run(cfg, tmp_path / f"run{n}")
        data = tmp_path / f"run{n}" / "data"
        outputs[n] = (summary, [(data / name).read_bytes() for name in ("train.jsonl", "quarantine.jsonl", "eval.jsonl")])
    assert outputs[0][0]["train"]["images"] > 0 and outputs[0][0]["train"]["quarantined"] > 0
    assert outputs[2] == outputs[0]


def test_both_paths_name_a_relative_file_alike_and_the_cache_key_covers_the_image_code(tmp_path, monkeypatch):
    """read_raw_texts (the data.num_proc workers) kept `./d/a.jsonl` as written where read_raw_rows recorded
    `d/a.jsonl`: quarantine entries and duplicate reasons named another file with workers. And the workers'
    cache key hashed no code of utils/images.py, which decides which images pass and writes their copies."""
    from specforge.data.formats import read_raw_rows, read_raw_texts
    from specforge.data.parallel import CODE

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"id": 1}\n{"id": 2}\n')
    monkeypatch.chdir(tmp_path)
    assert [r[0] for r in read_raw_texts("./d/a.jsonl")] == [r.file for r in read_raw_rows("./d/a.jsonl")]
    assert {p.name for p in CODE} >= {"images.py", "io.py", "conversations.py"}
