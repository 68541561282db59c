"""Decode, repair and canonicalise the TOON documents in assistant answers.

The draft must learn the exact text the target emits, so every answer that claims to be TOON has
to decode STRICTLY (toon_format, strict=True); one that cannot be repaired is quarantined rather
than taught.

`repair_toon(text)` is the whole policy for one payload:

1. A payload that parses as a JSON object or array is converted ("converted_json_to_toon").
   This runs before the TOON decoder because one-line JSON is often *valid* TOON with a
   different meaning: `{"a": 1}` decodes as the key `{"a"` with the string value `1}`.
2. A payload that decodes strictly is re-encoded with `toon_format.encode`. If that changes the
   bytes the row records "canonicalized" (so every TOON answer in the output has one spelling;
   a canonical input is kept byte-identical). A payload whose root is a single scalar (a line
   of prose, a number) is no TOON document: with `prose="quarantine"` (data.fix.toon_prose, the
   data stage's default) it raises `ToonNotADocument`, so a prose answer is not taught as TOON;
   with `prose="keep"` it is left as written (the encoder would only quote it) and the turn's
   row records "toon_prose" in `kept_as_written` (so the data report counts such rows).
3. Otherwise the repairs below run in this fixed order, each on the result of the previous one,
   with a strict re-decode after each that changed the text. Each repair that changed the text
   is recorded; the first successful decode is re-encoded canonically (no extra
   "canonicalized"). Lexical repairs come first because the structural ones read lines by
   indentation, and array lengths come last because the others change how many rows parse.

   stripped_trailing_whitespace  spaces/tabs at line ends (a tab after `key:` or after a
                                 tabular header is not valid TOON)
   fixed_indentation             leading tabs (one level each, as TOON's non-strict mode reads
                                 them), a consistent 3/4/...-space unit, odd indentation snapped
                                 to the nearest level the previous line allows
   fixed_row_field_count         tabular rows with surplus EMPTY trailing cells (a stray
                                 trailing delimiter) are trimmed. A row with too few cells is
                                 never padded: the missing value is unknown, and padding would
                                 teach the draft invented data
   quoted_strings                cells holding an unquoted ':' (which ends a table), values
                                 like `"Sunny" and warm` (text after a closing quote), and a row
                                 with surplus cells when exactly one way of merging adjacent
                                 cells back into one quoted string matches the column types of
                                 the table's well-formed rows
   fixed_array_length            a declared `[N]` that disagrees with the items found is set to
                                 the count found (the rows are the data; the header is a claim)

4. Anything still failing raises `ToonUnrepairable` with the decoder's last message
   (`repair_answers` with `unrepairable="keep"`: the turn stays as written and the row records
   "toon_unrepairable" in `kept_as_written`).

Every repair keeps the line count, so decoder line numbers refer to the payload as given.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import toon_format
from toon_format import ToonDecodeError

from specforge.data.formats import THINK_END, THINK_START

INDENT = 2  # toon_format's default and canonical indent size

FENCE = re.compile(r"^```toon[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_DECLARED = re.compile(r"Declared length (\d+) but found (\d+)")
# A plain tabular header: `key[N]{f1,f2}:` (no keyed `[N:]`, no nested or quoted field names).
_TABLE_HEADER = re.compile(r"\[(\d+)([\t|]?)\]\{([^{}\"]*)\}:$")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


class ToonUnrepairable(ValueError):
    """A payload that no repair makes decode strictly; the message is the decoder's."""


class ToonNotADocument(ValueError):
    """A payload that decodes to one scalar: valid TOON, but prose rather than a document."""


PROSE_POLICIES = ("quarantine", "keep")


def decode_strict(text: str) -> Any:
    return toon_format.decode(text, strict=True)


