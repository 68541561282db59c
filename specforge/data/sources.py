"""Table inputs of the data stage: Parquet and Arrow files, `datasets.save_to_disk` folders and
hub datasets, read into the same `RawRow`s as JSON Lines.

Spellings (`data.train_files` / `data.eval_files` entries):
- `path/rows.parquet`, `path/rows.arrow` (Arrow IPC file or stream, as `datasets` writes them);
- `path/folder`: a folder written by `Dataset.save_to_disk` (holds state.json / dataset_info.json);
  a DatasetDict folder is refused with its split names: name one split's folder;
- `hub:OWNER/NAME` or `hub:OWNER/NAME:SPLIT` (split default "train"): `datasets.load_dataset`,
  which needs the network (or the datasets cache) and fails naming the input otherwise.

A row's `line` is its 1-based row index (in the whole folder / hub split). Arrow gives every
row every struct field, None where the row had none: None-valued keys are dropped at every
level, so a table row normalises exactly like the JSON row without those keys (in a table, a
null field and a missing one are the same thing). An image column of `datasets` (an Image feature,
{bytes, path} in Arrow) becomes a base64 data URI, which the data stage writes to a file of the
run (specforge/data/fix/conversations.py: ImageChecker); other binary values make the row an error
row naming the field, quarantined as invalid_json; dates and times become ISO strings.
"""
from __future__ import annotations

import datetime as dt
import decimal
from pathlib import Path
from typing import Any, Iterator

from specforge.data.formats import DataFileError, RawRow
from specforge.errors import InvalidInput, MissingInput
from specforge.utils.images import to_data_uri
from specforge.utils.io import file_fingerprint, fingerprint

HUB_PREFIX = "hub:"
TABLE_SUFFIXES = (".parquet", ".arrow")
DATASET_FOLDER_FILES = ("state.json", "dataset_info.json", "dataset_dict.json")
BATCH_ROWS = 1024


def is_hub(spec: str | Path) -> bool:
    return isinstance(spec, str) and spec.startswith(HUB_PREFIX)


def is_table_source(path: str | Path) -> bool:
    """A hub name, a folder, or a .parquet / .arrow file (existing or not)."""
    return is_hub(path) or Path(path).is_dir() or Path(path).suffix.lower() in TABLE_SUFFIXES


def hub_name_split(spec: str) -> tuple[str, str]:
    """"hub:owner/name:split" -> ("owner/name", "split"); the split defaults to "train"."""
    name, _, split = spec[len(HUB_PREFIX):].partition(":")
    if not name or ":" in split or (_ and not split):
        raise InvalidInput(f"{spec}: a hub dataset is spelled hub:OWNER/NAME or hub:OWNER/NAME:SPLIT")
    return name, split or "train"


def check_source(path: str) -> None:
    """Raise naming `path` when it cannot be an input: a missing or empty file, or a folder that is
    not a save_to_disk folder (hub names are only checked for their spelling: no network here)."""
    if is_hub(path):
        hub_name_split(path)
    elif Path(path).is_dir():
        if not any((Path(path) / n).is_file() for n in DATASET_FOLDER_FILES):
            raise InvalidInput(f"data file {path} is a folder but not a datasets.save_to_disk folder "
                               f"(none of {', '.join(DATASET_FOLDER_FILES)} in it)")
    elif not Path(path).is_file():
        raise MissingInput(f"data file {path} not found")
    elif Path(path).stat().st_size == 0:
        raise InvalidInput(f"data file {path} is empty (0 bytes): it holds no conversation")


def source_fingerprint(path: str) -> str:
    """Content hash of a file or folder; a hub dataset only by its name (no network here)."""
    return fingerprint({"hub": path}) if is_hub(path) else file_fingerprint(path)


def read_table_rows(path: str | Path) -> Iterator[RawRow]:
    """RawRows of a Parquet / Arrow file, save_to_disk folder or hub split, in table order."""
    spec = str(path)
    line = 0
    for batch in _batches(spec):
        for row in batch.to_pylist():
            line += 1
            try:
                yield RawRow(spec, line, _plain(row, ""), None)
            except _NotJSON as e:
                yield RawRow(spec, line, None, f"not representable as JSON: {e}")


def _batches(spec: str) -> Iterator:
    """pyarrow RecordBatches / Tables of the source; DataFileError naming it when unreadable."""
    import pyarrow as pa

    if is_hub(spec):
        yield from _dataset_batches(_load_hub(spec))
        return
    path = Path(spec)
    if path.is_dir():
        yield from _dataset_batches(_load_folder(path))
        return
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        else:
            batches = _arrow_batches(path)
        yield from batches
    except (pa.ArrowException, OSError) as e:
        kind = "Parquet" if path.suffix.lower() == ".parquet" else "Arrow IPC"
        raise DataFileError(f"{path}: not a readable {kind} file ({e})") from None


def _arrow_batches(path: Path) -> Iterator:
    """An Arrow IPC file, or an IPC stream (what `datasets` writes as .arrow)."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        batches = pa.ipc.open_stream(source)
    yield from batches


def _load_folder(path: Path):
    import datasets

    check_source(str(path))
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataFileError(f"{path}: not a readable datasets.save_to_disk folder ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataFileError(f"{path}: a DatasetDict with splits {sorted(ds)}; name one split's folder, "
                            f"e.g. {path / sorted(ds)[0]}")
    return ds


def _load_hub(spec: str):
    import datasets

    name, split = hub_name_split(spec)
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - network, auth, missing split: all end here, named
        raise DataFileError(f"{spec}: cannot load hub dataset {name!r} split {split!r} "
                            f"({type(e).__name__}: {e}); no network? use a local copy "
                            "(.jsonl, .parquet, a save_to_disk folder)") from None


def _dataset_batches(ds) -> Iterator:
    """Arrow tables of a datasets.Dataset in its row order (indices mapping applied), never
    decoding features (an Image column stays {bytes, path})."""
    yield from ds.with_format("arrow").iter(batch_size=BATCH_ROWS)


class _NotJSON(ValueError):
    pass


def _plain(value: Any, where: str) -> Any:
    """`value` as JSON types: None-valued keys dropped, dates as ISO strings, an image of a
    `datasets` Image column as a data URI (or its path, where it holds no bytes); _NotJSON naming
    the field for anything else (other bytes)."""
    if isinstance(value, dict) and _is_image_struct(value):
        return to_data_uri(value["bytes"]) if value["bytes"] is not None else value.get("path")
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}.{k}" if where else str(k)) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, (dt.date, dt.time)):  # dt.datetime is a dt.date
        return value.isoformat()
    if isinstance(value, (dt.timedelta, decimal.Decimal)):
        return str(value)
    raise _NotJSON(f"{where or 'row'} holds {type(value).__name__} data (binary data is read only as an image, "
                   "in a datasets Image column's {bytes, path} layout)")


def _is_image_struct(value: dict) -> bool:
    """How `datasets` stores an Image feature in Arrow: {"bytes": binary or null, "path": string or null}."""
    return (set(value) == {"bytes", "path"} and isinstance(value["bytes"], (bytes, type(None)))
            and isinstance(value["path"], (str, type(None))))
