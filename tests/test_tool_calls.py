"""Tool-calling conversations (agentic traces, the workload of Qwen3-Coder users): OpenAI's `tools`,
assistant `tool_calls` and `tool` results are read, rendered by the target's template with the
row's tool definitions, and the loss covers what the assistant generates (its answer and its calls),
never the tools' results; in-process and in workers alike; regeneration asks only the answers after the
last call or result."""
from __future__ import annotations

import json
import shutil

import pytest

from specforge.data import stage
from specforge.data.fix.conversations import role_name_fixes
from specforge.data.formats import DataError, to_conversation
from specforge.data.regen.replay import Answer, Replay, conversation_key
from specforge.data.template import TemplateError, render
from specforge.eval.prompts import heldout_prompts
from specforge.targets.tiny import build_tiny_tokenizer
from specforge.utils.io import read_jsonl, write_jsonl
from test_data_stage import make_cfg

E = "<|im_end|>"
# A tool-aware ChatML template written for these tests (Qwen-like behaviour): the tools go into a
# system turn, an assistant turn's calls follow its content, a tool's result is a user turn.
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>' + m['content'] + '</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}{{ '<tool_call>' + c['function']['name'] + ' '"
    " + (c['function']['arguments'] | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": {"type": "object"}}}]


def tool_row(i: int = 0, tools=TOOLS) -> dict:
    return {"id": f"t{i}", "tools": tools, "messages": [
        {"role": "user", "content": f"Weather in Oslo on day {i}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "forecast", "arguments": json.dumps({"day": i})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"},
        {"role": "tool", "tool_call_id": "c2", "content": "-3"},
        {"role": "assistant", "content": f"sky: snow {i}"}]}


@pytest.fixture
def tok():
    t = build_tiny_tokenizer(None)
    t.chat_template = TOOL_TEMPLATE
    return t


def test_openai_tool_rows_are_read_with_their_calls_results_and_tools():
    conv = to_conversation({**tool_row(), "tools": json.dumps(TOOLS)})  # tools stored as a JSON string
    assert conv["tools"] == TOOLS
    call = conv["messages"][1]
    assert call == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "forecast", "arguments": {"day": 0}}, "id": "c1"}]}
    assert conv["messages"][2] == {"role": "tool", "content": "snow", "tool_call_id": "c1"}
    row = tool_row()
    row["messages"][2]["content"] = {"sky": "snow", "temp_c": -3}  # a result stored as an object
    assert to_conversation(row)["messages"][2]["content"] == '{"sky": "snow", "temp_c": -3}'
    thinking = to_conversation({"messages": [{"role": "user", "content": "Oslo?"},
                                             {"role": "assistant", "content": "sky: snow", "reasoning_content": "cold"}]})
    assert thinking["messages"][1]["content"] == "<think>\ncold\n</think>\n\nsky: snow"  # as the target wrote it
    assert "tools" not in thinking


def test_sharegpt_function_call_and_observation_turns(tok):
    """LLaMA-Factory's ShareGPT spelling: the call as JSON text in a `function_call` turn, its result in
    an `observation` turn, the tools as a JSON string."""
    row = {"conversations": [{"from": "human", "value": "Weather in Oslo on day 0?"},
                             {"from": "function_call", "value": json.dumps({"name": "forecast", "arguments": {"day": 0}})},
                             {"from": "observation", "value": "snow"},
                             {"from": "gpt", "value": "sky: snow 0"}], "tools": json.dumps(TOOLS)}
    conv = to_conversation(row)
    assert conv == to_conversation({**tool_row(), "id": conv["id"], "messages": [
        tool_row()["messages"][0], {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "forecast", "arguments": {"day": 0}}}]},
        {"role": "tool", "content": "snow"}, tool_row()["messages"][4]]})
    assert role_name_fixes(row, "sharegpt") == []  # its own spelling, not a fix
    bad = {**row, "conversations": [row["conversations"][0], {"from": "function_call", "value": "forecast(0)"}]}
    with pytest.raises(DataError, match=r"conversations\[1\].value: a function_call turn holds"):
        to_conversation(bad)


@pytest.mark.parametrize("change, message", [
    ({"tools": "{not json"}, r"tools: not a JSON list"),
    ({"tools": {"name": "forecast"}}, r"tools: expected a list of tool definitions"),
    ({"calls": [{"type": "function", "function": {"name": "forecast", "arguments": "{day: 1"}}]},
     r"messages\[1\].tool_calls\[0\].function.arguments: not JSON"),
    ({"calls": [{"type": "function", "function": {"arguments": "{}"}}]}, r"messages\[1\].tool_calls\[0\]: expected"),
    ({"calls": "forecast(1)"}, r"messages\[1\].tool_calls: expected a list of calls"),
])
def test_broken_tool_fields_are_row_errors_naming_the_field(change, message):
    row = tool_row()
    if "tools" in change:
        row["tools"] = change["tools"]
    if "calls" in change:
        row["messages"][1]["tool_calls"] = change["calls"]
    with pytest.raises(DataError, match=message):
        to_conversation(row)


