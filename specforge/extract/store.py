"""The sharded hidden-state store: what the extract stage writes and the train stage reads.

Layout of a store directory (docs/design.md, "Hidden-state store"):

- `shard_00000.safetensors`, ...: the samples of a shard concatenated along tokens:
  `input_ids` int32 [T], `loss_mask` uint8 [T], `aux` [T, 3*H] (aux layers in ascending order),
  `last` [T, H] (final post-norm state), `offsets` int64 [n+1]; the sample ids are a JSON list in
  the safetensors header metadata (`ids`), so the manifest stays small for 500K-sample stores.
  Vision-language stores (meta `vl: true`) also hold `position_ids` int32 [T, 3] (the target's
  M-RoPE positions, token-major) and `image_embeds` [I, H] (the target's merged input embeddings
  at image-token positions, in sequence order) with `image_offsets` int64 [n+1].
  fp8 stores (meta `storage_dtype: fp8`, `last_rows: scored`): `aux` and `image_embeds` are
  float8_e4m3fn with one float32 scale per row and stored state (`aux_scale` [T, 3],
  `image_embeds_scale` [I, 1]); `last` stays bf16 (see EXACT_STATES) and keeps only the rows
  training reads (`scored_rows`), R of them, with `last_offsets` int64 [n+1]. The reader dequantises
  and scatters them back, so every store reads the same: bf16 `aux` [S, 3H] and `last` [S, H]
  (zeros where nothing reads it).
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
import struct
from bisect import bisect_right
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specforge.config import STORE_DTYPES
from specforge.errors import InvalidInput
from specforge.utils.io import atomic_path, read_json, write_json

FORMAT = "specforge-hidden-states"
VERSION = 1
MANIFEST = "manifest.json"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
STORAGE_DTYPES = dict(zip(STORE_DTYPES, (torch.bfloat16, torch.float16, torch.float32, FP8)))
LAST_ROWS = ("all", "scored")
HIDDEN_TENSORS = ("aux", "aux_scale", "last")  # what `hidden_bytes_per_token` counts
# States an fp8 store keeps in bf16: the teacher reads `last` through the target's head, whose argmax
# e4m3 moved at 2.3% of the scored positions of the demo's store (benchmarks/store_bench.py); the
# draft's inputs (aux, image embeddings) take fp8's error the way they take feature noise.
EXACT_STATES = ("last",)


class StoreMetaMismatch(ValueError):
    """An existing store was produced from different inputs than the writer was given."""


class StoreDamaged(InvalidInput):
    """A store on disk that cannot be read as its manifest says: a listed shard missing or cut, a
    file that is not a shard, an interrupted extraction. The message says what to do."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def store_layout(storage_dtype: str) -> dict:
    """The meta keys that say how a store lays out its states: fp8 stores also keep `last` only
    where training reads it (the other dtypes keep every row, as stores always did)."""
    return {"storage_dtype": storage_dtype, **({"last_rows": "scored"} if storage_dtype == "fp8" else {})}


