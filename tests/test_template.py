"""Chat template rendering and loss masks, token by token, on the tiny ChatML tokenizer."""
from __future__ import annotations

import pytest

from specforge.data.formats import to_conversation
from specforge.data.template import TemplateError, render
from specforge.targets.tiny import build_tiny_tokenizer

S, E = "<|im_start|>", "<|im_end|>"

# SmolLM2-135M-Instruct's template: injects a default system prompt when none is given.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture
def tok():
    """A fresh tokenizer per test: some tests replace its chat template."""
    return build_tiny_tokenizer(None)


def pieces(tok, messages, **kw):
    ids, mask = render(tok, messages, **kw)
    return [(tok.decode([i]), m) for i, m in zip(ids, mask)]


def masked_text(tok, messages, **kw):
    ids, mask = render(tok, messages, **kw)
    return tok.decode([i for i, m in zip(ids, mask) if m])


USER_HEADER = [(S, 0), ("u", 0), ("s", 0), ("er", 0), ("\n", 0)]
ASSISTANT_HEADER = [(S, 0), ("a", 0), ("ss", 0), ("istant", 0), ("\n", 0)]


def test_multi_turn_golden(tok):
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "city: Oslo"},
        {"role": "user", "content": "tomorrow?"},
        {"role": "assistant", "content": "sky: rainy"},
    ]
    expected = (
        USER_HEADER + [("weather", 0), (" in", 0), (" Oslo", 0), ("?", 0), (E, 0), ("\n", 0)]
        + ASSISTANT_HEADER + [("c", 1), ("it", 1), ("y", 1), (":", 1), (" Oslo", 1), (E, 1), ("\n", 0)]
        + USER_HEADER + [("t", 0), ("o", 0), ("mo", 0), ("rrow", 0), ("?", 0), (E, 0), ("\n", 0)]
        + ASSISTANT_HEADER + [("s", 1), ("ky", 1), (":", 1), (" rainy", 1), (E, 1), ("\n", 0)]
    )
    assert pieces(tok, messages) == expected


def test_system_prompt_golden(tok):
    messages = [
        {"role": "system", "content": "Answer in TOON."},
        {"role": "user", "content": "Paris today?"},
        {"role": "assistant", "content": "sky: sunny"},
    ]
    expected = (
        [(S, 0), ("s", 0), ("y", 0), ("s", 0), ("t", 0), ("em", 0), ("\n", 0),
         ("An", 0), ("swer", 0), (" in", 0), (" TOON", 0), (".", 0), (E, 0), ("\n", 0)]
        + USER_HEADER + [("P", 0), ("ar", 0), ("is", 0), (" today", 0), ("?", 0), (E, 0), ("\n", 0)]
        + ASSISTANT_HEADER + [("s", 1), ("ky", 1), (":", 1), (" sunny", 1), (E, 1), ("\n", 0)]
    )
    assert pieces(tok, messages) == expected


def test_empty_assistant_turn_masks_only_its_end_token(tok):
    messages = [{"role": "user", "content": "Lima?"}, {"role": "assistant", "content": ""}]
    expected = (USER_HEADER + [("Li", 0), ("ma", 0), ("?", 0), (E, 0), ("\n", 0)]
                + ASSISTANT_HEADER + [(E, 1), ("\n", 0)])
    assert pieces(tok, messages) == expected


def test_render_matches_the_templates_own_token_ids(tok):
    messages = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "sky: windy"}]
    ids, mask = render(tok, messages)
    assert ids == list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
    assert len(mask) == len(ids)


def test_injected_default_system_prompt_is_not_masked(tok):
    tok.chat_template = SMOL_TEMPLATE
    messages = [
        {"role": "user", "content": "Bern?"},
        {"role": "assistant", "content": "sky: cloudy"},
        {"role": "user", "content": "and Perth?"},
        {"role": "assistant", "content": "sky: sunny"},
    ]
    ids, mask = render(tok, messages)
    text = tok.decode(ids)
    assert text.startswith(f"{S}system\nYou are a helpful AI assistant named SmolLM")
    assert masked_text(tok, messages) == f"sky: cloudy{E}sky: sunny{E}"
    # the masked tokens are exactly two contiguous runs, each right after an assistant header
    runs = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert len(runs) == 2
    for start in runs:
        assert tok.decode(ids[:start]).endswith(f"{S}assistant\n")