def test_the_loss_covers_the_answer_and_the_calls_not_the_tools_results(tok):
    conv = to_conversation(tool_row())
    ids, mask = render(tok, conv["messages"], tools=conv["tools"])
    assert ids == list(tok.apply_chat_template(conv["messages"], tools=TOOLS, tokenize=True)["input_ids"])
    assert tok.decode(ids).startswith("<|im_start|>system\nTools: forecast<|im_end|>")  # the template saw them
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == (
        f'<tool_call>forecast {{"day": 0}}</tool_call>{E}sky: snow 0{E}')
    with_text = to_conversation(tool_row())
    with_text["messages"][1]["content"] = "Let me look."
    ids, mask = render(tok, with_text["messages"], tools=TOOLS)
    assert tok.decode([i for i, m in zip(ids, mask) if m]).startswith(
        f'Let me look.<tool_call>forecast {{"day": 0}}</tool_call>{E}')


# Mistral's shape: the calls follow a special [TOOL_CALLS] token, the turn ends with </s>.
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'tool' %}{{ '[TOOL_RESULTS]' + m['content'] + '[/TOOL_RESULTS]' }}"
    "{% else %}{{ m['content'] }}{% if m.get('tool_calls') %}{{ '[TOOL_CALLS]' }}"
    "{% for c in m['tool_calls'] %}{{ c['function']['name'] + (c['function']['arguments'] | tojson) }}{% endfor %}"
    "{% endif %}{{ '</s>' }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("template, specials, generated", [
    # a tokenizer that marks the call tags special (Qwen's do not): they are not the end of the turn
    (TOOL_TEMPLATE, ["<tool_call>", "</tool_call>"], f'<tool_call>forecast {{"day": 0}}</tool_call>{E}sky: snow 0{E}'),
    (MISTRAL_TEMPLATE, ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>"],
     '[TOOL_CALLS]forecast{"day": 0}</s>sky: snow 0</s>'),
])
def test_calls_wrapped_in_special_tokens_are_trained_up_to_the_end_of_the_turn(template, specials, generated):
    tok = build_tiny_tokenizer(None, special_tokens=["<|im_start|>", E, *specials], chat_template=template)
    conv = to_conversation(tool_row())
    ids, mask = render(tok, conv["messages"], tools=conv["tools"])
    assert all(tok.convert_ids_to_tokens(tok.convert_tokens_to_ids(t)) == t for t in specials)  # one token each
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == generated