def handoff_dtype(storage_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype extractors hand the writer: the stored dtype itself, or the target's own compute
    dtype for fp8 (the writer alone quantises: with per-row scales it must see the values) and for
    float16 (the one range narrower than a target's: the writer must see what overflows it to say
    "use extract.dtype=bfloat16"). The cost, with a float32 target only: the hand-off buffers (the
    batch computed, WriteBehind's extract.batch_tokens tokens waiting) take 4 bytes a value, not 2."""
    return compute_dtype if storage_dtype in ("fp8", "float16") else STORAGE_DTYPES[storage_dtype]


def scored_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p of one sample whose final state training reads: the teacher at p is the target's
    distribution over token p+1, scored only where loss_mask[p+1] == 1 (ttt_forward's `valid`)."""
    return torch.nonzero(loss_mask[1:] != 0).reshape(-1)


def quantize_fp8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, groups * W] -> (float8_e4m3fn [N, groups * W], float32 scales [N, groups]), scale =
    amax / 448 per row and group: a BOS-sized outlier row (|x| ~ 1e4) or one loud aux layer keeps
    its own range instead of flattening the others; all-zero groups get scale 1."""
    n, width = x.shape[0], x.shape[1] // groups
    g = x.detach().to("cpu", torch.float32).reshape(n, groups, width)
    amax = g.abs().amax(-1) if width else g.new_zeros(n, groups)
    if not torch.isfinite(amax).all():
        raise ValueError("hidden states hold inf/nan: they cannot be stored as fp8 (check the target's dtype)")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (g / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(x.shape), scale


def _refuse_non_finite(sample_id: str, name: str, x: torch.Tensor, computed: torch.Tensor | None = None) -> None:
    """ValueError naming the sample, the tensor and its first row that is not finite. `computed`:
    what `x` was cast from (x is the stored copy; the cast overflowed)."""
    if bool(torch.isfinite(x).all()):
        return
    row = int((~torch.isfinite(x).reshape(x.shape[0], -1).all(-1)).nonzero()[0, 0])
    if computed is not None:
        why = (f"the target's values (up to {computed[row].abs().max().item():.4g}) overflow the storage dtype "
               f"{x.dtype}: use extract.dtype=bfloat16")
    else:
        why = f"the target computed them so (it overflows in {x.dtype}? try target.dtype=bfloat16 or float32)"
    raise ValueError(f"sample {sample_id!r}: {name} holds inf/nan in row {row} of {x.shape[0]}: {why}")


def stored_states(sample_id: str, name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` on the CPU in `dtype` (not fp8) as a store holds it, inf/nan refused naming the sample: the
    writer's, and extract=online's (specforge/extract/online.py), so both refuse alike."""
    _refuse_non_finite(sample_id, name, x)  # where x is (a GPU's reduction costs nothing)
    stored = x.detach().to("cpu", dtype)
    if stored.dtype == torch.float16 and x.dtype != torch.float16:  # the one narrower range
        _refuse_non_finite(sample_id, name, stored, computed=x)
    return stored


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of quantize_fp8, in `dtype`."""
    n, groups = scale.shape
    x = q.to(torch.float32).reshape(n, groups, q.shape[1] // groups) * scale[..., None]
    return x.reshape(q.shape).to(dtype)


def _normalise(meta: dict) -> dict:
    """JSON round trip, so tuples/lists and int/str keys compare the way they are stored."""
    return json.loads(json.dumps(meta, sort_keys=True, default=str))


class HiddenStateStoreWriter:
    """Accumulates samples and writes a shard every `shard_samples` samples.

    `meta` must hold `hidden_size` (H), `aux_layer_ids` (3 ids) and `storage_dtype` (one of
    STORAGE_DTYPES; `store_layout` gives these keys); `last_rows` ("all" or "scored": only the
    `scored_rows` of `last`) defaults to "all"; anything else in it (target fingerprint, source data fingerprint, ...) only
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
        if meta.get("last_rows", "all") not in LAST_ROWS:
            raise ValueError(f"store meta: last_rows={meta['last_rows']!r} is not one of {list(LAST_ROWS)}")
        self.scored_last = meta.get("last_rows") == "scored"
        self.vl = bool(meta.get("vl", False))
        self.shards: list[dict] = []
        self.done_ids: set[str] = set()
        self.resumed = False
        self._buffer: list[tuple[str, dict]] = []  # (id, the sample's shard tensors)
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
        damage = shard_damage(self.dir, shards)
        if damage:
            if if_mismatch == "restart":  # nothing in it can be trusted to resume from
                print(f"[extract] {self.dir}: {damage}; extracting it again", flush=True)
                self._wipe()
                return
            raise StoreDamaged(f"{manifest_path}: {damage}; the store is damaged, delete {self.dir} and extract again")
        for entry in shards:
            self.done_ids.update(_shard_ids(self.dir / entry["name"]))
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
        tensors = {"input_ids": ids.to(torch.int32), "loss_mask": mask.to(torch.uint8)}
        tensors.update(self._states(sample_id, "aux", aux, groups=self.aux_width // self.hidden_size))
        tensors.update(self._states(sample_id, "last", last[scored_rows(mask)] if self.scored_last else last))
        if self.vl:
            tensors["position_ids"] = position_ids.detach().to("cpu", torch.int32).T.contiguous()
            tensors.update(self._states(sample_id, "image_embeds", image_embeds))
        self._buffer.append((sample_id, tensors))
        self.done_ids.add(sample_id)
        if len(self._buffer) >= self.shard_samples:
            self.flush()

    def _states(self, sample_id: str, name: str, x: torch.Tensor, groups: int = 1) -> dict[str, torch.Tensor]:
        """Hidden states as stored: cast to the storage dtype, or (fp8) quantised with their scales.
        inf/nan (a target overflowing in its dtype, or states beyond float16's range) are refused:
        the draft would train on nothing but them."""
        if self.dtype != FP8 or name in EXACT_STATES:
            return {name: stored_states(sample_id, name, x, torch.bfloat16 if self.dtype == FP8 else self.dtype)}
        _refuse_non_finite(sample_id, name, x)  # where x is (a GPU's reduction costs nothing)
        q, scale = quantize_fp8(x, groups)
        return {name: q, f"{name}_scale": scale}

    def flush(self) -> None:
        """Write the buffered samples as one shard (temp file + rename), then list it."""
        if not self._buffer:
            return
        ids = [sid for sid, _ in self._buffer]
        samples = [t for _, t in self._buffer]
        tensors = {key: torch.cat([t[key] for t in samples]) for key in samples[0]}

        def offsets(key: str) -> torch.Tensor:  # where each sample's rows of `key` start, and the end
            counts = torch.tensor([t[key].shape[0] for t in samples], dtype=torch.int64)
            return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])

        tensors["offsets"] = offsets("input_ids")
        if self.scored_last:
            tensors["last_offsets"] = offsets("last")
        if self.vl:
            tensors["image_offsets"] = offsets("image_embeds")
        name = shard_name(len(self.shards))
        path = self.dir / name
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "ids": json.dumps(ids)})
        self.shards.append(
            {
                "name": name,
                "samples": len(ids),
                "tokens": int(tensors["offsets"][-1]),
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


def shard_damage(store_dir: Path, shards: list[dict]) -> str | None:
    """What is wrong with the listed shards on disk (missing, another size), or None: a stat each."""
    for entry in shards:
        path = Path(store_dir) / entry["name"]
        if not path.exists():
            return f"listed shard {entry['name']} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"listed shard {entry['name']} has {path.stat().st_size} bytes, {entry['bytes']} were written"
    return None


def _shard_ids(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "ids" not in meta:
        raise StoreDamaged(f"{path}: shard header has no 'ids' metadata; not a store shard")
    return json.loads(meta["ids"])


def _tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor of a safetensors file, from its header (no tensor is read)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def remove_store(path: str | os.PathLike) -> None:
    """Delete a store directory (used when a split no longer has samples)."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)


class HiddenStateStore:
    """Random access to the samples of a store, reading only the requested token range.

    Shards are memory-mapped through safetensors (`safe_open(...).get_slice(name)[a:b]`); open
    handles are cached (at most `max_open` at a time). Picklable for DataLoader workers: the
    handles are reopened in each process. A sample reads the same from every store: fp8 states
    come back dequantised to bf16, and a `last_rows: scored` store's `last` dense, zeros elsewhere.
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
            raise StoreDamaged(
                f"{manifest_path}: the store is incomplete (an extraction was interrupted); "
                "run the extract stage again to finish it"
            )
        damage = shard_damage(self.dir, manifest["shards"])
        if damage:
            raise StoreDamaged(f"{manifest_path}: {damage}; run the extract stage again (it extracts the store anew)")
        self.manifest = manifest
        self.meta: dict = manifest["meta"]
        self.shards: list[dict] = manifest["shards"]
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s["samples"])
        self.max_open = max_open
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._offsets: dict[tuple[int, str], list[int]] = {}
        self.vl = bool(self.meta.get("vl", False))
        self.quantised = self.meta.get("storage_dtype") == "fp8"
        self.scored_last = self.meta.get("last_rows") == "scored"
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
    def hidden_bytes_per_token(self) -> float:
        """Bytes of the hidden states alone (aux, last and their fp8 scales; not ids, masks, offsets,
        headers or VL extras) per stored token: a bf16 store's 8H, the base of `ratio_vs_8h`."""
        total = sum(n for s in self.shards for name, n in _tensor_bytes(self.dir / s["name"]).items()
                    if name in HIDDEN_TENSORS)
        return total / max(self.num_tokens, 1)

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

    def _shard_offsets(self, k: int, name: str = "offsets") -> list[int]:
        """Shard k's `offsets` (token rows per sample), or its `last_offsets` / `image_offsets`."""
        off = self._offsets.get((k, name))
        if off is None:
            off = self._offsets[(k, name)] = self._handle(k).get_tensor(name).tolist()
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

    def _states(self, h, name: str, a: int, b: int) -> torch.Tensor:
        """Rows a:b of the states `name`, dequantised (fp8 stores)."""
        x = h.get_slice(name)[a:b]
        if not self.quantised or name in EXACT_STATES:
            return x
        return dequantize_fp8(x, h.get_slice(f"{name}_scale")[a:b])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j, a, b = self._locate(i)
        h = self._handle(k)
        sample = {
            "input_ids": h.get_slice("input_ids")[a:b].long(),
            "loss_mask": h.get_slice("loss_mask")[a:b].long(),
            "aux": self._states(h, "aux", a, b),
        }
        if self.scored_last:  # the stored rows back in place; nothing reads the zeros
            off = self._shard_offsets(k, "last_offsets")
            rows, at = self._states(h, "last", off[j], off[j + 1]), scored_rows(sample["loss_mask"])
            if rows.shape[0] != at.numel():
                raise StoreDamaged(f"{self.dir / self.shards[k]['name']}: sample {j} has {rows.shape[0]} stored "
                                   f"`last` rows, its loss mask scores {at.numel()}; the store is damaged")
            sample["last"] = rows.new_zeros(b - a, rows.shape[1])
            sample["last"][at] = rows
        else:
            sample["last"] = self._states(h, "last", a, b)
        if self.vl:
            off = self._shard_offsets(k, "image_offsets")
            sample["position_ids"] = h.get_slice("position_ids")[a:b].long().T  # [3, S]
            sample["image_embeds"] = self._states(h, "image_embeds", off[j], off[j + 1])
        return sample

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state
