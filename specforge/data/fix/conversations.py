"""Conversation-level repairs and checks, each switched by a FixConfig field.

Every function either returns the (possibly changed) messages plus the fix names it applied,
or raises `Quarantine(reason)`. Reasons start with a stable code (the part before ": ") that the
report counts; the rest names the field, turn or path a person has to look at.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import UnidentifiedImageError

from specforge.data.formats import detect_format, is_tool_turn, read_turns, turns_field
from specforge.utils.images import (ImageTooLarge, OtherFormat, data_uri_bytes, decode_image, describe,
                                    image_format, is_data_uri, is_remote, opened, orientation_and_transparency,
                                    served_png, to_data_uri)
from specforge.utils.io import atomic_path

CANONICAL_ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's own spellings are its format, not a defect; anything else that was mapped is a fix.
NATIVE_ROLES = {"sharegpt": ("system", "human", "gpt", "function_call", "observation")}


class Quarantine(Exception):
    """A sample that must not be trained on; `reason` is what the quarantine file shows."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def role_name_fixes(data: dict, fmt: str) -> list[str]:
    """["normalized_role_names"] when a turn's role was spelled other than its format's way."""
    fmt = detect_format(data) if fmt == "auto" else fmt
    key = "from" if fmt == "sharegpt" else "role"
    native = NATIVE_ROLES.get(fmt, CANONICAL_ROLES)
    turns = read_turns(data, turns_field(data, fmt)) or []
    if any(isinstance(t, dict) and t.get(key) not in native for t in turns):
        return ["normalized_role_names"]
    return []


def message_chars(messages: list[dict]) -> int:
    """Characters of text in the messages (tool calls as the JSON they render to): what tokenizing
    the row will cost."""
    return sum((len(m["content"]) if isinstance(m["content"], str)
                else sum(len(p.get("text") or "") for p in m["content"] if p.get("type") == "text"))
               + (len(json.dumps(m["tool_calls"], ensure_ascii=False)) if m.get("tool_calls") else 0)
               for m in messages)


def check_row_length(messages: list[dict] | str, max_chars: int | None) -> None:
    """Quarantine a row too long to tokenize cheaply (one 2 MB line would double the stage's
    memory before truncation could cut it); checked before any repair or tokenization. A string:
    preformatted text (data.format=text)."""
    if max_chars is None:
        return
    n = len(messages) if isinstance(messages, str) else message_chars(messages)
    if n > max_chars:
        raise Quarantine(f"row_too_long: {n} characters > data.max_chars_per_row {max_chars}")


def is_empty(content: str | list) -> bool:
    if isinstance(content, str):
        return not content.strip()
    return all(p.get("type") == "text" and not p.get("text", "").strip() for p in content)


def drop_empty_turns(messages: list[dict], policy: str) -> tuple[list[dict], list[str]]:
    """Empty turns carry no signal and break role alternation: drop them or quarantine. A turn that
    calls tools is not empty, and a tool's result is kept even when empty (its call needs it)."""
    empty = [i for i, m in enumerate(messages)
             if is_empty(m["content"]) and not is_tool_turn(m)]
    if not empty:
        return messages, []
    if policy == "quarantine":
        i = empty[0]
        raise Quarantine(f"empty_turn: messages[{i}] ({messages[i]['role']}) is empty")
    return [m for i, m in enumerate(messages) if i not in empty], ["dropped_empty_turn"]


def merge_consecutive(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """Chat templates expect alternating turns; join runs of one role (text with a blank line).
    Tool results (one per call) and turns that call tools are never joined."""
    merged: list[dict] = []
    fixes: list[str] = []
    for m in messages:
        if merged and merged[-1]["role"] == m["role"] and not is_tool_turn(m) and not is_tool_turn(merged[-1]):
            merged[-1] = {"role": m["role"], "content": _join(merged[-1]["content"], m["content"])}
            name = f"merged_consecutive_{m['role']}"
            if name not in fixes:
                fixes.append(name)
        else:
            merged.append(m)
    return merged, fixes


def _join(a: str | list, b: str | list) -> str | list:
    """Two turns' content as one: texts apart by a blank line, also where a turn holds images (templates print
    text parts back to back: "What is this?Answer in French." otherwise)."""
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}\n\n{b}"
    first, second = _parts(a), _parts(b)
    if first and second and first[-1].get("type") == "text" and second[0].get("type") == "text":
        first[-1] = {**first[-1], "text": first[-1]["text"] + "\n\n"}
    return first + second


def _parts(content: str | list) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def require_assistant(messages: list[dict], policy: str) -> None:
    """Without an assistant turn the loss mask is empty: nothing to learn."""
    if policy == "quarantine" and not any(m["role"] == "assistant" for m in messages):
        raise Quarantine("no_assistant_turn: the conversation has no assistant turn")


