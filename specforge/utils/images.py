"""Images that travel as bytes instead of files: base64 `data:` URIs (OpenAI-style chat logs, requests
to a server) and the image columns of Parquet / Arrow tables. One decoder for the data stage, the
targets' image inputs and the server, limited to the common photo formats (none of PIL's rarer or
externally delegated decoders: EPS runs Ghostscript). Image files are read through the same list.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

PHOTO_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
# ISO-BMFF major brands of HEIF images (HEIC: an iPhone's photos), which PIL decodes only with the
# pillow-heif plugin, and SGLang and vLLM, which register no such plugin, not at all.
HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1")
EXIF_ORIENTATION = 0x0112  # 1: upright as stored; 2-8: mirrored and/or turned (a camera held sideways)
REMOTE_PREFIXES = ("http://", "https://")
_DATA_URI = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?;base64,(.*)", re.DOTALL)


@lru_cache(maxsize=1)
def image_formats() -> tuple[str, ...]:
    """The PHOTO_FORMATS this PIL build decodes (AVIF: Pillow 11.3 or newer, built with libavif)."""
    from PIL import Image

    Image.init()
    return tuple(f for f in PHOTO_FORMATS if f in Image.OPEN)


class ImageTooLarge(ValueError):
    """More pixels than PIL decodes without calling it a decompression bomb (Image.MAX_IMAGE_PIXELS)."""


class RemoteImage(ValueError):
    """An image named by URL where it must be read here: nothing of ours fetches from the network."""


class OtherFormat(ValueError):
    """An image file of a format outside image_formats(): HEIC, EPS, PSD, ..."""


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
    """"PNG", "JPEG", ... for bytes of one of image_formats() (read from the header), else None."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=image_formats()) as im:
            return im.format
    except Exception:  # PIL's openers raise many types for bytes that are not theirs
        return None


@contextmanager
def opened(source) -> Iterator:
    """PIL's Image.open (of a path or a file object) for image_formats() only, OtherFormat naming any
    other it recognises, and with its decompression-bomb limit a refusal: ImageTooLarge past
    Image.MAX_IMAGE_PIXELS, where PIL only warns up to twice that and then raises an error of its own."""
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, not warned about
        try:
            image = Image.open(source, formats=image_formats())
        except Image.DecompressionBombError as e:
            raise ImageTooLarge(str(e)) from None
        except UnidentifiedImageError:
            other = other_format(source)
            if other:
                raise OtherFormat(other) from None
            raise
    with image:
        if image.width * image.height > Image.MAX_IMAGE_PIXELS:
            raise ImageTooLarge(f"{image.width}x{image.height} pixels, more than {Image.MAX_IMAGE_PIXELS:,}")
        yield image


def other_format(source) -> str | None:
    """What an image outside image_formats() is, said for a person ("HEIC/HEIF ...", "EPS ..."), or None
    for bytes that no PIL decoder takes for an image. Only headers are read: PIL's EPS opener runs
    Ghostscript when the pixels are loaded, not here."""
    from PIL import Image

    read = image_formats()
    if isinstance(source, str) or hasattr(source, "__fspath__"):
        with open(source, "rb") as f:
            head = f.read(12)
    else:
        source.seek(0)
        head = source.read(12)
        source.seek(0)
    if head[4:8] == b"ftyp" and head[8:12] in HEIF_BRANDS:
        return ("HEIC/HEIF (an iPhone's photos), which PIL reads only with the pillow-heif plugin and SGLang "
                "and vLLM not at all: convert it to JPEG or PNG")
    try:
        with Image.open(source) as im:
            found = im.format
    except Exception:  # no decoder of PIL's takes it for an image
        return None
    finally:
        if hasattr(source, "seek"):
            source.seek(0)
    return f"{found}, not one of the formats read here ({', '.join(read)}): convert it to PNG or JPEG"


def load_image(path):
    """An RGB PIL image from an image file; ValueError saying why not, as decode_image."""
    try:
        with opened(path) as im:
            return im.convert("RGB")
    except ValueError:  # ImageTooLarge, OtherFormat
        raise
    except Exception as e:  # PIL's decoders raise many types (OSError, ValueError, SyntaxError, ...)
        formats = ", ".join(image_formats())
        raise ValueError(f"cannot be read as an image ({formats}): {type(e).__name__}: {e}") from None


def decode_image(data: bytes):
    """An RGB PIL image from encoded bytes; ValueError saying why not (ImageTooLarge past PIL's
    decompression-bomb limit, which a few KB of PNG can claim; OtherFormat for HEIC, EPS, ...)."""
    return load_image(io.BytesIO(data))


def exif_orientation(source) -> int:
    """The EXIF Orientation tag (1-8) of an image file or bytes; 1, upright as stored, where it has none
    or an unreadable one (the engines that apply the tag skip a malformed one too)."""
    try:
        return orientation_and_transparency(source)[0]
    except Exception:  # the image itself is checked elsewhere
        return 1


def transparent(source) -> bool:
    """Whether an image (a file or bytes) is RGBA with pixels not fully opaque: the one kind whose pixels
    servers read differently. SGLang converts it to RGB, keeping the colour stored under the alpha;
    vLLM composites it onto white (its rgba_to_rgb). Other modes with transparency (palette, LA) both
    convert alike."""
    return orientation_and_transparency(source)[1]


def orientation_and_transparency(source) -> tuple[int, bool]:
    """(exif_orientation, transparent) of an image file or bytes, from one opening of it."""
    with _opened_source(source) as im:
        try:
            value = im.getexif().get(EXIF_ORIENTATION, 1)
        except Exception:  # PIL's EXIF parser raises many types
            value = 1
        clear = im.mode == "RGBA" and im.getchannel("A").getextrema()[0] < 255
    return (value if isinstance(value, int) and 1 <= value <= 8 else 1), clear


def served_png(source, upright: bool = False, on_white: bool = False) -> bytes:
    """The image (a file or bytes) as RGB PNG bytes the way a server loads it: turned as its EXIF
    orientation says (`upright`: vLLM's and transformers' load_image; no tag left for a later reader to
    apply again) and RGBA composited onto white (`on_white`: vLLM's rgba_to_rgb)."""
    from PIL import Image, ImageOps

    with _opened_source(source) as im:
        image = ImageOps.exif_transpose(im) if upright else im.copy()
    if on_white and image.mode == "RGBA":  # blended through the alpha as a mask, the rounding of vLLM's paste
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.getchannel("A"))
        image = white
    out = io.BytesIO()
    image.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def upright_png(source) -> bytes:
    """The image turned as its EXIF orientation says, as RGB PNG bytes (served_png)."""
    return served_png(source, upright=True)


def _opened_source(source):
    """opened() of a file or of bytes."""
    return opened(io.BytesIO(source) if isinstance(source, bytes) else source)
