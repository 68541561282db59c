"""data.num_proc >= 1: the data stage's per-row work in `datasets.Dataset.map` worker processes.

Workers run only per-row steps, through the functions the in-process loop calls
(`parse_raw_text`, `normalise_row`, `render_conversation`, `conversation_key`), so both paths give the same
samples, reasons and counts. What needs the whole split stays in this process, in input order:
duplicates (`check_duplicate`: the first kept occurrence wins, as in `fix_dataset`),
max_samples and regeneration (which then comes before rendering: a second map).

Rows go into Arrow as JSON strings (`raw`, or its read `error`, + `file` + `line`), never as
nested columns, so heterogeneous rows cannot break schema inference; workers send conversations
back as JSON too, and token ids as int lists. Everything lives under `cache_dir/datasets/`: the input rows
(`rows-<hash>.arrow`) and each map's output, named by a fingerprint of the rows, the config, the
tokenizer and this code, so a re-run (with any num_proc) loads the output instead of recomputing.
Image files are not part of that fingerprint; an output naming embedded images that have gone (the
run directory deleted) is computed again. Nothing else there is deleted: clear it by hand.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path

from specforge.data.fix import Quarantine, check_config, check_duplicate, quarantine_entry
from specforge.data.fix.conversations import ImageChecker, ImageLoading, conversation_key
from specforge.data.formats import parse_raw_text, read_raw_texts, turns_entry
from specforge.data.rows import RowRender, normalise_row, render_conversation
from specforge.utils.io import durable_replace, file_fingerprint, fingerprint

MAP_BATCH = 64  # rows per call of the map function (a row costs ~1-3 ms of chat template)
READ_BATCH = 4096  # rows per Arrow batch written and read back in this process
# The per-row code: a change to it must not load stale results from the cache.
CODE = [Path(__file__).parent / n for n in ("formats.py", "sources.py", "rows.py", "template.py", "vl_render.py",
                                            "parallel.py", "fix/__init__.py", "fix/conversations.py", "fix/toon.py")]
CODE += [Path(__file__).parents[1] / "targets" / "vl.py", Path(__file__).parents[1] / "utils" / "images.py",
         Path(__file__).parents[1] / "utils" / "io.py"]  # which images pass and their copies; ids of rows without


def normalise_split(cfg, files: list[str], max_chars: int, tokenizer=None, vl=None, embedded_dir: Path | None = None,
                    _again: bool = False) -> tuple[int, list[dict], list[dict], list | None]:
    """(input rows, conversations, quarantine entries, renders) of `files`: the conversations
    and quarantine of the loop's read + fix step; with a `tokenizer`, also each conversation's
    RowRender from the same pass (else None: render with `render_split` later). `embedded_dir`:
    where the workers write images embedded as data URIs (ImageChecker)."""
    fix_cfg = _plain_config(cfg.data.fix)
    if fix_cfg.enabled:
        check_config(fix_cfg)
    cache = Path(cfg.cache_dir) / "datasets"
    rows, rows_key = _rows_dataset(files, cache)
    render = (_Render(tokenizer, vl, cfg.data.max_length, cfg.data.overlength, cfg.data.special_token_text)
              if tokenizer is not None else None)
    step = _Normalise(fix_cfg, cfg.data.format, cfg.data.image_root, max_chars, render, embedded_dir,
                      ImageLoading.of(cfg.data))
    if len(rows) == 0:
        return 0, [], [], [] if render else None
    key = fingerprint(rows_key, step.key(), _code_key())
    out = _map(rows, step, step.features(), cache / f"fix-{key}.arrow", key, cfg.data.num_proc)

    first_seen: dict[str, str] = {}
    convs, quarantine, renders = [], [], []
    with _no_gc():
        for i, rec in enumerate(_records(out)):
            reason = json.loads(rec["reason"]) if rec["reason"] is not None else None
            if reason is None and rec["key"] is not None:
                try:
                    check_duplicate(rec["key"], f"{rec['file']}:{rec['line']}", first_seen)
                except Quarantine as q:
                    reason = q.reason
            if reason is not None:
                row = rows[i]
                raw = parse_raw_text(row["file"], row["line"], row["raw"], row["error"])
                quarantine.append(quarantine_entry(raw, reason))
                continue
            conv = json.loads(rec["conv"])
            convs.append({**turns_entry(conv), "fixes": rec["fixes"], "kept_as_written": conv["kept_as_written"],
                          "file": rec["file"], "line": rec["line"]})
            if render:
                renders.append(_row_render(rec))
    if embedded_dir is not None and _lost_images(convs, embedded_dir):  # loaded from the cache, the run deleted since
        if _again:
            raise RuntimeError(f"data.num_proc: the workers wrote images into {embedded_dir} that are not there")
        for stale in cache.glob(f"fix-{key}*"):
            stale.unlink()
        return normalise_split(cfg, files, max_chars, tokenizer, vl, embedded_dir, _again=True)  # written again
    return len(rows), convs, quarantine, renders if render else None


def _lost_images(convs: list[dict], folder: Path) -> bool:
    """Whether conversations name an embedded image (ImageChecker) no longer in `folder`: a cached
    map's output names the files its workers wrote, which went with the run directory."""
    inside = str(Path(folder).resolve()) + os.sep
    return any(p["image"].startswith(inside) and not os.path.exists(p["image"])
               for c in convs for m in c.get("messages", ()) if isinstance(m["content"], list)
               for p in m["content"] if p.get("type") == "image")


