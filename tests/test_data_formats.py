"""Raw rows and conversation formats."""
from __future__ import annotations

import json

import pytest

from specforge.data.formats import DataError, read_raw_rows, to_conversation


def test_jsonl_rows_never_raise_and_keep_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"messages": []}\n'
        b"\n"
        b'{"broken": \n'
        b"[1, 2]\n"
        b'{"ok": "\xc3\xa9"}\n'
        b'{"id": 7}\n'
    )
    rows = list(read_raw_rows(path))
    assert [r.line for r in rows] == [1, 3, 4, 5, 6]
    assert rows[0].data == {"messages": []} and rows[0].error is None and rows[0].file == str(path)
    assert rows[1].data is None and rows[1].error.startswith("invalid JSON")
    assert rows[2].data is None and "expected a JSON object, got list" in rows[2].error
    assert rows[3].data == {"ok": "\u00e9"} and rows[3].error is None  # undecodable bytes: tests/test_hostile_data.py
    assert rows[4].data == {"id": 7}


def test_json_list_rows_carry_their_real_lines(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"id": "a"},\n\n  {"id": "b",\n   "x": 1},\n  "oops"\n]\n')
    rows = list(read_raw_rows(path))
    assert [(r.line, r.data) for r in rows[:2]] == [(2, {"id": "a"}), (4, {"id": "b", "x": 1})]
    assert rows[2].line == 6 and rows[2].data is None and "got str" in rows[2].error


def test_json_file_that_is_not_a_list_or_breaks_midway(tmp_path):
    (tmp_path / "a.json").write_text('{"id": 1}')
    (rows,) = list(read_raw_rows(tmp_path / "a.json"))
    assert rows.data is None and "list of objects" in rows.error
    (tmp_path / "b.json").write_text('[{"id": 1},\n {"id": }]')
    rows = list(read_raw_rows(tmp_path / "b.json"))
    assert rows[0].data == {"id": 1}
    assert rows[1].line == 2 and rows[1].error.startswith("invalid JSON")


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(read_raw_rows(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="d.csv.*unsupported"):
        list(read_raw_rows(tmp_path / "d.csv"))


def test_sharegpt():
    conv = to_conversation({"id": 12, "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Oslo?"},
        {"from": "gpt", "value": "rain"},
    ]})
    assert conv == {"id": "12", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "rain"},
    ]}


def test_openai_messages_with_text_parts_and_images():
    conv = to_conversation({"uuid": "u-1", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": "rain"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "maps/oslo.png"}},
                                     {"type": "text", "text": "And this?"}]},
    ]})
    assert conv["id"] == "u-1"
    assert conv["messages"][0] == {"role": "user", "content": "Look:\nOslo?"}
    assert conv["messages"][2]["content"] == [{"type": "image", "image": "maps/oslo.png"},
                                              {"type": "text", "text": "And this?"}]


def test_image_parts_in_each_providers_spelling():
    """OpenAI's chat (`image_url.url`) and Responses (`input_image` with the URL as a string), Hugging
    Face's `image`, Anthropic's base64 or URL `source`: one image part each."""
    png = "iVBORw0KGgo="
    parts = [{"type": "image_url", "image_url": {"url": "a.png"}}, {"type": "input_image", "image_url": "b.png"},
             {"type": "image", "image": "c.png"},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
             {"type": "image", "source": {"type": "url", "url": "https://example.com/d.png"}}]
    conv = to_conversation({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "x"}]})
    assert [p["image"] for p in conv["messages"][0]["content"]] == [
        "a.png", "b.png", "c.png", f"data:image/png;base64,{png}", "https://example.com/d.png"]
    with pytest.raises(DataError, match=r"content\[0\]: image part without an image path or URL"):
        to_conversation({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]})


def test_role_content_conversations_and_top_level_system():
    conv = to_conversation({"system": "Answer in TOON.", "conversations": [
        {"role": "user", "content": "Lima?"}, {"role": "assistant", "content": "sky: sunny"}]})
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant"]
    assert conv["messages"][0]["content"] == "Answer in TOON."


def test_auto_detection_matches_explicit_formats():
    sharegpt = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    messages = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    plain = {"conversations": messages["messages"]}
    assert to_conversation(sharegpt) == to_conversation(sharegpt, "sharegpt")
    assert to_conversation(messages) == to_conversation(messages, "messages")
    assert to_conversation(plain) == to_conversation(plain, "conversations")
    assert to_conversation(sharegpt)["messages"] == to_conversation(messages)["messages"]


