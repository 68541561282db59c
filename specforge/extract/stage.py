"""Extract stage: run_dir/data/{split}.jsonl -> run_dir/extract/{split}/ (hidden-state stores).

Backends (`extract.backend`): `embedded` runs the target through transformers in this process
(embedded.py, vl.py); `server` asks two running servers that speak SGLang's /generate, and
`sglang` launches those two SGLang servers itself (server_backend.py). All write the same store.

Resumable: each split's store records what produced it (target fingerprint, aux ids, dtypes, a
fingerprint of the input JSONL). A re-run with the same inputs keeps the finished shards and only
extracts the rest; a re-run with different inputs (the pipeline re-runs this stage whenever the
target, the extract config or the data changed) deletes the old store and starts fresh.

Several processes (torchrun / srun, docs/multinode.md): the plan of one process (samples longest
first, cut into chunks of `extract.shard_samples`, one shard each) is dealt round-robin, chunk c to
rank c % world_size. Each rank writes its chunks as a store of its own in `<split>/rank<r>of<W>/`
(resumable as above), and rank 0 then lists every rank's shards, in chunk order, in the split's
`manifest.json`. Each chunk is computed with exactly the forwards one process would run, so the
merged store holds the same samples, in the same order, as a one-process extraction. A rank reads
only its own store: an interrupted extraction re-run with the same number of processes resumes;
with another number it extracts everything again, and the rank stores it did not read are deleted
once the new store is complete.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from specforge import distributed as dist
from specforge.errors import InvalidInput, MissingInput
from specforge.extract.batching import Extractor, total_tokens
from specforge.extract.disk import written_bytes
from specforge.extract.embedded import EmbeddedExtractor
from specforge.extract.store import (FORMAT, MANIFEST, STORAGE_DTYPES, VERSION, HiddenStateStore,
                                     HiddenStateStoreWriter, handoff_dtype, remove_store, shard_damage,
                                     store_layout)
from specforge.extract.write_behind import WriteBehind
from specforge.run_layout import RunLayout
from specforge.utils.io import file_fingerprint, read_json, read_jsonl, write_json

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
            raise InvalidInput(f"{where}: expected an object with id, input_ids, loss_mask")
        for key in ("id", "input_ids", "loss_mask"):
            if key not in row:
                raise InvalidInput(f"{where}: missing field {key!r}")
        sid, ids, mask = row["id"], row["input_ids"], row["loss_mask"]
        if not isinstance(sid, str) or not sid:
            raise InvalidInput(f"{where}: field 'id' must be a non-empty string, got {sid!r}")
        if sid in seen:
            raise InvalidInput(f"{where}: duplicate id {sid!r} (first at line {seen[sid]})")
        seen[sid] = lineno
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise InvalidInput(f"{where}: field 'input_ids' must be a non-empty list of ints")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise InvalidInput(f"{where}: input_ids holds token {bad}, outside the target vocab [0, {vocab_size})")
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
            raise InvalidInput(
                f"{where}: field 'loss_mask' must be a list of 0/1 as long as input_ids ({len(ids)})"
            )
        sample = {
            "id": sid,
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        }
        if "images" in row:  # vision-language rows (specforge/data/vl_render.py)
            images, grids = row["images"], row.get("image_grid_thw")
            if (not isinstance(images, list) or not all(isinstance(p, str) for p in images)
                    or not isinstance(grids, list) or len(grids) != len(images)
                    or not all(isinstance(g, list) and len(g) == 3 for g in grids)):
                raise InvalidInput(f"{where}: 'images' must be a list of paths with one [t, h, w] per path "
                                   "in 'image_grid_thw'")
            sample.update(images=images, image_grid_thw=grids)
        rows.append(sample)
    return rows


def split_rows(path: Path, split: str, vocab_size: int | None) -> list[dict]:
    """A split's rows (load_rows); a train split without any is refused."""
    rows = load_rows(path, vocab_size=vocab_size)
    if not rows and split == "train":
        raise InvalidInput(f"{path}: no rows; nothing to train on")
    return rows


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from specforge.utils.progress import progress_bar

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tokens  {task.fields[rate]:>7.0f} tok/s"), TimeElapsedColumn())
    return progress_bar(columns=columns, console=Console(stderr=True))


