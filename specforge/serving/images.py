"""SGLang's `image_data` made safe to take from any client: local paths only inside the server's
`--image-root` directories, or base64 `data:` URIs, each bounded in size and decoded by a short
list of image formats. A path outside the roots and a missing path get the same answer, so the
server tells a client nothing about files it may not read.
"""
from __future__ import annotations

from pathlib import Path

from specforge.serving.policy import RequestError, ServePolicy
from specforge.utils import images


def load_image_data(image_data, policy: ServePolicy) -> list:
    """`image_data` (one reference or a list, in placeholder order) -> RGB PIL images."""
    refs = [image_data] if isinstance(image_data, str) else image_data
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
        raise RequestError("image_data must be an image path, a data: URI, or a list of them")
    return [_load_one(ref, i, policy) for i, ref in enumerate(refs)]


def _load_one(ref: str, index: int, policy: ServePolicy):
    where = f"image_data[{index}]"
    if images.is_remote(ref):
        raise RequestError(f"{where}: the embedded server takes local image files only (under --image-root) "
                           "or base64 data: URIs; it does not fetch URLs")
    if images.is_data_uri(ref):
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
    try:
        payload = images.data_uri_payload(uri)
        if len(payload) // 4 * 3 > max_bytes:
            raise ValueError(f"the data URI holds about {len(payload) // 4 * 3} bytes, "
                             f"more than --max-image-bytes ({max_bytes})")
        return images.b64_bytes(payload)
    except ValueError as e:
        raise RequestError(f"{where}: {e}") from None


def decode_image(data: bytes, where: str):
    """An RGB PIL image from encoded bytes; a bad or oversized image is the client's error (400)."""
    try:
        return images.decode_image(data)
    except ValueError as e:
        raise RequestError(f"{where}: {e}") from None
