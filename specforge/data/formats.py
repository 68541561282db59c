"""Raw dataset rows -> one normalised conversation shape.

Readers never raise on a bad JSON line: it becomes a `RawRow` with an error so the data stage can
quarantine it with its file and line. A file that is not UTF-8 text (binary, another encoding)
raises `DataFileError` naming the file, line and byte instead: quarantining its "lines" one by one
would only hide that the wrong file was given. Text inputs may be compressed, said by a last
suffix (`rows.jsonl.gz`, `.bz2`, `.xz`, `.zst`); a compressed file without one is refused with the
name to give it, and a corrupt or truncated stream raises naming the file and the last whole line.
`to_conversation` raises `DataError` naming the offending field, which the fix step (or the stage)
turns into a quarantine reason.

Tables (Parquet, Arrow, `datasets.save_to_disk` folders, hub datasets) are read by
`specforge.data.sources`; `read_raw_rows` takes any of them.
"""
from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NoReturn

from specforge.config import DATA_FORMATS
from specforge.errors import InvalidInput
from specforge.utils.io import fingerprint

FORMATS = DATA_FORMATS  # auto, sharegpt, messages, conversations, alpaca, prompt_completion, text
ALPACA_KEYS = ("instruction", "input", "output", "history", "context", "response")  # and "system", as the others
_ALPACA_SPELLINGS = {"input": "context", "output": "response"}  # Dolly's names for Alpaca's fields

