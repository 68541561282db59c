"""TOON repairs: for each repair a broken payload -> the exact canonical string, and what is
quarantined instead of guessed."""
from __future__ import annotations

import json

import pytest
import toon_format

from specforge.config import FixConfig
from specforge.data.fix import fix_dataset
from specforge.data.fix.toon import ToonUnrepairable, repair_fenced, repair_toon
from specforge.data.formats import RawRow

ANSWER = {
    "city": "Paris",
    "summary": "Light rain; 1.5 mm of precipitation.",
    "temp_c": {"min": 4, "max": 11},
    "tags": ["rain", "mild"],
    "hourly": [
        {"time": "06:00", "temp_c": 5, "sky": "cloudy"},
        {"time": "12:00", "temp_c": 10, "sky": "rain"},
        {"time": "18:00", "temp_c": 8, "sky": "partly cloudy"},
    ],
}
CANONICAL = (
    "city: Paris\n"
    "summary: Light rain; 1.5 mm of precipitation.\n"
    "temp_c:\n"
    "  min: 4\n"
    "  max: 11\n"
    "tags[2]: rain,mild\n"
    "hourly[3]{time,temp_c,sky}:\n"
    '  "06:00",5,cloudy\n'
    '  "12:00",10,rain\n'
    '  "18:00",8,partly cloudy'
)


def test_fixture_is_what_the_encoder_writes():
    assert toon_format.encode(ANSWER) == CANONICAL


def test_canonical_payload_is_kept_byte_identical():
    assert repair_toon(CANONICAL) == (CANONICAL, [])


def test_valid_but_non_canonical_payload_is_canonicalized():
    loose = CANONICAL.replace("min: 4", "min:   4").replace("max: 11", "max: 11.0") + "\n"
    assert repair_toon(loose) == (CANONICAL, ["canonicalized"])


def test_root_scalar_is_prose_and_left_as_written():
    assert repair_toon("Sorry, I only know the weather.") == ("Sorry, I only know the weather.", [])


@pytest.mark.parametrize(
    "broken",
    [
        CANONICAL.replace("hourly[3]", "hourly[4]"),
        CANONICAL.replace("hourly[3]", "hourly[2]"),
        CANONICAL.replace("tags[2]", "tags[5]"),
        CANONICAL.replace("hourly[3]", "hourly[1]").replace("tags[2]", "tags[3]"),
    ],
    ids=["table-too-long", "table-too-short", "inline", "two-headers"],
)
def test_fixed_array_length(broken):
    assert repair_toon(broken) == (CANONICAL, ["fixed_array_length"])


def test_fixed_row_field_count_trims_empty_trailing_cells():
    broken = CANONICAL.replace('"12:00",10,rain', '"12:00",10,rain,,')
    assert repair_toon(broken) == (CANONICAL, ["fixed_row_field_count"])


def test_row_with_a_missing_cell_is_not_padded():
    broken = CANONICAL.replace('"12:00",10,rain', '"12:00",rain')
    with pytest.raises(ToonUnrepairable, match="line 9: Expected 3 values but found 2"):
        repair_toon(broken)


@pytest.mark.parametrize(
    "broken",
    [
        CANONICAL.replace("  ", "\t"),
        CANONICAL.replace("  ", "    "),
        CANONICAL.replace("  min", "   min"),  # one odd line, sibling of nothing yet: child
        CANONICAL.replace("  max", "   max"),  # odd line after a sibling: snapped back
        CANONICAL.replace("  max", " max"),
    ],
    ids=["tabs", "four-spaces", "odd-first-child", "odd-sibling-deeper", "odd-sibling-shallower"],
)
def test_fixed_indentation(broken):
    assert repair_toon(broken) == (CANONICAL, ["fixed_indentation"])


@pytest.mark.parametrize(
    "broken",
    [
        CANONICAL.replace("hourly[3]{time,temp_c,sky}:", "hourly[3]{time,temp_c,sky}: \t"),
        CANONICAL.replace("temp_c:\n", "temp_c:\t\n"),
    ],
    ids=["after-table-header", "after-object-key"],
)
def test_stripped_trailing_whitespace(broken):
    assert repair_toon(broken) == (CANONICAL, ["stripped_trailing_whitespace"])


