"""The whole data stage on the tiny target: files, reconciled counts, quarantine, vocab cache."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import toon_format
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from data_prep.weather import generate
from specforge.config import Config
from specforge.data import stage
from specforge.data.vocab import check_vocab_mapping
from specforge.pipeline import run_pipeline
from specforge.utils.io import read_json, read_jsonl, write_jsonl

N_TRAIN, N_EVAL = 12, 4


@pytest.fixture
def raw(tmp_path):
    """Generated weather data with one invalid JSON line (line 4) and one row without an
    assistant turn (line 7) in the train file."""
    rows = generate(N_TRAIN, seed=0, split="train")
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, '{"messages": [{"role": "user", "content": "Oslo?"')
    lines.insert(6, json.dumps({"id": "no-answer", "messages": [{"role": "user", "content": "Oslo tomorrow?"}]}))
    train = tmp_path / "raw" / "train.jsonl"
    train.parent.mkdir()
    train.write_text("\n".join(lines) + "\n")
    eval_ = tmp_path / "raw" / "eval.jsonl"
    write_jsonl(eval_, generate(N_EVAL, seed=0, split="eval"))
    return train, eval_


def make_cfg(tmp_path, tiny_target_dir, train, eval_, **data):
    cfg = OmegaConf.structured(Config)
    cfg.run_name = "t"
    cfg.output_dir = str(tmp_path / "out")
    cfg.cache_dir = str(tmp_path / "cache")
    cfg.stages = ["data"]
    cfg.target.name = "tiny"
    cfg.target.path = str(tiny_target_dir)
    cfg.data.name = "weather"
    cfg.data.train_files = [str(train)]
    cfg.data.eval_files = [str(eval_)] if eval_ else []
    cfg.draft.draft_vocab_size = 64
    for k, v in data.items():
        OmegaConf.update(cfg, f"data.{k}", v)
    return cfg


def assert_reconciles(counts):
    accounted = counts["kept"] + counts["fixed"] + counts["quarantined"] + counts["skipped_max_samples"]
    assert counts["input_rows"] == accounted
    assert counts["samples"] == counts["kept"] + counts["fixed"]
    assert counts["quarantined"] == sum(counts["by_reason"].values())


def test_data_stage_end_to_end(tmp_path, tiny_target_dir, tiny_tokenizer, raw):
    train_file, eval_file = raw
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file)
    run_dir = tmp_path / "out" / "t"
    summary = stage.run(cfg, run_dir)
    data = run_dir / "data"

    train, ev = summary["train"], summary["eval"]
    assert train["input_rows"] == N_TRAIN + 2 and ev["input_rows"] == N_EVAL
    assert train["samples"] == N_TRAIN and ev["samples"] == N_EVAL
    assert train["quarantined"] == 2 and ev["quarantined"] == 0
    assert_reconciles(train)
    assert_reconciles(ev)

    quarantine = list(read_jsonl(data / "quarantine.jsonl"))
    assert {(q["split"], q["file"], q["line"]) for q in quarantine} == {("train", str(train_file), 4),
                                                                       ("train", str(train_file), 7)}
    assert train["by_reason"] == {"invalid_json": 1, "no_assistant_turn": 1}
    no_answer = next(q for q in quarantine if q["line"] == 7)
    assert no_answer["reason"].startswith("no_assistant_turn") and no_answer["row"]["id"] == "no-answer"

    samples = list(read_jsonl(data / "train.jsonl"))
    convs = list(read_jsonl(data / "train.conversations.jsonl"))
    assert [s["id"] for s in samples] == [c["id"] for c in convs] == [r["id"] for r in generate(N_TRAIN, 0)]
    for s, c in zip(samples, convs):
        assert set(s) == {"id", "input_ids", "loss_mask"} and set(c) == {"id", "messages"}
        assert len(s["input_ids"]) == len(s["loss_mask"]) <= cfg.data.max_length
        masked = tiny_tokenizer.decode([t for t, m in zip(s["input_ids"], s["loss_mask"]) if m])
        answers = [m["content"] for m in c["messages"] if m["role"] == "assistant"]
        assert masked == "".join(a + "<|im_end|>" for a in answers)
        assert toon_format.decode(answers[0])["city"]
    assert train["tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert train["loss_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    assert len(list(read_jsonl(data / "eval.jsonl"))) == N_EVAL

    vocab = load_file(str(data / "vocab.safetensors"))
    assert vocab["d2t"].dtype == torch.int64 and vocab["t2d"].dtype == torch.bool
    assert len(vocab["d2t"]) == 64 and len(vocab["t2d"]) == len(tiny_tokenizer)
    check_vocab_mapping(vocab["d2t"], vocab["t2d"])
    assert summary["vocab"]["cache_hit"] is False and 0 < summary["vocab"]["coverage"]["train"] <= 1

    report = read_json(data / "report.json")
    assert report["splits"]["train"] == train
    md = (data / "report.md").read_text()
    assert "| input_rows | 14 | 4 |" in md and "invalid_json" in md

    again = stage.run(cfg, run_dir)
    assert again["vocab"]["cache_hit"] is True
    assert torch.equal(load_file(str(data / "vocab.safetensors"))["d2t"], vocab["d2t"])


def test_without_fix_rows_are_parsed_and_quarantined_by_the_stage(tmp_path, tiny_target_dir, raw):
    train_file, _ = raw
    with open(train_file, "a") as f:
        f.write(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, None, **{"fix.enabled": False})
    summary = stage.run(cfg, tmp_path / "run")
    train = summary["train"]
    assert "eval" not in summary and not (tmp_path / "run" / "data" / "eval.jsonl").exists()
    assert train["by_reason"] == {"invalid_json": 1, "invalid_row": 1}
    assert train["samples"] == N_TRAIN + 1  # the row without an answer is kept as is: nothing to fix it
    assert_reconciles(train)
    q = [q for q in read_jsonl(tmp_path / "run" / "data" / "quarantine.jsonl") if q["reason"].startswith("invalid_row")]
    assert q[0]["line"] == N_TRAIN + 3 and "messages[0].role: unknown role 'bot'" in q[0]["reason"]


def test_overlength_drop_and_max_samples(tmp_path, tiny_target_dir, raw):
    train_file, eval_file = raw
    # tiny-tokenizer lengths of the first eval rows: 425, 427, 661, 686 tokens
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file, max_length=430, overlength="drop", max_samples=3)
    summary = stage.run(cfg, tmp_path / "run")
    for split in ("train", "eval"):
        assert_reconciles(summary[split])
        assert summary[split]["max_tokens"] <= 430 and summary[split]["truncated"] == 0
    ev = summary["eval"]
    assert ev["skipped_max_samples"] == 1 and ev["by_reason"] == {"overlength": 1} and ev["samples"] == 2
    (dropped,) = [q for q in read_jsonl(tmp_path / "run" / "data" / "quarantine.jsonl") if q["split"] == "eval"]
    assert dropped["file"] == str(eval_file) and dropped["line"] == 3
    assert dropped["reason"] == "overlength: 661 tokens > max_length 430"


def test_truncation_counts(tmp_path, tiny_target_dir, raw):
    train_file, eval_file = raw
    # first loss token of the eval rows (tiny tokenizer): 219, 227, 216, 239
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file, max_length=225)
    summary = stage.run(cfg, tmp_path / "run")
    ev = summary["eval"]
    assert_reconciles(ev)
    assert ev["truncated"] == 2 and ev["max_tokens"] == 225 and ev["samples"] == 2
    assert ev["by_reason"] == {"no_loss_tokens_after_truncation": 2}
    assert ev["loss_tokens"] == (225 - 219) + (225 - 216)


def test_missing_file_says_how_to_generate_it(tmp_path, tiny_target_dir):
    cfg = make_cfg(tmp_path, tiny_target_dir, tmp_path / "data" / "weather" / "train.jsonl", None)
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl.*python data_prep/weather\.py --out \S*data/weather`"):
        stage.extra_inputs(cfg)
    with pytest.raises(FileNotFoundError, match="data_prep/weather.py"):
        stage.run(cfg, tmp_path / "run")
    assert stage.generate_hint("data/weather_vl/eval.jsonl").endswith(
        "`python data_prep/weather.py --out data/weather_vl --images 0.5`")
    cfg = make_cfg(tmp_path, tiny_target_dir, tmp_path / "mine" / "chats.jsonl", None)  # someone's own data
    with pytest.raises(FileNotFoundError) as missing:  # no command here makes it: no hint
        stage.extra_inputs(cfg)
    assert str(missing.value) == f"data file {tmp_path / 'mine' / 'chats.jsonl'} not found"


def test_an_empty_file_or_held_out_split_is_refused_before_training(tmp_path, tiny_target_dir, raw):
    """A 0-byte data file is refused with the inputs' check (before the stage reads anything); held-out
    files whose rows all drop out (blank lines, or every row quarantined with the share check off)
    are refused by the stage, as an empty training split is: every held-out metric would be of nothing."""
    train_file, eval_file = raw
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    for train, held_out in ((empty, eval_file), (train_file, empty)):
        cfg = make_cfg(tmp_path, tiny_target_dir, train, held_out)
        with pytest.raises(ValueError, match=rf"data file {empty} is empty \(0 bytes\)"):
            stage.extra_inputs(cfg)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, blank)
    with pytest.raises(ValueError, match=r"no held-out samples left out of 0 rows of data.eval_files.*eval_files=\[\]"):
        stage.run(cfg, tmp_path / "run")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n{\"messages\": []}\n")
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, broken, max_quarantined_share=1.0)  # share check off
    with pytest.raises(ValueError, match=r"no held-out samples left out of 2 rows .*top reasons: invalid_json 1"):
        stage.run(cfg, tmp_path / "run2")
    assert stage.run(make_cfg(tmp_path, tiny_target_dir, train_file, None), tmp_path / "run3") is not None


def test_a_max_length_past_the_targets_context_is_refused_before_any_row_is_read(tmp_path, tiny_target_dir, raw):
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(tiny_target_dir).max_position_embeddings
    cfg = make_cfg(tmp_path, tiny_target_dir, raw[0], None, max_length=positions + 1)
    with pytest.raises(ValueError, match=rf"data.max_length={positions + 1} is past the target's context: "
                                         rf"{positions} positions \(max_position_embeddings and RoPE scaling in .*config.json"):
        stage.check(cfg)
    with pytest.raises(ValueError, match="past the target's context"):
        stage.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "data" / "train.jsonl").exists()
    stage.check(make_cfg(tmp_path, tiny_target_dir, raw[0], None, max_length=positions))
    # a RoPE scaling factor stated beside the original length extends it; Llama 3.1's names the original
    from transformers import LlamaConfig

    from specforge.targets.loader import target_context

    assert target_context(LlamaConfig(max_position_embeddings=4096, rope_scaling={"rope_type": "linear",
                                                                                  "factor": 4.0})) == 16384
    llama31 = AutoConfig.from_pretrained(Path(__file__).resolve().parents[1] / "benchmarks/targets/llama-3.1-8b")
    assert target_context(llama31) == 131072  # already the scaled length (8 x 8,192 is less)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert target_context(LlamaConfig(max_position_embeddings=40960, rope_scaling=yarn)) == 131072  # Qwen3


def test_a_draft_vocab_that_covers_too_few_loss_tokens_is_refused_with_its_report(tmp_path, tiny_target_dir, raw):
    """With 2 draft tokens the held-out simulated accept length looked perfect (it counts the
    positions whose token is in the draft vocab) while the draft could propose almost nothing."""
    cfg = make_cfg(tmp_path, tiny_target_dir, raw[0], raw[1])
    cfg.draft.draft_vocab_size = 2
    with pytest.raises(ValueError, match=r"draft.draft_vocab_size=2 covers \d+\.\d% of the training loss tokens, "
                                         r"below draft.min_vocab_coverage=0.8: .* The data has \d+ distinct loss tokens"):
        stage.run(cfg, tmp_path / "run")
    report = read_json(tmp_path / "run" / "data" / "report.json")
    assert report["vocab"]["coverage"]["train"] < 0.8  # the report says what was found
    cfg.draft.min_vocab_coverage = 0.0  # never refuse
    assert stage.run(cfg, tmp_path / "run2")["vocab"]["draft_vocab_size"] == 2
    cfg.draft.min_vocab_coverage, cfg.draft.init_from = 0.8, str(tmp_path / "some_draft")  # its own vocab map
    assert stage.run(cfg, tmp_path / "run3")["vocab"]["coverage"]["train"] < 0.8


def test_extra_inputs_follow_file_contents(tmp_path, tiny_target_dir, raw):
    train_file, eval_file = raw
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file)
    before = stage.extra_inputs(cfg)
    assert set(before) == {"train", "eval"} and str(train_file) in before["train"]
    with open(eval_file, "a") as f:
        f.write("\n")
        f.write(json.dumps(generate(1, seed=9, split="eval")[0]) + "\n")
    after = stage.extra_inputs(cfg)
    assert after["train"] == before["train"] and after["eval"] != before["eval"]


def test_pipeline_runs_then_skips_the_data_stage(tmp_path, tiny_target_dir, raw, capsys):
    train_file, eval_file = raw
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file)
    first = run_pipeline(cfg)["data"]
    assert first["train"]["samples"] == N_TRAIN
    second = run_pipeline(cfg)["data"]
    assert "data: up to date" in capsys.readouterr().out
    assert second["train"] == first["train"]


def test_rows_the_template_cannot_render_are_quarantined(tmp_path, tiny_target_dir, raw):
    from specforge.targets.tiny import build_tiny_tokenizer

    train_file, _ = raw
    tok = build_tiny_tokenizer(None)
    tok.chat_template = (  # like templates that reject a system turn (every weather row has one)
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    )
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, None)
    result = stage.process_split(cfg, "train", [str(train_file)], tok)
    counts = result["counts"]
    assert_reconciles(counts)
    assert counts["samples"] == 0 and counts["by_reason"]["template_error"] == N_TRAIN
    q = next(q for q in result["quarantine"] if q["reason"].startswith("template_error"))
    assert q["file"] == str(train_file) and q["line"] == 1 and "System role not supported" in q["reason"]


def test_no_training_samples_left_is_an_error_with_a_report(tmp_path, tiny_target_dir):
    train = tmp_path / "bad.jsonl"
    train.write_text("not json\n" + json.dumps({"messages": [{"role": "user", "content": "Oslo?"}]}) + "\n")
    cfg = make_cfg(tmp_path, tiny_target_dir, train, None)
    with pytest.raises(ValueError, match="no training samples left out of 2 rows.*quarantine.jsonl"):
        stage.run(cfg, tmp_path / "run")
    report = read_json(tmp_path / "run" / "data" / "report.json")
    assert report["splits"]["train"]["quarantined"] == 2 and report["vocab"] is None
    assert len(list(read_jsonl(tmp_path / "run" / "data" / "quarantine.jsonl"))) == 2


@pytest.mark.parametrize("num_proc", [0, 2])
def test_answers_kept_as_written_are_counted_in_the_report(tmp_path, tiny_target_dir, num_proc):
    """toon_prose=keep / toon_unrepairable=keep let such answers through: the report says how many
    rows carry one (in-process and in datasets.map workers alike)."""
    rows = generate(6, seed=0, split="train")
    last_answer = [max(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant") for r in rows]
    rows[1]["messages"][last_answer[1]]["content"] = "It will be sunny all day in Paris."
    rows[3]["messages"][last_answer[3]]["content"] = 'city: "Paris'
    train = tmp_path / "raw" / "train.jsonl"
    write_jsonl(train, rows)
    cfg = make_cfg(tmp_path, tiny_target_dir, train, None, num_proc=num_proc,
                   **{"fix.toon": True, "fix.toon_prose": "keep", "fix.toon_unrepairable": "keep"})
    run_dir = tmp_path / "out" / "t"
    counts = stage.run(cfg, run_dir)["train"]
    assert counts["quarantined"] == 0 and counts["samples"] == 6
    assert counts["by_kept_as_written"] == {"toon_prose": 1, "toon_unrepairable": 1}
    assert_reconciles(counts)
    convs = list(read_jsonl(run_dir / "data" / "train.conversations.jsonl"))
    assert convs[3]["messages"][last_answer[3]]["content"] == 'city: "Paris'  # as written
    md = (run_dir / "data" / "report.md").read_text()
    assert "## Kept as written" in md and "data.fix.toon_unrepairable=keep" in md
    assert "| toon_prose | 1 |" in md and "| toon_unrepairable | 1 |" in md


@pytest.mark.parametrize("num_proc", [0, 2])
def test_eval_rows_opening_with_a_training_prompt_are_not_held_out(tmp_path, tiny_target_dir, raw, num_proc):
    """An eval row whose prompt (the turns before its first answer) a train sample has, answered
    alike or not, is quarantined as in_train naming that sample; data.eval_in_train=keep counts it."""
    from specforge.data.fix.conversations import prompt_key

    greeting = [{"role": "system", "content": "Be kind."}, {"role": "assistant", "content": "Hello!"}]
    assert prompt_key(greeting + [{"role": "user", "content": "Oslo?"}]) is None  # nothing asked before it
    train_file, _ = raw
    train_rows = generate(N_TRAIN, seed=0, split="train")
    copied = json.loads(json.dumps(train_rows[5]))
    copied["id"] = "copy-with-another-answer"
    copied["messages"][-1]["content"] = "city: Nowhere"
    eval_rows = generate(N_EVAL, seed=0, split="eval") + [train_rows[2], copied]
    eval_file = tmp_path / "raw" / "eval_leaky.jsonl"
    write_jsonl(eval_file, eval_rows)

    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file, num_proc=num_proc)
    summary = stage.run(cfg, tmp_path / "out" / "t")
    ev = summary["eval"]
    assert ev["samples"] == N_EVAL and ev["quarantined"] == 2 and ev["in_train"] == 2
    assert ev["by_reason"] == {"in_train": 2} and "in_train" not in summary["train"]
    assert_reconciles(ev)
    data = tmp_path / "out" / "t" / "data"
    held = [q for q in read_jsonl(data / "quarantine.jsonl") if q["split"] == "eval"]
    # the raw train file has an invalid line 4 and a row without an answer at line 7 (fixture)
    assert [(q["line"], q["reason"].split(";")[0]) for q in held] == [
        (N_EVAL + 1, f"in_train: opens with the prompt of the train sample from {train_file} line 3"),
        (N_EVAL + 2, f"in_train: opens with the prompt of the train sample from {train_file} line 8")]
    assert [c["id"] for c in read_jsonl(data / "eval.conversations.jsonl")] == [r["id"] for r in eval_rows[:N_EVAL]]
    assert "| in_train | - | 2 |" in (data / "report.md").read_text()

    keep = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file, num_proc=num_proc, eval_in_train="keep")
    ev = stage.run(keep, tmp_path / "out" / "keep")["eval"]
    assert ev["samples"] == N_EVAL + 2 and ev["quarantined"] == 0 and ev["in_train"] == 2


def test_an_eval_file_that_is_a_training_file_is_refused_before_any_work(tmp_path, tiny_target_dir, raw):
    """The same file, or the same bytes under another name: refused by the stage's check (the
    pipeline runs it before any stage), as is a train file listed twice. Re-serialised, every row is
    in_train: the quarantined share fails the stage with the hint to hold out other conversations."""
    train_file, _ = raw
    copy = tmp_path / "raw" / "copy.jsonl"
    copy.write_bytes(train_file.read_bytes())
    for eval_file in (train_file, copy):
        cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file)
        with pytest.raises(ValueError, match=rf"data.eval_files: {eval_file} is also a training file \({train_file}\): "
                                             "no held-out row would be left"):
            run_pipeline(cfg)
        assert not (tmp_path / "out").exists()
        stage.check(make_cfg(tmp_path, tiny_target_dir, train_file, eval_file, eval_in_train="keep"))

    for twice in ([train_file, train_file], [train_file, copy]):
        cfg = make_cfg(tmp_path, tiny_target_dir, train_file, None)
        cfg.data.train_files = [str(f) for f in twice]
        with pytest.raises(ValueError, match=rf"data.train_files: {train_file} is listed twice \({twice[1]} is the same "
                                             r"input\); name it once"):
            stage.check(cfg)

    hub = make_cfg(tmp_path, tiny_target_dir, "hub:org/chats", "hub:org/chats:train")
    with pytest.raises(ValueError, match=r"data.eval_files: hub:org/chats:train is also a training file"):
        stage.check(hub)
    stage.check(make_cfg(tmp_path, tiny_target_dir, "hub:org/chats", "hub:org/chats:test"))

    reserialised = tmp_path / "raw" / "reserialised.jsonl"
    write_jsonl(reserialised, generate(N_TRAIN, seed=0, split="train"))
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, reserialised)
    with pytest.raises(ValueError, match=r"data eval: 12 of 12 rows quarantined \(100.0%\).*top reasons: in_train 12.*"
                                         r"hint: the eval files repeat the training prompts"):
        stage.run(cfg, tmp_path / "out" / "t")


def test_glob_patterns_name_shards(tmp_path, tiny_target_dir):
    """`data.train_files=[shards/*.jsonl*]`: every match, sorted, read as if listed (compressed ones
    too); a pattern matching nothing is refused before any work, and so is a shard named twice."""
    import gzip

    rows = generate(6, seed=0, split="train")
    shards = tmp_path / "shards"
    write_jsonl(shards / "b.jsonl", rows[3:])
    write_jsonl(shards / "a.jsonl", rows[:3])
    (shards / "c.jsonl.gz").write_bytes(gzip.compress((shards / "b.jsonl").read_bytes().replace(b'"id": "', b'"id": "gz-')))
    (shards / "notes.txt").write_text("not data")
    cfg = make_cfg(tmp_path, tiny_target_dir, shards / "*.jsonl*", None)
    assert stage.split_files(cfg) == {"train": [str(shards / n) for n in ("a.jsonl", "b.jsonl", "c.jsonl.gz")]}
    assert list(stage.extra_inputs(cfg)["train"]) == stage.split_files(cfg)["train"]
    counts = stage.run(cfg, tmp_path / "out" / "t")["train"]
    assert counts["input_rows"] == 9 and counts["samples"] == 6 and counts["by_reason"] == {"duplicate": 3}

    nothing = make_cfg(tmp_path, tiny_target_dir, tmp_path / "nowhere" / "*.jsonl", None)
    with pytest.raises(FileNotFoundError, match=rf"data.train_files: {tmp_path}/nowhere/\*.jsonl matches no file"):
        run_pipeline(nothing)
    twice = make_cfg(tmp_path, tiny_target_dir, shards / "*.jsonl", None)
    twice.data.train_files = [str(shards / "*.jsonl"), str(shards / "a.jsonl")]
    with pytest.raises(ValueError, match=rf"data.train_files: {shards}/a.jsonl is listed twice"):
        stage.check(twice)


def test_a_file_whose_name_looks_like_a_pattern_is_that_file(tmp_path, tiny_target_dir):
    """`rows[1].jsonl` was taken as a glob pattern, whose `[1]` matches the character 1: the stage read
    `rows1.jsonl` beside it instead, without a word (or refused the file as matching nothing)."""
    rows = generate(4, seed=0, split="train")
    write_jsonl(tmp_path / "rows[1].jsonl", rows[:2])
    write_jsonl(tmp_path / "rows1.jsonl", rows[2:])
    cfg = make_cfg(tmp_path, tiny_target_dir, tmp_path / "rows[1].jsonl", None)
    assert stage.split_files(cfg) == {"train": [str(tmp_path / "rows[1].jsonl")]}
    cfg.data.train_files = [str(tmp_path / "rows[0-9].jsonl")]  # no such file: a pattern still
    assert stage.split_files(cfg) == {"train": [str(tmp_path / "rows1.jsonl")]}


@pytest.mark.parametrize("num_proc", [0, 2])
def test_text_that_spells_a_special_token_is_quarantined(tmp_path, tiny_target_dir, tiny_tokenizer, num_proc):
    """'<|im_end|>' typed in a message tokenizes as the control token (a turn ending mid-answer, a
    fake turn after it): the row is quarantined naming the message and token, in-process and in
    workers alike; data.special_token_text=keep tokenizes it as it comes."""
    rows = generate(4, seed=0, split="train")
    rows[1]["messages"][-1]["content"] += "<|im_end|>\n<|im_start|>user\nand now?"
    rows[2]["messages"][1]["content"] = [{"type": "text", "text": "Weather <|im_start|> in Oslo?"}]
    train = tmp_path / "raw" / "train.jsonl"
    write_jsonl(train, rows)
    cfg = make_cfg(tmp_path, tiny_target_dir, train, None, num_proc=num_proc, max_quarantined_share=1.0)
    counts = stage.run(cfg, tmp_path / "out" / "t")["train"]
    assert counts["samples"] == 2 and counts["by_reason"] == {"special_token_text": 2}
    held = list(read_jsonl(tmp_path / "out" / "t" / "data" / "quarantine.jsonl"))
    last = len(rows[1]["messages"])
    assert [(q["line"], q["reason"]) for q in held] == [
        (2, f"special_token_text: assistant message {last} holds '<|im_end|>', which the tokenizer reads as its "
            "control token, not as text"),
        (3, "special_token_text: user message 2 holds '<|im_start|>', which the tokenizer reads as its control "
            "token, not as text")]
    keep = make_cfg(tmp_path, tiny_target_dir, train, None, num_proc=num_proc, special_token_text="keep")
    assert stage.run(keep, tmp_path / "out" / "keep")["train"]["samples"] == 4


@pytest.mark.parametrize("num_proc", [0, 2])
def test_ids_repeated_across_files_are_made_unique_as_a_fix(tmp_path, tiny_target_dir, num_proc):
    """Files merged with ids counted from 0 each: the extraction refused the second "0" after the
    data stage (and a regeneration) had run. Later repeats are renamed to where they come from."""
    from specforge.extract.stage import load_rows

    rows = generate(5, seed=2, split="train")
    first, second = tmp_path / "a" / "chats.jsonl", tmp_path / "b" / "chats.jsonl"
    write_jsonl(first, [{**rows[0], "id": "0"}, {**rows[1], "id": "0@chats.jsonl:1"}])
    write_jsonl(second, [{**r, "id": str(i)} for i, r in enumerate(rows[2:])])
    cfg = make_cfg(tmp_path, tiny_target_dir, first, None, num_proc=num_proc)
    cfg.data.train_files = [str(first), str(second)]
    summary = stage.run(cfg, tmp_path / "run")

    data = tmp_path / "run" / "data"
    assert [s["id"] for s in load_rows(data / "train.jsonl")] == \
           ["0", "0@chats.jsonl:1", "0@chats.jsonl:1~1", "1", "2"]  # what the extraction reads, unrefused
    assert [c["id"] for c in read_jsonl(data / "train.conversations.jsonl")] == \
           ["0", "0@chats.jsonl:1", "0@chats.jsonl:1~1", "1", "2"]
    assert summary["train"]["by_fix"] == {"renamed_duplicate_id": 1} and summary["train"]["fixed"] == 1
    assert "| renamed_duplicate_id | 1 |" in (data / "report.md").read_text()


def test_the_data_stage_reruns_under_another_seed_only_where_regeneration_samples(tmp_path, tiny_target_dir, raw):
    """Regenerated with temperature > 0, the answers follow the seed, yet the data stage's key did not
    hold it: another seed kept the answers sampled with the last one. Now it does, and only then
    (no regeneration, or greedy: runs made before stay up to date)."""
    from specforge.pipeline import STAGES, stage_fingerprint

    train_file, eval_file = raw

    def key(seed: int, **regen) -> str:
        cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file, **regen)
        cfg.seed = seed
        return stage_fingerprint(cfg, STAGES["data"], tmp_path / "run")

    assert key(0) == key(1)
    assert key(0, **{"regenerate.enabled": True}) == key(1, **{"regenerate.enabled": True})
    sampled = {"regenerate.enabled": True, "regenerate.temperature": 0.7}
    assert key(0, **sampled) != key(1, **sampled)
    cfg = make_cfg(tmp_path, tiny_target_dir, train_file, eval_file)
    assert "regenerate_seed" not in stage.extra_inputs(cfg)  # the key of a run made before is unchanged
