"""Repairs and quarantine: every raw row ends up kept, fixed (with its fixes) or quarantined.

`fix_dataset` is the one entry point the data stage calls. Nothing is dropped silently: each
input row lands in exactly one of `kept` (with `fixes == []` it was kept as is, otherwise it was
fixed) or `quarantined` (with file, line and reason), so the counts reconcile exactly:
`input_rows == kept + fixed + quarantined`. Rows are processed in input order with no
randomness, so the same input and config always give the same result.

Per row, in this order (each step switched by FixConfig; `enabled=False` only parses):
invalid JSON -> parse (to_conversation; row-level `images` become image parts there) -> row
length (`max_chars`: checked before any repair or tokenization) -> role names -> images -> empty
turns -> consecutive roles -> assistant present -> TOON answers (specforge.data.fix.toon; an
answer that is prose, not a document, is quarantined unless `toon_prose="keep"`, one no repair makes
valid unless `toon_unrepairable="keep"`: either is then left as written, and the row names it in
`kept_as_written`, which the data report counts) -> duplicates
(judged on the cleaned messages, so a copy that differs only by a fixable defect is still a copy).

Images: every image part is checked once (missing, unreadable or outside `image_root` ->
quarantined with the path in the reason) and a local one is rewritten to its resolved absolute
path, so later stages (and a fixed file written elsewhere) can open it without knowing the data
file; an image embedded as a data URI is decoded and, given `embedded_dir`, becomes a file there;
URLs are kept as written and not checked. That rewrite is not a repair and is not
counted in `fixes`. Duplicates compare the resolved paths (see `dedupe_key`).

A row records each fix name at most once, so `by_fix[name]` counts ROWS with that fix.
Reasons read "<code>: <detail>"; `by_reason` counts codes (see `reason_code`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from specforge.config import FixConfig
from specforge.data.fix.conversations import (
    ImageChecker,
    ImageLoading,
    Quarantine,
    check_row_length,
    conversation_key,
    drop_empty_turns,
    merge_consecutive,
    require_assistant,
    role_name_fixes,
)
from specforge.data.fix.toon import PROSE_POLICIES, ToonNotADocument, ToonUnrepairable, repair_answers, repair_toon
from specforge.data.formats import DataError, RawRow, to_conversation, tools_entry, turns_entry, with_turns_parsed
from specforge.errors import InvalidInput

__all__ = ["FixResult", "Quarantine", "check_duplicate", "fix_dataset", "fix_row", "quarantine_entry", "ranked_reasons",
           "reason_code", "repair_toon", "top_reasons"]

_CHOICES = {
    "empty_turns": ("drop_turn", "quarantine"),
    "no_assistant": ("quarantine", "keep"),
    "toon_where": ("message", "fenced"),
    "toon_prose": PROSE_POLICIES,
    "toon_unrepairable": PROSE_POLICIES,
}


@dataclass
class FixResult:
    """`kept` holds every surviving conversation (fixed ones included); in `counts`, "kept"
    is only those kept as is, so input_rows == kept + fixed + quarantined."""

    kept: list[dict] = field(default_factory=list)  # {"id", "messages", "fixes", "kept_as_written", "file", "line"}
    quarantined: list[dict] = field(default_factory=list)  # {"file", "line", "reason", "row"}
    counts: dict = field(default_factory=dict)

    def too_many_quarantined(self, limit: float) -> str | None:
        """Why more than `limit` of the rows were quarantined (share, top reasons, one example), or
        None: the standalone tools' check, as data.max_quarantined_share is the data stage's."""
        rows, quarantined = self.counts["input_rows"], self.counts["quarantined"]
        if quarantined <= limit * rows:
            return None
        top = ranked_reasons(self.counts)[0][0]
        example = next(q for q in self.quarantined if reason_code(q["reason"]) == top)
        return (f"{quarantined} of {rows} rows quarantined ({quarantined / rows:.1%}), more than "
                f"--max-quarantined-share={limit:g}; top reasons: {top_reasons(self.counts)}; e.g. line "
                f"{example['line']}: {example['reason'][:200]}")


def ranked_reasons(counts: dict) -> list[tuple[str, int]]:
    """(reason code, rows) pairs of counts["by_reason"], most frequent first (ties by name)."""
    return sorted(counts["by_reason"].items(), key=lambda kv: (-kv[1], kv[0]))


def top_reasons(counts: dict, n: int = 3) -> str:
    """"invalid_row 19, duplicate 2": the most frequent quarantine reason codes."""
    return ", ".join(f"{code} {k}" for code, k in ranked_reasons(counts)[:n]) or "none"


# What a fix or a kept-as-written name means, where its name alone does not say it
MEANING = {
    "toon_prose": "an answer that is one line of prose, not a TOON document, trained on as written "
                  "(data.fix.toon_prose=keep)",
    "toon_unrepairable": "an answer no repair makes valid TOON, trained on as written "
                         "(data.fix.toon_unrepairable=keep)",
    "image_exif_turned": "an image whose EXIF orientation turns it (a camera held sideways), read as stored, as "
                         "SGLang serves it; vLLM and transformers' load_image turn it upright: serving with vLLM, "
                         "set data.image_orientation=upright",
    "image_upright": "an image whose EXIF orientation turns it, replaced by an upright PNG copy "
                     "(data.image_orientation=upright), as vLLM serves it",
    "image_transparent": "an RGBA image with transparent pixels, read as SGLang serves it (the alpha dropped: the "
                         "colour stored under it shows); vLLM composites it onto white: serving with vLLM, set "
                         "data.image_alpha=white",
    "image_alpha_white": "an RGBA image with transparent pixels, replaced by a PNG copy composited onto white "
                         "(data.image_alpha=white), as vLLM serves it",
}


def fix_dataset(
    rows: Iterable[RawRow], cfg: FixConfig, fmt: str = "auto", image_root: str | None = None,
    max_chars: int | None = None, place: Callable[[RawRow], str] | None = None,
    embedded_dir: str | Path | None = None, loading: ImageLoading = ImageLoading(),
) -> FixResult:
    """Parse, repair and account for every row, in input order. `max_chars`: rows whose messages
    hold more characters are quarantined as row_too_long (None: no limit). `place`: how a row is
    named where a duplicate points to it (default "file:line"). `embedded_dir`: where images embedded
    as data URIs are written as files (None: they stay URIs; ImageChecker). `loading`: how the server
    loads the images where servers differ (data.image_orientation, data.image_alpha; ImageChecker)."""
    check_config(cfg)
    images = ImageChecker(image_root, embedded_dir, loading)
    first_seen: dict[str, str] = {}  # dedupe key -> "file:line" of its first kept occurrence
    result = FixResult()
    n = 0
    for raw in rows:
        n += 1
        try:
            conv, fixes = fix_row(raw, cfg, fmt, images, max_chars)
            if cfg.enabled and cfg.dedupe:
                check_duplicate(conversation_key(conv), place(raw) if place else f"{raw.file}:{raw.line}", first_seen)
        except Quarantine as q:
            result.quarantined.append(quarantine_entry(raw, q.reason))
            continue
        result.kept.append({**turns_entry(conv), "fixes": fixes, "kept_as_written": conv["kept_as_written"],
                            "file": raw.file, "line": raw.line})
    result.counts = _counts(n, result)
    return result


def fix_row(
    raw: RawRow, cfg: FixConfig, fmt: str = "auto", images: ImageChecker | None = None,
    max_chars: int | None = None,
) -> tuple[dict, list[str]]:
    """(conversation {"id", "messages", "kept_as_written"}, fixes) for one row, or raise Quarantine.
    Duplicates need the whole dataset, so they are judged by fix_dataset, not here."""
    images = images or ImageChecker(None)
    if raw.error is not None:
        raise Quarantine(f"invalid_json: {raw.error}")
    try:
        data = with_turns_parsed(raw.data) if isinstance(raw.data, dict) else raw.data
        conv = to_conversation(data, fmt)
    except DataError as e:
        raise Quarantine(f"invalid_row: {e}") from None
    except RecursionError:  # turns, tools or call arguments stored as a JSON string nested 100,000 deep
        raise Quarantine("invalid_row: a field holds JSON text nested too deep (arrays or objects past Python's "
                         "recursion limit)") from None
    if "text" in conv:  # preformatted (data.format=text): no turns to repair, trained as written
        check_row_length(conv["text"], max_chars)
        return {"id": conv["id"], "text": conv["text"], "kept_as_written": []}, []
    check_row_length(conv["messages"], max_chars)
    tools = tools_entry(conv.get("tools"))  # the row's tool definitions, for the template
    if not cfg.enabled:
        return {"id": conv["id"], "messages": conv["messages"], "kept_as_written": [], **tools}, []
    fixes = role_name_fixes(data, fmt)
    messages = conv["messages"]
    messages, found = images.resolve_images(messages, raw.file)  # resolving a path is not a fix
    messages, dropped = drop_empty_turns(messages, cfg.empty_turns)
    if not messages:
        raise Quarantine("no_messages: every turn was empty")
    merged: list[str] = []
    if cfg.merge_consecutive_roles:
        messages, merged = merge_consecutive(messages)
    require_assistant(messages, cfg.no_assistant)
    toon_fixes: list[str] = []
    as_written: list[str] = []
    if cfg.toon:
        try:
            messages, toon_fixes, as_written = repair_answers(messages, cfg.toon_where, cfg.toon_prose,
                                                                cfg.toon_unrepairable)
        except ToonUnrepairable as e:
            raise Quarantine(f"toon_unrepairable: {e}") from None
        except ToonNotADocument as e:
            raise Quarantine(f"toon_not_a_document: {e}") from None
    as_written += images.as_written(found)
    return ({"id": conv["id"], "messages": messages, "kept_as_written": as_written, **tools},
            fixes + images.fixes(found) + dropped + merged + toon_fixes)


def check_config(cfg: FixConfig) -> None:
    """Fail before reading any data when a policy is misspelled (it would silently do nothing)."""
    for name, allowed in _CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise InvalidInput(f"data.fix.{name}: {getattr(cfg, name)!r} is not one of {list(allowed)}")


def check_duplicate(key: str, where: str, first_seen: dict[str, str]) -> None:
    """Quarantine a row whose `dedupe_key` a kept row already had; else remember it as the first
    (`where`: "file:line"). Rows must come in input order: the first kept occurrence wins."""
    if key in first_seen:
        raise Quarantine(f"duplicate: same messages as {first_seen[key]}")
    first_seen[key] = where


def quarantine_entry(raw: RawRow, reason: str) -> dict:
    """{"file", "line", "reason", "row"}: the row as parsed, or its JSON error when it did not parse."""
    return {"file": raw.file, "line": raw.line, "reason": reason,
            "row": raw.data if raw.data is not None else raw.error}


def reason_code(reason: str) -> str:
    """The part of a reason before ': ' ("image_missing: a.png" -> "image_missing").

    Reasons carry details (path, decoder message, first occurrence) for a person to read;
    `by_reason` counts codes so the report aggregates and can be compared to expectations.
    """
    return reason.split(": ", 1)[0]


def _counts(n: int, result: FixResult) -> dict:
    by_fix: Counter = Counter(f for k in result.kept for f in k["fixes"])
    by_reason: Counter = Counter(reason_code(q["reason"]) for q in result.quarantined)
    as_written: Counter = Counter(name for k in result.kept for name in k["kept_as_written"])
    fixed = sum(1 for k in result.kept if k["fixes"])
    return {
        "input_rows": n,
        "kept": len(result.kept) - fixed,
        "fixed": fixed,
        "quarantined": len(result.quarantined),
        "by_fix": dict(sorted(by_fix.items())),
        "by_reason": dict(sorted(by_reason.items())),
        "by_kept_as_written": dict(sorted(as_written.items())),  # rows, among kept and fixed
    }