# Role spellings seen in public datasets -> the roles chat templates understand (a tool's result:
# OpenAI's "tool", its older "function", Llama 3's "ipython", glaive's ShareGPT "observation").
ROLE_MAP = {
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
    "observation": "tool",
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
TEXT_PART_TYPES = ("text", "input_text", "output_text")
IMAGE_PART_TYPES = ("image", "image_url", "input_image")
IMAGE_PLACEHOLDER = "<image>"  # LLaVA / ShareGPT: where a row-level image goes in a user turn


@dataclass
class RawRow:
    """One row of an input: a line (JSONL), an element (JSON list) or a table row, parsed or not.

    `line` is 1-based: the line in a text file, the row index in a table (Parquet, Arrow, a
    `datasets` folder or hub dataset), so quarantine entries always read "file, line"."""

    file: str
    line: int
    data: dict | None
    error: str | None


class DataError(InvalidInput):
    """A malformed row; the message starts with the field path, e.g. "messages[2].role: ..."."""


class DataFileError(InvalidInput):
    """An input that cannot be read at all (not UTF-8 text, not a Parquet/Arrow file, an
    unreachable hub dataset); the message names the file (and line and byte, for text)."""


NESTED_TOO_DEEP = "invalid JSON: nested too deep (arrays or objects past Python's recursion limit)"
SNIFF_BYTES = 1 << 16  # a NUL byte this early means binary data: refuse before reading a huge "line"
TEXT_SUFFIXES = (".jsonl", ".json")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # a text file's last suffix: how its bytes are compressed
MAGIC = {b"\x1f\x8b": ".gz", b"BZh": ".bz2", b"\xfd7zXZ\x00": ".xz", b"\x28\xb5\x2f\xfd": ".zst"}
SUPPORTED = (".jsonl, .json (either may end in .gz, .bz2, .xz or .zst), .parquet, .arrow, a "
             "datasets.save_to_disk folder or hub:OWNER/NAME[:SPLIT] (see specforge/data/sources.py)")


def read_raw_rows(path: str | Path) -> Iterator[RawRow]:
    """Rows of a .jsonl (one per non-blank line) or .json (a list of objects) file, or of a
    table source (specforge.data.sources: .parquet, .arrow, a save_to_disk folder, `hub:...`).

    Bad JSON or a non-object row yields a RawRow with `error` set; nothing is skipped silently.
    A missing file, an unsupported extension or an unreadable file (DataFileError) raises."""
    from specforge.data import sources  # tables need pyarrow / datasets: imported only for them

    if sources.is_table_source(path):
        yield from sources.read_table_rows(path)
        return
    path = _text_file(path)
    yield from _read_jsonl(path) if text_kind(path) == ".jsonl" else _read_json_list(path)


def read_raw_texts(path: str | Path) -> Iterator[tuple[str, int, str | None, str | None]]:
    """(file, line, JSON text, error) per row, in input order, for `parse_raw_text` to parse
    elsewhere (the data.num_proc workers): JSONL lines are not parsed here; rows of other sources
    are parsed and serialised back to JSON (ASCII, so any string survives the trip)."""
    from specforge.data import sources

    if not sources.is_table_source(path) and text_kind(_text_file(path)) == ".jsonl":
        file = str(_text_file(path))  # spelled as read_raw_rows spells it: the reasons name the same file
        for lineno, text in _jsonl_lines(Path(path)):
            yield file, lineno, text, None
        return
    for raw in read_raw_rows(path):
        yield raw.file, raw.line, None if raw.data is None else json.dumps(raw.data), raw.error


def parse_raw_text(file: str, line: int, text: str | None, error: str | None) -> RawRow:
    """The RawRow of one `read_raw_texts` item: what `read_raw_rows` yields for that row."""
    if text is None:
        return RawRow(file, line, None, error)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return RawRow(file, line, None, f"invalid JSON: {e.msg} (column {e.colno})")
    except RecursionError:  # `[[[[...` 100,000 deep: the parser recurses once per level
        return RawRow(file, line, None, NESTED_TOO_DEEP)
    return _object_or_error(file, line, obj)


def text_kind(path: Path) -> str:
    """".jsonl" or ".json" for `rows.jsonl` and `rows.jsonl.gz` alike (lower case)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def _text_file(path: str | Path) -> Path:
    """`path` checked to be an existing .jsonl/.json file (compressed or not) whose head is UTF-8 text."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    kind = text_kind(path)
    if kind not in TEXT_SUFFIXES:
        raise ValueError(f"{path}: unsupported data file type {''.join(path.suffixes[-2:]) or kind!r}; "
                         f"expected {SUPPORTED}")
    with _reading(path) as f:
        head = f.read(SNIFF_BYTES)
    compression = next((c for magic, c in MAGIC.items() if head.startswith(magic)), None)
    if compression is not None and path.suffix.lower() not in COMPRESSIONS:
        raise DataFileError(f"{path}: {compression[1:]}-compressed data under a plain {kind} name; "
                            f"name it {path.name}{compression} to have it decompressed")
    _check_text(path, head, 0, 1, sniff=True)
    return path


@contextmanager
def _reading(path: Path, lines: list | None = None) -> Iterator[BinaryIO]:
    """The file's bytes, decompressed as its last suffix says. A corrupt or truncated stream raises
    DataFileError naming the file (and the last whole line read, when the caller counts them in
    `lines[0]`)."""
    suffix = path.suffix.lower()
    if suffix not in COMPRESSIONS:
        with open(path, "rb") as f:
            yield f
        return
    errors: tuple = (OSError, EOFError, lzma.LZMAError)  # gzip.BadGzipFile and bz2's are OSErrors
    if suffix == ".zst":
        import zstandard

        errors += (zstandard.ZstdError,)
    try:
        if suffix == ".zst":
            with open(path, "rb") as raw, io.BufferedReader(_ZstdFrames(raw)) as f:
                yield f
        else:
            with {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix](path, "rb") as f:
                yield f
    except errors as e:
        where = f" after line {lines[0]}" if lines else ""
        raise DataFileError(f"{path}: not a readable {suffix[1:]} stream{where} ({e}): the file is corrupt or "
                            "truncated") from None


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a .zst file (`zstd` writes one, `cat a.zst b.zst`
    more). zstandard's own stream_reader stops after the first frame and takes a truncated one
    for the end of the data: both would lose rows without a word."""

    CHUNK = 1 << 20

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard

        self.raw, self.new_frame = raw, zstandard.ZstdDecompressor().decompressobj
        self.frame, self.in_frame, self.pending = self.new_frame(), False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            data = b""
            if self.frame.eof:  # what follows a frame starts the next one
                data, self.frame, self.in_frame = self.frame.unused_data, self.new_frame(), False
            data = data or self.raw.read(self.CHUNK)
            if not data:
                if self.in_frame:
                    import zstandard

                    raise zstandard.ZstdError("the data ends inside a frame")
                return 0
            self.in_frame = True
            self.pending = self.frame.decompress(data)
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n


def _object_or_error(file: str, line: int, obj: Any) -> RawRow:
    if isinstance(obj, dict):
        return RawRow(file, line, obj, None)
    return RawRow(file, line, None, f"expected a JSON object, got {type(obj).__name__}")


def _check_text(path: Path, data: bytes, offset: int, line: int, sniff: bool = False) -> str:
    """`data` (which starts at byte `offset`, on line `line` of the file) decoded as UTF-8; raises
    DataFileError naming the line and byte of the first NUL byte or undecodable byte, whichever
    comes first. `sniff`: `data` is only the head of the file, so a character cut at its end is
    not an error."""
    text, bad = "", None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not (sniff and e.end >= len(data) and "unexpected end" in e.reason):
            bad = e
    nul = data.find(b"\0")
    if bad is not None and (nul < 0 or bad.start < nul):
        _refuse(path, data, offset, line, bad.start, f"bytes that are not UTF-8 ({bad.reason})")
    if nul >= 0:
        _refuse(path, data, offset, line, nul, "a NUL byte (binary data, or UTF-16 text?)")
    return text.removeprefix("\ufeff") if offset == 0 else text


def _refuse(path: Path, data: bytes, offset: int, line: int, at: int, what: str) -> NoReturn:
    line += data.count(b"\n", 0, at)
    raise DataFileError(
        f"{path}: not a UTF-8 text file: line {line} (byte {offset + at} of the "
        f"{'decompressed text' if path.suffix.lower() in COMPRESSIONS else 'file'}) holds {what}; "
        "data files are UTF-8 JSON Lines (.jsonl) or a UTF-8 JSON list (.json)"
    )


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line; raises DataFileError at the first line that
    is not UTF-8 text."""
    offset, read = 0, [0]
    with _reading(path, read) as f:
        for lineno, raw in enumerate(f, 1):
            text = _check_text(path, raw, offset, lineno)
            offset += len(raw)
            read[0] = lineno
            if text.strip():
                yield lineno, text


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    file = str(path)
    for lineno, text in _jsonl_lines(path):
        yield parse_raw_text(file, lineno, text, None)


def _read_json_list(path: Path) -> Iterator[RawRow]:
    """Walk the top-level array element by element so each row gets its real line number."""
    file = str(path)
    with _reading(path) as f:
        data = f.read()
    text = _check_text(path, data, 0, 1)
    decoder = json.JSONDecoder()

    def skip_ws(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def line_of(i: int) -> int:
        return text.count("\n", 0, i) + 1

    i = skip_ws(0)
    if i >= len(text) or text[i] != "[":
        yield RawRow(file, line_of(i), None, "invalid JSON: a .json data file must hold a list of objects")
        return
    i = skip_ws(i + 1)
    if i < len(text) and text[i] == "]":
        return
    while i < len(text):
        start = i
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # The rest of the file cannot be split reliably: one error row for what is left.
            yield RawRow(file, line_of(start), None, f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})")
            return
        except RecursionError:
            yield RawRow(file, line_of(start), None, NESTED_TOO_DEEP)
            return
        yield _object_or_error(file, line_of(start), obj)
        i = skip_ws(i)
        if i < len(text) and text[i] == ",":
            i = skip_ws(i + 1)
        elif i < len(text) and text[i] == "]":
            return
        else:
            yield RawRow(file, line_of(i), None, "invalid JSON: expected ',' or ']' after a list element")
            return
    yield RawRow(file, line_of(len(text)), None, "invalid JSON: unterminated list")


def detect_format(data: dict) -> str:
    """'messages', 'sharegpt' (from/value turns), 'conversations' (role/content turns) or 'alpaca'
    (instruction / input / output)."""
    if "messages" in data:
        return "messages"
    turns = read_turns(data, _conversations_field(data))
    if turns is None and "instruction" in data and ("output" in data or "response" in data):
        return "alpaca"
    if turns is None and "prompt" in data and "completion" in data:
        return "prompt_completion"
    if turns is None:
        hint = "; a conversation already rendered with the chat template is read with data.format=text" \
            if isinstance(data.get("text"), str) else ""
        raise DataError(f"row: no 'messages' or 'conversations' field, nor Alpaca's 'instruction' and 'output', "
                        f"nor 'prompt' and 'completion' (keys: {sorted(data)[:8]}){hint}")
    if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" in turns[0]:
        return "sharegpt"
    return "conversations"


def read_turns(data: dict, field: str) -> Any:
    """data[field], and where it is a string holding a JSON list (some Parquet exports store the
    turns so, as some store `tools`), that list; anything else as it is, for the caller to judge."""
    turns = data.get(field)
    if isinstance(turns, str) and turns.lstrip().startswith("["):
        try:
            return json.loads(turns)
        except json.JSONDecodeError as e:
            raise DataError(f"{field}: a string that is not a JSON list of turns ({e.msg} at character {e.pos})") from None
    return turns


def with_turns_parsed(data: dict) -> dict:
    """`data` with every turns field stored as a JSON string replaced by its list, parsed once for
    the readers after it (format detection, conversion, role-name accounting)."""
    strings = [f for f in ("messages", "conversations", "conversation")
               if isinstance(data.get(f), str) and data[f].lstrip().startswith("[")]
    return {**data, **{f: read_turns(data, f) for f in strings}} if strings else data


def turns_field(data: dict, fmt: str) -> str:
    """Where a row of format `fmt` (sharegpt, messages, conversations) keeps its turns."""
    return "messages" if fmt == "messages" else _conversations_field(data)


def _conversations_field(data: dict) -> str:
    """"conversations", or "conversation" where a row has that alone (LMSYS-Chat-1M, WildChat)."""
    return "conversation" if "conversation" in data and "conversations" not in data else "conversations"


def to_conversation(data: dict, fmt: str = "auto") -> dict:
    """`{"id", "messages": [{"role", "content"}]}` from a ShareGPT, OpenAI-messages or
    role/content row. Text parts are joined into one string; a turn with image parts keeps its
    list of parts (normalised to {"type": "text"|"image", ...}) for vision-language targets.

    Row-level images (LLaVA / ShareGPT style: a top-level `images` list of paths, or one `image`
    path) become image parts too, so every image of a row lives in its messages: each `<image>`
    placeholder in a user turn's text, and each image part without a path (`{"type": "image"}`,
    the Hugging Face TRL spelling), takes the next image in order; the whitespace that only
    separates a placeholder from its text is dropped ("<image>\\nWhat is this?" -> [image, "What is
    this?"]). Without any placeholder the images go, in order, to the start of the first user
    turn. More placeholders than images or the reverse is a DataError naming the field."""
    if fmt not in FORMATS:
        raise ValueError(f"data.format: {fmt!r} is not one of {list(FORMATS)}")
    if not isinstance(data, dict):
        raise DataError(f"row: expected a JSON object, got {type(data).__name__}")
    data = with_turns_parsed(data)
    if fmt == "auto":
        fmt = detect_format(data)
    if fmt == "alpaca":
        return to_conversation(alpaca_as_messages(data), "messages")
    if fmt == "prompt_completion":
        return to_conversation(prompt_completion_as_messages(data), "messages")
    if fmt == "text":
        return text_conversation(data)
    field = turns_field(data, fmt)
    role_key, content_key = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    turns = read_turns(data, field)
    if turns is None:
        raise DataError(f"{field}: missing (format {fmt})")
    if not isinstance(turns, list):
        raise DataError(f"{field}: expected a list of turns, got {type(turns).__name__}")
    if not turns:
        raise DataError(f"{field}: empty")

    row_images = _row_images(data)
    messages = []
    system = data.get("system")  # ShareGPT variants keep the system prompt beside the turns
    if system is not None and not isinstance(system, str):
        raise DataError(f"system: expected a string, got {type(system).__name__}")
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where}: expected an object, got {type(turn).__name__}")
        if role_key not in turn:
            raise DataError(f"{where}.{role_key}: missing")
        raw_role = turn[role_key]
        if fmt == "sharegpt" and raw_role == "function_call":  # LLaMA-Factory's ShareGPT: the call as JSON
            calls = _sharegpt_calls(turn.get(content_key), f"{where}.{content_key}")
            turn, raw_role = {role_key: "gpt", "tool_calls": calls, content_key: None}, "gpt"
        role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise DataError(f"{where}.{role_key}: unknown role {raw_role!r}")
        calls = _tool_calls(turn.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else None
        if content_key not in turn and not calls:
            raise DataError(f"{where}.{content_key}: missing")
        raw_content = turn.get(content_key)
        if raw_content is None and calls:
            raw_content = ""  # OpenAI: an assistant turn that only calls tools has content null
        if role == "tool" and isinstance(raw_content, dict):
            raw_content = json.dumps(raw_content, ensure_ascii=False)  # a result stored as an object
        content = _content(raw_content, f"{where}.{content_key}", slots=row_images is not None)
        if role == "assistant":
            content = with_reasoning(content, _turn_reasoning(turn, where))
        message = {"role": role, "content": content}
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            message.update({k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)})
        messages.append(message)
    if row_images is not None:
        messages = _place_row_images(messages, *row_images)
    if system and system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})

    return {"id": _row_id(data, messages), "messages": messages, **tools_entry(_tools(data.get("tools")))}


