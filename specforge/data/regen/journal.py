"""The resume log `regen_<split>.partial.jsonl`.

Line 1 is a header with the fingerprint of everything that decides the answers (backend, model,
sampling, target files); then one line per finished conversation, flushed as it is written, so
a crash loses only the conversations in flight. A log whose fingerprint differs is discarded
(stale answers from another config must not be reused). The log is kept after a run finishes:
it is the cache that makes a rerun instant, and deleting it forces a full regeneration.
"""
from __future__ import annotations

import json
from pathlib import Path

from specforge.utils.io import write_jsonl

HEADER_KEY = "regen_fingerprint"


class Journal:
    def __init__(self, path: str | Path, fingerprint: str, info: dict) -> None:
        self.path = Path(path)
        self.header = {HEADER_KEY: fingerprint, **info}
        self._file = None

    def open(self) -> dict[str, dict]:
        """Finished records by key (the last line of a key wins). The log is rewritten first
        without a torn last line or superseded lines, so appends start on a clean line."""
        records = self._load()
        write_jsonl(self.path, [self.header, *records.values()])
        self._file = open(self.path, "a", encoding="utf-8")
        return records

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _load(self) -> dict[str, dict]:
        if not self.path.is_file():
            return {}
        lines = self.path.read_text(encoding="utf-8").split("\n")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get(HEADER_KEY) != self.header[HEADER_KEY]:
            n = sum(1 for line in lines[1:] if line.strip())
            print(f"[regenerate] {self.path}: written for another config or target; discarding {n} results")
            return {}
        records: dict[str, dict] = {}
        last = len(lines) - 1
        for lineno, line in enumerate(lines[1:], 2):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = rec["key"]
            except (json.JSONDecodeError, KeyError, TypeError):
                if lineno - 1 == last:  # the last line was cut by a crash mid-write: redo it
                    print(f"[regenerate] {self.path}:{lineno}: incomplete last line (interrupted write); dropped")
                    continue
                raise ValueError(f"{self.path}:{lineno}: not a regeneration record; delete the file to start over") from None
            records.pop(key, None)  # re-insert: order follows the latest write
            records[key] = rec
        return records
