"""The sharded hidden-state store: what the extract stage writes and the train stage reads.

Layout of a store directory (docs/design.md, "Hidden-state store"):

- `shard_00000.safetensors`, ...: the samples of a shard concatenated along tokens:
  `input_ids` int32 [T], `loss_mask` uint8 [T], `aux` [T, 3*H] (aux layers in ascending order),
  `last` [T, H] (final post-norm state), `offsets` int64 [n+1]; the sample ids are a JSON list in
  the safetensors header metadata (`ids`), so the manifest stays small for 500K-sample stores.
  Vision-language stores (meta `vl: true`) also hold `position_ids` int32 [T, 3] (the target's
  M-RoPE positions, token-major) and `image_embeds` [I, H] (the target's merged input embeddings
  at image-token positions, in sequence order) with `image_offsets` int64 [n+1].
- `manifest.json`: `meta` (what produced the states), the finished shards and `complete`.

Crash safety: a shard is written to a temp file and renamed, and only then listed in the manifest
(itself written atomically). A crash therefore loses at most the shard in progress; a shard file
that is not listed (crash between rename and manifest) is discarded on restart. Restarting with the
same meta keeps the listed shards and reports their sample ids in `done_ids` so the caller skips
them. The store supports one writer at a time.
"""
from __future__ import annotations

import json
import os
import shutil
from bisect import bisect_right
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specforge.utils.io import atomic_path, read_json, write_json

