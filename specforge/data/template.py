"""Conversation -> (input_ids, loss_mask) through the target tokenizer's own chat template.

The draft must see exactly the token stream the target sees when served, so we never build
prompts by hand. Which tokens carry loss is found by rendering prefixes of the conversation with
the same template and mapping character spans to tokens with offsets, so templates that inject
text (default system prompts, BOS, ...) are handled without knowing them.
"""
from __future__ import annotations

import os
import re
import weakref
from dataclasses import dataclass
from typing import Iterator

import jinja2

from specforge.config import OVERLENGTH
from specforge.data.formats import THINK_END, THINK_START, DataError, tools_entry


class TemplateError(DataError):
    """The chat template renders a conversation inconsistently; the row cannot be masked."""


@dataclass
class Rendered:
    """A rendered sample. Unpacks as `input_ids, loss_mask = render(...)`.

    `drop_reason` is set (and the lists are empty) when the sample must not be used:
    "overlength" (overlength="drop") or "no_loss_tokens_after_truncation"."""

    input_ids: list[int]
    loss_mask: list[int]
    full_length: int  # tokens before any truncation
    truncated: bool = False
    drop_reason: str | None = None
    turns: int = 0  # assistant turns masked

    def __iter__(self) -> Iterator[list[int]]:
        return iter((self.input_ids, self.loss_mask))


def _apply(tokenizer, messages: list[dict], **kw):
    """apply_chat_template; a template that cannot render this row (e.g. image parts in a text
    template) is a row error, not a crash of the whole stage."""
    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except (TypeError, jinja2.TemplateError) as e:
        raise TemplateError(f"messages: the chat template cannot render this conversation ({e})") from None