def alpaca_as_messages(data: dict) -> dict:
    """An Alpaca row (Stanford's `instruction`, optional `input`, `output`; LLaMA-Factory's optional
    `system` and `history` of [question, answer] pairs before it; Dolly's `context` and `response`
    for input and output) as an OpenAI-messages row: the user turn is the instruction and the input
    joined by a newline, as LLaMA-Factory renders it. The row's other fields (id, images, tools) stay."""
    def text(key: str, required: bool) -> str:
        if key not in data and _ALPACA_SPELLINGS.get(key) in data:
            key = _ALPACA_SPELLINGS[key]
        value = data.get(key)
        if value is None and not required:
            return ""
        if not isinstance(value, str):
            raise DataError(f"{key}: expected a string, got {'nothing' if value is None else type(value).__name__}")
        return value

    instruction, extra, output = text("instruction", True), text("input", False), text("output", True)
    messages = []
    history = data.get("history") or []
    if not isinstance(history, list):
        raise DataError(f"history: expected a list of [question, answer] pairs, got {type(history).__name__}")
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise DataError(f"history[{i}]: expected a [question, answer] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    messages += [{"role": "user", "content": "\n".join(t for t in (instruction, extra) if t)},
                 {"role": "assistant", "content": output}]
    return {**{k: v for k, v in data.items() if k not in ALPACA_KEYS}, "messages": messages}