def repair_toon(text: str, prose: str = "keep", kept: list[str] | None = None) -> tuple[str, list[str]]:
    """(canonical payload, fixes applied) for one TOON payload; raises ToonUnrepairable, or
    ToonNotADocument for a root scalar when `prose` is "quarantine" (when "keep", `kept` gets
    "toon_prose")."""
    data = _json_container(text)
    if data is not None:
        return _from_json(text, data)
    try:
        value = decode_strict(text)
    except ToonDecodeError as e:
        error = e
    else:
        _check_document(value, prose, kept)
        return _canonical(text, value, valid_as_given=True)
    fixes: list[str] = []
    for name, repair in REPAIRS:
        repaired = repair(text)
        if repaired == text:
            continue
        fixes.append(name)
        text = repaired
        try:
            value = decode_strict(text)
        except ToonDecodeError as e:
            error = e
            continue
        _check_document(value, prose, kept)
        canonical, _ = _canonical(text, value, valid_as_given=False)
        return canonical, fixes
    raise ToonUnrepairable(str(error))


def repair_fenced(content: str, prose: str = "keep", kept: list[str] | None = None) -> tuple[str, list[str]]:
    """Repair each ```toon fenced block of a message (text outside the blocks is free prose);
    raises ToonUnrepairable or ToonNotADocument naming the block."""
    fixes: list[str] = []
    pieces: list[str] = []
    end = 0
    for n, match in enumerate(FENCE.finditer(content), 1):
        payload = match.group(1)[:-1] if match.group(1).endswith("\n") else match.group(1)
        try:
            canonical, block_fixes = repair_toon(payload, prose, kept)
        except (ToonUnrepairable, ToonNotADocument) as e:
            raise type(e)(f"{e} (```toon block {n})") from None
        fixes.extend(f for f in block_fixes if f not in fixes)
        pieces += [content[end:match.start()], f"```toon\n{canonical}\n```" if canonical else "```toon\n```"]
        end = match.end()
    pieces.append(content[end:])
    return "".join(pieces), fixes


def repair_answers(messages: list[dict], where: str, prose: str = "keep",
                   unrepairable: str = "quarantine") -> tuple[list[dict], list[str], list[str]]:
    """Repair the TOON of every assistant turn (`where`: "message" or "fenced"; `prose`: what a
    payload that is a single scalar gets, "quarantine" or "keep"; `unrepairable`: what a turn no
    repair makes valid gets, "quarantine" or "keep" as written).

    Returns (messages, fixes, kept_as_written): the last names what went through although it is
    no valid TOON document, each at most once: "toon_prose", "toon_unrepairable".

    Raises ToonUnrepairable or ToonNotADocument naming the assistant turn (counted among
    assistant turns)."""
    if where not in ("message", "fenced"):
        raise ValueError(f"data.fix.toon_where: {where!r} is not 'message' or 'fenced'")
    if prose not in PROSE_POLICIES:
        raise ValueError(f"data.fix.toon_prose: {prose!r} is not one of {list(PROSE_POLICIES)}")
    if unrepairable not in PROSE_POLICIES:
        raise ValueError(f"data.fix.toon_unrepairable: {unrepairable!r} is not one of {list(PROSE_POLICIES)}")
    fn = repair_toon if where == "message" else repair_fenced

    kept: list[str] = []

    def repair(text: str) -> tuple[str, list[str]]:
        return fn(text, prose, kept)
    out, fixes, turn = [], [], 0
    for m in messages:
        calls_only = bool(m.get("tool_calls")) and isinstance(m["content"], str) and not m["content"].strip()
        if m["role"] != "assistant" or calls_only:  # a turn that only calls tools holds no answer
            out.append(m)
            turn += m["role"] == "assistant"
            continue
        turn += 1
        try:
            content, turn_fixes = _repair_content(m["content"], repair)
        except ToonUnrepairable as e:
            if unrepairable == "quarantine":
                raise ToonUnrepairable(f"{e} (assistant turn {turn})") from None
            content, turn_fixes = m["content"], []  # kept as the target wrote it
            if "toon_unrepairable" not in kept:
                kept.append("toon_unrepairable")
        except ToonNotADocument as e:
            raise ToonNotADocument(f"{e} (assistant turn {turn})") from None
        out.append({**m, "content": content})
        fixes.extend(f for f in turn_fixes if f not in fixes)
    return out, fixes, kept


