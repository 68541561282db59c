"""Images that come inside the data, not beside it: a `datasets` Image column (Parquet, a save_to_disk
folder, a hub dataset) or base64 data: URIs (OpenAI-style chat logs). The data stage writes each once
as a file of the run named by its content, and the samples equal those of the same rows with image
files; a URL is refused naming it, since nothing here fetches."""
from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import datasets
import pytest

from data_prep.weather import main as weather_main
from specforge.config import FixConfig
from specforge.data import stage
from specforge.data.fix import fix_dataset
from specforge.data.formats import RawRow, read_raw_rows
from specforge.errors import InvalidInput
from specforge.targets.vl import open_images
from specforge.utils.io import read_jsonl
from test_pipeline_vl import compose_cfg


def _uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _rows(data: Path) -> list[dict]:
    return list(read_jsonl(data / "train.jsonl"))


def _with_data_uris(rows: list[dict], data: Path) -> list[dict]:
    """The rows as a chat log stores them: OpenAI `image_url` parts holding the PNG bytes."""
    def part(p):
        return {"type": "image_url", "image_url": {"url": _uri(data / p["image"])}} if p["type"] == "image" else p
    return [{**r, "messages": [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list)
                               else m for m in r["messages"]]} for r in rows]


def _as_image_column(rows: list[dict], data: Path) -> datasets.Dataset:
    """The rows as a VL dataset on the hub stores them: <image> placeholders and an Image column."""
    records = []
    for r in rows:
        pictures, messages = [], []
        for m in r["messages"]:
            if isinstance(m["content"], list):
                pictures += [{"bytes": (data / p["image"]).read_bytes(), "path": None}
                             for p in m["content"] if p["type"] == "image"]
                m = {**m, "content": "".join("<image>" if p["type"] == "image" else p["text"] for p in m["content"])}
            messages.append(m)
        records.append({"id": r["id"], "messages": messages, "images": pictures})
    return datasets.Dataset.from_list(records).cast_column("images", datasets.Sequence(datasets.Image()))


@pytest.fixture(scope="module")
def weather_images(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embedded")
    assert weather_main(["--out", str(tmp / "data"), "--train", "8", "--eval", "2", "--seed", "5",
                         "--images", "1.0", "--image-size", "160"]) == 0
    return tmp / "data"


def _data_stage(tmp_path, tiny_vl_dir, name: str, train_file: Path, *overrides) -> Path:
    cfg = compose_cfg(tmp_path, tiny_vl_dir, f"data.train_files=[{train_file}]", "data.eval_files=[]",
                      f"cache_dir={tmp_path / ('cache-' + name)}", *overrides)
    stage.run(cfg, tmp_path / name)
    return tmp_path / name / "data"


def test_embedded_images_train_like_the_same_images_as_files(tmp_path, tiny_vl_dir, weather_images):
    rows = _rows(weather_images)
    (tmp_path / "uris.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _with_data_uris(rows, weather_images)))
    table = _as_image_column(rows, weather_images)
    table.to_parquet(str(tmp_path / "column.parquet"))
    table.save_to_disk(str(tmp_path / "column_folder"))
    inputs = {"files": weather_images / "train.jsonl", "uris": tmp_path / "uris.jsonl",
              "parquet": tmp_path / "column.parquet", "folder": tmp_path / "column_folder"}
    runs = {name: _data_stage(tmp_path, tiny_vl_dir, name, path) for name, path in inputs.items()}
    runs["uris_in_workers"] = _data_stage(tmp_path, tiny_vl_dir, "uris_in_workers", inputs["uris"], "data.num_proc=2")

    def samples(data: Path) -> list[dict]:
        return list(read_jsonl(data / "train.jsonl"))

    reference = samples(runs["files"])
    assert len(reference) == len(rows) and all(s["images"] for s in reference)
    assert not (runs["files"] / "images").exists()  # image files are read where they are
    for name, data in runs.items():
        got = samples(data)
        assert [{k: v for k, v in s.items() if k != "images"} for s in got] == \
               [{k: v for k, v in s.items() if k != "images"} for s in reference], name
        for mine, theirs in zip(got, reference):  # each image a file of the run, with the same bytes
            assert [Path(p).read_bytes() for p in mine["images"]] == [Path(p).read_bytes() for p in theirs["images"]]
            if name != "files":
                assert all(Path(p).parent == data / "images" for p in mine["images"]), name
        conversations = (data / "train.conversations.jsonl").read_text()
        assert "base64" not in conversations and "base64" not in (data / "train.jsonl").read_text()
    stored = sorted(p.name for p in (runs["uris"] / "images").iterdir())
    assert len(stored) == len({p for s in reference for p in s["images"]})  # one file per distinct image
    assert stored == sorted(p.name for p in (runs["uris_in_workers"] / "images").iterdir())


def test_an_image_that_is_not_one_is_quarantined_in_one_readable_line(tmp_path):
    noise = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + bytes(6000)).decode()
    rows = [RawRow("chat.jsonl", i, {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "sun"}]}, None)
        for i, url in enumerate([noise, "data:image/png;base64,@@@@"], 1)]
    result = fix_dataset(rows, FixConfig(), embedded_dir=tmp_path / "images")
    reasons = [q["reason"] for q in result.quarantined]
    assert reasons[0].startswith("image_unreadable: data:image/png;base64 (6,004 bytes): cannot be read as an image")
    assert reasons[1].startswith("image_unreadable: data:image/png;base64,@@@@: the data URI is not valid base64")
    assert all(len(r) < 300 for r in reasons)  # not the 8,000 characters of base64
    assert not (tmp_path / "images").exists()  # nothing written for them


