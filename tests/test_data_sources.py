"""Table inputs (Parquet, Arrow, save_to_disk folders, hub names): every row shape reads and
normalises exactly as from JSON Lines, with 1-based row numbers; bad tables fail naming the input."""
from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from PIL import Image

from specforge.config import FixConfig
from specforge.data.fix import fix_dataset
from specforge.data.formats import DataError, DataFileError, parse_raw_text, read_raw_rows, read_raw_texts, to_conversation
from specforge.data.sources import check_source, source_fingerprint
from test_data_stage import make_cfg

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = {"role": "system", "content": "Answer in TOON."}
ANSWER = "city: Oslo\ntemp: 3"

# One list of rows per shape; inside a shape every row has the same column types (as a real
# table would), but rows lack fields other rows have, so Arrow fills them with nulls.
SHAPES = {
    "messages": [
        {"id": "m1", "messages": [SYSTEM, {"role": "user", "content": "Oslo?", "name": "ann"},
                                  {"role": "assistant", "content": ANSWER}]},
        {"id": "m2", "messages": [{"role": "user", "content": "Bergen?"}, {"role": "assistant", "content": ANSWER}],
         "source": "web"},
        {"messages": [{"role": "user", "content": "Bergen?"}, {"role": "assistant", "content": ANSWER}]},  # duplicate
        {"id": "m4", "messages": [{"role": "human", "content": "Lima?"}, {"role": "assistant", "content": ANSWER}]},
        {"id": "m5", "messages": [{"role": "user", "content": "no answer"}]},
        {"id": "m6", "messages": [{"role": "bot", "content": "?"}]},
    ],
    "messages_with_images": [
        {"id": "i1", "messages": [
            {"role": "user", "content": [{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "Sky?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]},
        {"id": "i2", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "img/a.png"}},
                                         {"type": "text", "text": "And now?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]},
        {"id": "i3", "messages": [
            {"role": "user", "content": [{"type": "image", "image": "img/missing.png"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]},
    ],
    "sharegpt": [
        {"id": "s1", "images": ["img/a.png"], "conversations": [
            {"from": "human", "value": "<image>\nSky?"}, {"from": "gpt", "value": ANSWER}]},
        {"id": "s2", "system": "Be brief.", "conversations": [
            {"from": "human", "value": "Oslo?"}, {"from": "gpt", "value": ANSWER}, {"from": "gpt", "value": "more"}]},
        {"id": "s3", "images": ["img/a.png", "img/a.png"], "conversations": [
            {"from": "human", "value": "<image> only one slot"}, {"from": "gpt", "value": ANSWER}]},
    ],
    "conversations": [
        {"id": "c1", "conversations": [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": ANSWER}]},
        {"id": "c2", "conversations": [{"role": "user", "content": ""}, {"role": "user", "content": "Quito?"},
                                       {"role": "assistant", "content": ANSWER}]},
        {"id": "c3", "conversations": [{"role": "user", "content": "Quito?"}]},
    ],
    "alpaca": [  # Stanford's fields, LLaMA-Factory's system and history
        {"id": "a1", "instruction": "Oslo?", "input": "in TOON", "output": ANSWER},
        {"id": "a2", "system": "Be brief.", "history": [["Hi", "Hello"]], "instruction": "Lima?", "output": ANSWER},
        {"id": "a3", "instruction": "Quito?", "input": "", "output": ""},  # no answer to train on
    ],
    "prompt_completion": [  # OpenAI's legacy fine-tuning rows
        {"id": "p1", "prompt": "Oslo?", "completion": ANSWER},
        {"id": "p2", "system": "Be brief.", "prompt": "Lima?", "completion": ANSWER},
        {"id": "p3", "prompt": "Quito?", "completion": ""},  # no answer to train on
    ],
    # one table mixing shapes: every row gets the other shape's column as null
    "mixed": [
        {"id": "x1", "messages": [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": ANSWER}]},
        {"id": "x2", "conversations": [{"from": "human", "value": "Lima?"}, {"from": "gpt", "value": ANSWER}]},
    ],
}


def table_of(rows: list[dict]) -> pa.Table:
    """Columns and struct fields of all rows (Table.from_pylist takes the first row's keys only)."""
    return pa.Table.from_struct_array(pa.array(rows))


def write_all_formats(folder: Path, rows: list[dict]) -> dict[str, Path]:
    """The same rows as .jsonl, .parquet, .arrow (IPC file and datasets' stream) and a
    save_to_disk folder, all in `folder` (so relative image paths resolve alike)."""
    paths = {"jsonl": folder / "rows.jsonl", "parquet": folder / "rows.parquet",
             "arrow_file": folder / "rows.arrow", "folder": folder / "rows_ds"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = table_of(rows)
    pq.write_table(table, paths["parquet"])
    with pa.ipc.new_file(str(paths["arrow_file"]), table.schema) as w:
        w.write_table(table)
    datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(paths["folder"]))
    (stream,) = list(paths["folder"].glob("*.arrow"))
    paths["arrow_stream"] = folder / "rows_stream.arrow"  # beside the others: images resolve alike
    shutil.copy(stream, paths["arrow_stream"])
    return paths


@pytest.fixture
def image_dir(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "img" / "a.png")
    return tmp_path


def _outcome(rows) -> tuple[list, list]:
    """What the fix step makes of rows, without the file name (it differs per format)."""
    result = fix_dataset(rows, FixConfig(toon=False))
    kept = [(k["line"], k["id"], k["messages"], k["fixes"]) for k in result.kept]
    return kept, [(q["line"], q["reason"].replace(q["file"], "<file>"), q["row"]) for q in result.quarantined]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_reads_alike_from_every_format(image_dir, shape):
    rows = SHAPES[shape]
    paths = write_all_formats(image_dir, rows)
    assert [r.data for r in read_raw_rows(paths["jsonl"])] == rows
    want = _outcome(read_raw_rows(paths["jsonl"]))
    assert want[0] and (want[1] or shape == "mixed")  # some kept, some quarantined: a real check
    for fmt in ("parquet", "arrow_file", "arrow_stream", "folder"):
        got = list(read_raw_rows(paths[fmt]))
        assert [r.file for r in got] == [str(paths[fmt])] * len(rows), fmt
        assert [(r.line, r.data, r.error) for r in got] == [(i, r, None) for i, r in enumerate(rows, 1)], fmt
        assert _outcome(got) == want, fmt


def test_nulls_are_dropped_at_every_level(tmp_path):
    """Arrow gives every row every column and struct field, null where the row had none; read
    as they come back, x2 would be a messages row without messages and an image_url part an
    image part without a path."""
    mixed, with_images = table_of(SHAPES["mixed"]), table_of(SHAPES["messages_with_images"])
    with pytest.raises(DataError, match="messages: missing"):
        to_conversation(mixed.to_pylist()[1])
    with pytest.raises(DataError, match="image part without an image path"):
        to_conversation(with_images.to_pylist()[1])
    pq.write_table(mixed, tmp_path / "mixed.parquet")
    pq.write_table(with_images, tmp_path / "images.parquet")
    got = list(read_raw_rows(tmp_path / "mixed.parquet")) + list(read_raw_rows(tmp_path / "images.parquet"))
    assert [r.data for r in got] == SHAPES["mixed"] + SHAPES["messages_with_images"]
    assert to_conversation(got[1].data)["messages"][0] == {"role": "user", "content": "Lima?"}
    assert to_conversation(got[3].data)["messages"][0]["content"][0] == {"type": "image", "image": "img/a.png"}


def test_binary_values_quarantine_the_row_naming_the_field(tmp_path):
    """Bytes in an image column's layout are an image (tests/test_embedded_images.py), here a broken
    one; bytes anywhere else are not JSON."""
    path = tmp_path / "embedded.parquet"
    conversations = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "sun"}]
    pq.write_table(table_of([{"id": "a", "images": [{"bytes": b"\x89PNG", "path": None}],
                              "conversations": conversations},
                             {"id": "b", "blob": b"\x89PNG", "conversations": conversations}]),
                   path)
    image, other = read_raw_rows(path)
    assert image.data["images"] == ["data:;base64,iVBORw=="] and other.data is None and other.line == 2
    assert other.error.startswith("not representable as JSON: blob holds bytes data")
    broken, not_json = fix_dataset([image, other], FixConfig()).quarantined
    assert broken["reason"].startswith("image_unreadable: data:;base64,iVBORw==: cannot be read as an image")
    assert not_json["reason"].startswith("invalid_json: not representable as JSON") and not_json["file"] == str(path)


def test_unreadable_tables_fail_naming_the_input(tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"messages": []}\n')
    with pytest.raises(DataFileError, match=r"fake\.parquet: not a readable Parquet file"):
        list(read_raw_rows(fake))
    (tmp_path / "fake.arrow").write_bytes(b"\x00" * 64)
    with pytest.raises(DataFileError, match=r"fake\.arrow: not a readable Arrow IPC file"):
        list(read_raw_rows(tmp_path / "fake.arrow"))
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet"):
        list(read_raw_rows(tmp_path / "nope.parquet"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"plain is a folder but not a datasets.save_to_disk folder"):
        list(read_raw_rows(tmp_path / "plain"))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(SHAPES["conversations"]),
                               "test": datasets.Dataset.from_list(SHAPES["conversations"])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataFileError, match=r"dd: a DatasetDict with splits \['test', 'train'\]; name one split's folder"):
        list(read_raw_rows(tmp_path / "dd"))
    assert len(list(read_raw_rows(tmp_path / "dd" / "train"))) == 3  # one split's folder is fine
    with pytest.raises(ValueError, match="hub:OWNER/NAME or hub:OWNER/NAME:SPLIT"):
        check_source("hub:")


def test_hub_dataset_without_network_fails_naming_it(tmp_path):
    """Offline (as here, and as the hub client behaves without a network after its retries)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(ROOT)}
    code = "from specforge.data.formats import read_raw_rows; list(read_raw_rows('hub:nobody/nothing:test'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "DataFileError: hub:nobody/nothing:test: cannot load hub dataset 'nobody/nothing' split 'test'" in proc.stderr
    assert "no network?" in proc.stderr
    check_source("hub:nobody/nothing")  # the spelling alone is fine: nothing is fetched to check it
    assert source_fingerprint("hub:nobody/nothing") != source_fingerprint("hub:nobody/nothing:test")


COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            ".zst": lambda b: zstandard.ZstdCompressor().compress(b)}


def _compressed(path: Path, suffix: str) -> Path:
    out = path.with_name(path.name + suffix)
    out.write_bytes(COMPRESS[suffix.lower()](path.read_bytes()))
    return out


def _rows(path: Path) -> list[tuple]:
    return [(r.line, r.data, r.error) for r in read_raw_rows(path)]


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_compressed_text_reads_as_the_plain_file(tmp_path, suffix):
    """`rows.jsonl.gz` (and .bz2, .xz, .zst; .json lists too): the rows, line numbers and bad-JSON
    errors of the plain file, under the compressed file's name, by both readers."""
    rows = SHAPES["messages"]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + "\n{not json\n" + json.dumps(rows[3]) + "\n")
    listed = tmp_path / "rows.json"
    listed.write_text(json.dumps(rows, indent=1))
    for plain in (jsonl, listed):
        packed = _compressed(plain, suffix.upper() if suffix == ".gz" else suffix)  # any case: rows.jsonl.GZ
        assert _rows(packed) == _rows(plain) and {r.file for r in read_raw_rows(packed)} == {str(packed)}
        assert [parse_raw_text(*t) for t in read_raw_texts(packed)] == list(read_raw_rows(packed))
    line, data, error = _rows(packed.with_name("rows.jsonl" + packed.suffix))[3]
    assert (line, data) == (5, None) and error.startswith("invalid JSON: ")


def test_every_frame_of_a_zst_file_is_read(tmp_path):
    """`cat a.zst b.zst` is one valid .zst file of two frames (zstandard's stream_reader would stop
    after the first without a word)."""
    rows = [{"id": i, "messages": SHAPES["messages"][0]["messages"]} for i in range(5)]
    lines = [json.dumps(r) + "\n" for r in rows]
    path = tmp_path / "rows.jsonl.zst"
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress("".join(part).encode())
                              for part in (lines[:2], lines[2:])))
    assert [(r.line, r.data) for r in read_raw_rows(path)] == list(enumerate(rows, 1))


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_broken_compressed_files_fail_naming_the_file(tmp_path, suffix):
    """A truncated stream fails naming the last whole line read; compressed bytes under a plain
    name are refused with the name to give; compressed binary is not UTF-8 text, as plain."""
    plain = tmp_path / "rows.jsonl"
    digests = (hashlib.sha256(str(i).encode()).hexdigest() * 8 for i in range(600))  # ~300 KB, ~2:1
    plain.write_text("".join(json.dumps({"id": i, "pad": d}) + "\n" for i, d in enumerate(digests)))
    packed = _compressed(plain, suffix)
    data = packed.read_bytes()
    packed.write_bytes(data[: len(data) // 2])
    after = "" if suffix == ".bz2" else r" after line \d+"  # bz2 decodes 900 KB blocks: none of half a one
    with pytest.raises(DataFileError, match=rf"rows\.jsonl\{suffix}: not a readable {suffix[1:]} stream{after} "
                                            r"\(.*\): the file is corrupt or truncated"):
        list(read_raw_rows(packed))
    disguised = tmp_path / "disguised.jsonl"
    disguised.write_bytes(data)
    with pytest.raises(DataFileError, match=rf"disguised\.jsonl: {suffix[1:]}-compressed data under a plain \.jsonl "
                                            rf"name; name it disguised\.jsonl\{suffix} to have it decompressed"):
        list(read_raw_rows(disguised))
    binary = tmp_path / "binary.json" if suffix == ".xz" else tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"id": 1}\n\x00\x01')
    with pytest.raises(DataFileError, match=r"not a UTF-8 text file: line 2 \(byte 10 of the decompressed text\)"):
        list(read_raw_rows(_compressed(binary, suffix)))
    other = tmp_path / "rows.csv.gz"
    other.write_bytes(gzip.compress(b"a,b\n"))
    with pytest.raises(ValueError, match=r"rows\.csv\.gz: unsupported data file type '\.csv\.gz'; expected \.jsonl, "
                                         r"\.json \(either may end in \.gz, \.bz2, \.xz or \.zst\)"):
        list(read_raw_rows(other))


def test_stage_reads_tables(tmp_path, tiny_target_dir, tiny_tokenizer):
    """A Parquet file and a save_to_disk folder as the data stage's inputs: same samples as JSONL."""
    from data_prep.weather import generate
    from specforge.data import stage

    paths = write_all_formats(tmp_path, generate(6, seed=0))
    paths["jsonl.gz"] = _compressed(paths["jsonl"], ".gz")
    results = {}
    for fmt in ("jsonl", "parquet", "folder", "jsonl.gz"):
        cfg = make_cfg(tmp_path, tiny_target_dir, paths[fmt], None)
        before = stage.extra_inputs(cfg)["train"][str(paths[fmt])]
        results[fmt] = stage.process_split(cfg, "train", [str(paths[fmt])], tiny_tokenizer)
        assert before == source_fingerprint(str(paths[fmt]))
    assert results["parquet"]["samples"] == results["folder"]["samples"] == results["jsonl"]["samples"]
    assert results["jsonl.gz"]["samples"] == results["jsonl"]["samples"]
    assert results["parquet"]["counts"] == results["jsonl"]["counts"] and results["jsonl"]["counts"]["samples"] == 6