FORMAT = "specforge-hidden-states"
VERSION = 1
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class StoreMetaMismatch(ValueError):
    """An existing store was produced from different inputs than the writer was given."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def _normalise(meta: dict) -> dict:
    """JSON round trip, so tuples/lists and int/str keys compare the way they are stored."""
    return json.loads(json.dumps(meta, sort_keys=True, default=str))


class HiddenStateStoreWriter:
    """Accumulates samples and writes a shard every `shard_samples` samples.

    `meta` must hold `hidden_size` (H), `aux_layer_ids` (3 ids) and `storage_dtype` (one of
    STORAGE_DTYPES); anything else in it (target fingerprint, source data fingerprint, ...) only
    takes part in the resume check. `if_mismatch` says what to do when `out_dir` already holds a
    store with a different meta: "error" raises StoreMetaMismatch, "restart" deletes that store's
    files and starts empty.

    Use as a context manager: a clean exit calls `close()` (writes the last, partial shard and
    marks the store complete); an exception leaves the finished shards as they are for a resume.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        meta: dict[str, Any],
        shard_samples: int = 256,
        if_mismatch: str = "error",
    ):
        if shard_samples < 1:
            raise ValueError(f"extract.shard_samples: must be >= 1, got {shard_samples}")
        if if_mismatch not in ("error", "restart"):
            raise ValueError(f"if_mismatch: {if_mismatch!r} is not 'error' or 'restart'")
        for key in ("hidden_size", "aux_layer_ids", "storage_dtype"):
            if key not in meta:
                raise ValueError(f"store meta: missing required key {key!r}")
        if meta["storage_dtype"] not in STORAGE_DTYPES:
            raise ValueError(
                f"extract.dtype: {meta['storage_dtype']!r} is not a storage dtype; use one of {list(STORAGE_DTYPES)}"
            )
        self.dir = Path(out_dir)
        self.meta = _normalise(meta)
        self.shard_samples = shard_samples
        self.hidden_size = int(meta["hidden_size"])
        self.aux_width = len(meta["aux_layer_ids"]) * self.hidden_size
        self.dtype = STORAGE_DTYPES[meta["storage_dtype"]]
        self.vl = bool(meta.get("vl", False))
        self.shards: list[dict] = []
        self.done_ids: set[str] = set()
        self.resumed = False
        self._buffer: list[tuple] = []  # (id, ids, mask, aux, last, position_ids, image_embeds)
        self._closed = False
        self.dir.mkdir(parents=True, exist_ok=True)
        self._open_existing(if_mismatch)
        self._remove_strays()
        self._write_manifest(complete=self._complete_on_open)

    # -- opening / resuming -------------------------------------------------------------------

    def _open_existing(self, if_mismatch: str) -> None:
        self._complete_on_open = False
        manifest_path = self.dir / MANIFEST
        if not manifest_path.exists():
            return
        try:
            manifest = read_json(manifest_path)
            old_meta = manifest["meta"]
            shards = manifest["shards"]
        except (ValueError, KeyError) as e:
            if if_mismatch == "restart":
                self._wipe()
                return
            raise StoreMetaMismatch(f"{manifest_path}: not a readable store manifest ({e})") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION or old_meta != self.meta:
            if if_mismatch == "restart":
                self._wipe()
                return
            diff = sorted(k for k in set(old_meta) | set(self.meta) if old_meta.get(k) != self.meta.get(k))
            raise StoreMetaMismatch(
                f"{manifest_path}: existing store was written with different meta (keys {diff}); "
                f"delete {self.dir} or write with if_mismatch='restart'"
            )
        for entry in shards:
            path = self.dir / entry["name"]
            if not path.exists() or path.stat().st_size != entry["bytes"]:
                raise RuntimeError(
                    f"{manifest_path}: listed shard {entry['name']} is missing or has the wrong size; "
                    f"the store is damaged, delete {self.dir} and extract again"
                )
            self.done_ids.update(_shard_ids(path))
        self.shards = list(shards)
        self.resumed = bool(shards)
        self._complete_on_open = bool(manifest.get("complete"))

    def _own_files(self) -> list[Path]:
        """Files this writer may delete: shards, temp files of atomic writes, the manifest."""
        return [
            p
            for p in self.dir.iterdir()
            if p.is_file()
            and (
                (p.name.startswith("shard_") and p.name.endswith(".safetensors"))
                or (p.name.startswith((".shard_", f".{MANIFEST}.")) and p.name.endswith(".tmp"))
                or p.name == MANIFEST
            )
        ]

    def _wipe(self) -> None:
        for p in self._own_files():
            p.unlink()

    def _remove_strays(self) -> None:
        """Delete half-written temp files and shards that never made it into the manifest."""
        listed = {s["name"] for s in self.shards} | {MANIFEST}
        for p in self._own_files():
            if p.name not in listed:
                p.unlink()

    # -- writing ------------------------------------------------------------------------------

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor | list[int],
        loss_mask: torch.Tensor | list[int],
        aux: torch.Tensor,
        last: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> None:
        """Buffer one sample (tensors of S tokens, padding already stripped). Vision-language
        stores need `position_ids` [3, S] and `image_embeds` [I, H] (I may be 0); others refuse them."""
        if self._closed:
            raise RuntimeError(f"{self.dir}: writer is closed")
        if not isinstance(sample_id, str):
            raise TypeError(f"sample id {sample_id!r}: must be a str")
        if sample_id in self.done_ids:
            raise ValueError(f"{self.dir}: sample id {sample_id!r} is already in the store")
        ids = torch.as_tensor(input_ids).reshape(-1)
        mask = torch.as_tensor(loss_mask).reshape(-1)
        s = ids.numel()
        checks = [
            ("loss_mask", tuple(mask.shape), (s,)),
            ("aux", tuple(aux.shape), (s, self.aux_width)),
            ("last", tuple(last.shape), (s, self.hidden_size)),
        ]
        for name, got, want in checks:
            if got != want:
                raise ValueError(f"sample {sample_id!r}: {name} has shape {got}, expected {want}")
        if self.vl:
            if position_ids is None or image_embeds is None:
                raise ValueError(f"sample {sample_id!r}: a vision-language store needs position_ids and image_embeds")
            checks = [("position_ids", tuple(position_ids.shape), (3, s)),
                      ("image_embeds", tuple(image_embeds.shape[1:]), (self.hidden_size,))]
            for name, got, want in checks:
                if got != want:
                    raise ValueError(f"sample {sample_id!r}: {name} has shape {got}, expected {want}")
        elif position_ids is not None or image_embeds is not None:
            raise ValueError(f"sample {sample_id!r}: position_ids/image_embeds need a store with meta vl=true")
        if s == 0:
            raise ValueError(f"sample {sample_id!r}: has no tokens")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"sample {sample_id!r}: loss_mask must hold only 0 and 1")
        self._buffer.append(
            (
                sample_id,
                ids.to(torch.int32),
                mask.to(torch.uint8),
                aux.detach().to("cpu", self.dtype),
                last.detach().to("cpu", self.dtype),
                None if position_ids is None else position_ids.detach().to("cpu", torch.int32).T.contiguous(),
                None if image_embeds is None else image_embeds.detach().to("cpu", self.dtype),
            )
        )
        self.done_ids.add(sample_id)
        if len(self._buffer) >= self.shard_samples:
            self.flush()

    def flush(self) -> None:
        """Write the buffered samples as one shard (temp file + rename), then list it."""
        if not self._buffer:
            return
        ids = [b[0] for b in self._buffer]
        lengths = torch.tensor([b[1].numel() for b in self._buffer], dtype=torch.int64)
        offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        tensors = {
            "input_ids": torch.cat([b[1] for b in self._buffer]),
            "loss_mask": torch.cat([b[2] for b in self._buffer]),
            "aux": torch.cat([b[3] for b in self._buffer]),
            "last": torch.cat([b[4] for b in self._buffer]),
            "offsets": offsets,
        }
        if self.vl:
            counts = torch.tensor([b[6].shape[0] for b in self._buffer], dtype=torch.int64)
            image_offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
            image_offsets[1:] = torch.cumsum(counts, 0)
            tensors["position_ids"] = torch.cat([b[5] for b in self._buffer])
            tensors["image_embeds"] = torch.cat([b[6] for b in self._buffer])
            tensors["image_offsets"] = image_offsets
        name = shard_name(len(self.shards))
        path = self.dir / name
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "ids": json.dumps(ids)})
        self.shards.append(
            {
                "name": name,
                "samples": len(ids),
                "tokens": int(offsets[-1]),
                "first_id": ids[0],
                "last_id": ids[-1],
                "bytes": path.stat().st_size,
            }
        )
        self._buffer = []
        self._write_manifest(complete=False)

    def _write_manifest(self, complete: bool) -> None:
        write_json(
            self.dir / MANIFEST,
            {
                "format": FORMAT,
                "version": VERSION,
                "meta": self.meta,
                "complete": complete,
                "samples": sum(s["samples"] for s in self.shards),
                "tokens": sum(s["tokens"] for s in self.shards),
                "shards": self.shards,
            },
        )

    def close(self) -> dict:
        """Write the last shard, mark the store complete; returns the manifest totals."""
        if not self._closed:
            self.flush()
            self._write_manifest(complete=True)
            self._closed = True
        return {
            "samples": sum(s["samples"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": len(self.shards),
            "bytes": sum(s["bytes"] for s in self.shards),
        }

    def __enter__(self) -> "HiddenStateStoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # keep what is finished; the buffered samples are redone on resume
            self._buffer = []
            self._closed = True


def _shard_ids(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "ids" not in meta:
        raise RuntimeError(f"{path}: shard header has no 'ids' metadata; not a store shard")
    return json.loads(meta["ids"])


def remove_store(path: str | os.PathLike) -> None:
    """Delete a store directory (used when a split no longer has samples)."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)


class HiddenStateStore:
    """Random access to the samples of a store, reading only the requested token range.

    Shards are memory-mapped through safetensors (`safe_open(...).get_slice(name)[a:b]`); open
    handles are cached (at most `max_open` at a time). Picklable for DataLoader workers: the
    handles are reopened in each process.
    """

    def __init__(self, path: str | os.PathLike, require_complete: bool = True, max_open: int = 64):
        self.dir = Path(path)
        manifest_path = self.dir / MANIFEST
        if not manifest_path.exists():
            raise FileNotFoundError(f"{manifest_path}: no hidden-state store here (run the extract stage)")
        manifest = read_json(manifest_path)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(
                f"{manifest_path}: format {manifest.get('format')!r} v{manifest.get('version')!r}, "
                f"expected {FORMAT!r} v{VERSION}"
            )
        if require_complete and not manifest.get("complete"):
            raise RuntimeError(
                f"{manifest_path}: the store is incomplete (an extraction was interrupted); "
                "run the extract stage again to finish it"
            )
        for entry in manifest["shards"]:
            p = self.dir / entry["name"]
            if not p.exists() or p.stat().st_size != entry["bytes"]:
                raise RuntimeError(f"{manifest_path}: shard {entry['name']} is missing or has the wrong size")
        self.manifest = manifest
        self.meta: dict = manifest["meta"]
        self.shards: list[dict] = manifest["shards"]
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s["samples"])
        self.max_open = max_open
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._offsets: dict[int, list[int]] = {}
        self._image_offsets: dict[int, list[int]] = {}
        self.vl = bool(self.meta.get("vl", False))
        self._lengths: list[int] | None = None
        self._ids: list[str] | None = None

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    @property
    def bytes_per_token(self) -> float:
        """Bytes on disk per stored token, headers and offsets included."""
        return sum(s["bytes"] for s in self.shards) / max(self.num_tokens, 1)

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample, in store order (for length-grouped batching)."""
        if self._lengths is None:
            self._lengths = []
            for k in range(len(self.shards)):
                off = self._shard_offsets(k)
                self._lengths.extend(b - a for a, b in zip(off[:-1], off[1:]))
        return self._lengths

    @property
    def ids(self) -> list[str]:
        """Sample ids, in store order."""
        if self._ids is None:
            self._ids = [i for s in self.shards for i in _shard_ids(self.dir / s["name"])]
        return self._ids

    def _handle(self, k: int):
        h = self._handles.get(k)
        if h is None:
            h = safe_open(str(self.dir / self.shards[k]["name"]), framework="pt")
            self._handles[k] = h
            if len(self._handles) > self.max_open:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(k)
        return h

    def _shard_offsets(self, k: int) -> list[int]:
        off = self._offsets.get(k)
        if off is None:
            off = self._handle(k).get_tensor("offsets").tolist()
            self._offsets[k] = off
        return off

    def locate(self, i: int) -> tuple[int, int, int]:
        """(shard index, first token, end token) of sample i."""
        k, _, a, b = self._locate(i)
        return k, a, b

    def _locate(self, i: int) -> tuple[int, int, int, int]:
        """(shard index, index within the shard, first token, end token) of sample i."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for a store of {n} samples")
        k = bisect_right(self._starts, i) - 1
        off = self._shard_offsets(k)
        j = i - self._starts[k]
        return k, j, off[j], off[j + 1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j, a, b = self._locate(i)
        h = self._handle(k)
        sample = {
            "input_ids": h.get_slice("input_ids")[a:b].long(),
            "loss_mask": h.get_slice("loss_mask")[a:b].long(),
            "aux": h.get_slice("aux")[a:b],
            "last": h.get_slice("last")[a:b],
        }
        if self.vl:
            off = self._image_offsets.get(k)
            if off is None:
                off = self._image_offsets[k] = h.get_tensor("image_offsets").tolist()
            sample["position_ids"] = h.get_slice("position_ids")[a:b].long().T  # [3, S]
            sample["image_embeds"] = h.get_slice("image_embeds")[off[j] : off[j + 1]]
        return sample

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state