def test_alpaca_rows_with_input_system_and_history():
    """Stanford's instruction / input / output, LLaMA-Factory's system and history: the user turn
    is the instruction and its input on the next line; the rest of the row stays."""
    row = {"id": "a-1", "system": "Be brief.", "history": [["Oslo?", "rain"]],
           "instruction": "Translate to French.", "input": "sunny", "output": "ensoleillé"}
    conv = to_conversation(row)
    assert conv == {"id": "a-1", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "rain"},
        {"role": "user", "content": "Translate to French.\nsunny"}, {"role": "assistant", "content": "ensoleillé"},
    ]}
    assert to_conversation(row, "alpaca") == conv
    plain = to_conversation({"instruction": "Lima?", "input": "", "output": "sky: sunny"})["messages"]
    assert plain == [{"role": "user", "content": "Lima?"}, {"role": "assistant", "content": "sky: sunny"}]
    dolly = {"instruction": "Translate to French.", "context": "sunny", "response": "ensoleillé", "category": "qa"}
    assert to_conversation(dolly)["messages"] == conv["messages"][3:]  # Dolly's spelling of the same fields


def test_prompt_completion_rows_text_and_conversational():
    """OpenAI's legacy fine-tuning rows and TRL's prompt-completion datasets (text or turns)."""
    text = {"id": "p1", "prompt": "Oslo?", "completion": "rain"}
    assert to_conversation(text) == {"id": "p1", "messages": [{"role": "user", "content": "Oslo?"},
                                                              {"role": "assistant", "content": "rain"}]}
    assert to_conversation(text, "prompt_completion") == to_conversation(text)
    turns = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}],
             "completion": [{"role": "assistant", "content": "rain"}]}
    assert [m["role"] for m in to_conversation(turns)["messages"]] == ["system", "user", "assistant"]


def test_turns_stored_as_a_json_string_are_read_as_the_list():
    """Some Parquet exports store the turns as one JSON string (as some store `tools`)."""
    turns = [{"from": "human", "value": "Oslo?"}, {"from": "gpt", "value": "rain"}]
    conv = to_conversation({"id": "j", "conversations": json.dumps(turns)})
    assert conv == to_conversation({"id": "j", "conversations": turns})
    messages = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "rain"}]
    assert to_conversation({"id": "j", "messages": " " + json.dumps(messages)})["messages"] == messages
    with pytest.raises(DataError, match=r"messages: a string that is not a JSON list of turns"):
        to_conversation({"messages": '[{"role": "user"'})
    with pytest.raises(DataError, match="messages: expected a list of turns, got str"):
        to_conversation({"messages": "hello"})


def test_turns_stored_as_a_json_string_are_parsed_once_per_row(monkeypatch):
    """Format detection, conversion and the role-name accounting all read the turns: the string is
    parsed once for all three, and the row comes out as its list's would."""
    from specforge.config import FixConfig
    from specforge.data.fix import fix_row
    from specforge.data.formats import RawRow

    turns = [{"from": "human", "value": "Oslo?"}, {"from": "Assistant", "value": "rain"}]
    text, parsed, real = json.dumps(turns), [], json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: (parsed.append(s), real(s, *a, **k))[1])
    conv, fixes = fix_row(RawRow("f.jsonl", 1, {"id": "j", "conversations": text}, None), FixConfig())
    assert parsed.count(text) == 1
    monkeypatch.undo()
    assert (conv, fixes) == fix_row(RawRow("f.jsonl", 1, {"id": "j", "conversations": turns}, None), FixConfig())
    assert "normalized_role_names" in fixes


def test_lmsys_and_wildchat_rows_keep_their_turns_under_conversation():
    """LMSYS-Chat-1M and WildChat name the turns `conversation` (role/content), LMSYS its id
    `conversation_id`; a ShareGPT row may spell it so too."""
    lmsys = {"conversation_id": "c-7", "model": "vicuna-13b", "turn": 1, "language": "English",
             "conversation": [{"content": "Oslo?", "role": "user"}, {"content": "rain", "role": "assistant"}]}
    conv = to_conversation(lmsys)
    assert conv == {"id": "c-7", "messages": [{"role": "user", "content": "Oslo?"},
                                              {"role": "assistant", "content": "rain"}]}
    assert to_conversation(lmsys, "conversations") == conv
    sharegpt = {"id": "s", "conversation": [{"from": "human", "value": "Oslo?"}, {"from": "gpt", "value": "rain"}]}
    assert to_conversation(sharegpt)["messages"] == conv["messages"]


def test_hash_id_is_stable_and_content_dependent():
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    other = json.loads(json.dumps(row))
    other["messages"][1]["content"] = "c"
    a, b = to_conversation(row)["id"], to_conversation(json.loads(json.dumps(row)))["id"]
    assert a == b and a.startswith("sha-") and a != to_conversation(other)["id"]


