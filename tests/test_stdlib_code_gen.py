"""The code-assistant dataset built from the standard library's docstrings: deterministic, held-out
modules, rows the data stage reads."""
from __future__ import annotations

import json

import pytest

from data_prep.stdlib_code import MODULES, SYSTEM_PROMPT, generate, is_eval_module, main, module_apis, split_apis
from specforge.data.formats import to_conversation


def asked_module(row: dict) -> str:
    """The module of the API a row's reference answer names ("`textwrap.dedent(text)` is in the `textwrap` module")."""
    answer = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
    return answer.split("is in the `", 1)[1].split("`", 1)[0]


def test_deterministic_for_a_seed_and_a_prefix_for_fewer_rows():
    assert generate(40, seed=3) == generate(40, seed=3)
    assert generate(40, seed=3) != generate(40, seed=4)
    assert generate(15, seed=3) == generate(40, seed=3)[:15]


def test_held_out_rows_ask_about_other_modules():
    eval_modules = {m for m in MODULES if is_eval_module(m, 0)}
    assert 0 < len(eval_modules) < len(MODULES) // 3
    train = {asked_module(r) for r in generate(400, seed=0, split="train")}
    held_out = {asked_module(r) for r in generate(80, seed=0, split="eval")}
    assert held_out <= eval_modules and not train & eval_modules
    assert len(held_out) > 3 and len(train) > 30  # many modules on both sides
    train_apis = {(a.module, a.name) for a in split_apis(0, "train")}
    assert not train_apis & {(a.module, a.name) for a in split_apis(0, "eval")}


def test_apis_are_the_modules_own_and_documented():
    apis = module_apis("textwrap")
    names = {a.name for a in apis}
    assert {"dedent", "TextWrapper"} <= names and not any(n.startswith("_") for n in names)
    assert all(a.summary.endswith((".", "!", "?")) or len(a.summary) >= 24 for a in apis)
    dedent = next(a for a in apis if a.name == "dedent")
    assert dedent.signature == "(text)" and "whitespace" in dedent.summary
    # A method is written as it is called: no self
    assert all(not a.signature.startswith("(self") for a in module_apis("collections"))
    # Re-exports are not the module's own: os.path's functions are asked about under os.path only
    assert not {a.name for a in module_apis("os")} & {"join", "dirname"}


def test_rows_are_conversations_the_data_stage_reads():
    rows = generate(200, seed=1)
    assert len({r["id"] for r in rows}) == 200
    follow_ups = 0
    for row in rows:
        conv = to_conversation(row)
        roles = [m["role"] for m in conv["messages"]]
        if roles[0] == "system":
            assert conv["messages"][0]["content"] == SYSTEM_PROMPT
            roles = roles[1:]
        assert roles in (["user", "assistant"], ["user", "assistant"] * 2)
        follow_ups += len(roles) == 4
        assert all(m["content"].strip() for m in conv["messages"])
    assert 20 < follow_ups < 70  # ~20% of 200


def test_cli_writes_both_splits(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "c"), "--train", "12", "--eval", "5", "--seed", "7"]) == 0
    train = [json.loads(line) for line in (tmp_path / "c" / "train.jsonl").read_text().splitlines()]
    eval_ = [json.loads(line) for line in (tmp_path / "c" / "eval.jsonl").read_text().splitlines()]
    assert train == generate(12, seed=7, split="train") and eval_ == generate(5, seed=7, split="eval")
    assert "12 conversations" in capsys.readouterr().out
    for bad, said in ((["--train", "0"], "--train and --eval must be >= 1"),
                      (["--eval", "-1"], "--train and --eval must be >= 1"),
                      (["--multi-turn", "1.5"], "--multi-turn is a fraction in [0, 1], got 1.5")):
        with pytest.raises(SystemExit) as exit_:
            main(["--out", str(tmp_path / "bad"), *bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before anything is written