def test_template_without_trailing_newline_and_other_end_token(tok):
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ': ' + m['content'] + '<|endoftext|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant: ' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Quito?"}, {"role": "assistant", "content": "sky: rainy"}]
    # " sky" straddles the header's trailing space and the content: it is what the model predicts
    assert pieces(tok, messages)[-5:] == [(":", 0), (" sky", 1), (":", 1), (" rainy", 1), ("<|endoftext|>", 1)]


def test_system_and_user_turns_never_masked(tok):
    messages = [{"role": "system", "content": "sky: sunny"}, {"role": "user", "content": "sky: sunny"}]
    ids, mask = render(tok, messages)
    assert ids and not any(mask)


def test_truncate_cuts_to_max_length(tok):
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "city: Oslo"},
        {"role": "user", "content": "tomorrow?"},
        {"role": "assistant", "content": "sky: rainy"},
    ]
    full = render(tok, messages)
    r = render(tok, messages, max_length=25)
    assert r.truncated and r.drop_reason is None and r.full_length == len(full.input_ids)
    assert r.input_ids == full.input_ids[:25] and r.loss_mask == full.loss_mask[:25]
    assert sum(r.loss_mask) == 6  # the first answer survives whole
    untouched = render(tok, messages, max_length=len(full.input_ids))
    assert not untouched.truncated and untouched.input_ids == full.input_ids


def test_truncation_that_leaves_no_loss_tokens_drops_the_sample(tok):
    messages = [{"role": "user", "content": "weather in Oslo today?"}, {"role": "assistant", "content": "sky: rainy"}]
    r = render(tok, messages, max_length=8)
    assert r.drop_reason == "no_loss_tokens_after_truncation"
    assert r.input_ids == [] and r.loss_mask == []


def test_overlength_drop(tok):
    messages = [{"role": "user", "content": "weather in Oslo today?"}, {"role": "assistant", "content": "sky: rainy"}]
    r = render(tok, messages, max_length=8, overlength="drop")
    assert r.drop_reason == "overlength" and r.input_ids == []
    with pytest.raises(ValueError, match="overlength"):
        render(tok, messages, overlength="cut")


def test_template_without_end_of_turn_token_is_an_error(tok):
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Cairo?"}, {"role": "assistant", "content": "sky: sunny"}]
    with pytest.raises(TemplateError, match="end-of-turn"):
        render(tok, messages)


def test_template_that_rewrites_content_is_an_error(tok):
    tok.chat_template = (
        "{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | upper + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Cairo?"}, {"role": "assistant", "content": "sky: sunny"}]
    with pytest.raises(TemplateError, match=r"messages\[1\].content"):
        render(tok, messages)


def test_template_that_refuses_a_conversation_is_a_row_error(tok):
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="System role not supported"):
        render(tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])


def test_image_parts_in_a_text_template_are_a_row_error(tok):
    messages = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Oslo?"}]},
                {"role": "assistant", "content": "sky: rainy"}]
    with pytest.raises(TemplateError, match="cannot render"):
        render(tok, messages)


