"""Draft vocab mapping (docs/contract.md §4) and its cache."""
from __future__ import annotations

import random

import pytest
import torch

from specforge.data.vocab import (
    build_vocab_mapping,
    cache_path,
    cached_vocab_mapping,
    check_vocab_mapping,
    load_vocab,
    save_vocab,
    vocab_cache_key,
)


def test_hand_example():
    samples = [
        # id 1 is frequent but never under the loss mask: it must not count
        ([1, 5, 7, 5, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]),
        ([1, 2, 7, 9, 5, 7, 2], [0, 1, 1, 1, 1, 1, 1]),
    ]
    # loss counts: 5 x3, 7 x3, 2 x2, 9 x1 -> keep 5, 7 (tie broken by id), 2
    d2t, t2d = build_vocab_mapping(samples, vocab_size=10, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [2 - 0, 5 - 1, 7 - 2]
    assert t2d.tolist() == [j in (2, 5, 7) for j in range(10)]


def test_ties_are_broken_by_lower_id():
    d2t, t2d = build_vocab_mapping([([8, 3, 6], [1, 1, 1])], vocab_size=10, draft_vocab_size=2)
    assert torch.nonzero(t2d).flatten().tolist() == [3, 6]


def test_pads_with_lowest_unused_ids():
    d2t, t2d = build_vocab_mapping([([3, 8, 8], [1, 1, 1])], vocab_size=10, draft_vocab_size=5)
    used = (torch.arange(5) + d2t).tolist()
    assert used == [0, 1, 2, 3, 8]
    assert torch.nonzero(t2d).flatten().tolist() == used


def test_d2t_and_t2d_are_consistent_on_random_data():
    rng = random.Random(0)
    samples = []
    for _ in range(50):
        n = rng.randrange(5, 40)
        samples.append(([rng.randrange(300) for _ in range(n)], [rng.random() < 0.6 for _ in range(n)]))
    d2t, t2d = build_vocab_mapping(samples, vocab_size=300, draft_vocab_size=64)
    target_ids = torch.arange(64) + d2t
    assert len(d2t) == 64 and len(t2d) == 300 and int(t2d.sum()) == 64
    assert target_ids.tolist() == torch.nonzero(t2d).flatten().tolist()
    check_vocab_mapping(d2t, t2d)
    broken = t2d.clone()
    broken[int(target_ids[0])] = False
    broken[int((~t2d).nonzero()[0])] = True
    with pytest.raises(ValueError, match="inconsistent"):
        check_vocab_mapping(d2t, broken)


def test_draft_vocab_larger_than_target_is_clamped_with_a_message(capsys):
    d2t, t2d = build_vocab_mapping([([1, 2], [1, 1])], vocab_size=6, draft_vocab_size=32000)
    assert len(d2t) == 6 and bool(t2d.all()) and d2t.tolist() == [0] * 6
    assert "requested 32000, used 6" in capsys.readouterr().err


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="outside the target vocab"):
        build_vocab_mapping([([3, 12], [1, 1])], vocab_size=10, draft_vocab_size=2)
    with pytest.raises(ValueError, match="differ in length"):
        build_vocab_mapping([([3, 4], [1])], vocab_size=10, draft_vocab_size=2)
    with pytest.raises(ValueError, match="positive"):
        build_vocab_mapping([([3], [1])], vocab_size=10, draft_vocab_size=0)


def test_save_load_roundtrip_and_validation(tmp_path):
    d2t, t2d = build_vocab_mapping([([4, 5, 9], [1, 1, 1])], vocab_size=12, draft_vocab_size=4)
    save_vocab(tmp_path / "v.safetensors", d2t, t2d)
    d2t2, t2d2 = load_vocab(tmp_path / "v.safetensors")
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    save_vocab(tmp_path / "bad.safetensors", d2t.to(torch.int32), t2d)
    with pytest.raises(ValueError, match="int64"):
        load_vocab(tmp_path / "bad.safetensors")


def test_cache_key_depends_on_every_part():
    base = vocab_cache_key("data", "tok", 100, 10)
    assert base == vocab_cache_key("data", "tok", 100, 10)
    others = {vocab_cache_key("data2", "tok", 100, 10), vocab_cache_key("data", "tok2", 100, 10),
              vocab_cache_key("data", "tok", 101, 10), vocab_cache_key("data", "tok", 100, 11)}
    assert base not in others and len(others) == 4


def test_cache_hit_returns_identical_tensors(tmp_path):
    samples = [([1, 2, 3, 3, 7], [1, 1, 1, 1, 0])]
    key = vocab_cache_key("d", "t", 16, 4)
    d2t, t2d, hit = cached_vocab_mapping(tmp_path, key, samples, 16, 4)
    assert not hit and cache_path(tmp_path, key).is_file()
    assert cache_path(tmp_path, key) == tmp_path / "vocab" / f"{key}.safetensors"
    # a hit does not read the samples at all: an empty iterable still gives the stored map
    d2t2, t2d2, hit2 = cached_vocab_mapping(tmp_path, key, [], 16, 4)
    assert hit2 and torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    assert not list((tmp_path / "vocab").glob(".*.tmp"))  # atomic write left no temp file
