"""Preformatted text (data.format=text, SpecForge's `is_preformatted`): a conversation already rendered
with the target's chat template, e.g. what a server was sent and answered, trained as written. Its
samples are those of the same conversation given as turns; what needs turns is refused up front."""
from __future__ import annotations

import json
import shutil

import pytest

from data_prep.weather import generate
from specforge.data import stage
from specforge.data.formats import DataError, to_conversation
from specforge.data.template import (TemplateError, as_template_reads, assistant_markers, render, render_text,
                                     text_prompt)
from specforge.errors import InvalidInput
from specforge.eval.prompts import heldout_prompts
from specforge.targets.tiny import CHATML_TEMPLATE, SPECIAL_TOKENS, build_tiny_tokenizer
from specforge.utils.io import read_jsonl, write_jsonl
from test_data_stage import make_cfg
from test_template import HARMONY_SPECIALS, HARMONY_TEMPLATE, REASONING_TEMPLATE, SMOL_TEMPLATE

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml": (CHATML_TEMPLATE, SPECIAL_TOKENS),
    "smollm2 (a default system prompt)": (SMOL_TEMPLATE, SPECIAL_TOKENS),
    "reasoning (earlier <think> dropped)": (REASONING_TEMPLATE, SPECIAL_TOKENS),
    "llama 3": (LLAMA3_TEMPLATE, SPECIAL_TOKENS + LLAMA3_SPECIALS),
    "gpt-oss harmony (reasoning on its own channel)": (HARMONY_TEMPLATE, SPECIAL_TOKENS + HARMONY_SPECIALS[:-1]),
}
CONVERSATIONS = [
    [{"role": "user", "content": "weather in Oslo?"}, {"role": "assistant", "content": "city: Oslo"}],
    [{"role": "system", "content": "Answer in TOON."}, {"role": "user", "content": "Oslo?"},
     {"role": "assistant", "content": "<think>\ncold\n</think>\n\nsky: snow"}, {"role": "user", "content": "Lima?"},
     {"role": "assistant", "content": "<think>\nwarm\n</think>\n\nsky: sunny"}],
]


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one turn", "system + two turns with reasoning"])
def test_text_trains_exactly_as_the_same_turns_through_the_template(name, messages):
    template, specials = TEMPLATES[name]
    tok = build_tiny_tokenizer(None, special_tokens=specials, chat_template=template)
    turns = render(tok, messages)
    rendered = tok.apply_chat_template(as_template_reads(tok, messages), tokenize=False)  # harmony: reasoning apart
    text = render_text(tok, rendered)
    assert (text.input_ids, text.loss_mask, text.turns) == (turns.input_ids, turns.loss_mask, turns.turns)
    assert sum(turns.loss_mask) > 0
    prompt = text_prompt(tok, rendered)
    head = [m for m in messages[:[m["role"] for m in messages].index("assistant")]]
    assert prompt == tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True)


def test_each_turn_of_a_text_ends_at_its_own_end_token_as_the_turns_do():
    """The end of a turn was read off one probe answer: gpt-oss's harmony ends a last answer with
    <|return|>, an earlier one with <|end|> and a call with <|call|>, so a text trained everything from its
    first answer on, user turns and tool results included."""
    tok = build_tiny_tokenizer(None, special_tokens=SPECIAL_TOKENS + HARMONY_SPECIALS[:-1],
                               chat_template=HARMONY_TEMPLATE)
    call = {"type": "function", "id": "c0", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "get_weather", "content": "snow"}, {"role": "assistant", "content": "snow"},
                {"role": "user", "content": "Lima?"}, {"role": "assistant", "content": "sun"}]
    turns = render(tok, messages)
    text = render_text(tok, tok.apply_chat_template(messages, tokenize=False))
    assert (text.input_ids, text.loss_mask, text.turns) == (turns.input_ids, turns.loss_mask, turns.turns)
    assert tok.decode([i for i, m in zip(text.input_ids, text.loss_mask) if m]) == (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
        "<|channel|>final<|message|>snow<|end|><|channel|>final<|message|>sun<|return|>")


def test_a_turn_cut_off_trains_to_the_end_and_truncation_is_as_for_turns():
    tok = build_tiny_tokenizer(None)
    full = tok.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    cut = full[: full.rindex("sunny")]  # the last answer cut mid-way (a log of a stopped stream)
    r = render_text(tok, cut)
    assert r.loss_mask[-1] == 1 and tok.decode([i for i, m in zip(r.input_ids, r.loss_mask) if m]).endswith("sky: ")
    whole = render_text(tok, full)
    short = render_text(tok, full, max_length=12)
    assert short.drop_reason == "no_loss_tokens_after_truncation" and short.input_ids == []
    kept = render_text(tok, full, max_length=len(whole.input_ids) - 3)
    assert kept.truncated and kept.input_ids == whole.input_ids[:-3]
    assert render_text(tok, full, max_length=12, overlength="drop").drop_reason == "overlength"


def test_a_text_that_ends_at_the_generation_prompt_is_quarantined_not_a_sample_without_loss():
    """A prompt logged with its generation prompt and no answer (a request, not a conversation) opens an
    assistant turn, so it was kept: a sample of 0 loss tokens, extracted and trained for nothing."""
    from specforge.data.rows import render_conversation

    tok = build_tiny_tokenizer(None)
    prompt = "<|im_start|>user\nweather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    for max_length in (512, 6):  # judged before truncation, not as no_loss_tokens_after_truncation
        r = render_conversation(tok, {"id": "a", "text": prompt}, max_length, "truncate")
        assert r.reason.startswith("no_assistant_turn: the text ends at the generation prompt") and not r.input_ids
    answered = render_conversation(tok, {"id": "a", "text": prompt + "<|im_end|>\n"}, 512, "truncate")
    assert answered.reason is None and sum(answered.loss_mask) == 1  # an empty answer's end, as for turns