@pytest.mark.parametrize("num_proc", [0, 1])
def test_the_data_stage_keeps_tool_turns_apart_and_renders_with_the_tools(tmp_path, tiny_target_dir, num_proc):
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    (target / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    assert tokenizer.chat_template == TOOL_TEMPLATE
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [tool_row(i) for i in range(4)] + [tool_row(9, tools=None)])
    cfg = make_cfg(tmp_path, target, path, None, num_proc=num_proc)
    result = stage.process_split(cfg, "train", [str(path)], tokenizer)
    counts = result["counts"]
    assert counts["kept"] + counts["fixed"] == 5 and counts["quarantined"] == 0
    assert (counts["tool_rows"], counts["tool_calls"]) == (5, 5)  # the data report shows them
    assert "| tool_calls | 5 |" in stage.report_markdown({"train": counts}, None)
    conv = result["conversations"][0]
    assert conv["tools"] == TOOLS and "tools" not in result["conversations"][4]
    roles = [m["role"] for m in conv["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "assistant"]  # two results, not merged into one
    sample = result["samples"][0]
    expected = render(tokenizer, conv["messages"], tools=TOOLS)
    assert (sample["input_ids"], sample["loss_mask"]) == (expected.input_ids, expected.loss_mask)
    assert tokenizer.decode(sample["input_ids"]).startswith("<|im_start|>system\nTools: forecast")
    assert not tokenizer.decode(result["samples"][4]["input_ids"]).startswith("<|im_start|>system")


def test_held_out_prompts_are_rendered_with_their_tools(tmp_path, tok):
    write_jsonl(tmp_path / "eval.conversations.jsonl", [to_conversation(tool_row())])
    (prompt,) = heldout_prompts(tmp_path / "eval.conversations.jsonl", tok, 1)
    head = [{"role": "user", "content": "Weather in Oslo on day 0?"}]
    assert prompt["input_ids"] == list(tok.apply_chat_template(head, tools=TOOLS, add_generation_prompt=True,
                                                                tokenize=True)["input_ids"])


def test_regeneration_asks_only_the_answers_after_the_last_call_or_result():
    """The target's own calls would not match the results recorded after them: the trace up to the
    last of them is kept as written, the answers after it are asked (with the row's tools)."""
    conv = to_conversation(tool_row())
    replay = Replay("k", 0, conv, max_new_tokens=16)
    assert replay.asked == 1 and replay.tools == TOOLS
    assert replay.prompt() == conv["messages"][:4]  # the call and both results, as written
    replay.answer(Answer("sky: rain", tokens=4, truncated=False))
    assert replay.prompt() is None
    record = replay.record()
    assert record["status"] == "regenerated" and record["turns"] == 1
    assert record["messages"] == [*conv["messages"][:4], {"role": "assistant", "content": "sky: rain"}]

    follow_up = {**conv, "messages": [*conv["messages"], {"role": "user", "content": "And tomorrow?"},
                                      {"role": "assistant", "content": "sky: sun"}]}
    replay = Replay("k", 0, follow_up, max_new_tokens=16)
    assert replay.asked == 2
    replay.prompt()
    replay.answer(Answer("sky: rain", tokens=4, truncated=False))
    assert replay.prompt()[4:] == [{"role": "assistant", "content": "sky: rain"},  # conditioned on its answer
                                   {"role": "user", "content": "And tomorrow?"}]

    ends_with_a_result = {**conv, "messages": conv["messages"][:4]}
    replay = Replay("k", 0, ends_with_a_result, max_new_tokens=16)
    assert replay.asked == 0 and replay.prompt() is None and replay.record()["status"] == "unchanged"

    tools_only = {**conv, "messages": [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "snow"}]}
    replay = Replay("k", 0, tools_only, max_new_tokens=16)  # no call made: every answer is asked
    assert replay.asked == 1 and replay.prompt() == tools_only["messages"][:1] and replay.tools == TOOLS
    assert conversation_key(tools_only) != conversation_key({**tools_only, "tools": None})


def test_a_template_without_tool_support_is_a_row_error_not_lost_calls():
    """Plain ChatML ignores `tools` and `tool_calls`: the calls would vanish from the training text."""
    plain = build_tiny_tokenizer(None)
    conv = to_conversation(tool_row())
    with pytest.raises(TemplateError, match=r"tools: the chat template renders none of the row's tools \(forecast\)"):
        render(plain, conv["messages"], tools=conv["tools"])
    with pytest.raises(TemplateError, match=r"messages\[1\].tool_calls: the chat template does not render the call "
                                            r"to 'forecast'"):
        render(plain, conv["messages"])


def test_long_tool_calls_count_towards_the_row_length_limit():
    from specforge.data.fix.conversations import Quarantine, check_row_length

    row = tool_row()
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"code": "x" * 5000})
    with pytest.raises(Quarantine, match="row_too_long"):
        check_row_length(to_conversation(row)["messages"], 4000)


def test_a_special_token_spelled_in_call_arguments_is_quarantined(tok):
    from specforge.data.rows import render_row

    conv = to_conversation(tool_row())
    conv["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"note": f"done{E}"}
    r = render_row(tok, conv["messages"], 512, "truncate", tools=conv["tools"])
    assert r.reason == f"special_token_text: assistant message 2 holds '{E}', which the tokenizer reads as its " \
                       "control token, not as text"


def test_calls_rendered_before_the_content_are_found_and_trained(tok):
    """A template may render a turn's calls first and its text after them."""
    tok.chat_template = TOOL_TEMPLATE.replace(
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}{{ '<tool_call>' + c['function']['name'] + ' '"
        " + (c['function']['arguments'] | tojson) + '</tool_call>' }}{% endfor %}",
        "{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% for c in m.get('tool_calls') or [] %}{{ '<tool_call>' + c['function']['name'] + ' '"
        " + (c['function']['arguments'] | tojson) + '</tool_call>' }}{% endfor %}{{ m['content'] }}")
    assert tok.chat_template != TOOL_TEMPLATE
    conv = to_conversation(tool_row())
    conv["messages"][1]["content"] = "Let me look."
    ids, mask = render(tok, conv["messages"], tools=TOOLS)
    assert tok.decode([i for i, m in zip(ids, mask) if m]).startswith(
        f'<tool_call>forecast {{"day": 0}}</tool_call>Let me look.{E}')