def _template_text(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> str:
    return _apply(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                  **tools_entry(tools))


def _template_ids(tokenizer, messages: list[dict], tools=None) -> list[int]:
    out = _apply(tokenizer, messages, tokenize=True, **tools_entry(tools))
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def template_length(tokenizer, messages: list[dict], tools=None) -> int:
    """Tokens of these turns through the chat template, without a generation prompt."""
    return len(_template_ids(tokenizer, as_template_reads(tokenizer, messages), tools))


REASONING_FIELDS = ("thinking", "reasoning_content")  # gpt-oss's harmony template; Qwen3's, GLM-4.5's


def reasoning_field(tokenizer) -> str | None:
    """The message field the chat template renders an answer's reasoning from, or None."""
    template = str(tokenizer.chat_template or "")
    return next((f for f in REASONING_FIELDS if re.search(rf"\.{f}\b|\[\s*['\"]{f}['\"]\s*\]", template)), None)


def as_template_reads(tokenizer, messages: list[dict]) -> list[dict]:
    """The turns with the reasoning in front of an answer (`<think>...</think>`, as formats puts it back)
    moved into the field the template reads it from, so it renders as the target writes it: gpt-oss's
    harmony writes it on its analysis channel, and would render the <think> text as part of the answer."""
    field = reasoning_field(tokenizer)
    if field is None:
        return messages
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "assistant" and field not in m and isinstance(content, str) \
                and content.lstrip().startswith(THINK_START) and THINK_END in content:
            reasoning, answer = content.lstrip()[len(THINK_START):].split(THINK_END, 1)
            m = {**m, field: reasoning.strip("\n"), "content": answer.lstrip("\n")}
        out.append(m)
    return out


THINKING_SWITCH = "enable_thinking"  # the chat template variable of Qwen3's hybrid models: think first or not


def has_thinking_switch(tokenizer) -> bool:
    """The chat template renders prompts with or without thinking (`enable_thinking`)."""
    return THINKING_SWITCH in str(tokenizer.chat_template or "")


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def assistant_char_spans(tokenizer, messages: list[dict], full: str, tools=None) -> list[tuple[int, int, int | None]]:
    """For each assistant turn: (generation start, body end, turn end) as character offsets into
    `full`; turn end None where the conversation up to this turn does not render as a prefix of the
    whole. Generation starts where the template's generation prompt ends; the body ends with the
    content, or with the name of the turn's last tool call. A template may drop the reasoning
    (`<think>...</think>`) of a turn before the last user message; that turn's content ends where
    its answer does."""
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start = _generation_start(tokenizer, messages[:i], full, tools)
        if start is None:
            raise TemplateError(
                f"messages[{i}]: the chat template renders the conversation before this assistant "
                f"turn differently from the full conversation; cannot locate the turn"
            )
        upto = _template_text(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        exact = full.startswith(upto) and len(upto) > start
        turn_end = len(upto) if exact else len(full)
        content = msg["content"]
        if isinstance(content, str) and content:
            at = full.find(content, start, turn_end)
            if at < 0 and THINK_END in content:
                # Reasoning templates (Qwen3, DeepSeek-R1) render a turn before the last user message
                # without its <think> block: the turn is its answer, as the target sees it later on.
                content = content.rsplit(THINK_END, 1)[1].lstrip("\n")
                at = full.find(content, start, turn_end) if content else start
                if at >= 0 and THINK_END not in full[start:at] \
                        and not any(m["role"] == "user" for m in messages[i + 1:]):
                    raise TemplateError(
                        f"messages[{i}].content: the chat template drops the reasoning (<think>...</think>) of "
                        f"this turn, though no user message follows it: it would be trained without the "
                        f"reasoning the target writes; give target.chat_template a template that keeps it")
            if at < 0 and (stripped := content.strip()) and stripped != content:
                # Templates that `| trim` the content (Llama 3's, Gemma's) render it without its outer whitespace.
                content, at = stripped, full.find(stripped, start, turn_end)
            if at < 0:
                raise TemplateError(
                    f"messages[{i}].content: not found in the rendered text after the generation prompt"
                )
            content_end = at + len(content)
        else:
            content_end = start
        body_end = content_end
        for call in msg.get("tool_calls") or ():  # in order, each after the one before (else anywhere in the turn)
            name = call["function"]["name"]
            at = full.find(name, body_end, turn_end)
            at = at if at >= 0 else full.find(name, start, turn_end)
            if at < 0:
                raise TemplateError(f"messages[{i}].tool_calls: the chat template does not render the call to "
                                    f"{name!r} (a template without tool support?)")
            body_end = max(body_end, at + len(name))
        spans.append((start, body_end, turn_end if exact else None))
    return spans


def _generation_start(tokenizer, head: list[dict], full: str, tools=None) -> int | None:
    """Where the answer after the turns `head` starts in `full`: after the generation prompt, or None
    where the text does not render `head` first. A generation prompt that opens a think block
    (DeepSeek-R1-Distill's `<｜Assistant｜><think>\n`, Qwen3-Thinking-2507's, QwQ's) is not in the text
    of an answer the template renders without it: there the answer starts after what the prompt and
    the answer share, so the <think> the template writes itself stays context, as the served prompt."""
    prompt = _template_text(tokenizer, head, add_generation_prompt=True, tools=tools)
    if full.startswith(prompt):
        return len(prompt)
    bare = _template_text(tokenizer, head, add_generation_prompt=False, tools=tools)
    header = prompt[len(bare):]
    if not (prompt.startswith(bare) and full.startswith(bare)):
        return None
    shared = os.path.commonprefix([header, full[len(bare):]])
    return len(bare) + len(shared) if THINK_START in header[len(shared):] else None


def _tool_name(tool: dict) -> str:
    """A tool definition's name ({"type": "function", "function": {"name"}} or bare {"name"})."""
    fn = tool.get("function", tool)
    return str(fn.get("name") if isinstance(fn, dict) else None)


def render(tokenizer, messages: list[dict], max_length: int | None = None, overlength: str = "truncate",
           tools: list[dict] | None = None) -> Rendered:
    """Tokenize a conversation with its chat template; loss on assistant content + end of turn.

    The loss mask covers every token the model generates after the assistant header up to and
    including the turn's end-of-turn special token (`<|im_end|>` in ChatML):
    the content and whatever the template renders after it in that turn, never the header, the
    newline after the end token, or system/user/tool turns. A token straddling the header/content
    boundary (e.g. "assistant: " + "sky" -> " sky") counts as generated. `tools`: the row's tool
    definitions, which the template renders (usually into the system turn)."""
    if overlength not in OVERLENGTH:
        raise ValueError(f"data.overlength: {overlength!r} is not one of {list(OVERLENGTH)}")
    messages = as_template_reads(tokenizer, messages)
    full = _template_text(tokenizer, messages, add_generation_prompt=False, tools=tools)
    names = [_tool_name(t) for t in tools or ()]
    if tools and not any(n in full for n in names):
        raise TemplateError(f"tools: the chat template renders none of the row's tools ({', '.join(names)}): "
                            "a template without tool support?")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    expected = _template_ids(tokenizer, messages, tools)
    if input_ids != expected:
        raise TemplateError(
            "chat template: tokenizing the rendered text does not give the template's own token ids"
        )

    specials = _special_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    spans = assistant_char_spans(tokenizer, messages, full, tools)
    calls = [bool(m.get("tool_calls")) for m in messages if m["role"] == "assistant"]
    for turn, (start, body_end, turn_end) in enumerate(spans):
        # The turn's end-of-turn token: the first special token after its content, or after its last
        # call's name. Calls may be wrapped in special tokens (<tool_call>...</tool_call> where a
        # tokenizer marks them special; DeepSeek's): there it is the turn's last special token, where
        # the turn's extent is known.
        tokens = [t for t, (a, b) in enumerate(offsets) if b > start and a < (turn_end or len(full))]
        ends = [t for t in tokens if offsets[t][0] >= body_end and input_ids[t] in specials]
        if not ends:
            raise TemplateError(
                f"assistant turn {turn}: no end-of-turn special token after the content"
            )
        end = ends[-1] if calls[turn] and turn_end is not None else ends[0]
        for t in tokens:  # generated: the content (a token may straddle the header), then its tool calls
            if t > end:
                break
            loss_mask[t] = 1

    return _limited(Rendered(input_ids, loss_mask, full_length=len(input_ids), turns=len(spans)),
                    max_length, overlength)


def _limited(result: Rendered, max_length: int | None, overlength: str) -> Rendered:
    """`result` cut to max_length (overlength="truncate"), or dropped with its reason."""
    n, turns = result.full_length, result.turns
    if max_length is None or n <= max_length:
        return result
    if overlength == "drop":
        return Rendered([], [], full_length=n, drop_reason="overlength", turns=turns)
    loss_mask = result.loss_mask
    result.input_ids, result.loss_mask, result.truncated = result.input_ids[:max_length], loss_mask[:max_length], True
    if any(loss_mask) and not any(result.loss_mask):
        return Rendered([], [], full_length=n, truncated=True, drop_reason="no_loss_tokens_after_truncation",
                        turns=turns)
    return result


# ---- preformatted text (data.format=text) ------------------------------------------------------------

_MARKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (header, end-of-turn ids)

_PROBE = "Sunny, 21 degrees."
_PROBE_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"city": {"type": "string"}}}}}]
_PROBE_TURNS = (  # (turns, tools): a turn before a user message, and a tool call, where their end may differ
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": _PROBE}, {"role": "user", "content": "Q2"},
      {"role": "assistant", "content": _PROBE}], None),
    ([{"role": "user", "content": "Q"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "id": "call_0", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
      {"role": "tool", "name": "get_weather", "tool_call_id": "call_0", "content": "snow"},
      {"role": "assistant", "content": _PROBE}], _PROBE_TOOLS),
)