def text_conversation(data: dict) -> dict:
    """`{"id", "text"}` of a preformatted row (data.format=text, SpecForge's `is_preformatted`): `text` is
    the conversation already rendered with the target's chat template, e.g. what a server was sent
    and answered, trained as written (specforge/data/template.py: render_text)."""
    text = data.get("text")
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"text: expected the conversation rendered with the chat template, a non-empty string "
                        f"(data.format=text), got {type(text).__name__ if not isinstance(text, str) else 'blank text'}")
    return {"id": _row_id(data, text), "text": text}


def prompt_completion_as_messages(data: dict) -> dict:
    """A prompt-completion row (OpenAI's legacy fine-tuning files, TRL's prompt-completion datasets)
    as an OpenAI-messages row: a text prompt is the user turn and a text completion the answer; TRL's
    conversational kind gives lists of turns (the prompt's, then the completion's)."""
    def turns(key: str, role: str) -> list:
        value = data.get(key)
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        if isinstance(value, list):
            return value
        raise DataError(f"{key}: expected a string or a list of turns, got "
                        f"{'nothing' if value is None else type(value).__name__}")

    messages = turns("prompt", "user") + turns("completion", "assistant")
    return {**{k: v for k, v in data.items() if k not in ("prompt", "completion")}, "messages": messages}


