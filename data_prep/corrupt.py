"""Inject known amounts of known breakage into clean rows, to prove the fix step accounts for all.

`corrupt(rows, rates, seed)` takes clean OpenAI-`messages` rows whose assistant answers are
canonical TOON (what data_prep/weather.py writes) and returns the rows to write plus the exact
report `fix_dataset` must produce for them. Each corrupted row gets exactly ONE breakage, so the
expected counts are exact; `duplicate` adds a copy (new id, same messages) of an untouched row.

The expectation assumes `FixConfig(toon=True)` with the other fields at their defaults
(toon_where="message", empty turns dropped, no-assistant rows quarantined, dedupe on), and that
the images clean rows name exist (user turns may be [image parts..., text] lists, as
`data_prep/weather.py --images` writes them). `missing_image` points a row at an image file that
does not exist: its first image part's path is replaced, or a text-only row gets one.

    python data_prep/corrupt.py data/weather/train.jsonl data/weather/train.corrupt.jsonl \
        --rate 0.02 --seed 0        # writes the expected report beside it (.expected.json)
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import re
import sys
from pathlib import Path
from typing import Callable, Union

import toon_format

from specforge.utils.io import atomic_path, read_jsonl, write_json

Row = Union[dict, str]  # a str is a raw (invalid JSON) line

# breakage -> what the fix report shows for it: ("fix", fix name) or ("quarantine", reason code)
OUTCOMES: dict[str, tuple[str, str]] = {
    "invalid_json": ("quarantine", "invalid_json"),
    "array_length": ("fix", "fixed_array_length"),
    "row_field_count": ("fix", "fixed_row_field_count"),
    "tab_indentation": ("fix", "fixed_indentation"),
    "trailing_whitespace": ("fix", "stripped_trailing_whitespace"),
    "json_instead_of_toon": ("fix", "converted_json_to_toon"),
    "unquoted_string": ("fix", "quoted_strings"),
    "unrepairable_toon": ("quarantine", "toon_unrepairable"),
    "sharegpt_roles": ("fix", "normalized_role_names"),
    "consecutive_turns": ("fix", "merged_consecutive_user"),
    "empty_turn": ("fix", "dropped_empty_turn"),
    "no_assistant": ("quarantine", "no_assistant_turn"),
    "duplicate": ("quarantine", "duplicate"),
    "missing_image": ("quarantine", "image_missing"),
}
_HEADER_LINE = re.compile(r"\[(\d+)\]\{[^{}]*\}:$")


# --------------------------------------------------------------------------------------------
# One function per breakage: (clean row, rng) -> corrupted row, or None when it does not apply
# --------------------------------------------------------------------------------------------


def _invalid_json(row: dict, rng: random.Random) -> str:
    return json.dumps(row, ensure_ascii=False)[:-1]  # the closing brace is lost


def _on_answer(edit: Callable[[str], str | None]) -> Callable[[dict, random.Random], dict | None]:
    """Apply a text edit to the first assistant answer; None when the edit does not apply."""

    def breakage(row: dict, rng: random.Random) -> dict | None:
        i = _first(row, "assistant")
        new = edit(row["messages"][i]["content"]) if i is not None else None
        if new is None:
            return None
        out = copy.deepcopy(row)
        out["messages"][i]["content"] = new
        return out

    return breakage


def _bump_array_length(toon: str) -> str | None:
    lines = toon.split("\n")
    for k, line in enumerate(lines):
        match = _HEADER_LINE.search(line)
        if match:
            n = int(match.group(1))
            lines[k] = line[: match.start()] + f"[{n + 1}]" + line[match.start() + len(f"[{n}]"):]
            return "\n".join(lines)
    return None


def _table_row(lines: list[str]) -> int | None:
    """Index of the first row of the first tabular array."""
    for k, line in enumerate(lines[:-1]):
        if _HEADER_LINE.search(line):
            return k + 1
    return None


def _trailing_delimiter(toon: str) -> str | None:
    lines = toon.split("\n")
    k = _table_row(lines)
    if k is None:
        return None
    lines[k] += ","
    return "\n".join(lines)


def _tabs(toon: str) -> str | None:
    lines = toon.split("\n")
    out = [("\t" * ((len(x) - len(x.lstrip(" "))) // 2)) + x.lstrip(" ") for x in lines]
    return "\n".join(out) if out != lines else None


def _trailing_whitespace(toon: str) -> str | None:
    lines = toon.split("\n")
    out = [x + " \t" if x.endswith(":") else x for x in lines]  # a tab after an opener is invalid
    return "\n".join(out) if out != lines else None


def _json_answer(toon: str) -> str | None:
    value = toon_format.decode(toon)
    if not isinstance(value, (dict, list)):
        return None
    text = json.dumps(value, ensure_ascii=False)
    return text if toon_format.encode(json.loads(text)) == toon else None


def _unquote_first_cell(toon: str) -> str | None:
    """The model forgot the quotes a colon needs (e.g. `"06:00"` -> `06:00`), which ends a table."""
    lines = toon.split("\n")
    k = _table_row(lines)
    if k is None:
        return None
    indent = lines[k][: len(lines[k]) - len(lines[k].lstrip(" "))]
    first, sep, rest = lines[k].lstrip(" ").partition(",")
    if first.startswith('"'):
        text = json.loads(first) if first.endswith('"') and "\\" not in first else None
    else:
        text = first if not re.fullmatch(r"-?[\d.eE+-]+|true|false|null", first) else None
    if not text or "," in text or '"' in text:
        return None
    text = text if ":" in text else f"{text}: noted"
    lines[k] = indent + text + sep + rest
    return "\n".join(lines)


def _unrepairable(toon: str) -> str | None:
    if not isinstance(toon_format.decode(toon), dict):
        return None
    return toon + '\nnote: "unterminated'


def _rename_roles(row: dict, rng: random.Random) -> dict:
    names = {"user": "human", "assistant": "gpt"}
    out = copy.deepcopy(row)
    for m in out["messages"]:
        m["role"] = names.get(m["role"], m["role"])
    return out


def _insert_after_user(content: str) -> Callable[[dict, random.Random], dict | None]:
    def breakage(row: dict, rng: random.Random) -> dict | None:
        i = _first(row, "user")
        if i is None:
            return None
        out = copy.deepcopy(row)
        out["messages"].insert(i + 1, {"role": "user", "content": content})
        return out

    return breakage


def _drop_assistants(row: dict, rng: random.Random) -> dict | None:
    i = _first(row, "assistant")
    if i is None or _first(row, "user") is None or _first(row, "user") > i:
        return None  # keep at least one user turn so the row still parses
    out = copy.deepcopy(row)
    out["messages"] = out["messages"][:i]
    return out


def _missing_image(row: dict, rng: random.Random) -> dict | None:
    i = _first(row, "user")
    if i is None:
        return None
    out = copy.deepcopy(row)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(row.get("id", "row")))
    missing = {"type": "image", "image": f"missing_images/{name}.png"}
    content = out["messages"][i]["content"]
    if isinstance(content, str):
        out["messages"][i]["content"] = [{"type": "text", "text": content}, missing]
    else:  # an image row: its first image is the one that went missing
        k = next(k for k, p in enumerate(content) if p["type"] == "image")
        content[k] = missing
    return out


def _first(row: dict, role: str) -> int | None:
    return next((i for i, m in enumerate(row["messages"]) if m["role"] == role), None)


BREAKAGES: dict[str, Callable[[dict, random.Random], Row | None]] = {
    "invalid_json": _invalid_json,
    "array_length": _on_answer(_bump_array_length),
    "row_field_count": _on_answer(_trailing_delimiter),
    "tab_indentation": _on_answer(_tabs),
    "trailing_whitespace": _on_answer(_trailing_whitespace),
    "json_instead_of_toon": _on_answer(_json_answer),
    "unquoted_string": _on_answer(_unquote_first_cell),
    "unrepairable_toon": _on_answer(_unrepairable),
    "sharegpt_roles": _rename_roles,
    "consecutive_turns": _insert_after_user("Please answer in TOON."),
    "empty_turn": _insert_after_user(""),
    "no_assistant": _drop_assistants,
    "missing_image": _missing_image,
}
assert set(BREAKAGES) | {"duplicate"} == set(OUTCOMES)


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------


def corrupt(rows: list[dict], rates: dict[str, float | int], seed: int) -> tuple[list[Row], dict]:
    """(rows to write, expected fix counts). `rates`: breakage -> fraction of rows (float) or
    exact number of rows (int). Deterministic in (rows, rates, seed)."""
    check_clean(rows)
    counts = _resolve_counts(rates, len(rows))
    rng = random.Random(f"corrupt:{seed}")
    order = list(range(len(rows)))
    rng.shuffle(order)
    used: set[int] = set()
    out: list[Row] = list(rows)
    for name, breakage in BREAKAGES.items():
        for _ in range(counts.get(name, 0)):
            k, new = _next_applicable(rows, order, used, breakage, rng, name)
            out[k] = new
    dup_sources = [_next_applicable(rows, order, used, lambda r, g: r, rng, "duplicate")[0]
                   for _ in range(counts.get("duplicate", 0))]
    out = _insert_duplicates(out, rows, dup_sources, rng)
    return out, _expected(counts, len(out))


def _next_applicable(rows, order, used, breakage, rng, name) -> tuple[int, Row]:
    for k in order:
        if k in used:
            continue
        new = breakage(rows[k], rng)
        if new is not None:
            used.add(k)
            return k, new
    raise ValueError(f"rates[{name!r}]: not enough untouched rows where this breakage applies")


def _insert_duplicates(out: list[Row], rows: list[dict], sources: list[int], rng: random.Random) -> list[Row]:
    """A copy with a new id goes somewhere after its source, so the source is the first seen."""
    tags: list[int | None] = list(range(len(out)))  # original index per output position
    for n, k in enumerate(sources):
        dup = {**copy.deepcopy(rows[k]), "id": f"{rows[k].get('id', k)}-dup{n}"}
        at = rng.randint(tags.index(k) + 1, len(out))
        out.insert(at, dup)
        tags.insert(at, None)
    return out


def _resolve_counts(rates: dict[str, float | int], n_rows: int) -> dict[str, int]:
    counts = {}
    for name, rate in rates.items():
        if name not in OUTCOMES:
            raise ValueError(f"rates: unknown breakage {name!r}; known: {sorted(OUTCOMES)}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
            raise ValueError(f"rates[{name!r}]: expected a fraction (float) or a count (int), got {rate!r}")
        counts[name] = rate if isinstance(rate, int) else round(rate * n_rows)
    if sum(counts.values()) > n_rows:
        raise ValueError(f"rates: {sum(counts.values())} breakages asked for but only {n_rows} rows")
    return counts


def _expected(counts: dict[str, int], input_rows: int) -> dict:
    by_fix: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    for name, n in counts.items():
        if n:
            kind, label = OUTCOMES[name]
            target = by_fix if kind == "fix" else by_reason
            target[label] = target.get(label, 0) + n
    fixed, quarantined = sum(by_fix.values()), sum(by_reason.values())
    return {
        "input_rows": input_rows,
        "kept": input_rows - fixed - quarantined,
        "fixed": fixed,
        "quarantined": quarantined,
        "by_fix": dict(sorted(by_fix.items())),
        "by_reason": dict(sorted(by_reason.items())),
        "by_kept_as_written": {},  # the default fix config quarantines what it cannot repair
    }


def check_clean(rows: list[dict]) -> None:
    """Expected counts are exact only if nothing but the injected breakage needs fixing."""
    seen: dict[str, int] = {}
    for k, row in enumerate(rows):
        problem = _clean_problem(row)
        if problem:
            raise ValueError(f"rows[{k}]: not a clean row: {problem}")
        key = json.dumps(row["messages"], sort_keys=True)
        if key in seen:
            raise ValueError(f"rows[{k}]: same messages as rows[{seen[key]}] (clean rows must be distinct)")
        seen[key] = k


def _clean_problem(row: dict) -> str | None:
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        return "expected an OpenAI row with a non-empty 'messages' list"
    roles = [m.get("role") for m in messages]
    if any(r not in ("system", "user", "assistant") for r in roles):
        return f"roles {roles} are not all system/user/assistant"
    if any(a == b for a, b in zip(roles, roles[1:])):
        return f"roles {roles} repeat"
    if "assistant" not in roles:
        return "no assistant turn"
    for m in messages:
        if m["role"] == "user" and isinstance(m.get("content"), list):
            problem = _clean_parts(m["content"])
            if problem:
                return f"a user turn's parts: {problem}"
            continue
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            return f"a {m['role']} turn is not a non-empty string"
        if m["role"] == "assistant" and not _canonical_toon(m["content"]):
            return "an assistant answer is not canonical TOON"
    return None


def _clean_parts(parts: list) -> str | None:
    """A clean user turn with images: image parts first, then one non-empty text part."""
    if not parts or not all(isinstance(p, dict) for p in parts):
        return "expected a non-empty list of objects"
    *images, text = parts
    if not images or not all(p.get("type") == "image" and isinstance(p.get("image"), str) and p["image"]
                             for p in images):
        return 'expected {"type": "image", "image": <path>} parts before the text'
    if text.get("type") != "text" or not isinstance(text.get("text"), str) or not text["text"].strip():
        return "expected one non-empty text part last"
    return None


def _canonical_toon(text: str) -> bool:
    try:
        value = toon_format.decode(text)
    except toon_format.ToonDecodeError:
        return False
    return not isinstance(value, (dict, list)) or toon_format.encode(value) == text


def write_jsonl_lines(path: str | Path, rows: list[Row]) -> int:
    """JSONL where a str row is written as is (an invalid JSON line), atomically."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            line = row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)
            if "\n" in line:
                raise ValueError(f"row {n}: a JSONL line cannot contain a newline")
            f.write(line + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="clean JSONL (OpenAI messages rows with TOON answers)")
    p.add_argument("dst", help="corrupted JSONL to write; the expected report goes to <dst>.expected.json")
    p.add_argument("--rate", type=float, default=0.02, help="fraction of rows per breakage")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = list(read_jsonl(args.src))
    out, expected = corrupt(rows, {name: args.rate for name in OUTCOMES}, args.seed)
    write_jsonl_lines(args.dst, out)
    write_json(f"{args.dst}.expected.json", expected)
    print(f"wrote {len(out)} rows to {args.dst}: {expected['fixed']} to fix, "
          f"{expected['quarantined']} to quarantine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