# A reasoning template as Qwen3's and DeepSeek-R1's behave: an assistant turn before the last user
# message is rendered without its <think> block, the turns after it with theirs.
REASONING_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}"
    "{% set answer = m['content'].split('</think>')[-1].lstrip('\\n') %}"
    "{% set reasoning = m['content'].split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% if loop.index0 > ns.last_user %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_reasoning_template_that_drops_earlier_think_blocks_trains_on_what_it_renders(tok):
    """Multi-turn conversations of a thinking target (regenerated with data.regenerate.thinking=true):
    the earlier turn is trained as rendered (its answer), the last one with its reasoning."""
    tok.chat_template = REASONING_TEMPLATE
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "<think>\ncold\n</think>\n\nsky: snow"},
                {"role": "user", "content": "Lima?"},
                {"role": "assistant", "content": "<think>\nwarm\n</think>\n\nsky: sunny"}]
    assert masked_text(tok, messages) == f"sky: snow{E}<think>\nwarm\n</think>\n\nsky: sunny{E}"
    empty = [messages[0], {"role": "assistant", "content": "<think>\ncold\n</think>\n\n"}, *messages[2:]]
    assert masked_text(tok, empty) == f"{E}<think>\nwarm\n</think>\n\nsky: sunny{E}"  # no answer: its end token
    rewritten = [messages[0], {"role": "assistant", "content": "<think>\ncold\n</think>\n\nSKY: snow"}, *messages[2:]]
    tok.chat_template = REASONING_TEMPLATE.replace("+ answer + '<|im_end|>\\n' }}{% endif %}",
                                                   "+ answer | lower + '<|im_end|>\\n' }}{% endif %}")
    with pytest.raises(TemplateError, match=r"messages\[1\].content: not found"):
        render(tok, rewritten)  # a template that changes the answer itself is still refused


# Phi-3's shape: each turn closes with <|end|>, and the conversation, when no generation prompt
# follows, with the end-of-text token too.
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ '<|endoftext|>' }}{% endif %}"
)


def test_a_turn_ends_at_its_end_of_turn_token_not_at_the_conversation_end_after_it():
    tok = build_tiny_tokenizer(None, special_tokens=["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>", E],
                               chat_template=PHI3_TEMPLATE)
    ids, mask = render(tok, [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "snow"},
                             {"role": "user", "content": "Lima?"}, {"role": "assistant", "content": "sun"}])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "snow<|end|>sun<|end|>"


# Llama 3's and Gemma's way: each turn's content rendered `| trim`, without its outer whitespace.
TRIM_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("answer", ["sunny today", "sunny today\n", " sunny today", "\n sunny today \n"])
def test_a_template_that_trims_the_content_trains_on_the_answer_it_renders(tok, answer):
    """The answer was looked for as written: one with a trailing newline or a leading space (common in
    regenerated and scraped data) was not in the text a trimming template renders, so the row was
    quarantined as template_error."""
    tok.chat_template = TRIM_TEMPLATE
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": answer}]
    assert masked_text(tok, messages) == f"sunny today{E}"


# DeepSeek-R1-Distill's template as published since February 2025 (tool calls left out): it drops the
# reasoning of every answer, and its generation prompt opens a think block that no rendered answer has.
R1_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
R1_JANUARY_TEMPLATE = R1_TEMPLATE.replace("'<｜Assistant｜><think>\\n'", "'<｜Assistant｜>'")  # its first version
# Qwen3-Thinking-2507's and QwQ's: Qwen3's, with a generation prompt that opens the think block.
THINKING_TEMPLATE = REASONING_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}{% endif %}",
                                               "{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


def r1_tokenizer(template):
    tok = build_tiny_tokenizer(None, special_tokens=R1_SPECIALS + [E], chat_template=template)
    tok.bos_token, tok.eos_token = R1_SPECIALS[0], R1_SPECIALS[1]
    return tok


def test_a_generation_prompt_that_opens_a_think_block_the_answers_lack_still_locates_them(tok):
    """The prompt rendered with the generation prompt had to be a prefix of the whole text: with R1's
    `<｜Assistant｜><think>\\n` every row was quarantined, with Qwen3-Thinking-2507's every multi-turn row
    (its earlier answers are rendered without `<think>\\n`). A turn starts where the prompt and the text part."""
    eos = R1_SPECIALS[1]
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "<think>\ncold\n</think>\n\nsky: snow"},
                {"role": "user", "content": "Lima?"}, {"role": "assistant", "content": "sky: sunny"}]
    assert masked_text(r1_tokenizer(R1_TEMPLATE), messages) == f"\n\nsky: snow{eos}sky: sunny{eos}"  # as rendered
    tok.chat_template = THINKING_TEMPLATE
    messages[3] = {"role": "assistant", "content": "<think>\nwarm\n</think>\n\nsky: sunny"}
    # the last turn after the served prompt (its <think>\n is the prompt's), the earlier one as rendered
    assert masked_text(tok, messages) == f"sky: snow{E}warm\n</think>\n\nsky: sunny{E}"
    assert masked_text(tok, messages[:2]) == f"cold\n</think>\n\nsky: snow{E}"


