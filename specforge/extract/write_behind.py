"""Writing a store behind the extraction: samples go to the store writer on a thread of its own
while the caller computes the next batch.

Why: on an H200, writing an 8B target's states (32.8 KB per token: cast, concatenate, save a
shard) took 39% of an extraction's wall time, with the GPU idle meanwhile (docs/benchmarks.md,
"On a GPU, second run"). Here the two overlap. At most `limit_tokens` tokens wait to be written
(host memory: those, the sample being written, the writer's shard buffer and the batch being
computed). An error in writing is raised in the caller at its next `add` or at the end of the
block; on an error of the caller, the samples already computed are still written (finished work
is kept; the writer's unflushed buffer is redone on resume, as before).
"""
from __future__ import annotations

import threading
from collections import deque


class WriteBehind:
    """`with WriteBehind(writer, limit_tokens) as behind: behind.add(sample_id, input_ids, ...)`,
    the arguments of `HiddenStateStoreWriter.add`; the writer is closed by its own `with`."""

    def __init__(self, writer, limit_tokens: int):
        self.writer = writer
        self.limit_tokens = max(1, int(limit_tokens))
        self._samples: deque = deque()
        self._waiting = 0  # tokens queued, not yet taken by the thread
        self._done = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._write, name="store-writer", daemon=True)

    def __enter__(self) -> "WriteBehind":
        self._thread.start()
        return self

    def add(self, sample_id: str, input_ids, loss_mask, **states) -> None:
        tokens = len(input_ids)
        with self._changed:  # a sample longer than the limit still goes in, alone
            self._changed.wait_for(lambda: self._error or not self._samples
                                   or self._waiting + tokens <= self.limit_tokens)
            if self._error is not None:
                raise self._error
            self._samples.append((tokens, (sample_id, input_ids, loss_mask), states))
            self._waiting += tokens
            self._changed.notify_all()

    def _write(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._samples or self._done)
                if not self._samples:
                    return
                tokens, args, states = self._samples.popleft()
                self._waiting -= tokens
                self._changed.notify_all()
            if self._error is None:
                try:
                    self.writer.add(*args, **states)
                except BaseException as e:  # noqa: BLE001 - raised again in the caller
                    with self._changed:
                        self._error = e
                        self._changed.notify_all()

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._changed:
            self._done = True
            self._changed.notify_all()
        self._thread.join()
        if exc_type is None and self._error is not None:
            raise self._error
