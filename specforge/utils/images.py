"""Images that travel as bytes instead of files: base64 `data:` URIs (OpenAI-style chat logs, requests
to a server) and the image columns of Parquet / Arrow tables. One decoder for the data stage, the
targets' image inputs and the server, limited to the common photo formats (none of PIL's rarer or
externally delegated decoders: EPS runs Ghostscript).
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from contextlib import contextmanager
from typing import Iterator

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
EXIF_ORIENTATION = 0x0112  # 1: upright as stored; 2-8: mirrored and/or turned (a camera held sideways)
REMOTE_PREFIXES = ("http://", "https://")
_DATA_URI = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?;base64,(.*)", re.DOTALL)


class ImageTooLarge(ValueError):
    """More pixels than PIL decodes without calling it a decompression bomb (Image.MAX_IMAGE_PIXELS)."""


class RemoteImage(ValueError):
    """An image named by URL where it must be read here: nothing of ours fetches from the network."""


def is_data_uri(ref: str) -> bool:
    return ref.startswith("data:")


def is_remote(ref: str) -> bool:
    return ref.startswith(REMOTE_PREFIXES)


def describe(ref: str) -> str:
    """`ref` as a message may quote it: a data URI by its head and size, not its thousands of characters."""
    if not is_data_uri(ref):
        return ref
    head, _, payload = ref.partition(",")
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    return f"{head} ({size:,} bytes)" if len(ref) > 80 else ref


def data_uri_payload(uri: str) -> str:
    """The base64 text of `data:[image/<type>];base64,<data>`; ValueError for any other spelling."""
    match = _DATA_URI.fullmatch(uri)
    if match is None:
        raise ValueError("a data URI must read data:image/<type>;base64,<data>")
    return match.group(2)


def b64_bytes(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the data URI is not valid base64 ({e})") from None


def data_uri_bytes(uri: str) -> bytes:
    return b64_bytes(data_uri_payload(uri))


def to_data_uri(data: bytes) -> str:
    """`data` as a data URI, its type named where PIL recognises the bytes (left out otherwise: the
    decoder, not the label, decides whether they are an image)."""
    fmt = image_format(data)
    kind = f"image/{fmt.lower()}" if fmt else ""
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"


def as_data_uri(ref: str) -> str:
    """An image reference as a client sends it to a server: a local file as a base64 data URI, which
    every server takes (vLLM refuses a bare path, and reads file:// URLs only under
    --allowed-local-media-path; a server on another machine has not the file); a data URI or a URL
    as it is."""
    if is_data_uri(ref) or is_remote(ref):
        return ref
    with open(ref, "rb") as f:
        return to_data_uri(f.read())


def image_format(data: bytes) -> str | None:
    """"PNG", "JPEG", ... for bytes of one of IMAGE_FORMATS (read from the header), else None."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
            return im.format
    except Exception:  # PIL's openers raise many types for bytes that are not theirs
        return None


@contextmanager
def opened(source, formats: tuple[str, ...] | None = None) -> Iterator:
    """PIL's Image.open (of a path or a file object) with its decompression-bomb limit a refusal:
    ImageTooLarge past Image.MAX_IMAGE_PIXELS, where PIL only warns up to twice that and then raises
    an error of its own."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, not warned about
        try:
            image = Image.open(source, formats=formats)
        except Image.DecompressionBombError as e:
            raise ImageTooLarge(str(e)) from None
    with image:
        if image.width * image.height > Image.MAX_IMAGE_PIXELS:
            raise ImageTooLarge(f"{image.width}x{image.height} pixels, more than {Image.MAX_IMAGE_PIXELS:,}")
        yield image


def decode_image(data: bytes):
    """An RGB PIL image from encoded bytes; ValueError saying why not (ImageTooLarge past PIL's
    decompression-bomb limit, which a few KB of PNG can claim)."""
    try:
        with opened(io.BytesIO(data), IMAGE_FORMATS) as im:
            return im.convert("RGB")
    except ImageTooLarge:
        raise
    except Exception as e:  # PIL's decoders raise many types (OSError, ValueError, SyntaxError, ...)
        raise ValueError(f"cannot be read as an image ({', '.join(IMAGE_FORMATS)}): {type(e).__name__}: {e}") from None


def exif_orientation(source) -> int:
    """The EXIF Orientation tag (1-8) of an image file or bytes; 1, upright as stored, where it has none
    or an unreadable one (the engines that apply the tag skip a malformed one too)."""
    try:
        with _opened_source(source) as im:
            value = im.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # the image itself is checked elsewhere; PIL's EXIF parser raises many types
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def upright_png(source) -> bytes:
    """The image (a file or bytes) turned as its EXIF orientation says, as RGB PNG bytes: the pixels a
    loader that applies the tag (vLLM's, transformers' load_image) hands the model, with no tag left for
    any later reader to apply again."""
    from PIL import ImageOps

    with _opened_source(source) as im:
        upright = ImageOps.exif_transpose(im).convert("RGB")
    out = io.BytesIO()
    upright.save(out, format="PNG")
    return out.getvalue()


def _opened_source(source):
    """opened() of a file, or of bytes limited to IMAGE_FORMATS as decode_image limits them."""
    return opened(io.BytesIO(source), IMAGE_FORMATS) if isinstance(source, bytes) else opened(source)