@pytest.mark.parametrize("row, fmt, field", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "x"},
                   {"role": "bot", "content": "x"}]}, "auto", r"messages\[2\]\.role: unknown role 'bot'"),
    ({"messages": [{"role": "user"}]}, "auto", r"messages\[0\]\.content: missing"),
    ({"messages": [{"role": "user", "content": None}]}, "auto", r"messages\[0\]\.content: is null"),
    ({"messages": [{"role": "user", "content": 3}]}, "auto", r"messages\[0\]\.content: expected a string"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "auto", r"messages\[0\]\.content\[0\]\.type"),
    ({"messages": "hello"}, "auto", "messages: expected a list"),
    ({"messages": []}, "auto", "messages: empty"),
    ({"messages": ["hi"]}, "auto", r"messages\[0\]: expected an object"),
    ({"conversations": [{"from": "human"}]}, "auto", r"conversations\[0\]\.value: missing"),
    ({"conversations": [{"from": 3, "value": "x"}]}, "sharegpt", r"conversations\[0\]\.from: unknown role 3"),
    ({"text": "hi"}, "auto", "no 'messages' or 'conversations' field, nor Alpaca's 'instruction' and 'output', "
                             "nor 'prompt' and 'completion'"),
    ({"instruction": "hi"}, "alpaca", "output: expected a string, got nothing"),
    ({"instruction": ["hi"], "output": "x"}, "auto", "instruction: expected a string, got list"),
    ({"instruction": "hi", "input": 3, "output": "x"}, "auto", "input: expected a string, got int"),
    ({"instruction": "hi", "output": "x", "history": [["q"]]}, "auto", r"history\[0\]: expected a \[question, answer\]"),
    ({"instruction": "hi", "output": "x", "history": "q"}, "auto", "history: expected a list"),
    ({"prompt": "hi"}, "prompt_completion", "completion: expected a string or a list of turns, got nothing"),
    ({"prompt": 3, "completion": "x"}, "auto", "prompt: expected a string or a list of turns, got int"),
    ({"prompt": "hi", "completion": [{"role": "bot", "content": "x"}]}, "auto", r"messages\[1\]\.role: unknown role"),
    ({"conversations": []}, "messages", "messages: missing"),
    ({"system": 5, "messages": [{"role": "user", "content": "x"}]}, "auto", "system: expected a string"),
])
def test_malformed_rows_name_the_field(row, fmt, field):
    with pytest.raises(DataError, match=field):
        to_conversation(row, fmt)


def test_unknown_format_is_a_config_error_not_a_row_error():
    with pytest.raises(ValueError, match="data.format") as e:
        to_conversation({"messages": []}, "vicuna")
    assert not isinstance(e.value, DataError)


def _img(path):
    return {"type": "image", "image": path}


def _txt(text):
    return {"type": "text", "text": text}


def test_row_level_images_fill_placeholders_in_order_across_user_turns():
    conv = to_conversation({"id": "l", "images": ["a.png", "b.png", "c.png"], "conversations": [
        {"from": "human", "value": "<image>\nCompare with <image> please."},
        {"from": "gpt", "value": "Done <image>."},  # not a user turn: plain text
        {"from": "human", "value": "And <image>?"},
        {"from": "gpt", "value": "ok"},
    ]})
    assert conv["messages"] == [
        {"role": "user", "content": [_img("a.png"), _txt("Compare with"), _img("b.png"), _txt("please.")]},
        {"role": "assistant", "content": "Done <image>."},
        {"role": "user", "content": [_txt("And"), _img("c.png"), _txt("?")]},
        {"role": "assistant", "content": "ok"},
    ]


def test_row_level_images_without_placeholders_open_the_first_user_turn():
    conv = to_conversation({"images": ["a.png", "b.png"], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Same city?"},
        {"role": "assistant", "content": "yes"}, {"role": "user", "content": "Sure?"}]})
    assert [m["content"] for m in conv["messages"]] == [
        "Be brief.", [_img("a.png"), _img("b.png"), _txt("Same city?")], "yes", "Sure?"]
    one = to_conversation({"image": "a.png", "conversations": [{"from": "human", "value": "Hi"}]})
    assert one["messages"][0]["content"] == [_img("a.png"), _txt("Hi")]