def render_split(cfg, convs: list[dict], tokenizer, vl=None) -> list[RowRender]:
    """One RowRender per conversation (after max_samples / regeneration), rendered by workers."""
    if not convs:
        return []
    import pyarrow as pa

    cache = Path(cfg.cache_dir) / "datasets"
    rendered = pa.array([json.dumps(turns_entry(c)) for c in convs], pa.large_string())
    batch = pa.record_batch([rendered], names=["conv"])
    rows, rows_key = _write_rows(cache, [batch])
    step = _Render(tokenizer, vl, cfg.data.max_length, cfg.data.overlength, cfg.data.special_token_text)
    key = fingerprint(rows_key, step.key(), _code_key())
    out = _map(rows, step, step.features(), cache / f"render-{key}.arrow", key, cfg.data.num_proc)
    with _no_gc():
        return [_row_render(rec) for rec in _records(out)]


class _Render:
    """The map function of the render step (and the render half of a fused _Normalise)."""

    def __init__(self, tokenizer, vl, max_length: int, overlength: str, special_token_text: str) -> None:
        self.tokenizer, self.vl, self.max_length, self.overlength = tokenizer, vl, max_length, overlength
        self.special_token_text = special_token_text

    def key(self) -> dict:
        vl = None if self.vl is None else (self.vl[0].to_dict(), repr(self.vl[1]))
        return {"tokenizer": _tokenizer_key(self.tokenizer), "vl": vl, "max_length": self.max_length,
                "overlength": self.overlength, "special_token_text": self.special_token_text}

    @staticmethod
    def features() -> dict:
        from datasets import List, Value

        return {"ids": List(Value("int32")), "mask": List(Value("int8")), "truncated": Value("bool"),
                "rreason": Value("string"), "images": Value("string")}

    def columns(self, convs: list[dict | None]) -> dict[str, list]:
        """Output columns for these conversations (formats.turns_entry; None: quarantined before rendering)."""
        out: dict[str, list] = {k: [] for k in ("ids", "mask", "truncated", "rreason", "images")}
        for c in convs:
            r = RowRender() if c is None else render_conversation(self.tokenizer, c, self.max_length, self.overlength,
                                                                  self.vl, self.special_token_text)
            out["ids"].append(r.input_ids)
            out["mask"].append(r.loss_mask)
            out["truncated"].append(r.truncated)
            out["rreason"].append(None if r.reason is None else json.dumps(r.reason))
            out["images"].append(json.dumps(r.images) if r.images else None)
        return out

    def __call__(self, batch: dict) -> dict:
        return self.columns([json.loads(c) for c in batch["conv"]])


class _Normalise:
    """The map function of the fix step: parse, normalise_row, dedupe key (+ render when fused)."""

    def __init__(self, fix_cfg, fmt: str, image_root: str | None, max_chars: int, render: _Render | None,
                 embedded_dir: Path | None = None, loading: ImageLoading = ImageLoading()) -> None:
        self.fix, self.fmt, self.image_root, self.max_chars, self.render = fix_cfg, fmt, image_root, max_chars, render
        self.embedded_dir, self.loading = embedded_dir, loading
        self.images = ImageChecker(image_root, embedded_dir, loading)
        self.dedupe = fix_cfg.enabled and fix_cfg.dedupe

    def key(self) -> dict:
        # the embedded images' folder: the conversations name files there
        embedded = str(Path(self.embedded_dir).resolve()) if self.embedded_dir else None
        return {"fix": asdict(self.fix), "format": self.fmt, "image_root": self.image_root, "cwd": os.getcwd(),
                "max_chars": self.max_chars, "render": self.render.key() if self.render else None,
                "embedded_dir": embedded, "loading": asdict(self.loading)}

    def features(self):
        from datasets import Features, List, Value

        cols = {"file": Value("string"), "line": Value("int64"), "conv": Value("large_string"),
                "fixes": List(Value("string")), "reason": Value("string"), "key": Value("string")}
        return Features({**cols, **(self.render.features() if self.render else {})})

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {k: [] for k in ("file", "line", "conv", "fixes", "reason", "key")}
        convs = []
        for text, error, file, line in zip(batch["raw"], batch["error"], batch["file"], batch["line"]):
            raw = parse_raw_text(file, line, text, error)
            conv, fixes, reason = None, [], None
            try:
                conv, fixes = normalise_row(raw, self.fix, self.fmt, self.images, self.max_chars)
            except Quarantine as q:
                reason = json.dumps(q.reason)  # JSON: a reason may quote any string of the row
            out["file"].append(file)
            out["line"].append(line)
            out["conv"].append(None if conv is None else json.dumps(conv))
            out["fixes"].append(fixes)
            out["reason"].append(reason)
            out["key"].append(conversation_key(conv) if conv is not None and self.dedupe else None)
            convs.append(conv)
        if self.render:
            out.update(self.render.columns(convs))
        return out


