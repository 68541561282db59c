"""Atomic file writes, JSONL and fingerprints: every stage writes through these so a crash never
leaves a half-written file that looks complete. Writes are also durable: the bytes and the rename
reach the disk before a write returns, so a node that loses power (not only a process that dies)
finds either the old file or the whole new one, never an empty file under the final name."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's bytes, or a directory's entries, to the disk. Best effort: a file system that
    cannot fsync a directory (some network mounts) raises, and is left to its own guarantees."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def durable_replace(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """os.replace(tmp, path) that survives a power loss: the bytes first, then the rename."""
    fsync(tmp)
    os.replace(tmp, path)
    fsync(Path(path).parent)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.exists():  # mkstemp makes 0600 files; give them the permissions of a normal write
            os.chmod(tmp, 0o666 & ~_umask())
        durable_replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory beside `path`; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def normalize_modes(root: Path) -> None:
    """`root` and everything below it: files 0666 and directories 0777, less the umask."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for p in Path(root).rglob("*"):
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished directory `tmp` onto `path`; never a moment with a half directory under
    `path` (at worst, for an instant, none). Everything in it gets the permissions of a normal
    write first: mkdtemp makes 0700 directories and safetensors writes 0600 files, which a server
    running as another user could not read next to a 0644 config.json. Every file and directory in
    it reaches the disk before the rename, and the rename before this returns."""
    normalize_modes(tmp)
    for p in sorted(Path(tmp).rglob("*"), reverse=True):  # files before the directories holding them
        if not p.is_symlink():
            fsync(p)
    fsync(tmp)
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    fsync(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Rows of a JSONL file; a bad line raises with the file and line number."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (configs, file fingerprints, versions)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def file_fingerprint(path: str | os.PathLike) -> str:
    """Content hash of a file, or of every file under a directory (names + bytes)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