def extract_split(extractor: Extractor, rows: list[dict], out_dir: Path, meta: dict,
                  shard_samples: int, progress=None, label: str | None = None) -> dict:
    """Extract the rows not yet in the store at `out_dir`; returns the split's summary."""
    label = label or out_dir.name
    writer = HiddenStateStoreWriter(out_dir, meta, shard_samples=shard_samples, if_mismatch="restart")
    todo = [r for r in rows if r["id"] not in writer.done_ids]
    skipped = len(rows) - len(todo)
    if skipped:
        print(f"[extract] {label}: resuming, {skipped} samples already stored", flush=True)
    stats0 = dict(extractor.stats)
    task = progress.add_task(f"extract {label}", total=total_tokens(todo), rate=0.0) if progress else None
    sink = (WriteBehind(writer, limit_tokens=extractor.batch_tokens) if extractor.writes_behind
            else contextlib.nullcontext(writer))
    with writer, sink as store_writer:
        for sample, states in extractor.run(todo, chunk=shard_samples):
            store_writer.add(sample["id"], sample["input_ids"], sample["loss_mask"], **states)
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
        "hidden_bytes_per_token": round(store.hidden_bytes_per_token, 1),  # aux + last (+ fp8 scales)
        "shards": len(store.shards),
    }


# -- several processes ---------------------------------------------------------------------------

def rank_dir_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}of{world_size:05d}"


def store_order(rows: list[dict]) -> list[int]:
    """Row indices in the order a store holds them: longest first, ties by index (Extractor.batches')."""
    return sorted(range(len(rows)), key=lambda i: (-len(rows[i]["input_ids"]), i))


def chunk_plan(rows: list[dict], shard_samples: int) -> list[list[int]]:
    """Row indices in store order, cut into chunks of `shard_samples`: exactly the order and chunks
    of Extractor.run(rows, chunk=shard_samples) in one process."""
    order = store_order(rows)
    return [order[c : c + shard_samples] for c in range(0, len(order), shard_samples)]


def extract_split_sharded(extractor: Extractor, rows: list[dict], out_dir: Path, meta: dict,
                          shard_samples: int, progress=None) -> dict:
    """This rank's chunks into its own store, then (rank 0) one manifest over every rank's shards.
    A collective: every rank calls it; every rank returns the split's summary."""
    env = dist.current()
    chunks = chunk_plan(rows, shard_samples)
    mine = [rows[i] for c in range(env.rank, len(chunks), env.world_size) for i in chunks[c]]
    part_meta = dict(meta, rank=env.rank, world_size=env.world_size, shard_samples=shard_samples)
    part = extract_split(extractor, mine, out_dir / rank_dir_name(env.rank, env.world_size), part_meta,
                         shard_samples, progress, label=f"{out_dir.name} (rank {env.rank} of {env.world_size})")
    parts = dist.gather_objects(part)  # also waits until every rank's store is complete
    summary = None
    if env.is_main:
        merge_rank_stores(out_dir, meta, len(chunks), env.world_size, shard_samples)
        store = HiddenStateStore(out_dir)
        tokens = sum(p["extracted_tokens"] for p in parts)
        padded = sum(p["extracted_tokens"] / p["padding_efficiency"] for p in parts if p["padding_efficiency"])
        seconds = max(p["seconds"] for p in parts)
        summary = {
            "samples": len(store),
            "tokens": store.num_tokens,
            "extracted_samples": sum(p["extracted_samples"] for p in parts),
            "extracted_tokens": tokens,
            "resumed_samples": sum(p["resumed_samples"] for p in parts),
            "seconds": seconds,  # the slowest rank
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,  # all ranks together
            "padding_efficiency": round(tokens / padded, 4) if padded else None,
            "bytes_per_token": round(store.bytes_per_token, 1),
        "hidden_bytes_per_token": round(store.hidden_bytes_per_token, 1),  # aux + last (+ fp8 scales)
            "shards": len(store.shards),
            "world_size": env.world_size,
        }
    return dist.broadcast_object(summary)


