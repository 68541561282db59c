"""The data stage's per-row steps, one implementation each, called by the in-process loop
(data.num_proc=0) and by the `datasets.map` workers (specforge/data/parallel.py) alike, so both
give the same samples and the same reasons."""
from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field

from specforge.data.fix import Quarantine, fix_row
from specforge.data.fix.conversations import ImageChecker, prompt_turns
from specforge.data.formats import DataError, RawRow
from specforge.data.template import assistant_markers, render, render_text, template_length
from specforge.data.vl_render import render_vl


def normalise_row(raw: RawRow, fix_cfg, fmt: str, images: ImageChecker,
                  max_chars: int | None) -> tuple[dict, list[str]]:
    """(conversation {"id", "messages"} or {"id", "text"}, fixes) or Quarantine. With
    data.fix.enabled=false the row is only parsed and length-checked, but its images are still
    checked, resolved and counted where servers load them differently (copied as data.image_orientation and
    data.image_alpha say)."""
    conv, fixes = fix_row(raw, fix_cfg, fmt, images, max_chars)
    if not fix_cfg.enabled and "messages" in conv:
        conv["messages"], found = images.resolve_images(conv["messages"], raw.file)
        conv["kept_as_written"], fixes = images.as_written(found), images.fixes(found)
    return conv, fixes


@dataclass
class RowRender:
    """A rendered conversation, or the quarantine `reason` why it cannot be a sample."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    truncated: bool = False
    reason: str | None = None
    images: dict = field(default_factory=dict)  # {"images", "image_grid_thw"} of a VL sample with images


def render_conversation(tokenizer, conv: dict, max_length: int, overlength: str, vl=None,
                        special_token_text: str = "quarantine") -> RowRender:
    """A conversation of the data stage as a sample: its turns through the chat template
    (`render_row`), or preformatted text (data.format=text) tokenized as written."""
    if "text" not in conv:
        return render_row(tokenizer, conv["messages"], max_length, overlength, vl, special_token_text,
                          conv.get("tools"))
    try:
        r = render_text(tokenizer, conv["text"], max_length, overlength)
    except DataError as e:
        return RowRender(reason=f"template_error: {e}")
    if r.drop_reason is not None:
        return RowRender(reason=f"{r.drop_reason}: {r.full_length} tokens > max_length {max_length}")
    if not r.turns:
        header, _ = assistant_markers(tokenizer)
        return RowRender(reason=f"no_assistant_turn: the text opens no assistant turn ({header!r}, the chat "
                                "template's generation prompt): nothing to learn")
    if not any(r.loss_mask):  # not cut away by truncation (that is a drop_reason): the text has no answer
        return RowRender(reason="no_assistant_turn: the text ends at the generation prompt, its answer empty: "
                                "nothing to learn")
    return RowRender(r.input_ids, r.loss_mask, r.truncated)


def render_row(tokenizer, messages: list[dict], max_length: int, overlength: str, vl=None,
               special_token_text: str = "quarantine", tools: list[dict] | None = None) -> RowRender:
    """Tokenize one conversation with the chat template (`vl`: (image processor, VLInfo) of a
    vision-language target; `tools`: the row's tool definitions); over-length and template errors
    become a reason, not a crash, and so does text that spells a special token
    (data.special_token_text=keep: tokenized as it comes)."""
    if special_token_text == "quarantine" and (where := special_token_in_text(tokenizer, messages)):
        return RowRender(reason=f"special_token_text: {where}, which the tokenizer reads as its control token, "
                                "not as text")
    images = {}
    try:
        if vl is None:
            r = render(tokenizer, messages, max_length, overlength, tools)
        else:
            r, paths, grids = render_vl(tokenizer, messages, *vl, max_length, overlength, tools)
            images = {"images": paths, "image_grid_thw": grids} if paths else {}
    except DataError as e:  # TemplateError: the template cannot be mapped for this row
        reason = str(e) if str(e).startswith(("image_", "template_error")) else f"template_error: {e}"
        return RowRender(reason=reason)
    if r.drop_reason is not None:
        return RowRender(reason=f"{r.drop_reason}: {r.full_length} tokens > max_length {max_length}")
    return RowRender(r.input_ids, r.loss_mask, r.truncated, None, images)


def prompt_overlength(tokenizer, messages: list[dict], max_length: int, tools=None) -> str | None:
    """The reason a row cannot become a sample whatever its answers say, or None: the turns before
    its first answer already fill max_length, so truncation keeps no loss token and
    data.overlength=drop drops it. Checked before regeneration, which would answer it for nothing."""
    head = prompt_turns(messages)
    if len(head) == len(messages) or not any(m["role"] == "user" for m in head) \
            or any(not isinstance(m.get("content"), (str, type(None))) for m in head):
        return None  # no answer, a canned greeting first, or images (the processor counts their tokens)
    try:  # the first loss token comes after these turns (less one: their last may merge with the next)
        start = template_length(tokenizer, head, tools) - 1
    except DataError:  # the template cannot render it: the render after regeneration says so
        return None
    if start < max_length:
        return None
    return (f"prompt_overlength: the turns before the first answer take {start + 1} tokens, max_length "
            f"{max_length}: no answer would fit (not regenerated)")


_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> compiled pattern or None


def special_token_in_text(tokenizer, messages: list[dict]) -> str | None:
    """Where a message's text spells one of the tokenizer's special tokens ("assistant message 2
    holds '<|im_end|>'"), or None. The tokenizer turns such text into the control token itself: a
    turn that ends mid-answer, a fake turn after it (a chat log dumped with its template, scraped
    text); the draft would learn to predict turn ends where the target never stops."""
    if tokenizer not in _SPECIALS:
        specials = set(tokenizer.all_special_tokens)
        specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        specials = sorted((t for t in specials if t), key=len, reverse=True)
        _SPECIALS[tokenizer] = re.compile("|".join(map(re.escape, specials))) if specials else None
    pattern = _SPECIALS[tokenizer]
    if pattern is None:
        return None
    for i, message in enumerate(messages, 1):
        content = message["content"]
        texts = ([content] if isinstance(content, str)
                 else [part.get("text") or "" for part in content if part.get("type") == "text"])
        if message.get("tool_calls"):  # rendered as JSON text: arguments are text too
            texts.append(json.dumps(message["tool_calls"], ensure_ascii=False))
        for text in texts:
            if hit := pattern.search(text):
                return f"{message['role']} message {i} holds {hit.group()!r}"
    return None


__all__ = ["Quarantine", "RowRender", "normalise_row", "prompt_overlength", "render_conversation", "render_row",
           "special_token_in_text"]