def test_a_template_that_marks_no_assistant_turn_is_refused():
    tok = build_tiny_tokenizer(None, chat_template=(  # Mistral's shape: the answer follows [/INST] directly
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ m['content'] + '<|endoftext|>' }}{% endif %}{% endfor %}"))
    with pytest.raises(TemplateError, match="opens no assistant turn with a generation prompt"):
        assistant_markers(tok)


def test_rows_without_text_are_row_errors_and_auto_points_to_the_format():
    with pytest.raises(DataError, match=r"text: expected the conversation rendered with the chat template"):
        to_conversation({"text": "  "}, "text")
    with pytest.raises(DataError, match="got int"):
        to_conversation({"text": 3}, "text")
    with pytest.raises(DataError, match="read with data.format=text"):
        to_conversation({"text": "<|im_start|>user\nhi<|im_end|>\n"})
    assert to_conversation({"id": 7, "text": "x"}, "text") == {"id": "7", "text": "x"}


def _texts(tok, rows: list[dict]) -> list[dict]:
    return [{"id": r["id"], "text": tok.apply_chat_template(r["messages"], tokenize=False)} for r in rows]


@pytest.mark.parametrize("num_proc", [0, 2])
def test_the_data_stage_gives_the_samples_and_prompts_of_the_same_turns(tmp_path, tiny_target_dir, tiny_tokenizer,
                                                                         num_proc):
    train, held_out = generate(10, seed=3, split="train"), generate(4, seed=3, split="eval")
    train.append(train[2])  # a copy: a duplicate either way
    held_out.append({**train[0], "id": "seen"})  # a training prompt: not held out either way
    files = {}
    for kind, convert in (("turns", lambda rows: rows), ("text", lambda rows: _texts(tiny_tokenizer, rows))):
        for split, rows in (("train", train), ("eval", held_out)):
            files[kind, split] = tmp_path / kind / f"{split}.jsonl"
            write_jsonl(files[kind, split], convert(rows))
    with open(files["text", "train"], "a") as f:  # a text without an answer
        f.write(json.dumps({"id": "q", "text": "<|im_start|>user\nhi<|im_end|>\n"}) + "\n")
    results = {}
    for kind in ("turns", "text"):
        cfg = make_cfg(tmp_path, tiny_target_dir, files[kind, "train"], files[kind, "eval"], num_proc=num_proc,
                       format="text" if kind == "text" else "auto")
        cfg.run_name = kind
        results[kind] = (stage.run(cfg, tmp_path / kind / "run"), tmp_path / kind / "run" / "data")
    (turns, turns_dir), (text, text_dir) = results["turns"], results["text"]
    for split in ("train", "eval"):
        assert (text_dir / f"{split}.jsonl").read_bytes() == (turns_dir / f"{split}.jsonl").read_bytes()
    assert text["train"]["by_reason"] == {"duplicate": 1, "no_assistant_turn": 1}
    assert turns["train"]["by_reason"] == {"duplicate": 1}
    assert text["eval"]["by_reason"] == turns["eval"]["by_reason"] == {"in_train": 1}
    assert {c["id"]: c["text"] for c in read_jsonl(text_dir / "train.conversations.jsonl")} == \
           {r["id"]: r["text"] for r in _texts(tiny_tokenizer, train[:10])}
    prompts = {kind: heldout_prompts(data / "eval.conversations.jsonl", tiny_tokenizer, 8)
               for kind, (_, data) in results.items()}
    assert [p["input_ids"] for p in prompts["text"]] == [p["input_ids"] for p in prompts["turns"]]
    assert len(prompts["text"]) == 4


@pytest.mark.parametrize("setting, named", [
    ("data.regenerate.enabled=true", "data.regenerate.enabled"),
    ("data.fix.toon=true", "data.fix.toon"),
    ("target.kind=qwen3_vl", "target.kind=qwen3_vl"),
])
def test_what_needs_turns_is_refused_before_any_row_is_read(tmp_path, tiny_target_dir, setting, named):
    from omegaconf import OmegaConf

    cfg = make_cfg(tmp_path, tiny_target_dir, tmp_path / "absent.jsonl", None, format="text")
    key, value = setting.split("=")
    OmegaConf.update(cfg, key, True if value == "true" else value)
    with pytest.raises(InvalidInput, match=f"data.format=text: .*{named} cannot apply"):
        stage.check(cfg)


def test_a_template_that_cannot_mark_turns_is_refused_before_any_row(tmp_path, tiny_target_dir):
    target = tmp_path / "mistral_like"
    shutil.copytree(tiny_target_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] + '<|endoftext|>' }}{% endfor %}"
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    rows = tmp_path / "rows.jsonl"
    write_jsonl(rows, [{"text": "hi"}])
    cfg = make_cfg(tmp_path, target, rows, None, format="text")
    with pytest.raises(InvalidInput, match="data.format=text with the chat template of .*opens no assistant turn"):
        stage.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "data" / "quarantine.jsonl").exists()  # no row was read