def _rows_dataset(files: list[str], cache: Path):
    """The input rows as a memory-mapped Dataset (file, line, raw, error) and its content hash."""
    import pyarrow as pa

    def batches():
        cols: dict[str, list] = {"file": [], "line": [], "raw": [], "error": []}  # read_raw_texts' order
        for f in files:
            for item in read_raw_texts(f):
                for name, value in zip(cols, item):
                    cols[name].append(value)
                if len(cols["line"]) == READ_BATCH:
                    yield _batch(cols)
        yield _batch(cols)  # the rest (maybe empty: the file needs a schema)

    def _batch(cols: dict[str, list]):
        b = pa.record_batch([pa.array(cols["file"], pa.string()), pa.array(cols["line"], pa.int64()),
                             pa.array(cols["raw"], pa.large_string()), pa.array(cols["error"], pa.string())],
                            names=list(cols))
        for v in cols.values():
            v.clear()
        return b

    return _write_rows(cache, batches())


def _write_rows(cache: Path, batches):
    """Write record batches once to cache/rows-<content hash>.arrow; (Dataset, hash)."""
    import pyarrow as pa
    from datasets import Dataset

    cache.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".rows.", suffix=".tmp", dir=cache)
    os.close(fd)
    try:
        writer = None
        for b in batches:
            if writer is None:
                writer = pa.ipc.new_stream(tmp, b.schema)
                digest.update(b.schema.serialize())  # same bytes under other columns: another file
            writer.write_batch(b)
            for col in b.columns:
                for buf in col.buffers():
                    digest.update(b"-" if buf is None else memoryview(buf))
        writer.close()
        key = digest.hexdigest()[:16]
        final = cache / f"rows-{key}.arrow"
        if not final.exists():
            durable_replace(tmp, final)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return Dataset.from_file(str(final)), key


def _map(rows, fn, features, cache_file: Path, key: str, num_proc: int):
    """rows.map(fn) in `num_proc` worker processes, loaded from `cache_file` when there."""
    from datasets import Features

    out = rows.map(fn, batched=True, batch_size=MAP_BATCH, remove_columns=rows.column_names,
                   features=Features(features), num_proc=num_proc, cache_file_name=str(cache_file),
                   new_fingerprint=key, load_from_cache_file=True, desc="data rows")
    if len(out) != len(rows):
        raise RuntimeError(f"data.num_proc: {len(rows)} rows in but {len(out)} out; every row must be accounted for")
    return out


def _records(ds):
    """The rows of a mapped Dataset as dicts, batch by batch (token ids via numpy: much faster
    than pyarrow's to_pylist for long int lists)."""
    for table in ds.with_format("arrow").iter(batch_size=READ_BATCH):
        cols = {}
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            cols[name] = _int_lists(col) if name in ("ids", "mask") else col.to_pylist()
        yield from (dict(zip(cols, values)) for values in zip(*cols.values()))


def _int_lists(col) -> list[list[int]]:
    offsets = col.offsets.to_numpy()
    values = col.flatten().to_numpy().tolist()
    starts = (offsets[:-1] - offsets[0]).tolist()
    ends = (offsets[1:] - offsets[0]).tolist()
    return [values[a:b] for a, b in zip(starts, ends)]


def _row_render(rec: dict) -> RowRender:
    reason = json.loads(rec["rreason"]) if rec["rreason"] is not None else None
    images = json.loads(rec["images"]) if rec["images"] is not None else {}
    return RowRender(rec["ids"], rec["mask"], rec["truncated"], reason, images)


@contextmanager
def _no_gc():
    """No cyclic GC while this process turns the workers' output into Python objects: they hold
    no cycles, and with a heap of 100K samples the collector's passes cost more than the rest."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plain_config(cfg):
    """A plain dataclass of an OmegaConf node: cheap attribute access in workers, and picklable."""
    if is_dataclass(cfg):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


def _tokenizer_key(tokenizer) -> str:
    """What rendering depends on: vocab, merges, added/special tokens (the fast tokenizer's JSON)
    and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        from datasets.fingerprint import Hasher

        return Hasher.hash(tokenizer)
    return fingerprint(type(tokenizer).__name__, tokenizer.chat_template, tokenizer.all_special_ids,
                       hashlib.sha256(backend.to_str().encode()).hexdigest())


def _code_key() -> str:
    return fingerprint({p.name: file_fingerprint(p) for p in CODE})