def dedupe_key(messages: list[dict] | str, tools: list[dict] | None = None) -> str:
    """Duplicates are judged on the cleaned messages, not the id: copies often get new ids.

    Image parts are compared by the absolute path the fix step resolved them to (remote URLs as
    written), not by how the row spelled them: "a.png" and "./a.png" beside the same data file
    are one image, so two rows that differ only in that spelling are duplicates, while the same
    relative spelling in two folders (two different files) is not. The bytes of image files are not
    compared: two copies of one picture under different paths are different images here (embedded
    images are named by their bytes, so there one picture is one image). A row's
    tool definitions count too: the same turns offered other tools are another sample."""
    text = json.dumps(messages if not tools else [messages, tools], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def conversation_key(conv: dict) -> str:
    """`dedupe_key` of a conversation of the data stage; a preformatted one (data.format=text) by its text."""
    return dedupe_key(conv["text"] if "text" in conv else conv["messages"], conv.get("tools"))


def prompt_turns(messages: list[dict]) -> list[dict]:
    """The turns before the first assistant turn: what the model is asked to continue."""
    head = []
    for message in messages:
        if message["role"] == "assistant":
            break
        head.append(message)
    return head


def prompt_key(messages: list[dict]) -> str | None:
    """Two conversations with this key open with the same prompt, so the target answers them
    alike: an eval row sharing it with a train sample is not held out. None without a user turn
    before the first answer (a canned greeting first): nothing is asked there."""
    head = prompt_turns(messages)
    return dedupe_key(head) if any(m["role"] == "user" for m in head) else None


@dataclass(frozen=True)
class ImageLoading:
    """How the server the draft is for loads an image, where servers differ (docs/design.md): SGLang
    reads it as stored and drops an RGBA image's alpha (the defaults); vLLM turns it as its EXIF
    orientation says (data.image_orientation=upright) and composites RGBA onto white
    (data.image_alpha=white). The target in training must see the pixels the server will show it."""

    upright: bool = False
    on_white: bool = False

    @classmethod
    def of(cls, data_cfg) -> "ImageLoading":
        return cls(upright=data_cfg.image_orientation == "upright", on_white=data_cfg.image_alpha == "white")

    def applies(self, finding: str) -> bool:
        """Whether this loading changes an image that holds `finding` (IMAGE_FINDINGS)."""
        return {"exif_turned": self.upright, "transparent": self.on_white}[finding]

    def changes(self, found: frozenset) -> tuple[bool, bool]:
        """(turn it upright, composite it onto white) for an image holding `found`."""
        return tuple(f in found and self.applies(f) for f in ("exif_turned", "transparent"))


# What an image may hold that servers load differently: (its name read as stored, its name as a fix)
IMAGE_FINDINGS = {"exif_turned": ("image_exif_turned", "image_upright"),
                  "transparent": ("image_transparent", "image_alpha_white")}


class ImageChecker:
    """Checks image references and resolves them to what later stages open without the data file.

    A relative path resolves against `image_root`, or without one against the folder of the data
    file that names it; an absolute path stays as it is (but must lie under `image_root` when
    one is set). Each resolved path is opened once however many rows name it (datasets reuse
    images). An image embedded as a base64 `data:` URI (as chat logs and table image columns
    carry them: specforge/data/sources.py) is decoded and, with `embedded_dir`, written there once
    as a file named by its content, which then stands for it (the run's samples keep paths, not
    megabytes of base64); without one it stays the URI. URLs are left alone: no network here (a
    server that fetches them may still be sent them; the data stage refuses them when it renders).

    An image that servers load differently (IMAGE_FINDINGS: an EXIF orientation that turns it, a photo
    taken with the camera sideways; transparent pixels) is counted; where `loading` (ImageLoading) says
    so, a PNG copy of the pixels that server gives the model stands for it, written as an embedded image
    is, so every later reader (the target here, a server sent its bytes) sees them. Otherwise it is read
    as stored, as SGLang reads it."""

    def __init__(self, image_root: str | None, embedded_dir: str | Path | None = None,
                 loading: ImageLoading = ImageLoading()) -> None:
        self.root = Path(image_root).resolve() if image_root else None
        self.embedded_dir = Path(embedded_dir) if embedded_dir else None
        self.loading = loading
        self._seen: dict[Path, tuple] = {}  # path -> (why it cannot be trained on or None, _checked's answer)
        self._embedded: dict[str, tuple] = {}  # sha256 of a data URI -> (what stands for it, found, why not or None)

    def resolve(self, ref: str, data_file: str) -> Path:
        """The absolute path a local reference names (not checked)."""
        base = self.root or Path(data_file).resolve().parent
        return (base / ref).resolve()

    def resolve_images(self, messages: list[dict], data_file: str) -> tuple[list[dict], frozenset]:
        """(`messages` with every local image part checked and rewritten to its absolute path, so
        later stages can open it without knowing the data file; what its images hold that servers
        load differently, for `fixes` and `as_written`). Raises Quarantine naming the first bad image.
        Path resolution is not a repair: it is not recorded as a fix."""
        out, found = [], frozenset()
        for m in messages:
            if isinstance(m["content"], str):
                out.append(m)
                continue
            parts = []
            for p in m["content"]:
                if p.get("type") == "image" and not is_remote(p["image"]):
                    image, its = self._checked(p["image"], data_file)
                    p, found = {**p, "image": image}, found | its
                parts.append(p)
            out.append({**m, "content": parts})
        return out, found

    def fixes(self, found: frozenset) -> list[str]:
        """What a row whose images servers load differently records: a copy as the server loads them (a fix) ..."""
        return [IMAGE_FINDINGS[f][1] for f in sorted(found) if self.loading.applies(f)]

    def as_written(self, found: frozenset) -> list[str]:
        """... or read as stored (as SGLang reads them), although another server would show other pixels."""
        return [IMAGE_FINDINGS[f][0] for f in sorted(found) if not self.loading.applies(f)]

    def _checked(self, ref: str, data_file: str) -> tuple[str, frozenset]:
        """(what stands for a good local image: its resolved path or a copy as the server loads it, what it
        holds that servers load differently), or Quarantine("<code>: <ref> (<details>)")."""
        if is_data_uri(ref):
            return self._embedded_image(ref)
        path = self.resolve(ref, data_file)
        details = [] if ref == str(path) else [f"resolved to {path}"]
        if self.root is not None and not path.is_relative_to(self.root):
            problem = "image_outside_root"
            details.append(f"outside image_root {self.root}")
        else:
            if path not in self._seen:
                self._seen[path] = self._look(path)
            problem, _, detail = (self._seen[path][0] or "").partition(": ")
            if detail:
                details.insert(0, detail)
        if problem:
            raise Quarantine(f"{problem}: {ref}" + (f" ({', '.join(details)})" if details else ""))
        return self._seen[path][1]

    def _look(self, path: Path) -> tuple:
        """(why the file cannot be trained on, or None; (what stands for it, what it holds))."""
        problem = _open_problem(path)
        if problem:
            return problem, (str(path), frozenset())
        found = _findings(path)
        upright, on_white = self.loading.changes(found)
        if not (upright or on_white):
            return None, (str(path), found)
        return None, (self._stand_in(served_png(path, upright, on_white)), found)

    def _embedded_image(self, uri: str) -> tuple[str, frozenset]:
        """(the file (or, without embedded_dir, the URI) that stands for a good embedded image, what it
        holds)."""
        key = hashlib.sha256(uri.encode()).hexdigest()
        if key not in self._embedded:
            try:
                data = data_uri_bytes(uri)
                decode_image(data)
                found = _findings(data)
                upright, on_white = self.loading.changes(found)
                if upright or on_white:
                    stands_for = self._stand_in(served_png(data, upright, on_white))
                else:
                    stands_for = self._write_embedded(data) if self.embedded_dir else uri
                self._embedded[key] = (stands_for, found, None)
            except ImageTooLarge as e:
                self._embedded[key] = (None, frozenset(), f"image_too_large: {describe(uri)}: {e}")
            except OtherFormat as e:
                self._embedded[key] = (None, frozenset(), f"image_format: {describe(uri)}: {e}")
            except ValueError as e:
                self._embedded[key] = (None, frozenset(), f"image_unreadable: {describe(uri)}: {e}")
        stands_for, found, problem = self._embedded[key]
        if problem:
            raise Quarantine(problem)
        return stands_for, found

    def _stand_in(self, data: bytes) -> str:
        """Image bytes made here (a copy as the server loads it) as later stages will read them: a file in
        embedded_dir, or without one a data URI."""
        return self._write_embedded(data) if self.embedded_dir else to_data_uri(data)

    def _write_embedded(self, data: bytes) -> str:
        """`data` as `<embedded_dir>/<sha256 of the bytes>.<format>`, written once (atomically: workers
        of data.num_proc may write the same image at once)."""
        path = self.embedded_dir / f"{hashlib.sha256(data).hexdigest()[:32]}.{image_format(data).lower()}"
        if not path.is_file():
            with atomic_path(path) as tmp:
                tmp.write_bytes(data)
        return str(path.resolve())


def _findings(source) -> frozenset:
    """What an image (a file or bytes) holds that servers load differently (IMAGE_FINDINGS), from one opening."""
    orientation, clear = orientation_and_transparency(source)
    return frozenset(name for name, holds in (("exif_turned", orientation != 1), ("transparent", clear)) if holds)


def _open_problem(path: Path) -> str | None:
    """Why the image file cannot be trained on ("<code>" or "<code>: <details>"), or None. Past PIL's
    decompression-bomb limit it is refused as the server and embedded images refuse it (one such
    file would decode to gigabytes, or stop the whole stage with PIL's error)."""
    if not path.is_file():
        return "image_missing"
    if not os.access(path, os.R_OK):
        return "image_unreadable"
    try:
        with opened(path) as img:
            img.verify()
    except ImageTooLarge as e:
        return f"image_too_large: {e}"
    except OtherFormat as e:
        return f"image_format: {e}"
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError):
        return "image_unreadable"
    return None

