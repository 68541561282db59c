"""The synthetic weather dataset: deterministic, disjoint splits, valid TOON answers."""
from __future__ import annotations

import datetime as dt
import json

import toon_format

from data_prep.weather import (
    EVAL_CITIES,
    SYSTEM_PROMPT,
    generate,
    generate_samples,
    is_eval_pair,
    main,
)
from specforge.data.formats import to_conversation


def pairs(samples):
    return {(a["city"], a["date"]) for s in samples for a in s.answers}


def test_deterministic_for_a_seed():
    assert generate(30, seed=3) == generate(30, seed=3)
    assert generate(30, seed=3) != generate(30, seed=4)
    assert generate(10, seed=3) == generate(30, seed=3)[:10]  # a prefix: n does not reshuffle


def test_train_and_eval_are_disjoint():
    train, eval_ = generate_samples(300, seed=0, split="train"), generate_samples(100, seed=0, split="eval")
    assert not pairs(train) & pairs(eval_)
    assert not {s.id for s in train} & {s.id for s in eval_}
    assert all(not is_eval_pair(c, dt.date.fromisoformat(d)) for c, d in pairs(train))
    assert all(is_eval_pair(c, dt.date.fromisoformat(d)) for c, d in pairs(eval_))
    eval_cities = {c for c, _ in pairs(eval_)}
    assert eval_cities & EVAL_CITIES and eval_cities - EVAL_CITIES  # unseen cities and unseen dates
    assert not {c for c, _ in pairs(train)} & EVAL_CITIES


def test_every_answer_decodes_to_its_object():
    for split in ("train", "eval"):
        for s in generate_samples(60, seed=1, split=split):
            answers = [m["content"] for m in s.messages if m["role"] == "assistant"]
            assert len(answers) == len(s.answers) >= 1
            for text, obj in zip(answers, s.answers):
                assert toon_format.decode(text) == obj
                assert text.splitlines()[0] == f"city: {obj['city']}"
                assert f"hourly[{len(obj['hourly'])}]{{time,temp_c,sky,wind_kmh,precip_mm}}:" in text


def test_conversation_shape():
    samples = generate_samples(200, seed=2)
    for s in samples:
        roles = [m["role"] for m in s.messages]
        assert roles[0] == "system" and s.messages[0]["content"] == SYSTEM_PROMPT
        assert roles[1:] == ["user", "assistant"] * (len(roles) // 2)
    assert any(len(s.answers) == 2 for s in samples)  # follow-ups exist
    assert len({json.dumps(s.messages) for s in samples}) == len(samples)  # no duplicates


def test_follow_ups_are_consistent_with_the_first_answer():
    for s in generate_samples(200, seed=5):
        if len(s.answers) == 2 and s.messages[3]["content"] in ("And the next day?", "What about the day after?",
                                                               "How about the following day?"):
            first, second = s.answers
            assert second["city"] == first["city"]
            assert dt.date.fromisoformat(second["date"]) - dt.date.fromisoformat(first["date"]) == dt.timedelta(days=1)


def test_sharegpt_rows_parse_to_the_same_conversation():
    for m, sg in zip(generate(20, seed=0), generate(20, seed=0, fmt="sharegpt")):
        assert "conversations" in sg and sg["conversations"][1]["from"] == "human"
        assert to_conversation(sg) == to_conversation(m)


def test_cli_writes_both_splits(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "w"), "--train", "12", "--eval", "5", "--seed", "7"]) == 0
    train = [json.loads(line) for line in (tmp_path / "w" / "train.jsonl").read_text().splitlines()]
    eval_ = [json.loads(line) for line in (tmp_path / "w" / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 12 and len(eval_) == 5
    assert train == generate(12, seed=7, split="train")
    assert "wrote 12 train" in capsys.readouterr().out