def assistant_markers(tokenizer) -> tuple[str, frozenset[int]]:
    """(the text that opens an assistant turn, the ids of the tokens that end one), read off the chat
    template: its generation prompt after a user turn, and the tokens `render` ends probe turns with
    (gpt-oss's harmony ends a last answer with <|return|>, an earlier one with <|end|>, a call with
    <|call|>). A template whose generation prompt is empty (Mistral's [INST] ... [/INST]) cannot mark
    turns in text: TemplateError."""
    if tokenizer not in _MARKERS:
        user = [{"role": "user", "content": "Q"}]
        bare, prompt = (_template_text(tokenizer, user, add_generation_prompt=g) for g in (False, True))
        header = prompt[len(bare):] if prompt.startswith(bare) else ""
        if not header.strip():
            raise TemplateError("the chat template opens no assistant turn with a generation prompt, so preformatted "
                                "text (data.format=text) cannot be split into turns; give the conversations as turns")
        answered = _template_text(tokenizer, [*user, {"role": "assistant", "content": _PROBE}],
                                  add_generation_prompt=False)
        enc = tokenizer(answered, add_special_tokens=False, return_offsets_mapping=True)
        after = answered.find(_PROBE) + len(_PROBE)
        specials = _special_ids(tokenizer)
        ends = [t for t, (a, _) in zip(enc["input_ids"], enc["offset_mapping"]) if a >= after and t in specials]
        if not ends:
            raise TemplateError("the chat template ends an assistant turn with no special token, so preformatted "
                                "text (data.format=text) cannot be split into turns; give the conversations as turns")
        end_ids = {ends[0]}
        for turns, tools in _PROBE_TURNS:
            try:
                ids, mask = render(tokenizer, turns, tools=tools)
            except TemplateError:  # no tool support, say: text cannot hold such turns either
                continue
            end_ids.update(t for t, m, nxt in zip(ids, mask, [*mask[1:], 0]) if m and not nxt and t in specials)
        _MARKERS[tokenizer] = (header, frozenset(end_ids))
    return _MARKERS[tokenizer]


def text_prompt(tokenizer, text: str) -> str | None:
    """Preformatted text up to its first assistant turn's header (what the target is asked to
    continue), or None without one."""
    header, _ = assistant_markers(tokenizer)
    at = text.find(header)
    return None if at < 0 else text[: at + len(header)]


def render_text(tokenizer, text: str, max_length: int | None = None, overlength: str = "truncate") -> Rendered:
    """Preformatted text (a conversation already rendered with the chat template: data.format=text),
    tokenized as written; loss, as `render` puts it, on what each assistant turn generates: from
    its header (`assistant_markers`) up to and including its end-of-turn token, or to the end of the
    text where a turn is cut off."""
    header, end_ids = assistant_markers(tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    loss_mask = [0] * len(input_ids)
    t, turns, at = 0, 0, text.find(header)
    while at >= 0:
        start = at + len(header)
        while t < len(input_ids) and offsets[t][1] <= start:  # a token straddling the header counts as generated
            t += 1
        while t < len(input_ids):
            loss_mask[t] = 1
            t += 1
            if input_ids[t - 1] in end_ids and not text.startswith(header, offsets[t - 1][1]):
                break  # (harmony writes its analysis, <|end|>, then the header and its final answer: one turn)
        turns += 1
        at = text.find(header, offsets[t - 1][1] if t else start)
    return _limited(Rendered(input_ids, loss_mask, full_length=len(input_ids), turns=turns), max_length, overlength)
