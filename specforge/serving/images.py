"""SGLang's `image_data` made safe to take from any client: local paths only inside the server's
`--image-root` directories, or base64 `data:` URIs, each bounded in size and decoded by a short
list of image formats. A path outside the roots and a missing path get the same answer, so the
server tells a client nothing about files it may not read.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

from specforge.serving.policy import RequestError, ServePolicy

# The decoders a client can reach: the common photo formats, none of PIL's rarer or
# externally delegated ones (EPS runs Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URI = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?;base64,(.*)", re.DOTALL)


def load_image_data(image_data, policy: ServePolicy) -> list:
    """`image_data` (one reference or a list, in placeholder order) -> RGB PIL images."""
    refs = [image_data] if isinstance(image_data, str) else image_data
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
        raise RequestError("image_data must be an image path, a data: URI, or a list of them")
    return [_load_one(ref, i, policy) for i, ref in enumerate(refs)]


def _load_one(ref: str, index: int, policy: ServePolicy):
    where = f"image_data[{index}]"
    if ref.startswith(("http://", "https://")):
        raise RequestError(f"{where}: the embedded server takes local image files only (under --image-root) "
                           "or base64 data: URIs; it does not fetch URLs")
    if ref.startswith("data:"):
        return decode_image(_data_uri_bytes(ref, where, policy.max_image_bytes), where)
    path = resolve_image_path(ref, policy.image_roots, where)
    try:  # inside a root: what goes wrong may be told
        size = path.stat().st_size
        if size > policy.max_image_bytes:
            raise RequestError(f"{where}: {ref}: {size} bytes, more than --max-image-bytes ({policy.max_image_bytes})")
        data = path.read_bytes()
    except OSError as e:
        raise RequestError(f"{where}: {ref}: cannot be read ({e.strerror})") from None
    return decode_image(data, f"{where}: {ref}")


def resolve_image_path(ref: str, roots, where: str) -> Path:
    """The real file `ref` names, if it lies inside one of `roots` (after symlinks). Missing and
    forbidden paths raise the same message: no existence oracle for files outside the roots."""
    if not roots:
        raise RequestError(f"{where}: this server reads no local image files (start it with --image-root DIR); "
                           "send the image as a base64 data: URI")
    try:
        path = Path(ref).resolve()
        allowed = any(path.is_relative_to(root) for root in roots) and path.is_file()
    except (OSError, ValueError):  # e.g. a NUL byte, a name too long
        allowed = False
    if not allowed:
        raise RequestError(f"{where}: {ref!r} is not an image file under the server's --image-root")
    return path


def _data_uri_bytes(uri: str, where: str, max_bytes: int) -> bytes:
    """The bytes of `data:[image/...];base64,...`, refused before decoding when too large."""
    match = _DATA_URI.fullmatch(uri)
    if match is None:
        raise RequestError(f"{where}: a data URI must read data:image/<type>;base64,<data>")
    payload = match.group(2)
    if len(payload) // 4 * 3 > max_bytes:
        raise RequestError(f"{where}: the data URI holds about {len(payload) // 4 * 3} bytes, "
                           f"more than --max-image-bytes ({max_bytes})")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{where}: the data URI is not valid base64 ({e})") from None


def decode_image(data: bytes, where: str):
    """An RGB PIL image from encoded bytes; a bad or oversized image is the client's error (400)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
            if im.width * im.height > Image.MAX_IMAGE_PIXELS:
                raise RequestError(f"{where}: {im.width}x{im.height} pixels, more than {Image.MAX_IMAGE_PIXELS}")
            return im.convert("RGB")
    except RequestError:
        raise
    except Exception as e:  # PIL's decoders raise many types (OSError, ValueError, SyntaxError, ...)
        raise RequestError(f"{where}: cannot be read as an image ({', '.join(IMAGE_FORMATS)}): "
                           f"{type(e).__name__}: {e}") from None