# Where servers put split-off thinking: vLLM "reasoning" (it removed "reasoning_content" in January
# 2026), SGLang and DeepSeek "reasoning_content".
REASONING_KEYS = ("reasoning", "reasoning_content")
THINK_START, THINK_END = "<think>", "</think>"  # how Qwen3 and DeepSeek-R1 write their reasoning


def with_reasoning(content: str | list[dict], reasoning: str | None) -> str | list[dict]:
    """The answer with its thinking in front, as the target wrote it and its template renders it
    (Qwen3's: `<think>\n` + reasoning + `\n</think>\n\n` + answer): servers with a reasoning parser,
    and datasets saved from them, split it off."""
    if not reasoning or not reasoning.strip():
        return content
    first = content if isinstance(content, str) else next((p["text"] for p in content if p["type"] == "text"), "")
    if first.lstrip().startswith(THINK_START):  # exported twice: the answer already carries it
        return content
    think = f"{THINK_START}\n{reasoning.strip(chr(10))}\n{THINK_END}\n\n"
    if isinstance(content, str):
        return think + content.lstrip("\n")
    return [{"type": "text", "text": think}, *content]


def _turn_reasoning(turn: dict, where: str) -> str | None:
    """An assistant turn's split-off thinking, under either key a server writes it."""
    for key in REASONING_KEYS:
        value = turn.get(key)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}.{key}: expected a string, got {type(value).__name__}")
        if value and value.strip():
            return value
    return None