def merge_rank_stores(out_dir: Path, meta: dict, num_chunks: int, world_size: int, shard_samples: int) -> None:
    """Write `out_dir/manifest.json` listing the shards of every rank's store in chunk order (chunk c
    is shard c // world_size of rank c % world_size), then remove what an earlier extraction left."""
    parts = []
    for r in range(world_size):
        d = out_dir / rank_dir_name(r, world_size)
        manifest = read_json(d / MANIFEST)
        want = dict(meta, rank=r, world_size=world_size, shard_samples=shard_samples)
        if not manifest.get("complete") or manifest["meta"] != json.loads(json.dumps(want, sort_keys=True, default=str)):
            raise RuntimeError(f"{d}: the store of rank {r} is incomplete or from other inputs; run the extract stage again")
        expected = len(range(r, num_chunks, world_size))
        if len(manifest["shards"]) != expected:
            raise RuntimeError(f"{d}: {len(manifest['shards'])} shards, expected {expected} (one per chunk of "
                               f"{shard_samples} samples); delete {out_dir} and extract again")
        parts.append(manifest)
    shards = []
    for c in range(num_chunks):
        r = c % world_size
        entry = dict(parts[r]["shards"][c // world_size])
        entry["name"] = f"{rank_dir_name(r, world_size)}/{entry['name']}"
        shards.append(entry)
    write_json(out_dir / MANIFEST, {
        "format": FORMAT, "version": VERSION, "meta": json.loads(json.dumps(meta, sort_keys=True, default=str)),
        "complete": True, "samples": sum(s["samples"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards), "shards": shards,
    })
    remove_unlisted(out_dir)


def remove_unlisted(out_dir: Path) -> None:
    """Delete shard files and rank stores of `out_dir` that its manifest does not list (left by an
    extraction with another number of processes)."""
    listed = {s["name"] for s in read_json(out_dir / MANIFEST)["shards"]}
    keep_dirs = {name.split("/", 1)[0] for name in listed if "/" in name}
    for p in out_dir.iterdir():
        if p.is_dir() and p.name.startswith("rank") and p.name not in keep_dirs:
            shutil.rmtree(p)
        elif p.is_file() and p.name.startswith("shard_") and p.name not in listed:
            p.unlink()


def extract_splits(cfg, run_dir: Path, splits: dict, rows_by_split: dict, extractor: Extractor, base_meta: dict,
                   env) -> dict:
    """Each split's rows (`rows_by_split`, read from the files `splits` names) into
    run_dir/extract/<split>; returns the per-split summaries."""
    layout = RunLayout(run_dir)
    summaries = {}
    with _progress() if env.is_main else contextlib.nullcontext() as progress:
        for split, path in splits.items():
            rows = rows_by_split[split]
            out_dir = layout.store(split)
            if not rows:
                continue
            meta = dict(base_meta, split=split, source=file_fingerprint(path))
            if env.distributed:
                summaries[split] = extract_split_sharded(extractor, rows, out_dir, meta, cfg.extract.shard_samples,
                                                         progress)
            else:
                summaries[split] = extract_split(extractor, rows, out_dir, meta, cfg.extract.shard_samples, progress)
                remove_unlisted(out_dir)
    for split in SPLITS:  # a stale store from earlier data must not be read as this run's
        if split not in summaries and env.is_main:
            remove_store(layout.store(split))
    return summaries


BACKENDS = ("embedded", "server", "sglang", "online")


def check(cfg) -> None:
    """The pipeline's check before its first stage: a backend that cannot run here must not cost a
    data stage (and its regeneration) first."""
    from specforge.targets.loader import aux_layer_ids, local_target_config
    from specforge.targets.vl import is_vl

    backend = cfg.extract.backend
    if backend not in BACKENDS:
        raise InvalidInput(f"extract.backend={backend!r}: unknown backend; known: {', '.join(BACKENDS)}")
    if cfg.extract.dtype not in STORAGE_DTYPES:
        raise InvalidInput(f"extract.dtype: {cfg.extract.dtype!r} is not one of {list(STORAGE_DTYPES)}")
    if backend in ("server", "sglang") and is_vl(cfg.target.kind):
        raise InvalidInput(f"extract.backend={backend}: vision-language targets need the M-RoPE positions and "
                           "the merged image embeddings, which SGLang's hidden states do not carry; use "
                           "extract.backend=embedded")
    if backend == "server" and not (cfg.extract.aux_url and cfg.extract.final_url):
        raise InvalidInput("extract.backend=server needs extract.aux_url (a server capturing the aux layers) "
                           "and extract.final_url (a server returning final hidden states)")
    if backend == "server":
        from specforge.launch.process import check_urls

        check_urls({f"extract.{name}": getattr(cfg.extract, name) for name in ("aux_url", "final_url")})
    if backend == "sglang":
        from specforge.launch.sglang_commands import check_aux_support

        check_aux_support(cfg.extract.sglang_version)  # installed (or named), and returns aux hidden states
    if (target_config := local_target_config(cfg.target)) is not None:
        aux_layer_ids(cfg.target, target_config)


def config_meta(cfg) -> tuple[dict, object]:
    """(store_meta, the target's transformers config), from its config alone: no weights loaded."""
    from transformers import AutoConfig

    from specforge.targets.loader import resolve_target_path

    target_path = resolve_target_path(cfg.target)
    model_config = AutoConfig.from_pretrained(target_path, trust_remote_code=cfg.target.trust_remote_code)
    return store_meta(cfg, model_config, target_path), model_config


def preflight(cfg, run_dir) -> str | None:
    """check_only=true, with the data stage's samples final: the disk check on them (its line, or
    refused), where the target's config is here already (nothing is fetched). None: nothing to say."""
    from specforge.targets.loader import local_target_config

    layout = RunLayout(Path(run_dir))
    splits = sample_files(layout)
    if cfg.extract.backend == "online" or not cfg.extract.disk_check or "train" not in splits \
            or local_target_config(cfg.target) is None:
        return None
    meta, model_config = config_meta(cfg)
    return disk_check(cfg, layout, read_rows(splits, meta), meta, model_config)


def sample_files(layout: RunLayout) -> dict[str, Path]:
    """{split: the data stage's samples file}, for the splits that have one."""
    return {split: layout.samples(split) for split in SPLITS if layout.samples(split).exists()}


def read_rows(splits: dict[str, Path], meta: dict) -> dict[str, list[dict]]:
    """Every split's rows, checked against the target's vocab (split_rows)."""
    return {split: split_rows(path, split, meta["vocab_size"]) for split, path in splits.items()}


def disk_check(cfg, layout: RunLayout, rows: dict, meta: dict, model_config) -> str:
    """specforge/extract/disk.py's check of the stores `rows` make, before the target runs."""
    from specforge.extract.disk import check_disk_space, free_bytes, store_bytes
    from specforge.targets.vl import is_vl, vl_info

    image_token_id = vl_info(model_config).image_token_id if is_vl(cfg.target.kind) else None
    every = [row for split in rows.values() for row in split]

    def needed(dtype: str) -> int:
        return store_bytes(every, meta["hidden_size"], len(meta["aux_layer_ids"]), dtype, image_token_id)

    return check_disk_space(needed(cfg.extract.dtype), resumed_bytes(layout, dist.current().world_size),
                            free_bytes(layout.extract_dir), layout.extract_dir, total_tokens(every),
                            cfg.extract.dtype, needed("fp8"))


def resumed_bytes(layout: RunLayout, world_size: int) -> int:
    """What an extraction with `world_size` processes resumes from, or deletes as it opens it: each
    split's own store (one process) or its rank<r>of<W> stores. Those of another number of processes
    are neither reused nor deleted before the merge (remove_unlisted): they still take their room."""
    stores = [layout.store(s) for s in SPLITS]
    if world_size > 1:
        stores = [d / rank_dir_name(r, world_size) for d in stores for r in range(world_size)]
    return written_bytes(stores, nested=False)


def store_meta(cfg, model_config, target_path: Path) -> dict:
    """What produced a store's states (or, online, the states training computes): a store from
    another target, aux layers, dtype or backend is extracted again rather than resumed."""
    from specforge.targets.loader import aux_layer_ids, target_fingerprint, text_config

    tcfg = text_config(model_config)
    return {
        "backend": cfg.extract.backend,
        "target_fingerprint": target_fingerprint(target_path),
        "model_type": tcfg.model_type,
        "aux_layer_ids": aux_layer_ids(cfg.target, model_config),
        "hidden_size": tcfg.hidden_size,
        "num_layers": tcfg.num_hidden_layers,
        "vocab_size": tcfg.vocab_size,
        "target_dtype": cfg.target.dtype,
        **store_layout(cfg.extract.dtype),  # a dtype switch extracts again, never mixes dtypes in a store
    }


@contextlib.contextmanager
def open_backend(cfg, run_dir: Path, env, meta: dict, model_config):
    """(extractor, store meta) for `extract.backend`; servers a backend starts are stopped when
    the block ends. `meta`, `model_config`: config_meta's. The meta names what produced the
    states: a store from another target, aux layers, dtype or backend is extracted again rather
    than resumed."""
    from specforge.targets.loader import load_target, resolve_target_path, text_config, torch_dtype
    from specforge.targets.vl import is_vl

    backend = cfg.extract.backend
    storage = handoff_dtype(cfg.extract.dtype, torch_dtype(cfg.target.dtype))  # fp8: the writer quantises
    target_path = resolve_target_path(cfg.target)
    meta = dict(meta)
    if backend == "embedded":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
        model = load_target(cfg.target, device=str(env.device))
        # what it computes in (float32 for bf16 on a CPU without native bf16): no rounding on the way
        storage = handoff_dtype(cfg.extract.dtype, model.dtype)
    # else the weights live in the servers: the config is enough here
    aux, tcfg = meta["aux_layer_ids"], text_config(model_config)
    if backend == "embedded":
        if is_vl(cfg.target.kind):
            from specforge.extract.vl import VLExtractor
            from specforge.targets.vl import load_image_processor, vl_info

            info = vl_info(model_config)
            processor = load_image_processor(target_path, cfg.data.image_min_pixels, cfg.data.image_max_pixels)
            meta.update(vl=True, image_token_id=info.image_token_id, image_min_pixels=cfg.data.image_min_pixels,
                        image_max_pixels=cfg.data.image_max_pixels)
            yield VLExtractor(model, aux, cfg.extract.batch_tokens, storage, processor, info), meta
        else:
            yield EmbeddedExtractor(model, aux, batch_tokens=cfg.extract.batch_tokens, storage_dtype=storage), meta
        return

    from specforge.extract.server_backend import open_server_extractor

    log_dir = RunLayout(run_dir).extract_logs(rank_dir_name(env.rank, env.world_size))
    with open_server_extractor(cfg, target_path, aux, tcfg, storage, log_dir, env) as extractor:
        yield extractor, meta


def run(cfg, run_dir, fingerprint: str | None = None) -> dict:
    """Extract every split that has rows; returns totals and per-split summaries."""
    t0 = time.time()
    check(cfg)

    run_dir = Path(run_dir)
    layout = RunLayout(run_dir)
    splits = sample_files(layout)
    if "train" not in splits:
        raise MissingInput(f"{layout.samples('train')}: not found; run the data stage first")

    env = dist.current()  # several processes: each extracts its share (extract_split_sharded)
    meta, model_config = config_meta(cfg)
    rows = read_rows(splits, meta)
    if cfg.extract.backend == "online":
        return check_online(run_dir, rows, meta, env)
    if cfg.extract.disk_check:  # every rank: each refuses alike on a shared filesystem, or checks its own
        line = disk_check(cfg, layout, rows, meta, model_config)
        if env.is_main:
            print(f"[extract] {line}", flush=True)
    with open_backend(cfg, run_dir, env, meta, model_config) as (extractor, base_meta):
        summaries = extract_splits(cfg, run_dir, splits, rows, extractor, base_meta, env)

    extracted = sum(s["extracted_tokens"] for s in summaries.values())
    fwd = sum(s["seconds"] for s in summaries.values())
    tokens = sum(s["tokens"] for s in summaries.values())
    nbytes = sum(s["bytes_per_token"] * s["tokens"] for s in summaries.values())
    summary = {
        "splits": summaries,
        "backend": cfg.extract.backend,
        "aux_layer_ids": base_meta["aux_layer_ids"],
        "tokens": tokens,
        "extracted_tokens": extracted,
        "forward_seconds": round(fwd, 3),
        "tokens_per_s": round(extracted / fwd, 1) if fwd else None,
        "bytes_per_token": round(nbytes / tokens, 1) if tokens else None,
        "shards": sum(s["shards"] for s in summaries.values()),
        "seconds": round(time.time() - t0, 2),
    }
    for split, s in summaries.items() if env.is_main else ():
        rate = f"{s['tokens_per_s']} tok/s" if s["tokens_per_s"] else "all from an earlier run"
        print(
            f"[extract] {split}: {s['samples']} samples, {s['tokens']} tokens in {s['shards']} shards, "
            f"{rate}, {s['bytes_per_token']} B/token ({s['hidden_bytes_per_token']} of hidden states)",
            flush=True,
        )
    return summary


def damaged(cfg, run_dir, summary: dict) -> str | None:
    """A finished extraction's stores that are gone or broken (a shard deleted or cut by hand):
    the pipeline extracts again instead of handing training a store it cannot read."""
    if cfg.extract.backend == "online":
        return None
    layout = RunLayout(run_dir)
    for split in summary.get("splits", {}):
        manifest = layout.store(split) / MANIFEST
        if not manifest.is_file():
            return f"its store {layout.store(split)} is gone"
        try:
            problem = shard_damage(manifest.parent, read_json(manifest)["shards"])
        except (ValueError, KeyError) as e:
            problem = f"its manifest cannot be read ({e})"
        if problem:
            return f"in its store {layout.store(split)}, {problem}"
    return None


def check_online(run_dir: Path, rows: dict, meta: dict, env) -> dict:
    """extract=online stores nothing (the train stage computes the states: specforge/extract/online.py);
    this stage still reads every row against the target's vocab (`rows`, read so), so bad data is
    refused before training loads anything. A store an earlier extraction wrote is left as it is
    (hours of target forwards; switching back resumes it), unread, and said so."""
    counts = {split: {"samples": len(r), "tokens": total_tokens(r)} for split, r in rows.items()}
    kept = written_bytes([RunLayout(run_dir).store(split) for split in SPLITS])
    if kept and env.is_main:
        print(f"[extract] online: the store in {RunLayout(run_dir).extract_dir} ({kept / 1e9:.2f} GB) from an earlier "
              "extraction is kept but not read; delete it to free the space", flush=True)
    return {"backend": "online", "aux_layer_ids": meta["aux_layer_ids"], "splits": counts,
            "tokens": sum(c["tokens"] for c in counts.values()), "stored_bytes": 0}