def test_one_image_embedded_in_two_rows_is_one_file_and_the_rows_are_duplicates(tmp_path, weather_images):
    picture = next((weather_images / "images" / "train").iterdir())
    row = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _uri(picture)}}]},
                        {"role": "assistant", "content": "sun"}]}
    raws = [RawRow("chat.jsonl", i, row, None) for i in (1, 2)]
    result = fix_dataset(raws, FixConfig(), embedded_dir=tmp_path / "images")
    (kept,) = result.kept
    assert [q["reason"] for q in result.quarantined] == ["duplicate: same messages as chat.jsonl:1"]
    (stored,) = (tmp_path / "images").iterdir()
    assert stored.read_bytes() == picture.read_bytes() and stored.suffix == ".png"
    assert kept["messages"][0]["content"] == [{"type": "image", "image": str(stored)}]
    # without a folder to write to (eval prompt files, data_prep/fix.py) the URI stays, and opens alike
    (alone,) = fix_dataset(raws[:1], FixConfig()).kept
    (uri,) = [p["image"] for p in alone["messages"][0]["content"]]
    assert uri == _uri(picture)
    assert open_images([uri])[0].tobytes() == open_images([stored])[0].tobytes()


def test_an_image_column_reads_as_data_uris_and_other_bytes_name_their_field(tmp_path, weather_images):
    picture = next((weather_images / "images" / "train").iterdir())
    messages = [{"role": "user", "content": "<image>Weather?"}, {"role": "assistant", "content": "sun"}]
    table = datasets.Dataset.from_list([
        {"id": "bytes", "messages": messages, "images": [{"bytes": picture.read_bytes(), "path": None}]},
        {"id": "path", "messages": messages, "images": [{"bytes": None, "path": str(picture)}]},
    ]).cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
    table.to_parquet(str(tmp_path / "t.parquet"))
    first, second = read_raw_rows(tmp_path / "t.parquet")
    assert first.data["images"] == [_uri(picture)] and second.data["images"] == [str(picture)]

    datasets.Dataset.from_list([{"id": "blob", "messages": messages, "blob": b"\x00\x01"}]).to_parquet(
        str(tmp_path / "blob.parquet"))
    (blob,) = read_raw_rows(tmp_path / "blob.parquet")
    assert blob.data is None and blob.error.startswith("not representable as JSON: blob holds bytes data")


def test_urls_are_refused_naming_them_where_images_are_opened(tmp_path, tiny_vl_dir, weather_images):
    rows = _with_data_uris(_rows(weather_images), weather_images)
    for r in rows[:5]:
        r["messages"][1]["content"][0] = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    (tmp_path / "urls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InvalidInput) as refused:
        _data_stage(tmp_path, tiny_vl_dir, "urls", tmp_path / "urls.jsonl")
    assert "top reasons: image_remote 5" in str(refused.value)
    assert "image_remote: https://example.com/a.png: a URL; images are read from files or data: URIs here, " \
           "never fetched: download them and name the files" in str(refused.value)
    assert "hint: the images are URLs, and nothing here fetches them" in str(refused.value)


def test_eval_prompts_with_embedded_images_render_as_with_files_and_urls_are_refused(tmp_path, tiny_vl_dir,
                                                                                        weather_images):
    from transformers import AutoConfig

    from specforge.eval.prompts import load_suites
    from specforge.targets.loader import load_tokenizer
    from specforge.targets.vl import load_image_processor, vl_info

    rows = _rows(weather_images)[:2]
    for r in rows:  # image paths absolute, as the data stage writes them: the suite file may live anywhere
        r["messages"][1]["content"] = [{**p, "image": str(weather_images / p["image"])} if p["type"] == "image" else p
                                       for p in r["messages"][1]["content"]]
    suites = {"files": rows, "uris": _with_data_uris(rows, weather_images)}
    suites["urls"] = json.loads(json.dumps(suites["uris"]))
    url = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    suites["urls"][1]["messages"][1]["content"][0] = url
    for name, suite in suites.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in suite))
    vl = (load_image_processor(tiny_vl_dir, 4096, 16384), vl_info(AutoConfig.from_pretrained(tiny_vl_dir)))

    def load(*names):
        files = ",".join(str(tmp_path / f"{n}.jsonl") for n in names)
        cfg = compose_cfg(tmp_path, tiny_vl_dir, f"eval.suites=[{files}]")
        return load_suites(cfg, cfg.eval, load_tokenizer(cfg.target), vl)

    files, uris = load("files", "uris").values()
    assert [p["input_ids"] for p in uris] == [p["input_ids"] for p in files]
    for mine, theirs in zip(uris, files):
        assert mine["images"]["pixel_values"].equal(theirs["images"]["pixel_values"])
    second = rows[1]["id"]
    refusal = f"eval.suites: .*urls.jsonl, line 2: prompt '{second}': https://example.com/a.png: a URL"
    with pytest.raises(InvalidInput, match=refusal):
        load("urls")