def tools_entry(tools: list[dict] | None) -> dict:
    """{"tools": tools} when a row has tool definitions, else {}: the key a conversation (and a
    chat template call) carries only for such rows."""
    return {"tools": tools} if tools else {}


def turns_entry(conv: dict) -> dict:
    """What a conversation of the data stage is, as its files store it: {"id", "messages"(, "tools")},
    or {"id", "text"} where it came preformatted (data.format=text)."""
    if "text" in conv:
        return {"id": conv["id"], "text": conv["text"]}
    return {"id": conv["id"], "messages": conv["messages"], **tools_entry(conv.get("tools"))}


def is_tool_turn(message: dict) -> bool:
    """A tool's result, or an assistant turn that calls tools."""
    return message["role"] == "tool" or bool(message.get("tool_calls"))


def uses_tools(messages: list[dict], tools=None) -> bool:
    """A conversation with tool definitions, calls or results (an agentic trace)."""
    return bool(tools) or any(is_tool_turn(m) for m in messages)


def _tools(value: Any) -> list[dict] | None:
    """The row's tool definitions (OpenAI's `tools`: function schemas, or that list as a JSON
    string as some datasets store it), passed to the chat template as `tools`."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"tools: not a JSON list ({e.msg} at character {e.pos})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"tools: expected a list of tool definitions (objects), got {type(value).__name__}")
    return value or None


def _sharegpt_calls(value: Any, where: str) -> list[dict]:
    """A ShareGPT `function_call` turn's value: one call {"name", "arguments"} or a list of them, as JSON."""
    what = f'{where}: a function_call turn holds {{"name", "arguments"}} (or a list of them) as JSON'
    try:
        calls = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError as e:
        raise DataError(f"{what} ({e.msg} at character {e.pos})") from None
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise DataError(what)
    return calls


def _tool_calls(value: Any, where: str) -> list[dict] | None:
    """An assistant turn's calls as OpenAI writes them ({"type": "function", "function": {"name",
    "arguments"}}, arguments a JSON string or an object) or bare {"name", "arguments"}; arguments
    become an object, which chat templates render (a JSON string that does not parse is an error)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise DataError(f"{where}: expected a list of calls, got {type(value).__name__}")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(f"{where}[{j}]: expected {{\"function\": {{\"name\", \"arguments\"}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise DataError(f"{where}[{j}].function.arguments: not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(args, dict):
            raise DataError(f"{where}[{j}].function.arguments: expected an object, got {type(args).__name__}")
        out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _content(value: Any, where: str, slots: bool = False) -> str | list[dict]:
    """A string, or a list of parts when there is an image. `slots`: the row has row-level
    images, so an image part without a path is a slot they fill (`{"type": "image", "image": None}`)."""
    if isinstance(value, str):
        return value
    if value is None:
        raise DataError(f"{where}: is null (expected a string or a list of parts)")
    if not isinstance(value, list):
        raise DataError(f"{where}: expected a string or a list of parts, got {type(value).__name__}")
    parts: list[dict] = []
    for j, part in enumerate(value):
        pw = f"{where}[{j}]"
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise DataError(f"{pw}: expected an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind in TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise DataError(f"{pw}.text: expected a string, got {type(text).__name__}")
            parts.append({"type": "text", "text": text})
        elif kind in IMAGE_PART_TYPES:
            parts.append(_image_part(part, pw, slots))
        else:
            raise DataError(f"{pw}.type: unknown part type {kind!r}")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image_part(part: dict, where: str, slots: bool = False) -> dict:
    """{"type": "image", "image": <path, data URI or URL>} whatever the input spelling was: OpenAI's
    `image_url` ({"url"} or, in its Responses API, the URL itself), Hugging Face's `image`, or
    Anthropic's `source` ({"type": "base64", "media_type", "data"} or {"type": "url", "url"})."""
    src = part.get("image", part.get("image_url"))
    if isinstance(src, dict):
        src = src.get("url")
    source = part.get("source")
    if src is None and isinstance(source, dict):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            src = f"data:{source.get('media_type') or ''};base64,{source['data']}"
        elif source.get("type") == "url":
            src = source.get("url")
    if src is None and slots:
        return {"type": "image", "image": None}  # filled from the row-level images
    if not isinstance(src, str) or not src:
        raise DataError(f"{where}: image part without an image path or URL")
    return {"type": "image", "image": src}