def test_path_less_image_parts_take_the_row_images_and_text_parts_are_split_too():
    conv = to_conversation({"images": ["a.png", "b.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "vs <image>"}]}]})
    assert conv["messages"][0]["content"] == [_img("a.png"), _txt("vs"), _img("b.png")]


def test_llava_row_equals_the_messages_row_it_was_written_from():
    llava = {"id": "x", "images": ["m.png", "n.png"],
             "conversations": [{"from": "human", "value": "<image>\n<image>\nWeather?"}, {"from": "gpt", "value": "a"}]}
    messages = {"id": "x", "messages": [{"role": "user", "content": [_img("m.png"), _img("n.png"), _txt("Weather?")]},
                                        {"role": "assistant", "content": "a"}]}
    assert to_conversation(llava) == to_conversation(messages)


def test_images_listed_both_in_the_turns_and_beside_them_count_once():
    row = {"images": ["a.png"], "messages": [{"role": "user", "content": [_img("a.png"), _txt("x")]}]}
    assert to_conversation(row)["messages"][0]["content"] == [_img("a.png"), _txt("x")]


def test_null_image_fields_and_placeholders_without_images_stay_text():
    row = {"image": None, "images": None, "messages": [{"role": "user", "content": "What is <image>?"}]}
    assert to_conversation(row)["messages"][0]["content"] == "What is <image>?"


@pytest.mark.parametrize("images", [[], ["a.png"]])
def test_row_level_images_keep_the_tool_calls_and_tool_names_of_the_turns(images):
    """Placing row-level images (even `images: []`) rebuilt every turn as {"role", "content"}: an agentic
    trace with an `images` column lost its calls (an empty assistant turn), and its results their names."""
    calls = [{"type": "function", "function": {"name": "forecast", "arguments": {"city": "Oslo"}}}]
    row = {"images": images, "messages": [
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "sunny", "name": "forecast", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny."}]}
    messages = to_conversation(row)["messages"]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert messages[2] == {"role": "tool", "content": "sunny", "name": "forecast", "tool_call_id": "c1"}
    assert messages[0]["content"] == ([_img("a.png"), _txt("weather?")] if images else "weather?")


@pytest.mark.parametrize("row, field", [
    ({"images": ["a.png"], "messages": [{"role": "user", "content": "<image> or <image>"}]},
     r"images: 1 image\(s\) listed but the turns have 2 <image> placeholder"),
    ({"images": ["a.png", "b.png", "c.png"], "messages": [{"role": "user", "content": "<image> or <image>"}]},
     r"images: 3 image\(s\) listed but the turns have 2"),
    ({"image": "a.png", "conversations": [{"from": "human", "value": "<image><image>"}]},
     r"image: 1 image\(s\) listed but the turns have 2"),
    ({"images": ["a.png"], "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]},
     r"images: 1 image\(s\) listed but the turns have 2"),
    ({"images": ["a.png"], "messages": [{"role": "user", "content": [_img("b.png"), _txt("x")]}]},
     r"images: the turns already carry other image paths"),
    ({"images": ["a.png"], "messages": [{"role": "assistant", "content": "x"}]}, "images: 1 image.*no user turn"),
    ({"images": [3], "messages": [{"role": "user", "content": "x"}]}, "images: expected a path or a list of paths"),
    ({"images": {"a": 1}, "messages": [{"role": "user", "content": "x"}]}, "images: expected a path"),
    ({"image": ["a.png"], "messages": [{"role": "user", "content": "x"}]}, "image: expected a path, got list"),
    ({"image": "a.png", "images": ["b.png"], "messages": [{"role": "user", "content": "x"}]},
     "image: the row has both 'image' and 'images'"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     r"messages\[0\]\.content\[0\]: image part without"),
])
def test_row_image_mismatches_name_the_field(row, field):
    with pytest.raises(DataError, match=f"^{field}"):
        to_conversation(row)


def test_reasoning_split_off_by_a_server_is_put_back_in_front_of_the_answer():
    """vLLM's and SGLang's reasoning parsers store the thinking beside the answer, as
    `reasoning_content` or (vLLM 0.10+) `reasoning`; the target wrote it first, in <think>."""
    think = "<think>\ncold\n</think>\n\n"
    for key in ("reasoning_content", "reasoning"):
        row = {"messages": [{"role": "user", "content": "Oslo?"},
                            {"role": "assistant", "content": "sky: snow", key: "cold\n"}]}
        assert to_conversation(row)["messages"][1]["content"] == think + "sky: snow"
    pictured = {"messages": [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "reasoning": "cold",
                "content": [{"type": "text", "text": "sky: snow"}, {"type": "image", "image": "map.png"}]}]}
    assert to_conversation(pictured)["messages"][1]["content"] == [
        {"type": "text", "text": think}, {"type": "text", "text": "sky: snow"}, {"type": "image", "image": "map.png"}]
    twice = {"messages": [{"role": "user", "content": "Oslo?"},
                          {"role": "assistant", "content": think + "sky: snow", "reasoning_content": "cold"}]}
    assert to_conversation(twice)["messages"][1]["content"] == think + "sky: snow"  # not two <think> blocks
    blank = {"messages": [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "x", "reasoning": " "}]}
    assert to_conversation(blank)["messages"][1]["content"] == "x"
    nonsense = {"messages": [{"role": "user", "content": "Oslo?"},
                             {"role": "assistant", "content": "x", "reasoning_content": ["cold"]}]}
    with pytest.raises(DataError, match=r"messages\[1\].reasoning_content: expected a string, got list"):
        to_conversation(nonsense)
