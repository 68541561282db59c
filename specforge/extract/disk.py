"""The disk a hidden-state store needs, checked before the target runs: the store of 300M tokens of
a 4,096-wide target is ~10 TB in bf16, and an extraction that fills its disk hours in has wasted
them (it resumes, but only once space is found)."""
from __future__ import annotations

import shutil
from pathlib import Path

from specforge.errors import InvalidInput

STATE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
OFFSET_BYTES = 8  # int64 per sample and offsets tensor


def store_bytes(rows: list[dict], hidden_size: int, num_aux: int, storage_dtype: str,
                image_token_id: int | None = None) -> int:
    """What a store of `rows` will hold (specforge/extract/store.py's layout): token ids and loss
    masks, the aux and final states, offsets, and for vision-language rows M-RoPE positions and
    image embeddings. The shards' headers (a few KB each) are left out."""
    tokens = sum(len(r["input_ids"]) for r in rows)
    images = 0 if image_token_id is None else sum(int((r["input_ids"] == image_token_id).sum()) for r in rows)
    total = tokens * (4 + 1) + OFFSET_BYTES * len(rows)  # input_ids int32, loss_mask uint8, offsets
    if storage_dtype == "fp8":  # aux in e4m3 with a float32 scale per row and layer; `last` bf16 where scored
        scored = sum(int((r["loss_mask"][1:] != 0).sum()) for r in rows)
        total += tokens * num_aux * (hidden_size + 4) + scored * hidden_size * 2 + OFFSET_BYTES * len(rows)
        image_row = hidden_size + 4
    else:
        width = STATE_BYTES[storage_dtype]
        total += tokens * (num_aux + 1) * hidden_size * width
        image_row = hidden_size * width
    if image_token_id is not None:  # position_ids int32 [T, 3], image_embeds [I, H], image_offsets
        total += tokens * 3 * 4 + images * image_row + OFFSET_BYTES * len(rows)
    return total


def free_bytes(directory: Path) -> int:
    """Free space (for this user) on the filesystem `directory` is or will be on."""
    existing = Path(directory).absolute()
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def written_bytes(directories: list[Path], nested: bool = True) -> int:
    """What earlier extractions left in `directories` (with `nested`, in their sub-directories too);
    stage.resumed_bytes: those an extraction resumes from, or deletes to start afresh."""
    return sum(f.stat().st_size for d in directories if d.exists()
               for f in (d.rglob("*") if nested else d.iterdir()) if f.is_file())


def check_disk_space(needed: int, written: int, free: int, where: Path, tokens: int, dtype: str,
                     fp8_needed: int) -> str:
    """A line for the log, or InvalidInput when the stores (`needed` bytes, `written` of them on
    disk already) cannot fit in `free`, naming what stores less."""
    gb = 1e9
    line = (f"the stores take ~{needed / gb:.2f} GB ({tokens:,} tokens at extract.dtype={dtype}), "
            f"{written / gb:.2f} GB of it from an earlier run; {free / gb:.2f} GB free in {where}")
    if needed - written <= free:
        return line
    smaller = (f"extract.dtype=fp8 needs ~{fp8_needed / gb:.2f} GB; " if dtype != "fp8" else "")
    raise InvalidInput(
        f"extract: {line}. Free space or move output_dir; {smaller}extract=online stores nothing (the target "
        "runs beside the draft during training). extract.disk_check=false skips this check")