def test_a_template_that_drops_the_last_answers_reasoning_is_a_row_error_not_a_sample_without_it(tok):
    """The fallback for templates that drop earlier turns' reasoning applied to every turn: with R1's
    January template (it drops it from all) the last answer trained without its reasoning, silently,
    where the README promises the later turns keep it. A turn no user message follows must render it."""
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "<think>\nLong reasoning about Oslo.\n</think>\n\nsky: snow"}]
    for template in (R1_JANUARY_TEMPLATE, R1_TEMPLATE):
        with pytest.raises(TemplateError, match=r"messages\[1\].content: the chat template drops the reasoning .*"
                                                r"target.chat_template"):
            render(r1_tokenizer(template), messages)
    tok.chat_template = REASONING_TEMPLATE  # reasoning rendered, respaced: still trained
    respaced = [messages[0], {"role": "assistant", "content": "<think>cold</think>sky: snow"}]
    assert masked_text(tok, respaced) == f"<think>\ncold\n</think>\n\nsky: snow{E}"


# gpt-oss's harmony template, its message loop as published (system prompt shortened, tool definitions
# not rendered): reasoning comes from `message.thinking`, on the analysis channel; an earlier answer ends
# with <|end|>, the last with <|return|>, a call with <|call|>.
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", E]
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>Reasoning: medium<|end|>' }}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content + '<|end|>' }}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set last_tool_call = namespace(name=none) %}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if 'tool_calls' in message %}"
    "{%- set future_final_message = namespace(found=false) %}"
    "{%- for future_message in loop_messages[loop.index:] %}"
    "{%- if future_message.role == 'assistant' and 'tool_calls' not in future_message %}"
    "{%- set future_final_message.found = true %}{%- endif %}{%- endfor %}"
    "{%- set tool_call = message.tool_calls[0] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content and message.thinking %}{{- raise_exception('Cannot pass both content and thinking') }}"
    "{%- elif message.content and not future_final_message.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.thinking and not future_final_message.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant to=' }}{{- 'functions.' + tool_call.name + '<|channel|>commentary ' }}"
    "{{- (tool_call.content_type if tool_call.content_type is defined else 'json') + '<|message|>' }}"
    "{{- tool_call.arguments|tojson }}{{- '<|call|>' }}{%- set last_tool_call.name = tool_call.name %}"
    "{%- elif loop.last and not add_generation_prompt %}"
    "{%- if 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- set last_tool_call.name = none %}{%- endif %}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start|>functions.' + last_tool_call.name }}"
    "{{- ' to=assistant<|channel|>commentary<|message|>' + message.content|tojson + '<|end|>' }}"
    "{%- elif message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def test_reasoning_is_rendered_from_the_field_the_template_reads_it_from():
    """Reasoning a server split off was put back as `<think>` text in front of the answer for every
    template: gpt-oss's harmony rendered it inside the final answer, a text the target never writes,
    instead of on its analysis channel (`message.thinking`)."""
    tok = build_tiny_tokenizer(None, special_tokens=HARMONY_SPECIALS, chat_template=HARMONY_TEMPLATE)
    conv = to_conversation({"messages": [{"role": "user", "content": "Oslo?"}, {"role": "assistant",
                            "content": "sky: snow", "reasoning_content": "It is winter."}]})
    assert masked_text(tok, conv["messages"]) == ("<|channel|>analysis<|message|>It is winter.<|end|>"
                                                  "<|start|>assistant<|channel|>final<|message|>sky: snow<|return|>")