@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "pretty"])
def test_converted_json_to_toon(indent):
    assert repair_toon(json.dumps(ANSWER, indent=indent)) == (CANONICAL, ["converted_json_to_toon"])


def test_one_line_json_is_converted_although_toon_would_accept_it():
    """`{"a": 1}` decodes as TOON (key '{"a"', value '1}'); it must still be read as JSON."""
    assert toon_format.decode('{"a": 1}') == {'{"a"': "1}"}
    assert repair_toon('{"a": 1}') == ("a: 1", ["converted_json_to_toon"])


def test_quoted_strings_colon_in_first_cell():
    broken = CANONICAL.replace('"12:00"', "12:00")  # a bare colon ends the table
    assert repair_toon(broken) == (CANONICAL, ["quoted_strings"])


def test_quoted_strings_text_after_closing_quote():
    broken = CANONICAL.replace("summary: Light rain;", 'summary: "Light" rain;')
    expected = CANONICAL.replace(
        "summary: Light rain; 1.5 mm of precipitation.", 'summary: "\\"Light\\" rain; 1.5 mm of precipitation."')
    assert repair_toon(broken) == (expected, ["quoted_strings"])


def test_quoted_strings_merges_an_unquoted_delimiter_when_one_merge_fits_the_columns():
    broken = CANONICAL.replace('"12:00",10,rain', '"12:00",10,rain, then sun')
    expected = CANONICAL.replace('"12:00",10,rain', '"12:00",10,"rain, then sun"')
    assert repair_toon(broken) == (expected, ["quoted_strings"])


def test_ambiguous_surplus_cells_are_not_merged():
    """Two text columns: the extra cell could belong to either, so nothing is guessed."""
    doc = "rows[2]{a,b}:\n  x,y\n  p,q,r"
    with pytest.raises(ToonUnrepairable, match="Expected 2 values but found 3"):
        repair_toon(doc)


def test_repairs_compose_in_order():
    broken = CANONICAL.replace("  ", "\t").replace("hourly[3]", "hourly[7]").replace('"06:00"', "06:00")
    assert repair_toon(broken) == (CANONICAL, ["fixed_indentation", "quoted_strings", "fixed_array_length"])


def test_unterminated_string_is_unrepairable():
    with pytest.raises(ToonUnrepairable, match="line 2: Unterminated string"):
        repair_toon(CANONICAL.replace("summary: Light", 'summary: "Light'))


def test_fenced_blocks_are_repaired_in_place():
    text = f"Here you go:\n```toon\n{CANONICAL.replace('  ', chr(9))}\n```\nand\n```toon\n{CANONICAL}\n```\nBye."
    out, fixes = repair_fenced(text)
    assert out == f"Here you go:\n```toon\n{CANONICAL}\n```\nand\n```toon\n{CANONICAL}\n```\nBye."
    assert fixes == ["fixed_indentation"]


def test_fenced_unrepairable_names_the_block():
    text = f"```toon\n{CANONICAL}\n```\n```toon\nbad: \"x\n```"
    with pytest.raises(ToonUnrepairable, match=r"line 1: Unterminated string \(```toon block 2\)"):
        repair_fenced(text)


def _row(answer: str, line: int = 1) -> RawRow:
    data = {"id": f"r{line}", "messages": [{"role": "user", "content": "Weather in Paris?"},
                                           {"role": "assistant", "content": answer}]}
    return RawRow("answers.jsonl", line, data, None)


def test_fix_dataset_quarantines_unrepairable_toon_with_the_decoder_message():
    rows = [_row(CANONICAL, 1), _row(CANONICAL.replace("  ", "\t").replace("hourly[3]", "hourly[9]"), 2),
            _row('city: "Paris', 3)]
    result = fix_dataset(rows, FixConfig(toon=True, dedupe=False))
    assert [k["fixes"] for k in result.kept] == [[], ["fixed_indentation", "fixed_array_length"]]
    assert result.kept[1]["messages"][1]["content"] == CANONICAL
    [q] = result.quarantined
    assert (q["file"], q["line"]) == ("answers.jsonl", 3)
    assert q["reason"] == "toon_unrepairable: line 1: Unterminated string (assistant turn 1)"
    assert result.counts["by_reason"] == {"toon_unrepairable": 1}


