"""Conversation repairs and quarantine: every row kept, fixed or quarantined with a reason that
names the file, line, field or path to look at."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from specforge.config import FixConfig
from specforge.data.fix import fix_dataset
from specforge.data.fix.conversations import merge_consecutive
from specforge.data.formats import RawRow, read_raw_rows

USER = {"role": "user", "content": "Weather in Oslo?"}
ASSISTANT = {"role": "assistant", "content": "city: Oslo\ntemp_c: 3"}


def _raw(messages: list[dict], line: int = 1, file: str = "d.jsonl", **extra) -> RawRow:
    return RawRow(file, line, {"id": f"row{line}", "messages": messages, **extra}, None)


def _one(raw: RawRow, **cfg) -> tuple[dict | None, dict | None]:
    """(kept item, quarantine item) of a single row; exactly one is set."""
    result = fix_dataset([raw], FixConfig(**cfg))
    assert len(result.kept) + len(result.quarantined) == 1
    return (result.kept or [None])[0], (result.quarantined or [None])[0]


def _reconciles(counts: dict) -> bool:
    return counts["input_rows"] == counts["kept"] + counts["fixed"] + counts["quarantined"]


def test_clean_row_is_kept_as_is_with_its_provenance():
    kept, _ = _one(_raw([USER, ASSISTANT], line=7))
    assert kept == {"id": "row7", "messages": [USER, ASSISTANT], "fixes": [], "kept_as_written": [],
                    "file": "d.jsonl", "line": 7}


def test_invalid_json_line_is_quarantined_with_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"messages": [USER, ASSISTANT]})
    path.write_text(f"{good}\n{good[:-1]}\n")
    result = fix_dataset(read_raw_rows(path), FixConfig(dedupe=False))
    [q] = result.quarantined
    assert (q["file"], q["line"]) == (str(path), 2)
    assert q["reason"].startswith("invalid_json: ")
    assert result.counts == {"input_rows": 2, "kept": 1, "fixed": 0, "quarantined": 1,
                             "by_fix": {}, "by_reason": {"invalid_json": 1}, "by_kept_as_written": {}}


def test_malformed_row_reason_names_the_field():
    _, q = _one(_raw([USER, {"role": "robot", "content": "hi"}]))
    assert q["reason"] == "invalid_row: messages[1].role: unknown role 'robot'"
    assert q["row"]["messages"][1]["role"] == "robot"  # the original row, for a person to inspect


def test_non_canonical_role_names_are_a_fix():
    kept, _ = _one(_raw([{"role": "human", "content": "Hi"}, {"role": "gpt", "content": "Hello"}]))
    assert [m["role"] for m in kept["messages"]] == ["user", "assistant"]
    assert kept["fixes"] == ["normalized_role_names"]


def test_sharegpt_native_role_names_are_not_a_fix():
    data = {"id": "s", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    kept, _ = _one(RawRow("d.jsonl", 1, data, None))
    assert kept["fixes"] == [] and [m["role"] for m in kept["messages"]] == ["user", "assistant"]


def test_consecutive_turns_of_one_role_are_merged():
    kept, _ = _one(_raw([USER, {"role": "user", "content": "In Celsius."}, ASSISTANT]))
    assert kept["messages"] == [{"role": "user", "content": "Weather in Oslo?\n\nIn Celsius."}, ASSISTANT]
    assert kept["fixes"] == ["merged_consecutive_user"]


def test_turns_with_images_merge_with_their_texts_apart():
    """Image parts made the merge concatenate part lists: templates print text parts back to back, so the
    target read "What is this?In Celsius." where plain turns get a blank line."""
    first = {"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,iVBORw0KGgo="},
                                         {"type": "text", "text": "What is this?"}]}
    joined, _ = merge_consecutive([first, {"role": "user", "content": "In Celsius."}, ASSISTANT])
    assert joined[0]["content"][1:] == [{"type": "text", "text": "What is this?\n\n"},
                                        {"type": "text", "text": "In Celsius."}]
    assert first["content"][1]["text"] == "What is this?"  # the row itself is left as it was


def test_merging_can_be_switched_off():
    messages = [USER, USER, ASSISTANT]
    kept, _ = _one(_raw(messages), merge_consecutive_roles=False, dedupe=False)
    assert kept["messages"] == messages and kept["fixes"] == []


def test_empty_turn_is_dropped_then_neighbours_merged():
    kept, _ = _one(_raw([USER, {"role": "assistant", "content": "  "}, USER, ASSISTANT]))
    assert kept["messages"] == [{"role": "user", "content": "Weather in Oslo?\n\nWeather in Oslo?"}, ASSISTANT]
    assert kept["fixes"] == ["dropped_empty_turn", "merged_consecutive_user"]


def test_empty_turn_quarantined_when_configured():
    _, q = _one(_raw([USER, {"role": "user", "content": ""}, ASSISTANT]), empty_turns="quarantine")
    assert q["reason"] == "empty_turn: messages[1] (user) is empty"


def test_no_assistant_turn_is_quarantined_or_kept_per_config():
    _, q = _one(_raw([USER]))
    assert q["reason"].startswith("no_assistant_turn")
    kept, _ = _one(_raw([USER]), no_assistant="keep")
    assert kept["messages"] == [USER] and kept["fixes"] == []


def test_duplicates_are_quarantined_naming_the_first_occurrence():
    rows = [_raw([USER, ASSISTANT], line=1, file="a.jsonl"), _raw([USER, ASSISTANT], line=5, file="b.jsonl")]
    result = fix_dataset(rows, FixConfig())
    assert [k["line"] for k in result.kept] == [1]
    [q] = result.quarantined
    assert (q["file"], q["line"], q["reason"]) == ("b.jsonl", 5, "duplicate: same messages as a.jsonl:1")
    assert len(fix_dataset(rows, FixConfig(dedupe=False)).kept) == 2


def test_a_copy_that_differs_only_by_a_fixable_defect_is_still_a_duplicate():
    rows = [_raw([USER, ASSISTANT], line=1), _raw([USER, {"role": "user", "content": ""}, ASSISTANT], line=2)]
    result = fix_dataset(rows, FixConfig())
    assert [q["reason"] for q in result.quarantined] == ["duplicate: same messages as d.jsonl:1"]


@pytest.fixture
def image_root(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    Image.new("RGB", (4, 4), "blue").save(root / "ok.png")
    (root / "broken.png").write_bytes(b"not an image")
    Image.new("RGB", (4, 4), "red").save(tmp_path / "outside.png")
    return root


def _with_image(path: str, line: int = 1) -> RawRow:
    user = {"role": "user", "content": [{"type": "text", "text": "What is this map?"},
                                        {"type": "image_url", "image_url": {"url": path}}]}
    return _raw([user, ASSISTANT], line=line)


@pytest.mark.parametrize(
    "path, reason",
    [
        ("missing.png", "image_missing: missing.png (resolved to {root}/missing.png)"),
        ("broken.png", "image_unreadable: broken.png (resolved to {root}/broken.png)"),
        ("../outside.png",
         "image_outside_root: ../outside.png (resolved to {root.parent}/outside.png, outside image_root {root})"),
    ],
)
def test_bad_image_references_are_quarantined(image_root, path, reason):
    result = fix_dataset([_with_image(path)], FixConfig(), image_root=str(image_root))
    assert [q["reason"] for q in result.quarantined] == [reason.format(root=image_root.resolve())]
    assert result.counts["by_reason"] == {reason.split(":")[0]: 1}


def test_images_past_the_decompression_bomb_limit_are_quarantined_not_a_crash(image_root, monkeypatch):
    """PIL warns past MAX_IMAGE_PIXELS and raises past twice that, which stopped the whole data stage
    on one such file; files and embedded images alike are refused as the server refuses them."""
    import base64
    import warnings

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the real limit, 89M pixels, at a test's size
    Image.new("1", (40, 40)).save(image_root / "warned.png")  # 1,600 pixels: PIL only warns
    Image.new("1", (50, 50)).save(image_root / "refused.png")  # 2,500: PIL raises DecompressionBombError
    embedded = "data:image/png;base64," + base64.b64encode((image_root / "warned.png").read_bytes()).decode()
    rows = [_with_image(ref, line=i) for i, ref in enumerate(["warned.png", "refused.png", embedded, "ok.png"], 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # nothing of it printed
        result = fix_dataset(rows, FixConfig(), image_root=str(image_root))
    reasons = [q["reason"] for q in result.quarantined]
    root = image_root.resolve()
    assert reasons == [
        f"image_too_large: warned.png (40x40 pixels, more than 1,000, resolved to {root}/warned.png)",
        f"image_too_large: refused.png (Image size (2500 pixels) exceeds limit of 2000 pixels, could be decompression "
        f"bomb DOS attack., resolved to {root}/refused.png)",
        "image_too_large: data:image/png;base64 (69 bytes): 40x40 pixels, more than 1,000"]
    assert len(result.kept) == 1


def test_absolute_image_path_is_reported_as_written(image_root):
    gone = str(image_root.resolve() / "gone.png")
    result = fix_dataset([_with_image(gone)], FixConfig(), image_root=str(image_root))
    assert [q["reason"] for q in result.quarantined] == [f"image_missing: {gone}"]


def test_readable_image_is_kept_with_its_resolved_absolute_path(image_root):
    result = fix_dataset([_with_image("ok.png")], FixConfig(), image_root=str(image_root))
    assert result.counts["kept"] == 1 and result.kept[0]["fixes"] == []  # resolving is not a fix
    assert result.kept[0]["messages"][0]["content"] == [
        {"type": "text", "text": "What is this map?"}, {"type": "image", "image": str(image_root.resolve() / "ok.png")}]


def test_urls_are_neither_checked_nor_rewritten(image_root):
    """A server may fetch them (specforge bench); where they would be opened here they are refused
    (tests/test_embedded_images.py), as are data: URIs that are not images."""
    urls = ["https://example.com/x.png", "http://example.com/y.png"]
    rows = [_with_image(u, line=i) for i, u in enumerate(urls + ["data:image/png;base64,AAAA"], 1)]
    result = fix_dataset(rows, FixConfig(), image_root=str(image_root))
    assert [k["messages"][0]["content"][1]["image"] for k in result.kept] == urls
    assert [q["reason"].split(": ")[0] for q in result.quarantined] == ["image_unreadable"]


def test_fixed_rows_fixed_again_are_unchanged(image_root):
    first = fix_dataset([_with_image("ok.png")], FixConfig(), image_root=str(image_root)).kept[0]
    again_raw = RawRow("elsewhere/clean.jsonl", 1, {"id": first["id"], "messages": first["messages"]}, None)
    for root in (str(image_root), None):  # absolute paths need neither the root nor the data file's folder
        again = fix_dataset([again_raw], FixConfig(), image_root=root).kept[0]
        assert again["messages"] == first["messages"] and again["fixes"] == []


def test_row_level_images_field_is_checked(image_root):
    rows = [_raw([USER, ASSISTANT], line=1, images=["ok.png"]),
            _raw([USER, ASSISTANT], line=2, images="gone.png")]
    result = fix_dataset(rows, FixConfig(dedupe=False), image_root=str(image_root))
    assert [q["reason"] for q in result.quarantined] == [
        f"image_missing: gone.png (resolved to {image_root.resolve()}/gone.png)"]
    assert result.kept[0]["messages"][0]["content"] == [
        {"type": "image", "image": str(image_root.resolve() / "ok.png")}, {"type": "text", "text": USER["content"]}]


def test_every_image_is_checked_exactly_once(image_root, monkeypatch):
    from specforge.data.fix.conversations import ImageChecker

    checked = []
    original = ImageChecker._checked
    monkeypatch.setattr(ImageChecker, "_checked", lambda self, ref, f: checked.append(ref) or original(self, ref, f))
    parts = [{"type": "image", "image": "ok.png"}, {"type": "text", "text": "Map?"}]
    rows = [
        _raw([USER, ASSISTANT], line=1, images=["ok.png"]),  # row-level, no placeholder
        _raw([{"role": "user", "content": "<image> and <image>?"}, ASSISTANT], line=2, image=None,
             images=["ok.png", "./ok.png"]),  # placeholders
        _raw([{"role": "user", "content": parts}, ASSISTANT], line=3, images=["ok.png"]),  # listed in both
        _with_image("https://example.com/x.png", line=4),  # remote: not checked
    ]
    result = fix_dataset(rows, FixConfig(dedupe=False), image_root=str(image_root))
    assert result.counts["kept"] == 4
    assert checked == ["ok.png", "ok.png", "./ok.png", "ok.png"]
    ok = str(image_root.resolve() / "ok.png")
    assert result.kept[1]["messages"][0]["content"] == [
        {"type": "image", "image": ok}, {"type": "text", "text": "and"}, {"type": "image", "image": ok},
        {"type": "text", "text": "?"}]
    assert result.kept[2]["messages"][0]["content"] == [{"type": "image", "image": ok}, parts[1]]


def test_image_placeholder_mismatch_is_quarantined_naming_the_field(image_root):
    _, q = _one(_raw([{"role": "user", "content": "<image> vs <image>"}, ASSISTANT], images=["ok.png"]))
    assert q["reason"].startswith("invalid_row: images: 1 image(s) listed but the turns have 2 <image>")


def test_duplicates_compare_resolved_image_paths(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        Image.new("RGB", (4, 4), "blue").save(tmp_path / folder / "map.png")
    a, b = str(tmp_path / "a" / "d.jsonl"), str(tmp_path / "b" / "d.jsonl")
    rows = [
        RawRow(a, 1, _with_image("map.png").data, None),
        RawRow(a, 2, _with_image("./map.png").data, None),  # same file, other spelling: a copy
        RawRow(b, 3, _with_image("map.png").data, None),  # same spelling, another file: not a copy
    ]
    result = fix_dataset(rows, FixConfig())
    assert [k["line"] for k in result.kept] == [1, 3]
    assert [q["reason"] for q in result.quarantined] == [f"duplicate: same messages as {a}:1"]


def test_without_image_root_paths_resolve_beside_the_data_file(image_root):
    row = RawRow(str(image_root / "train.jsonl"), 1, _with_image("ok.png").data, None)
    result = fix_dataset([row], FixConfig())
    assert result.counts["kept"] == 1
    assert result.kept[0]["messages"][0]["content"][1]["image"] == str(image_root.resolve() / "ok.png")


def test_every_row_is_accounted_for_and_fixes_count_rows():
    rows = [
        _raw([USER, ASSISTANT], line=1),
        _raw([{"role": "human", "content": "a"}, {"role": "user", "content": "b"}, ASSISTANT], line=2),
        _raw([{"role": "user", "content": "c"}, {"role": "user", "content": "d"},
              {"role": "user", "content": "e"}, ASSISTANT], line=3),
        _raw([USER], line=4),
        RawRow("d.jsonl", 5, None, "invalid JSON: Expecting value (column 1)"),
    ]
    result = fix_dataset(rows, FixConfig())
    assert result.counts == {
        "input_rows": 5, "kept": 1, "fixed": 2, "quarantined": 2,
        "by_fix": {"merged_consecutive_user": 2, "normalized_role_names": 1},
        "by_reason": {"invalid_json": 1, "no_assistant_turn": 1}, "by_kept_as_written": {},
    }
    assert _reconciles(result.counts)
    assert result.quarantined[1]["row"] == "invalid JSON: Expecting value (column 1)"


def test_same_input_gives_identical_output():
    rows = [_raw([USER, USER, ASSISTANT], line=i) for i in range(1, 4)] + [_raw([USER], line=9)]
    first, second = fix_dataset(rows, FixConfig()), fix_dataset(rows, FixConfig())
    assert json.dumps(first.__dict__, sort_keys=True) == json.dumps(second.__dict__, sort_keys=True)


def test_disabled_fixing_only_parses():
    rows = [_raw([USER, USER], line=1), RawRow("d.jsonl", 2, None, "invalid JSON: x")]
    result = fix_dataset(rows, FixConfig(enabled=False))
    assert result.kept[0]["messages"] == [USER, USER] and result.kept[0]["fixes"] == []
    assert [q["reason"] for q in result.quarantined] == ["invalid_json: invalid JSON: x"]


@pytest.mark.parametrize("field, value", [("empty_turns", "drop"), ("no_assistant", "skip"), ("toon_where", "all")])
def test_misspelled_policy_fails_before_reading_data(field, value):
    with pytest.raises(ValueError, match=f"data.fix.{field}: '{value}'"):
        fix_dataset([], FixConfig(**{field: value}))


def test_row_whose_turns_are_all_empty_is_quarantined():
    _, q = _one(_raw([{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]))
    assert q["reason"] == "no_messages: every turn was empty"


def test_malformed_images_field_names_the_field():
    _, q = _one(_raw([USER, ASSISTANT], images=[3]))
    assert q["reason"] == "invalid_row: images: expected a path or a list of paths"