def test_a_run_deleted_and_run_again_writes_its_images_again_though_the_workers_output_is_cached(
        tmp_path, tiny_vl_dir, weather_images):
    """data.num_proc caches what the workers return under cache_dir, naming the image files they
    wrote into the run; `rm -rf outputs/<run>` then the same command must not train on names of
    files that went with it."""
    rows = _with_data_uris(_rows(weather_images), weather_images)
    (tmp_path / "uris.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = _data_stage(tmp_path, tiny_vl_dir, "run", tmp_path / "uris.jsonl", "data.num_proc=2")
    samples = (first / "train.jsonl").read_bytes()
    shutil.rmtree(tmp_path / "run")
    again = _data_stage(tmp_path, tiny_vl_dir, "run", tmp_path / "uris.jsonl", "data.num_proc=2")
    assert (again / "train.jsonl").read_bytes() == samples
    assert all(Path(p).is_file() for s in read_jsonl(again / "train.jsonl") for p in s["images"])


def test_images_of_a_finished_data_stage_deleted_by_hand_are_written_again(tmp_path, tiny_vl_dir, weather_images,
                                                                             capsys):
    """The data stage is skipped while its inputs are unchanged; the images it wrote from the data
    are its outputs, so one deleted (to save space, say) runs it again, not the extraction into a
    missing file; so does a deleted samples file."""
    from specforge.pipeline import run_pipeline

    rows = _with_data_uris(_rows(weather_images), weather_images)
    (tmp_path / "uris.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_cfg(tmp_path, tiny_vl_dir, f"data.train_files=[{tmp_path / 'uris.jsonl'}]", "data.eval_files=[]",
                      "stages=[data]")
    run_pipeline(cfg)
    data = tmp_path / "outputs" / "qwen3vl_tiny" / "data"
    samples = (data / "train.jsonl").read_bytes()
    run_pipeline(cfg)
    assert "[pipeline] data: up to date" in capsys.readouterr().out
    lost = next((data / "images").iterdir())
    lost.unlink()
    run_pipeline(cfg)
    said = capsys.readouterr().out
    assert f"up to date, but the image {lost} it wrote from the data is gone: running it again" in said
    assert lost.is_file() and (data / "train.jsonl").read_bytes() == samples
    (data / "train.jsonl").unlink()
    run_pipeline(cfg)
    assert f"up to date, but {data / 'train.jsonl'} is gone: running it again" in capsys.readouterr().out
    assert (data / "train.jsonl").read_bytes() == samples


def test_the_images_folder_holds_the_images_the_samples_name_and_the_report_counts_them(tmp_path, tiny_vl_dir,
                                                                                      weather_images):
    rows = _with_data_uris(_rows(weather_images), weather_images)
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "some.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    _data_stage(tmp_path, tiny_vl_dir, "run", tmp_path / "all.jsonl")
    data = _data_stage(tmp_path, tiny_vl_dir, "run", tmp_path / "some.jsonl")  # the data edited: fewer rows
    named = {Path(p) for s in read_jsonl(data / "train.jsonl") for p in s["images"]}
    assert set((data / "images").iterdir()) == named and len(named) >= 3
    size = sum(p.stat().st_size for p in named)
    assert json.loads((data / "report.json").read_text())["embedded_images"] == {"files": len(named), "bytes": size}
    report = (data / "report.md").read_text()
    assert f"{len(named)} distinct, {size / 1e6:.1f} MB." in report