def _row_images(data: dict) -> tuple[str, list[str]] | None:
    """(field name, paths) of a row-level `images` (a path or a list) or `image` (a path) field;
    None when the row has neither (or they are null)."""
    one, many = data.get("image"), data.get("images")
    if one is not None and many is not None:
        raise DataError("image: the row has both 'image' and 'images'; use one of them")
    if many is not None:
        paths = [many] if isinstance(many, str) else many
        if not isinstance(paths, list) or not all(isinstance(x, str) and x for x in paths):
            raise DataError("images: expected a path or a list of paths")
        return "images", paths
    if one is not None:
        if not isinstance(one, str) or not one:
            raise DataError(f"image: expected a path, got {type(one).__name__}")
        return "image", [one]
    return None


def _split_placeholders(text: str) -> list[dict]:
    """"a <image> b" -> [text a, slot, text b]: empty text pieces are dropped, and so is the
    whitespace between a piece and the placeholder it touches."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    parts: list[dict] = []
    for k, piece in enumerate(pieces):
        if k > 0:
            parts.append({"type": "image", "image": None})
            piece = piece.lstrip()
        if k < len(pieces) - 1:
            piece = piece.rstrip()
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _place_row_images(messages: list[dict], key: str, paths: list[str]) -> list[dict]:
    """Messages whose slots (`<image>` in user text, path-less image parts) hold `paths`, in order."""
    out = []
    for m in messages:
        content = m["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if m["role"] == "user":
            parts = [q for p in parts for q in (
                _split_placeholders(p["text"]) if p["type"] == "text" and IMAGE_PLACEHOLDER in p["text"] else [p])]
        out.append({**m, "content": parts})  # tool_calls, name, tool_call_id stay
    slots = [p for m in out for p in m["content"] if p["type"] == "image" and p["image"] is None]
    given = [p["image"] for m in out for p in m["content"] if p["type"] == "image" and p["image"] is not None]
    if slots:
        if len(slots) != len(paths):
            raise DataError(f"{key}: {len(paths)} image(s) listed but the turns have {len(slots)} "
                            f"{IMAGE_PLACEHOLDER} placeholder(s) or image part(s) without a path")
        for slot, path in zip(slots, paths):
            slot["image"] = path
    elif given:
        if given != paths:  # the same images listed twice (in the turns and beside them) is fine
            raise DataError(f"{key}: the turns already carry other image paths ({given}); "
                            f"use {IMAGE_PLACEHOLDER} placeholders or one of the two")
    elif paths:
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            raise DataError(f"{key}: {len(paths)} image(s) but no user turn to attach them to")
        first["content"] = [{"type": "image", "image": p} for p in paths] + first["content"]
    return [{**m, "content": _collapse(m["content"])} for m in out]


def _collapse(parts: list[dict]) -> str | list[dict]:
    """Text-only parts back to one string (as `_content` does); parts with an image stay a list."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _row_id(data: dict, messages: list[dict] | str) -> str:
    for key in ("id", "uuid", "conversation_id"):  # the last: LMSYS-Chat-1M's
        value = data.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) != "":
            return str(value)
    return "sha-" + fingerprint(messages)
