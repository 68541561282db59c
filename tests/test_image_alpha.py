"""RGBA images with transparent pixels (logos, icons, screenshots of a UI). SGLang converts them to RGB,
keeping the colour stored under the alpha; vLLM composites them onto white. data.image_alpha picks which the
target sees in training, and the data stage counts them either way (as data.image_orientation does for EXIF)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from specforge.config import FixConfig
from specforge.data.fix import fix_dataset
from specforge.data.fix.conversations import ImageLoading
from specforge.errors import InvalidInput
from specforge.targets.vl import open_images
from specforge.utils.images import EXIF_ORIENTATION, served_png, transparent
from specforge.utils.io import read_jsonl
from test_image_orientation import _data_stage, _image, _rows

WHITE = ImageLoading(on_white=True)


def logo(path: Path, fmt: str = "PNG") -> Path:
    """A 48 x 16 RGBA picture: an opaque blue left third, a half-transparent red middle, and a right third fully
    transparent over black (what many exporters store under alpha 0)."""
    pixels = np.zeros((16, 48, 4), dtype=np.uint8)
    pixels[:, :16] = (20, 40, 200, 255)
    pixels[:, 16:32] = (200, 0, 0, 128)
    Image.fromarray(pixels, "RGBA").save(path, format=fmt)
    return path


def test_the_white_copy_has_the_pixels_vllm_gives_and_the_stored_read_sglangs(tmp_path):
    image = logo(tmp_path / "logo.png")
    (white,) = open_images([_data_uri(served_png(image, on_white=True))])
    (stored,) = open_images([image])
    w, s = np.asarray(white), np.asarray(stored)
    assert (w[0, 0] == (20, 40, 200)).all() and (s[0, 0] == (20, 40, 200)).all()  # opaque: the same
    assert (w[0, 40] == 255).all() and (s[0, 40] == 0).all()  # transparent: white for vLLM, black for SGLang
    assert abs(int(w[0, 20, 1]) - round(255 * 127 / 255)) <= 1 and s[0, 20, 1] == 0  # half: blended


def test_only_rgba_with_a_transparent_pixel_counts(tmp_path):
    assert transparent(logo(tmp_path / "logo.png")) and transparent(logo(tmp_path / "logo.webp", "WEBP"))
    Image.new("RGBA", (8, 8), (1, 2, 3, 255)).save(tmp_path / "opaque.png")
    palette = Image.new("P", (8, 8), 0)
    palette.info["transparency"] = 0
    palette.save(tmp_path / "palette.png")  # servers convert a palette image alike, transparent or not
    Image.new("LA", (8, 8), (100, 0)).save(tmp_path / "gray.png")
    assert not any(transparent(tmp_path / name) for name in ("opaque.png", "palette.png", "gray.png"))


def test_drop_keeps_the_image_and_counts_it_white_fixes_it_with_a_copy(tmp_path):
    image = logo(tmp_path / "logo.png")
    Image.new("RGB", (32, 32)).save(tmp_path / "plain.png")
    refs = ["logo.png", "plain.png", _data_uri(image.read_bytes())]

    dropped = fix_dataset(_rows(tmp_path, refs), FixConfig(), image_root=None, embedded_dir=tmp_path / "images")
    assert _image(dropped.kept[0]) == str(image)
    assert [r["kept_as_written"] for r in dropped.kept] == [["image_transparent"], [], ["image_transparent"]]
    assert dropped.counts["by_kept_as_written"] == {"image_transparent": 2} and dropped.counts["fixed"] == 0

    white = fix_dataset(_rows(tmp_path, refs), FixConfig(), image_root=None, embedded_dir=tmp_path / "images",
                        loading=WHITE)
    copies = [Path(_image(r)) for r in white.kept]
    assert copies[0] == copies[2] and copies[0].parent == tmp_path / "images" and copies[1] == tmp_path / "plain.png"
    assert copies[0].read_bytes() == served_png(image, on_white=True)
    assert [r["fixes"] for r in white.kept] == [["image_alpha_white"], [], ["image_alpha_white"]]
    assert white.counts["by_fix"] == {"image_alpha_white": 2} and white.counts["by_kept_as_written"] == {}


def test_a_turned_transparent_image_gets_one_copy_with_both_fixes(tmp_path):
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    pixels = np.zeros((16, 48, 4), dtype=np.uint8)
    pixels[:, :16] = (20, 40, 200, 255)
    Image.fromarray(pixels, "RGBA").save(tmp_path / "both.png", exif=exif)
    both = ImageLoading(upright=True, on_white=True)
    (row,) = fix_dataset(_rows(tmp_path, ["both.png"]), FixConfig(), loading=both).kept
    assert row["fixes"] == ["image_upright", "image_alpha_white"] and row["kept_as_written"] == []
    (copy,) = open_images([_image(row)])
    assert copy.size == (16, 48) and (np.asarray(copy)[-1, 0] == 255).all()  # turned, and white where it was clear
    (row,) = fix_dataset(_rows(tmp_path, ["both.png"]), FixConfig(), loading=WHITE).kept
    assert row["fixes"] == ["image_alpha_white"] and row["kept_as_written"] == ["image_exif_turned"]


@pytest.mark.parametrize("num_proc", [0, 2])
def test_the_data_stage_renders_what_the_setting_says_and_reports_it(tmp_path, tiny_vl_dir, num_proc):
    logo(tmp_path / "logo.png")
    rows = [{"id": "r0", "messages": [
        {"role": "user", "content": [{"type": "image", "image": "logo.png"}, {"type": "text", "text": "Logo?"}]},
        {"role": "assistant", "content": "a blue bar"}]}]
    (tmp_path / "photos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {a: _data_stage(tmp_path, tiny_vl_dir, a, f"data.num_proc={num_proc}", f"data.image_alpha={a}")
            for a in ("drop", "white")}
    (drop,), (white,) = (list(read_jsonl(runs[a] / "train.jsonl")) for a in ("drop", "white"))
    assert drop["input_ids"] == white["input_ids"] and drop["images"] != white["images"]
    reports = {a: json.loads((d / "report.json").read_text())["splits"]["train"] for a, d in runs.items()}
    assert reports["drop"]["by_kept_as_written"] == {"image_transparent": 1}
    assert reports["white"]["by_fix"] == {"image_alpha_white": 1}
    assert "set data.image_alpha=white" in (runs["drop"] / "report.md").read_text()


def test_a_misspelled_setting_is_refused_before_any_row_is_read(tmp_path, tiny_vl_dir):
    (tmp_path / "photos.jsonl").write_text("")
    with pytest.raises(InvalidInput, match="data.image_alpha"):
        _data_stage(tmp_path, tiny_vl_dir, "bad", "data.image_alpha=black")


def _data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()
