"""Extract stage: run_dir/data/{split}.jsonl -> run_dir/extract/{split}/ (hidden-state stores).

Resumable: each split's store records what produced it (target fingerprint, aux ids, dtypes, a
fingerprint of the input JSONL). A re-run with the same inputs keeps the finished shards and only
extracts the rest; a re-run with different inputs (the pipeline re-runs this stage whenever the
target, the extract config or the data changed) deletes the old store and starts fresh.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from specforge.extract.embedded import EmbeddedExtractor, total_tokens
from specforge.extract.store import STORAGE_DTYPES, HiddenStateStore, HiddenStateStoreWriter, remove_store
from specforge.utils.io import file_fingerprint, read_jsonl

SPLITS = ("train", "eval")


def extra_inputs(cfg) -> dict:
    """The target directory's identity (config, tokenizer, weight sizes), when it exists already:
    a target rebuilt in place at the same path must invalidate the stored states."""
    from specforge.targets.loader import target_fingerprint

    path = Path(cfg.target.path)
    return {"target": target_fingerprint(path) if (path / "config.json").is_file() else None}


def load_rows(path: Path, vocab_size: int | None = None) -> list[dict]:
    """The rows of a data-stage JSONL, validated; errors name the file and line.

    Token ids and masks are kept as int32 / uint8 tensors: Python int lists would cost ~7x the
    memory for a 500K-sample split."""
    rows, seen = [], {}
    for lineno, row in enumerate(read_jsonl(path), 1):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with id, input_ids, loss_mask")
        for key in ("id", "input_ids", "loss_mask"):
            if key not in row:
                raise ValueError(f"{where}: missing field {key!r}")
        sid, ids, mask = row["id"], row["input_ids"], row["loss_mask"]
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"{where}: field 'id' must be a non-empty string, got {sid!r}")
        if sid in seen:
            raise ValueError(f"{where}: duplicate id {sid!r} (first at line {seen[sid]})")
        seen[sid] = lineno
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise ValueError(f"{where}: field 'input_ids' must be a non-empty list of ints")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise ValueError(f"{where}: input_ids holds token {bad}, outside the target vocab [0, {vocab_size})")
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
            raise ValueError(
                f"{where}: field 'loss_mask' must be a list of 0/1 as long as input_ids ({len(ids)})"
            )
        rows.append({
            "id": sid,
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        })
    return rows


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[extract] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens  {task.fields[rate]:>7.0f} tok/s"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def extract_split(extractor: EmbeddedExtractor, rows: list[dict], out_dir: Path, meta: dict,
                  shard_samples: int, progress=None) -> dict:
    """Extract the rows not yet in the store at `out_dir`; returns the split's summary."""
    writer = HiddenStateStoreWriter(out_dir, meta, shard_samples=shard_samples, if_mismatch="restart")
    todo = [r for r in rows if r["id"] not in writer.done_ids]
    skipped = len(rows) - len(todo)
    if skipped:
        print(f"[extract] {out_dir.name}: resuming, {skipped} samples already stored", flush=True)
    stats0 = dict(extractor.stats)
    task = progress.add_task(out_dir.name, total=total_tokens(todo), rate=0.0) if progress else None
    with writer:
        for sample, aux, last in extractor.run(todo, chunk=shard_samples):
            writer.add(sample["id"], sample["input_ids"], sample["loss_mask"], aux, last)
            if progress is not None:
                done = extractor.stats["tokens"] - stats0["tokens"]
                secs = extractor.stats["seconds"] - stats0["seconds"]
                progress.update(task, completed=done, rate=done / secs if secs else 0.0)
    store = HiddenStateStore(out_dir)
    tokens = extractor.stats["tokens"] - stats0["tokens"]
    seconds = extractor.stats["seconds"] - stats0["seconds"]
    padded = extractor.stats["padded_tokens"] - stats0["padded_tokens"]
    return {
        "samples": len(store),
        "tokens": store.num_tokens,
        "extracted_samples": len(todo),
        "extracted_tokens": tokens,
        "resumed_samples": skipped,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "padding_efficiency": round(tokens / padded, 4) if padded else None,
        "bytes_per_token": round(store.bytes_per_token, 1),
        "shards": len(store.shards),
    }


