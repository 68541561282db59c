"""Photos whose EXIF orientation turns them (a camera held sideways). SGLang reads them as stored,
vLLM and transformers' load_image turn them upright; data.image_orientation picks which the target
sees in training, and the data stage counts them either way."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from specforge.config import FixConfig
from specforge.data import stage
from specforge.data.fix import fix_dataset
from specforge.data.fix.conversations import ImageLoading
from specforge.data.formats import RawRow
from specforge.errors import InvalidInput
from specforge.eval.prompts import file_conversations
from specforge.targets.vl import open_images
from specforge.utils.images import EXIF_ORIENTATION, data_uri_bytes, exif_orientation, upright_png
from specforge.utils.io import read_jsonl

UPRIGHT = ImageLoading(upright=True)
TURNED = 6  # shown turned 90 degrees clockwise: a phone held upright, its sensor sideways


def sideways_photo(path: Path, orientation: int = TURNED, fmt: str = "JPEG") -> Path:
    """A 96 x 32 picture (a dark bar on the left, so any turn or mirror moves it) tagged `orientation`."""
    image = Image.new("RGB", (96, 32), (230, 200, 120))
    ImageDraw.Draw(image).rectangle([0, 0, 15, 31], fill=(20, 40, 200))
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    image.save(path, format=fmt, exif=exif)
    return path


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


@pytest.mark.parametrize("orientation", range(2, 9))
def test_the_upright_copy_has_the_pixels_transformers_load_image_gives(tmp_path, orientation):
    from transformers.image_utils import load_image

    photo = sideways_photo(tmp_path / "p.jpg", orientation)
    assert exif_orientation(photo) == orientation
    copy = upright_png(photo)
    with Image.open(io.BytesIO(copy)) as im:
        assert im.format == "PNG" and exif_orientation(copy) == 1  # no tag left for a later reader to apply again
        np.testing.assert_array_equal(pixels(im), pixels(load_image(str(photo))))
    assert upright_png(photo.read_bytes()) == copy  # bytes (a data URI's) as a file
    assert (pixels(load_image(str(photo))).shape[:2] == (96, 32)) == (orientation >= 5)  # 5-8 swap the sides


def test_images_without_a_turn_read_as_upright(tmp_path):
    plain = tmp_path / "plain.png"
    Image.new("RGB", (8, 4)).save(plain)
    assert exif_orientation(plain) == 1
    assert exif_orientation(sideways_photo(tmp_path / "one.jpg", orientation=1)) == 1
    assert exif_orientation(tmp_path / "missing.png") == 1  # the image check names it; the tag reader does not


def _rows(tmp_path: Path, refs: list[str]) -> list[RawRow]:
    return [RawRow(str(tmp_path / "data.jsonl"), i + 1, {"id": f"r{i}", "messages": [
        {"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": f"Weather {i}?"}]},
        {"role": "assistant", "content": "sunny"}]}, None) for i, ref in enumerate(refs)]


def _image(row: dict) -> str:
    return row["messages"][0]["content"][0]["image"]


def test_stored_keeps_the_photo_and_counts_it_upright_fixes_it_with_a_copy(tmp_path):
    photo = sideways_photo(tmp_path / "side.jpg")
    plain = tmp_path / "plain.png"
    Image.new("RGB", (32, 32)).save(plain)
    uri = "data:image/jpeg;base64," + base64.b64encode(photo.read_bytes()).decode()
    refs = ["side.jpg", "plain.png", uri, "side.jpg"]

    stored = fix_dataset(_rows(tmp_path, refs), FixConfig(), image_root=None, embedded_dir=tmp_path / "images")
    assert [_image(r) for r in stored.kept][:2] == [str(photo), str(plain)]
    assert [r["kept_as_written"] for r in stored.kept] == [["image_exif_turned"], [], ["image_exif_turned"],
                                                           ["image_exif_turned"]]
    assert stored.counts["by_kept_as_written"] == {"image_exif_turned": 3} and stored.counts["fixed"] == 0
    assert exif_orientation(Path(_image(stored.kept[2]))) == TURNED  # the data URI's bytes, written as they came

    upright = fix_dataset(_rows(tmp_path, refs), FixConfig(), image_root=None, embedded_dir=tmp_path / "images",
                          loading=UPRIGHT)
    copies = [Path(_image(r)) for r in upright.kept]
    assert copies[1] == plain and copies[0] == copies[2] == copies[3]  # one copy of the same pixels, however named
    assert copies[0].parent == tmp_path / "images" and copies[0].suffix == ".png"
    assert copies[0].read_bytes() == upright_png(photo) and photo.exists()  # the user's file is left as it is
    assert [r["fixes"] for r in upright.kept] == [["image_upright"], [], ["image_upright"], ["image_upright"]]
    assert upright.counts["by_fix"] == {"image_upright": 3} and upright.counts["by_kept_as_written"] == {}
    (image,) = open_images([copies[0]])
    assert image.size == (32, 96)

    inline = fix_dataset(_rows(tmp_path, refs[:1]), FixConfig(), loading=UPRIGHT)  # no folder: the copy travels inline
    assert data_uri_bytes(_image(inline.kept[0])) == upright_png(photo)


def test_with_the_fix_step_off_the_images_are_still_turned_and_counted(tmp_path):
    from specforge.data.fix.conversations import ImageChecker
    from specforge.data.rows import normalise_row

    photo = sideways_photo(tmp_path / "side.jpg")
    (raw,) = _rows(tmp_path, ["side.jpg"])
    off = FixConfig(enabled=False)
    conv, fixes = normalise_row(raw, off, "auto", ImageChecker(None), None)
    assert (_image(conv), fixes, conv["kept_as_written"]) == (str(photo), [], ["image_exif_turned"])
    conv, fixes = normalise_row(raw, off, "auto", ImageChecker(None, tmp_path / "images", UPRIGHT), None)
    assert (fixes, conv["kept_as_written"]) == (["image_upright"], [])
    assert Path(_image(conv)).read_bytes() == upright_png(photo)


def test_an_eval_suite_file_follows_the_run(tmp_path):
    sideways_photo(tmp_path / "side.jpg")
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"id": "q", "messages": [
        {"role": "user", "content": [{"type": "image", "image": "side.jpg"}, {"type": "text", "text": "Weather?"}]}]}))
    (stored,) = file_conversations(str(suite))
    (upright,) = file_conversations(str(suite), loading=UPRIGHT)
    assert _image(stored) == str(tmp_path / "side.jpg")
    assert open_images([_image(upright)])[0].size == (32, 96)


def _data_stage(tmp_path, tiny_vl_dir, name: str, *overrides) -> Path:
    from test_pipeline_vl import compose_cfg

    cfg = compose_cfg(tmp_path, tiny_vl_dir, f"data.train_files=[{tmp_path / 'photos.jsonl'}]", "data.eval_files=[]",
                      "data.fix.toon=false",
                      f"cache_dir={tmp_path / ('cache-' + name)}", *overrides)
    stage.run(cfg, tmp_path / name)
    return tmp_path / name / "data"


@pytest.mark.parametrize("num_proc", [0, 2])
def test_the_data_stage_renders_what_the_setting_says_and_reports_it(tmp_path, tiny_vl_dir, num_proc):
    sideways_photo(tmp_path / "side.jpg")
    Image.new("RGB", (64, 64), (10, 120, 30)).save(tmp_path / "plain.png")
    rows = [{"id": f"r{i}", "messages": [
        {"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": f"Weather {i}?"}]},
        {"role": "assistant", "content": f"sunny, {i} degrees"}]} for i, ref in enumerate(["side.jpg", "plain.png"])]
    (tmp_path / "photos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    runs = {o: _data_stage(tmp_path, tiny_vl_dir, o, f"data.num_proc={num_proc}", f"data.image_orientation={o}")
            for o in ("stored", "upright")}
    samples = {o: list(read_jsonl(d / "train.jsonl")) for o, d in runs.items()}
    (_, h, w), plain = samples["stored"][0]["image_grid_thw"][0], samples["stored"][1]
    assert w > h  # 96 x 32 as stored
    assert samples["upright"][0]["image_grid_thw"] == [[1, w, h]]
    assert samples["upright"][1] == plain  # an image without a turn trains the same either way
    reports = {o: json.loads((d / "report.json").read_text()) for o, d in runs.items()}
    assert reports["stored"]["splits"]["train"]["by_kept_as_written"] == {"image_exif_turned": 1}
    assert reports["upright"]["splits"]["train"]["by_fix"] == {"image_upright": 1}
    assert "set data.image_orientation=upright" in (runs["stored"] / "report.md").read_text()
    assert "upright PNG copy (data.image_orientation=upright), as vLLM serves it" in (runs["upright"] / "report.md").read_text()


def test_a_misspelled_orientation_is_refused_before_any_row_is_read(tmp_path, tiny_vl_dir):
    (tmp_path / "photos.jsonl").write_text("")
    with pytest.raises(InvalidInput, match="data.image_orientation"):
        _data_stage(tmp_path, tiny_vl_dir, "bad", "data.image_orientation=sideways")
