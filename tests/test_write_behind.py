"""Writing a store behind the extraction (specforge/extract/write_behind.py): the same store as
writing in place, the writer's errors raised in the caller, the caller's errors keeping what was
computed, and no more than the limit waiting."""
from __future__ import annotations

import threading

import pytest
import torch

from specforge.extract.store import HiddenStateStore, HiddenStateStoreWriter
from specforge.extract.write_behind import WriteBehind
from tests.test_store import META, assert_same_store, make_samples, write_all


def write_behind(out, samples, shard_samples=2, limit_tokens=16, writer_class=HiddenStateStoreWriter):
    with writer_class(out, META, shard_samples=shard_samples) as w, WriteBehind(w, limit_tokens) as behind:
        for s in samples:
            behind.add(s["id"], s["input_ids"], s["loss_mask"], aux=s["aux"], last=s["last"])
    return w


def test_the_store_written_behind_equals_the_store_written_in_place(tmp_path):
    samples = make_samples(9)
    write_all(tmp_path / "in_place", samples)
    write_behind(tmp_path / "behind", samples)
    assert_same_store(tmp_path / "in_place", tmp_path / "behind")


def test_a_writers_error_reaches_the_caller_with_its_type_and_message(tmp_path):
    samples = make_samples(6)
    samples[3]["last"] = samples[3]["last"].clone()
    samples[3]["last"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="s003"):
        write_behind(tmp_path / "s", samples)
    # the whole shard before the bad sample was written (shards of 2)
    assert len(HiddenStateStore(tmp_path / "s", require_complete=False)) == 2


def test_on_the_callers_error_the_samples_it_handed_over_are_still_written(tmp_path):
    samples = make_samples(7)
    with pytest.raises(KeyboardInterrupt):
        with HiddenStateStoreWriter(tmp_path / "s", META, shard_samples=2) as w, WriteBehind(w, 4) as behind:
            for i, s in enumerate(samples):
                if i == 5:
                    raise KeyboardInterrupt("a crash while computing the sixth")
                behind.add(s["id"], s["input_ids"], s["loss_mask"], aux=s["aux"], last=s["last"])
    store = HiddenStateStore(tmp_path / "s", require_complete=False)
    assert store.ids == ["s000", "s001", "s002", "s003"]  # two full shards


class GatedWriter(HiddenStateStoreWriter):
    """A real writer whose `add` waits for the test's signal: a slow disk."""

    gate = threading.Event()
    entered = threading.Event()

    def add(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(30)
        super().add(*args, **kwargs)


def test_no_more_than_the_limit_waits_while_the_writer_is_busy(tmp_path):
    tokens = lambda n: {"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),  # noqa: E731
                        "aux": torch.zeros(n, 3 * META["hidden_size"]), "last": torch.zeros(n, META["hidden_size"])}
    samples = [{"id": f"s{i}", **tokens(10)} for i in range(3)]
    w = GatedWriter(tmp_path / "s", META, shard_samples=8)
    with w, WriteBehind(w, limit_tokens=10) as behind:
        def add(s):
            behind.add(s["id"], s["input_ids"], s["loss_mask"], aux=s["aux"], last=s["last"])

        add(samples[0])
        assert GatedWriter.entered.wait(10)  # the writer holds the first
        add(samples[1])  # waits: 10 tokens, the limit
        third = threading.Thread(target=add, args=(samples[2],))
        third.start()
        third.join(0.5)
        assert third.is_alive(), "a third sample went in beyond the limit"
        GatedWriter.gate.set()
        third.join(10)
        assert not third.is_alive()
    assert len(HiddenStateStore(tmp_path / "s")) == 3