def run(cfg, run_dir) -> dict:
    """Extract every split that has rows; returns totals and per-split summaries."""
    t0 = time.time()
    if cfg.extract.backend == "sglang":
        raise NotImplementedError(
            "extract.backend=sglang: sglang backend: not available in this build; use extract.backend=embedded"
        )
    if cfg.extract.backend != "embedded":
        raise ValueError(f"extract.backend={cfg.extract.backend!r}: unknown backend; known: embedded, sglang")
    if cfg.target.kind != "causal_lm":
        raise ValueError(
            f"target.kind={cfg.target.kind!r}: the embedded extractor handles text causal LMs only "
            "(vision-language targets need image inputs the data rows do not carry)"
        )
    if cfg.extract.dtype not in STORAGE_DTYPES:
        raise ValueError(f"extract.dtype: {cfg.extract.dtype!r} is not one of {list(STORAGE_DTYPES)}")
    from specforge.targets.loader import aux_layer_ids, load_target, resolve_target_path, target_fingerprint, text_config

    run_dir = Path(run_dir)
    data_dir = run_dir / "data"
    splits = {}
    for split in SPLITS:
        path = data_dir / f"{split}.jsonl"
        if not path.exists():
            if split == "train":
                raise FileNotFoundError(f"{path}: not found; run the data stage first")
            continue
        splits[split] = path

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_path = resolve_target_path(cfg.target)
    model = load_target(cfg.target, device=device)
    tcfg = text_config(model.config)
    aux = aux_layer_ids(cfg.target, model.config)
    extractor = EmbeddedExtractor(
        model, aux, batch_tokens=cfg.extract.batch_tokens, storage_dtype=STORAGE_DTYPES[cfg.extract.dtype]
    )
    base_meta = {
        "target_fingerprint": target_fingerprint(target_path),
        "model_type": tcfg.model_type,
        "aux_layer_ids": aux,
        "hidden_size": tcfg.hidden_size,
        "num_layers": tcfg.num_hidden_layers,
        "vocab_size": tcfg.vocab_size,
        "target_dtype": cfg.target.dtype,
        "storage_dtype": cfg.extract.dtype,
    }

    summaries = {}
    with _progress() as progress:
        for split, path in splits.items():
            rows = load_rows(path, vocab_size=tcfg.vocab_size)
            out_dir = run_dir / "extract" / split
            if not rows:
                if split == "train":
                    raise ValueError(f"{path}: no rows; nothing to train on")
                continue
            meta = dict(base_meta, split=split, source=file_fingerprint(path))
            summaries[split] = extract_split(extractor, rows, out_dir, meta, cfg.extract.shard_samples, progress)
    for split in SPLITS:  # a stale store from earlier data must not be read as this run's
        if split not in summaries:
            remove_store(run_dir / "extract" / split)

    extracted = sum(s["extracted_tokens"] for s in summaries.values())
    fwd = sum(s["seconds"] for s in summaries.values())
    tokens = sum(s["tokens"] for s in summaries.values())
    nbytes = sum(s["bytes_per_token"] * s["tokens"] for s in summaries.values())
    summary = {
        "splits": summaries,
        "aux_layer_ids": aux,
        "tokens": tokens,
        "extracted_tokens": extracted,
        "forward_seconds": round(fwd, 3),
        "tokens_per_s": round(extracted / fwd, 1) if fwd else None,
        "bytes_per_token": round(nbytes / tokens, 1) if tokens else None,
        "shards": sum(s["shards"] for s in summaries.values()),
        "seconds": round(time.time() - t0, 2),
    }
    for split, s in summaries.items():
        print(
            f"[extract] {split}: {s['samples']} samples, {s['tokens']} tokens in {s['shards']} shards, "
            f"{s['tokens_per_s']} tok/s, {s['bytes_per_token']} B/token",
            flush=True,
        )
    return summary
