"""Chat template rendering and loss masks, token by token, on the tiny ChatML tokenizer."""
from __future__ import annotations

import pytest

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
