"""What `specforge serve` accepts from a client: who may call it (an API key), how large and how
slow a request may be, which image files it may name. The handler applies these rules before a
request reaches the engine, so a hostile or broken client costs a bounded amount of memory and
time and always gets an HTTP answer with a JSON error.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
import socket
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

DEFAULT_MAX_REQUEST_BYTES = 64 << 20
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_IMAGE_BYTES = 32 << 20
# Routes answered without the API key (SGLang's middleware exempts its /health routes too), so
# launchers can wait for readiness without knowing the key.
UNAUTHENTICATED_GETS = ("/health", "/health_generate")


class RequestError(ValueError):
    """A request refused with an HTTP status (400 unless said) and this message."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServePolicy:
    """The limits of one server. `image_roots` empty: image_data may not name local files."""

    api_key: str | None = None
    image_roots: tuple[Path, ...] = field(default_factory=tuple)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    def __post_init__(self):
        roots = []
        for root in self.image_roots:
            resolved = Path(root).resolve()
            if not resolved.is_dir():
                raise ValueError(f"--image-root {root}: not a directory")
            roots.append(resolved)
        object.__setattr__(self, "image_roots", tuple(roots))  # resolved once: symlinks of the roots followed
        for name in ("max_request_bytes", "read_timeout_s", "max_image_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(self, name)!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key: must not be empty")


def is_authorized(authorization: str | None, api_key: str | None) -> bool:
    """`Authorization: Bearer <api_key>`, compared in constant time; True when no key is set."""
    if api_key is None:
        return True
    if authorization is None:
        return False
    # Header values arrive decoded as latin-1: back to the bytes the client sent, the key as UTF-8.
    return hmac.compare_digest(authorization.encode("latin-1", "replace"), f"Bearer {api_key}".encode())


def content_length(headers, limit: int) -> int:
    """The body size a POST announces: 400 when missing or not one byte count, 413 above `limit`."""
    if headers.get("Transfer-Encoding") is not None:
        raise RequestError("Transfer-Encoding request bodies are not supported: send the body with a Content-Length")
    values = [v.strip() for v in headers.get_all("Content-Length") or []]
    if not values:
        raise RequestError("Content-Length header is required")
    if len(set(values)) != 1 or not re.fullmatch(r"[0-9]{1,19}", values[0]):
        raise RequestError(f"Content-Length must be one byte count, got {', '.join(map(repr, values))}")
    length = int(values[0])
    if length > limit:
        raise RequestError(f"the request body ({length} bytes) is larger than --max-request-bytes ({limit})",
                           HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    return length


def is_loopback(host: str) -> bool:
    """Whether every address `host` stands for is a loopback address (so only this machine can connect)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
