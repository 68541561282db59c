"""Known breakage in, exact report out: corrupt() predicts what fix_dataset() must count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import toon_format

from data_prep.corrupt import OUTCOMES, corrupt, write_jsonl_lines
from data_prep.weather import generate, generate_samples, to_row, write_images
from specforge.config import FixConfig
from specforge.data.fix import fix_dataset
from specforge.data.formats import read_raw_rows

# Breakages whose repair gives back exactly the clean messages.
INVERTIBLE = {"array_length", "row_field_count", "tab_indentation", "trailing_whitespace",
              "json_instead_of_toon", "unquoted_string", "sharegpt_roles", "empty_turn"}


def clean_rows(n: int) -> list[dict]:
    """Small distinct rows whose answers are canonical TOON with a table keyed by time."""
    rows = []
    for i in range(n):
        answer = {
            "city": f"City{i}",
            "temp_c": {"min": i % 7, "max": 10 + i % 5},
            "hourly": [{"time": f"{h:02d}:00", "temp_c": i % 9 + h // 6, "sky": ["sunny", "rain"][(i + h) % 2]}
                       for h in (0, 12)],
        }
        rows.append({"id": f"r{i}", "messages": [
            {"role": "system", "content": "Answer in TOON."},
            {"role": "user", "content": f"Weather in City{i}?"},
            {"role": "assistant", "content": toon_format.encode(answer)},
        ]})
    return rows


def run_fix(tmp_path, rows_out, name="data.jsonl"):
    path = tmp_path / name
    write_jsonl_lines(path, rows_out)
    return fix_dataset(read_raw_rows(path), FixConfig(toon=True), image_root=str(tmp_path))


def assert_matches(result, expected):
    assert result.counts == expected
    c = result.counts
    assert c["input_rows"] == c["kept"] + c["fixed"] + c["quarantined"]


def test_every_breakage_is_counted_exactly(tmp_path):
    clean = clean_rows(60)
    out, expected = corrupt(clean, {name: 3 for name in OUTCOMES}, seed=1)
    assert expected["input_rows"] == 63 and expected["quarantined"] == 15 and expected["fixed"] == 27
    assert_matches(run_fix(tmp_path, out), expected)


def test_invertible_breakages_repair_back_to_the_clean_messages(tmp_path):
    clean = clean_rows(30)
    out, _ = corrupt(clean, {name: 3 for name in INVERTIBLE}, seed=2)
    by_id = {row["id"]: row["messages"] for row in clean}
    result = run_fix(tmp_path, out)
    assert result.counts["fixed"] == 3 * len(INVERTIBLE)
    for item in result.kept:
        assert item["messages"] == by_id[item["id"]], item["fixes"]


def test_running_twice_gives_identical_output(tmp_path):
    clean = clean_rows(40)
    first = corrupt(clean, {name: 0.05 for name in OUTCOMES}, seed=3)
    assert corrupt(clean, {name: 0.05 for name in OUTCOMES}, seed=3) == first
    assert corrupt(clean, {name: 0.05 for name in OUTCOMES}, seed=4)[0] != first[0]
    a, b = run_fix(tmp_path, first[0], "a.jsonl"), run_fix(tmp_path, first[0], "a.jsonl")
    assert json.dumps(a.__dict__, sort_keys=True) == json.dumps(b.__dict__, sort_keys=True)


def test_weather_rows(tmp_path):
    clean = generate(150, seed=0)
    out, expected = corrupt(clean, {name: 0.02 for name in OUTCOMES}, seed=0)
    assert all(n == 3 for n in {**expected["by_fix"], **expected["by_reason"]}.values())
    assert_matches(run_fix(tmp_path, out), expected)


def test_weather_rows_with_images(tmp_path):
    samples = generate_samples(150, seed=0, images=0.6)
    assert write_images(samples, tmp_path, size=96) > 80
    clean = [to_row(s) for s in samples]
    out, expected = corrupt(clean, {name: 0.02 for name in OUTCOMES}, seed=0)
    result = run_fix(tmp_path, out)
    assert_matches(result, expected)
    missing = [q for q in result.quarantined if q["reason"].startswith("image_missing: ")]
    assert len(missing) == 3
    for q in missing:
        assert f"missing_images/{q['row']['id']}.png (resolved to {tmp_path.resolve()}/missing_images/" in q["reason"]
    # image rows lose their real image to the missing one, they do not gain a second
    by_id = {s.id: s for s in samples}
    for q in missing:
        parts = [p for p in q["row"]["messages"][1]["content"] if p["type"] == "image"]
        assert len(parts) == max(1, len(by_id[q["row"]["id"]].images))
    assert any(by_id[q["row"]["id"]].images for q in missing)
    # the kept rows' images resolved to files that exist
    paths = [p["image"] for k in result.kept for m in k["messages"] if isinstance(m["content"], list)
             for p in m["content"] if p["type"] == "image"]
    assert len(paths) > 80 and all(p.startswith(str(tmp_path.resolve())) and Path(p).is_file() for p in paths)


def test_clean_image_rows_must_be_well_formed():
    user = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "image": "a.png"}]}
    row = {"messages": [user, {"role": "assistant", "content": "a: 1"}]}
    with pytest.raises(ValueError, match="a user turn's parts: expected .*image.* parts before the text"):
        corrupt([row], {}, seed=0)


def test_invalid_json_is_written_raw(tmp_path):
    out, _ = corrupt(clean_rows(5), {"invalid_json": 1}, seed=0)
    write_jsonl_lines(tmp_path / "x.jsonl", out)
    lines = (tmp_path / "x.jsonl").read_text().splitlines()
    bad = [line for line in lines if not line.endswith("}")]
    assert len(lines) == 5 and len(bad) == 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad[0])


@pytest.mark.parametrize(
    "rows, rates, message",
    [
        (clean_rows(3), {"bogus": 1}, "unknown breakage 'bogus'"),
        (clean_rows(3), {"invalid_json": 2, "empty_turn": 2}, "4 breakages asked for but only 3 rows"),
        (clean_rows(3), {"invalid_json": -1}, "expected a fraction"),
        (clean_rows(2) + clean_rows(1), {}, r"rows\[2\]: same messages as rows\[0\]"),
        ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a:  1"}]}], {},
         "not canonical TOON"),
        ([{"messages": [{"role": "user", "content": "x"}]}], {}, "no assistant turn"),
    ],
)
def test_bad_requests_fail_loudly(rows, rates, message):
    with pytest.raises(ValueError, match=message):
        corrupt(rows, rates, seed=0)


def test_breakage_that_does_not_apply_anywhere_fails_loudly():
    rows = [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a: 1"}]}]
    with pytest.raises(ValueError, match="rates\\['array_length'\\]: not enough untouched rows"):
        corrupt(rows, {"array_length": 1}, seed=0)