def test_unrepairable_toon_keep_leaves_that_turn_as_written():
    """toon_unrepairable=keep: the broken turn stays byte for byte, the others are still repaired,
    and a misspelled policy fails before any row is read."""
    broken = 'city: "Paris'
    fixable = CANONICAL.replace("hourly[3]", "hourly[9]")
    row = RawRow("answers.jsonl", 1, {"messages": [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": broken},
        {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": fixable}]}, None)
    result = fix_dataset([row, _row(broken, 2)], FixConfig(toon=True, dedupe=False, toon_unrepairable="keep"))
    assert result.quarantined == [] and len(result.kept) == 2
    answers = [m["content"] for m in result.kept[0]["messages"] if m["role"] == "assistant"]
    assert answers == [broken, CANONICAL] and result.kept[0]["fixes"] == ["fixed_array_length"]
    assert result.kept[1]["messages"][1]["content"] == broken and result.kept[1]["fixes"] == []
    assert result.counts["input_rows"] == result.counts["kept"] + result.counts["fixed"] == 2
    assert [k["kept_as_written"] for k in result.kept] == [["toon_unrepairable"], ["toon_unrepairable"]]
    assert result.counts["by_kept_as_written"] == {"toon_unrepairable": 2}
    with pytest.raises(ValueError, match=r"data.fix.toon_unrepairable: 'drop' is not one of \['quarantine', 'keep'\]"):
        fix_dataset([row], FixConfig(toon=True, toon_unrepairable="drop"))


def test_toon_off_leaves_answers_alone():
    broken = CANONICAL.replace("  ", "\t")
    result = fix_dataset([_row(broken)], FixConfig(toon=False))
    assert result.kept[0]["messages"][1]["content"] == broken and result.kept[0]["fixes"] == []


def test_fenced_mode_only_touches_blocks():
    answer = f"It will rain.\n```toon\n{CANONICAL.replace('hourly[3]', 'hourly[2]')}\n```"
    result = fix_dataset([_row(answer)], FixConfig(toon=True, toon_where="fenced"))
    assert result.kept[0]["messages"][1]["content"] == f"It will rain.\n```toon\n{CANONICAL}\n```"
    assert result.kept[0]["fixes"] == ["fixed_array_length"]


def test_prose_kept_is_recorded_and_prose_quarantined_is_not():
    prose = "It will be sunny all day in Paris."
    kept = fix_dataset([_row(prose, 1), _row(CANONICAL, 2)], FixConfig(toon=True, dedupe=False, toon_prose="keep"))
    assert [k["messages"][1]["content"] for k in kept.kept] == [prose, CANONICAL]
    assert [k["kept_as_written"] for k in kept.kept] == [["toon_prose"], []]
    assert kept.counts["by_kept_as_written"] == {"toon_prose": 1}
    strict = fix_dataset([_row(prose, 1), _row(CANONICAL, 2)], FixConfig(toon=True, dedupe=False))
    assert strict.counts["by_reason"] == {"toon_not_a_document": 1} and strict.counts["by_kept_as_written"] == {}


def test_an_answer_with_its_reasoning_in_front_repairs_the_toon_after_it():
    """A server's split-off reasoning is put back in front of the answer (`<think>\\n...\\n</think>\\n\\n`):
    the whole text was decoded as TOON, so every such row was quarantined toon_unrepairable, or with
    toon_unrepairable=keep kept unrepaired. The reasoning stays as written, the answer after it is repaired."""
    reasoning = "The user asks: Paris weather.\nIt rains."
    row = RawRow("answers.jsonl", 1, {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": CANONICAL.replace("hourly[3]", "hourly[9]"), "reasoning_content": reasoning}]},
        None)
    result = fix_dataset([row], FixConfig(toon=True, dedupe=False))
    assert result.quarantined == [] and result.kept[0]["fixes"] == ["fixed_array_length"]
    assert result.kept[0]["messages"][1]["content"] == f"<think>\n{reasoning}\n</think>\n\n{CANONICAL}"
    fenced = fix_dataset([_row(f"<think>\nmaybe ```toon\n</think>\n\nIt rains.\n```toon\n{CANONICAL}\n```")],
                         FixConfig(toon=True, toon_where="fenced"))
    assert fenced.quarantined == [] and fenced.kept[0]["fixes"] == []
