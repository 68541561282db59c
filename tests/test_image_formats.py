"""Which image formats are read: one list (utils/images.py: image_formats) for files and embedded bytes,
in the data stage, the target and the server alike. A phone's HEIC photo, which PIL (and so SGLang and
vLLM) cannot decode, and formats outside the list (EPS, whose pixels PIL gets from Ghostscript) are
quarantined naming the format, not as bytes that are "unreadable"."""
from __future__ import annotations

import base64
import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image

from specforge.config import FixConfig
from specforge.data.fix import fix_dataset
from specforge.targets.vl import open_images
from specforge.utils.images import OtherFormat, decode_image, image_formats, load_image
from test_image_orientation import _image, _rows


def heic_bytes() -> bytes:
    """The head of an iPhone photo: an ISO-BMFF `ftyp` box of major brand `heic` (what identifies the
    format; no decoder here goes further)."""
    return struct.pack(">I", 24) + b"ftypheic" + b"\0\0\0\0" + b"mif1heic" + bytes(64)


def _uri(data: bytes, kind: str) -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture
def photos(tmp_path) -> Path:
    picture = Image.new("RGB", (24, 16), (30, 90, 200))
    picture.save(tmp_path / "scan.tif")
    picture.save(tmp_path / "drawing.eps")
    (tmp_path / "IMG_0001.HEIC").write_bytes(heic_bytes())
    if "AVIF" in image_formats():
        picture.save(tmp_path / "photo.avif")
    return tmp_path


def test_heic_and_formats_outside_the_list_are_quarantined_naming_the_format(photos):
    eps = (photos / "drawing.eps").read_bytes()
    refs = ["IMG_0001.HEIC", "drawing.eps", _uri(heic_bytes(), "heic"), _uri(eps, "eps"), "scan.tif"]
    result = fix_dataset(_rows(photos, refs), FixConfig(), image_root=None, embedded_dir=photos / "images")
    reasons = [q["reason"] for q in result.quarantined]
    heic = "HEIC/HEIF (an iPhone's photos), which PIL reads only with the pillow-heif plugin and SGLang and vLLM"
    assert reasons[0].startswith(f"image_format: IMG_0001.HEIC ({heic}")
    assert reasons[1].startswith("image_format: drawing.eps (EPS, not one of the formats read here (PNG, JPEG,")
    assert reasons[2] == (
        f"image_format: data:image/heic;base64 (88 bytes): {heic} not at all: convert it to JPEG or PNG")
    assert reasons[3].startswith("image_format: data:image/eps;base64 (") and ": EPS, not one of" in reasons[3]
    assert result.counts["by_reason"] == {"image_format": 4}
    assert [r["messages"][0]["content"][0]["image"] for r in result.kept] == [str(photos / "scan.tif")]


def test_the_target_refuses_them_by_name_without_running_ghostscript(photos, monkeypatch):
    def no_ghostscript(*args, **kwargs):
        raise AssertionError("Ghostscript was run")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", no_ghostscript)
    with pytest.raises(OtherFormat, match="EPS, not one of"):
        load_image(photos / "drawing.eps")
    with pytest.raises(ValueError, match=r"image .*drawing.eps: EPS, not one of the formats read here"):
        open_images([photos / "drawing.eps"])
    with pytest.raises(ValueError, match=r"image .*IMG_0001.HEIC: HEIC/HEIF"):
        open_images([photos / "IMG_0001.HEIC"])


def test_a_file_and_its_bytes_read_alike_in_every_format_of_the_list(photos):
    """TIFF scans and AVIF photos were read from files and refused as embedded bytes (a Parquet Image
    column, a data URI): now one list serves both, and both give the same pixels."""
    files = ["scan.tif"] + (["photo.avif"] if "AVIF" in image_formats() else [])
    for name in files:
        path = photos / name
        from_file, from_bytes = load_image(path), decode_image(path.read_bytes())
        assert from_file.size == (24, 16) and np.array_equal(np.asarray(from_file), np.asarray(from_bytes))
    uris = [_uri((photos / name).read_bytes(), Path(name).suffix[1:]) for name in files]
    result = fix_dataset(_rows(photos, files + uris), FixConfig(), image_root=None, embedded_dir=photos / "images")
    assert result.counts["quarantined"] == 0 and len(result.kept) == 2 * len(files)
    written = [Path(_image(r)) for r in result.kept[len(files):]]
    assert [p.suffix for p in written] == [".tiff", ".avif"][:len(files)]


def test_bytes_no_decoder_takes_for_an_image_stay_unreadable(tmp_path):
    (tmp_path / "notes.png").write_bytes(b"not an image at all")
    result = fix_dataset(_rows(tmp_path, ["notes.png"]), FixConfig(), image_root=None)
    assert [q["reason"] for q in result.quarantined] == [
        f"image_unreadable: notes.png (resolved to {tmp_path}/notes.png)"]
    with pytest.raises(ValueError, match=r"cannot be read as an image \(PNG, JPEG, WEBP, GIF, BMP, TIFF"):
        decode_image(io.BytesIO(b"not an image at all").getvalue())