def _repair_content(content: str | list, repair: Callable) -> tuple[str | list, list[str]]:
    """A string, or each text part of a multimodal answer."""
    if isinstance(content, str):
        return _after_reasoning(content, repair)
    parts, fixes = [], []
    for part in content:
        if part.get("type") == "text":
            text, part_fixes = _after_reasoning(part["text"], repair)
            part = {**part, "text": text}
            fixes.extend(f for f in part_fixes if f not in fixes)
        parts.append(part)
    return parts, fixes


def _after_reasoning(text: str, repair: Callable) -> tuple[str, list[str]]:
    """`repair` of the answer after a leading `<think>...</think>` block (the reasoning a server split off,
    put back in front by formats.with_reasoning), the reasoning kept as written: decoded whole, it is
    no TOON document."""
    if not text.lstrip().startswith(THINK_START) or THINK_END not in text:
        return repair(text)
    cut = text.rindex(THINK_END) + len(THINK_END)
    answer = text[cut:].lstrip()
    fixed, fixes = repair(answer)
    return text[: len(text) - len(answer)] + fixed, fixes


def _check_document(value: Any, prose: str, kept: list[str] | None = None) -> None:
    """TOON documents are objects or arrays; a root scalar is what prose decodes to."""
    if isinstance(value, (dict, list)):
        return
    if prose == "keep":
        if kept is not None and "toon_prose" not in kept:
            kept.append("toon_prose")
        return
    kind = {str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
    shown = json.dumps(value, ensure_ascii=False)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ToonNotADocument(f"the answer decodes to a single {kind} ({shown}), not a TOON object or array")


def _canonical(text: str, value: Any, valid_as_given: bool) -> tuple[str, list[str]]:
    if not isinstance(value, (dict, list)):
        return text, []  # a root scalar is prose: re-encoding would only add quotes
    canonical = toon_format.encode(value)
    if valid_as_given and canonical != text:
        return canonical, ["canonicalized"]
    return canonical, []


def _json_container(text: str) -> dict | list | None:
    stripped = text.strip()
    if not stripped or stripped[0] not in "{[":
        return None
    try:
        value = json.loads(stripped)
    except ValueError:
        return None
    return value if isinstance(value, (dict, list)) else None


def _from_json(text: str, data: dict | list) -> tuple[str, list[str]]:
    try:
        canonical = toon_format.encode(data)
    except (TypeError, ValueError) as e:
        raise ToonUnrepairable(f"JSON payload cannot be encoded as TOON: {e}") from None
    return canonical, ([] if canonical == text else ["converted_json_to_toon"])


# --------------------------------------------------------------------------------------------
# Lexical helpers (mirroring toon_format's decoder: quotes toggle anywhere in a token)
# --------------------------------------------------------------------------------------------


def _quote(value: str) -> str:
    """A quoted TOON string token (escapes as in TOON §7.1)."""
    return '"' + re.sub(r'[\\"\x00-\x1f]', lambda m: _ESCAPES.get(m.group()) or f"\\u{ord(m.group()):04x}", value) + '"'


def _quoted_end(text: str, start: int = 0) -> int:
    """Index just past the quoted token starting at `start`, or -1 if it never closes."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return -1


def _find_unquoted(text: str, char: str) -> int:
    """Index of the first `char` outside double quotes, or -1."""
    first, *rest = _split_cells(text, char)
    return len(first) if rest else -1


def _split_cells(text: str, delim: str) -> list[str]:
    """Raw (unstripped) tokens of a delimited row, splitting only outside quotes."""
    tokens, start, in_quotes, i = [], 0, False, 0
    while i < len(text):
        c = text[i]
        if in_quotes and c == "\\":
            i += 1
        elif c == '"':
            in_quotes = not in_quotes
        elif c == delim and not in_quotes:
            tokens.append(text[start:i])
            start = i + 1
        i += 1
    tokens.append(text[start:])
    return tokens


def _kind(token: str) -> str:
    """The JSON type a stripped cell token decodes to."""
    if token in ("true", "false"):
        return "bool"
    if token == "null":
        return "null"
    if not token.startswith('"') and _NUMBER.fullmatch(token):
        return "number"
    return "string"


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


# --------------------------------------------------------------------------------------------
# Tables: the tabular arrays of a document, found by indentation (canonical 2-space by now)
# --------------------------------------------------------------------------------------------


@dataclass
class _Table:
    delim: str
    width: int  # fields per row
    rows: list[int]  # line indices


def _tables(lines: list[str]) -> list[_Table]:
    tables = []
    for i, line in enumerate(lines):
        content = line.strip(" ")
        match = _TABLE_HEADER.search(content)
        if match is None or _find_unquoted(content, "[") != match.start():
            continue
        delim = match.group(2) or ","
        row_indent = _indent_of(line) + INDENT * (2 if content.startswith("- ") else 1)
        rows = []
        for j in range(i + 1, len(lines)):
            if not lines[j].strip(" ") or _indent_of(lines[j]) != row_indent:
                break
            rows.append(j)
        tables.append(_Table(delim, len(match.group(3).split(delim)), rows))
    return tables


def _rewrite_rows(text: str, fix_row: Callable[[list[str], _Table, list[list[str]]], list[str] | None]) -> str:
    """Apply `fix_row(tokens, table, all_rows_tokens)` to every table row; None keeps a row."""
    lines = text.split("\n")
    for table in _tables(lines):
        cells = [_split_cells(lines[j].strip(" "), table.delim) for j in table.rows]
        for j, tokens in zip(table.rows, cells):
            new = fix_row(tokens, table, cells)
            if new is not None:
                lines[j] = " " * _indent_of(lines[j]) + table.delim.join(t.strip(" ") for t in new)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The repairs, in the order they run
# --------------------------------------------------------------------------------------------


def stripped_trailing_whitespace(text: str) -> str:
    return "\n".join(line.rstrip(" \t") for line in text.split("\n"))


def fixed_indentation(text: str) -> str:
    lines = text.split("\n")
    widths = [_leading_width(line) for line in lines]
    body = [w for line, w in zip(lines, widths) if _is_content(line) and w]
    unit = math.gcd(*body) if body else INDENT
    if unit > INDENT:
        widths = [w // unit * INDENT if w % unit == 0 else w for w in widths]
    out, prev = [], None  # prev: (width, opens a block) of the previous content line
    for line, width in zip(lines, widths):
        if not _is_content(line):
            out.append(line)
            continue
        width = _snap(width, prev)
        content = line.lstrip(" \t")
        out.append(" " * width + content)
        prev = (width, content.endswith(":") or content.startswith("- "))
    return "\n".join(out)


def _leading_width(line: str) -> int:
    """Width of the leading run of spaces and tabs; a tab is one level."""
    run = line[: len(line) - len(line.lstrip(" \t"))]
    return run.count(" ") + INDENT * run.count("\t")


def _is_content(line: str) -> bool:
    content = line.strip(" \t")
    return bool(content) and not content.startswith("#")  # blanks and comments keep their place


def _snap(width: int, prev: tuple[int, bool] | None) -> int:
    """An odd width goes to the nearest level the previous line allows; ties go deeper."""
    if width % INDENT == 0 or prev is None:
        return width - width % INDENT
    prev_width, opens = prev
    top = prev_width + (INDENT if opens else 0)
    below, above = width - width % INDENT, width - width % INDENT + INDENT
    return min(above if above <= top else below, top)


def fixed_row_field_count(text: str) -> str:
    def trim(tokens: list[str], table: _Table, _: list[list[str]]) -> list[str] | None:
        surplus = tokens[table.width:]
        if surplus and all(not t.strip(" ") for t in surplus):
            return tokens[: table.width]
        return None

    return _rewrite_rows(text, trim)


def quoted_strings(text: str) -> str:
    text = _rewrite_rows(text, _quote_row)
    lines = text.split("\n")
    rows = {j for table in _tables(lines) for j in table.rows}
    return "\n".join(line if i in rows else _quote_value(line) for i, line in enumerate(lines))


def _quote_row(tokens: list[str], table: _Table, all_rows: list[list[str]]) -> list[str] | None:
    merged = _merge_surplus(tokens, table, all_rows) if len(tokens) > table.width else None
    stripped = [t.strip(" ") for t in merged or tokens]
    quoted = [_quote_cell(t) for t in stripped]
    return quoted if merged or quoted != stripped else None


def _quote_cell(token: str) -> str:
    if token.startswith('"'):
        end = _quoted_end(token)
        return _quote(token) if 0 < end < len(token) else token  # unterminated: ambiguous, keep
    return _quote(token) if ":" in token else token


def _merge_surplus(tokens: list[str], table: _Table, all_rows: list[list[str]]) -> list[str] | None:
    """Merge the one window of adjacent unquoted cells whose result fits the column types."""
    kinds: list[set[str]] = [set() for _ in range(table.width)]
    for row in all_rows:
        if len(row) == table.width:
            for k, token in zip(kinds, row):
                k.add(_kind(token.strip(" ")))
    extra = len(tokens) - table.width
    fits = []
    for i in range(table.width):
        window = tokens[i : i + extra + 1]
        if any(t.strip(" ").startswith('"') for t in window):
            continue
        merged = tokens[:i] + [_quote(table.delim.join(window).strip(" "))] + tokens[i + extra + 1 :]
        if all(not k or _kind(t.strip(" ")) in k for k, t in zip(kinds, merged)):
            fits.append(merged)
    return fits[0] if len(fits) == 1 else None


def _quote_value(line: str) -> str:
    """`key: "Sunny" and warm` or `- "a" b` -> the whole value quoted."""
    indent = line[: _indent_of(line)]
    content = line[len(indent):]
    prefix = "- " if content.startswith("- ") else ""
    body = content[len(prefix):]
    colon = _find_unquoted(body, ":")
    if 0 <= _find_unquoted(body, "[") < colon:
        return line  # an array header: its values are cells, not one string
    head, value = (body[: colon + 1] + " ", body[colon + 1 :].strip(" ")) if colon >= 0 else ("", body)
    end = _quoted_end(value) if value.startswith('"') else -1
    if 0 < end < len(value):
        return indent + prefix + head + _quote(value)
    return line


def fixed_array_length(text: str) -> str:
    lines = text.split("\n")
    for _ in range(len(lines)):
        try:
            decode_strict("\n".join(lines))
            break
        except ToonDecodeError as e:
            match = _DECLARED.fullmatch(e.msg)
            if match is None or e.line is None:
                break
            lines[e.line - 1] = _set_length(lines[e.line - 1], *match.groups())
    return "\n".join(lines)


def _set_length(line: str, declared: str, found: str) -> str:
    at = _find_unquoted(line, "[")
    fixed = re.sub(rf"^\[{declared}(?=[:\t|]?\])", f"[{found}", line[at:], count=1)
    return line[:at] + fixed


REPAIRS: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("stripped_trailing_whitespace", stripped_trailing_whitespace),
    ("fixed_indentation", fixed_indentation),
    ("fixed_row_field_count", fixed_row_field_count),
    ("quoted_strings", quoted_strings),
    ("fixed_array_length", fixed_array_length),
)
