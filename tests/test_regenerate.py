"""Regenerating assistant turns with the target: embedded (transformers) and OpenAI-compatible
servers (a real HTTP server on 127.0.0.1 serving the tiny target), resume after a kill,
failures, retries and concurrency. No mocks: the target is the tiny Llama, taught in a few
seconds to answer weather questions in prose so that answers end and depend on the prompt."""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from specforge.config import FixConfig, RegenerateConfig, TargetConfig
from specforge.data.regen import regenerate_conversations
from specforge.data.regen.replay import Answer, Replay
from specforge.utils.io import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
CITIES = ["Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Perth", "Bern"]
SKIES = ["sunny", "rainy", "cloudy", "windy"]
SYSTEM = "You are a helpful assistant."
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the embedded backend runs


def chat(city: str, i: int, follow_up: bool, system: bool = False) -> list[dict]:
    """A weather chat whose answers the taught target says (today, then tomorrow)."""
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    msgs += [{"role": "user", "content": f"What is the weather in {city}?"},
             {"role": "assistant", "content": f"{city} is {SKIES[i % 4]} today."}]
    if follow_up:
        msgs += [{"role": "user", "content": "And tomorrow?"},
                 {"role": "assistant", "content": f"{city} is {SKIES[(i + 1) % 4]} tomorrow."}]
    return msgs


@pytest.fixture(scope="module")
def target(tiny_target_dir, tmp_path_factory, one_thread):
    """The tiny random Llama taught the chats above (random weights only ever repeat one token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32)
    teach(model, tok, [tok.apply_chat_template(chat(c, i, True, system=i % 2 == 0), tokenize=False)
                       for i, c in enumerate(CITIES)])
    out = tmp_path_factory.mktemp("chat_target")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return TargetConfig(name="tiny-chat", path=str(out), dtype="float32")


def teach(model, tok, texts: list[str], steps: int = 120) -> None:
    """Train the model on these texts until it says them."""
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        model(**enc, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()


def dataset(n: int = 8, follow_up_every: int = 2) -> list[dict]:
    """Stage-shaped rows whose original answers are TOON (what the target never says)."""
    assert n <= 16
    rows = []
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        system = i % 3 == 0 if i < 8 else (i - 8) % 3 != 0  # so that all 16 first rows differ
        msgs = chat(city, i, follow_up=i % follow_up_every == 0, system=system)
        for m in msgs:
            if m["role"] == "assistant":
                m["content"] = f"weather:\n  city: {city}\n  sky: {SKIES[(i + 2) % 4]}"
        rows.append({"id": f"w{i}", "messages": msgs, "fixes": [], "file": "raw.jsonl", "line": i + 1,
                     "source": "test"})
    return rows


def cfg(**kw) -> RegenerateConfig:
    return RegenerateConfig(**{"enabled": True, "batch_size": 3, "max_new_tokens": 24, **kw})


def assert_replaced(src: list[dict], out: list[dict]) -> None:
    """Same turns and roles; system/user content unchanged; every assistant turn new."""
    assert [m["role"] for m in out] == [m["role"] for m in src]
    for a, b in zip(src, out):
        if a["role"] == "assistant":
            assert b["content"] != a["content"] and b["content"].strip()
        else:
            assert b == a


# --------------------------------------------------------------------------- embedded backend


def test_replay_conditions_on_regenerated_answers():
    conv = {"id": "x", "messages": chat("Oslo", 0, True, system=True)}
    r = Replay("k", 0, conv, max_new_tokens=8)
    assert r.prompt() == conv["messages"][:2]
    r.answer(Answer("NEW ANSWER", tokens=3, truncated=False))
    prompt = r.prompt()
    assert prompt[2] == {"role": "assistant", "content": "NEW ANSWER"} and prompt[3] == conv["messages"][3]
    r.answer(Answer("second", tokens=2, truncated=False))
    assert r.prompt() is None
    rec = r.record()
    assert rec["status"] == "regenerated" and rec["turns"] == 2 and rec["tokens"] == 5


def test_embedded_regenerates_deterministically(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    convs = dataset(8)
    rows, report = regenerate_conversations(convs, cfg(), target, tmp_path / "a", "train")
    assert report.pop("quarantine") == []
    assert [r["id"] for r in rows] == [c["id"] for c in convs]
    for src, row in zip(convs, rows):
        assert_replaced(src["messages"], row["messages"])
        assert {k: row[k] for k in ("fixes", "file", "line", "source")} == \
               {k: src[k] for k in ("fixes", "file", "line", "source")}
    assert report["requested"] == report["regenerated"] == report["output_rows"] == 8
    assert report["turns_regenerated"] == 8 + 4 and report["failed"] == 0
    assert report["tokens_generated"] > 0 and report["tokens_per_s"] > 0
    assert list(read_jsonl(tmp_path / "a" / "regen_train.jsonl")) == rows
    # The follow-up was asked with the regenerated first answer: asking the model ourselves
    # from that prompt (one at a time, no padding) gives the same second answer.
    tok = AutoTokenizer.from_pretrained(target.path)
    model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).to(DEVICE)
    msgs = rows[0]["messages"]
    prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True).to(DEVICE)
    gen = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert tok.decode(gen, skip_special_tokens=True) == msgs[-1]["content"]
    assert msgs[-1]["content"].endswith("tomorrow.")  # the taught answer about the regenerated city
    # Deterministic: a fresh run elsewhere gives the same rows; a rerun here reuses the log.
    again, _ = regenerate_conversations(convs, cfg(), target, tmp_path / "b", "train")
    assert again == rows
    cached, rep = regenerate_conversations(convs, cfg(), target, tmp_path / "a", "train")
    assert cached == rows and rep["resumed"] == 8 and rep["asked"] == 0


def test_progress_counts_turns_between_the_groups_it_journals(target, tmp_path):
    """The embedded backend journals a group of 4 x batch_size conversations at a time (minutes
    apart on a CPU): the bar counts turns, so a log hears of every answered one before its group
    ends (a canned greeting before any user turn is copied, not asked)."""
    from specforge.data.regen.replay import turns_to_answer

    greeting = [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "Sunny."}]
    assert turns_to_answer(greeting) == 1 and turns_to_answer(chat("Oslo", 0, True)) == 2
    import io

    from rich.console import Console

    from specforge.utils.progress import progress_bar

    out = io.StringIO()
    with progress_bar(console=Console(file=out, force_terminal=False, width=200), every=0) as bar:
        _, report = regenerate_conversations(dataset(8), cfg(batch_size=1), target, tmp_path, "train", progress=bar)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("regenerate train (turns): ")]
    counts = [re.match(r"regenerate train \(turns\): (\d+)/12", line).group(1) for line in lines]
    assert counts[:4] == ["1", "2", "3", "4"]  # the first group of 4 journals after its 6 turns
    assert lines[-1].startswith("regenerate train (turns): 12/12 (100%)") and lines[-1].endswith(" tok/s")
    assert report["turns_regenerated"] == 12
    # every first answer cut at 2 tokens: the follow-ups are never asked, and the bar still ends full
    cut = io.StringIO()
    with progress_bar(console=Console(file=cut, force_terminal=False, width=200), every=0) as bar:
        _, report = regenerate_conversations(dataset(8), cfg(batch_size=1, max_new_tokens=2), target,
                                             tmp_path / "cut", "train", progress=bar)
    assert report["failures_by_reason"] == {"regen_truncated": 8}
    last = [line for line in cut.getvalue().splitlines() if line.startswith("regenerate train (turns): ")][-1]
    assert last.startswith("regenerate train (turns): 12/12 (100%)")


def test_sampling_is_seeded(target, tmp_path):
    """Same seed, same samples (the answers of skipped rows included); another seed, others."""
    def answers(name: str, seed: int) -> list:
        regenerate_conversations(dataset(6), cfg(temperature=2.0), target, tmp_path / name, "train", seed=seed)
        return list(read_jsonl(tmp_path / name / "regen_train.partial.jsonl"))[1:]

    state = torch.get_rng_state()
    first = answers("a", 1)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    assert answers("b", 1) == first
    assert answers("c", 2) != first


def test_unusable_answers_are_skipped_and_fix_runs_on_the_output(target, tmp_path):
    convs = dataset(4, follow_up_every=99)
    # w4 asks what w0 asks: unique as input (other original answer), a duplicate once regenerated.
    convs.append({**convs[0], "id": "w4", "line": 5, "messages": [dict(m) for m in convs[0]["messages"]]})
    convs[4]["messages"][-1]["content"] = "weather:\n  city: Paris\n  sky: foggy"
    # The taught target answers in prose: toon_prose="keep" lets it through (the default quarantines it).
    fix = FixConfig(toon=True, toon_prose="keep")
    rows, report = regenerate_conversations(convs, cfg(), target, tmp_path, "eval", fix=fix)
    quarantine = report.pop("quarantine")
    assert [r["id"] for r in rows] == ["w0", "w1", "w2", "w3"]
    assert [(q["file"], q["line"], q["reason"]) for q in quarantine] == [
        ("raw.jsonl", 5, "duplicate: same messages as raw.jsonl:1 (after regeneration)")]
    assert report["fix"]["quarantined"] == report["quarantined"] == 1 and report["fix"]["input_rows"] == 5
    assert list(read_jsonl(tmp_path / "regen_eval.skipped.jsonl")) == quarantine

    rows, report = regenerate_conversations(convs, cfg(max_new_tokens=2), target, tmp_path, "eval")
    quarantine = report.pop("quarantine")
    assert report["resumed"] == 0 and report["asked"] == 5  # another config: the old log is not reused
    assert rows == [] and report["skipped"] == report["failed"] == 5 and report["output_rows"] == 0
    assert report["failures_by_reason"] == {"regen_truncated": 5}
    failures = list(read_jsonl(tmp_path / "regen_eval.failures.jsonl"))
    assert {f["action"] for f in failures} == {"skipped"} and [f["id"] for f in failures] == [c["id"] for c in convs]
    assert [q["row"]["messages"] for q in quarantine] == [c["messages"] for c in convs]
    assert all("max_new_tokens=2" in q["reason"] for q in quarantine)


def test_rows_of_a_json_list_on_one_line_regenerate(target, tmp_path):
    """json.dump without indent puts every row of a .json list on line 1: regeneration refused
    them ("two conversations claim this place"). Each keeps its file and line, a duplicate's
    reason names the first's."""
    convs = [{**c, "file": "rows.json", "line": 1} for c in dataset(3, follow_up_every=99)]
    convs.append({**convs[0], "id": "w3", "messages": [dict(m) for m in convs[0]["messages"]]})
    convs[3]["messages"][-1]["content"] = "weather:\n  city: Paris\n  sky: foggy"  # a duplicate once regenerated
    rows, report = regenerate_conversations(convs, cfg(), target, tmp_path, "train")
    assert [(r["id"], r["file"], r["line"]) for r in rows] == [("w0", "rows.json", 1), ("w1", "rows.json", 1),
                                                              ("w2", "rows.json", 1)]
    assert [(q["file"], q["line"], q["reason"]) for q in report["quarantine"]] == [
        ("rows.json", 1, "duplicate: same messages as rows.json:1 (after regeneration)")]


def test_the_group_of_the_longest_conversation_is_decoded_first(target, tmp_path):
    """Groups (4 x batch_size conversations, cut by position) decode heaviest first, so that a batch
    too large for a GPU's memory fails in the first minutes; the rows still come in input order."""
    convs = dataset(8)  # batch_size 1: groups w0-w3 and w4-w7
    user = next(m for m in convs[6]["messages"] if m["role"] == "user")
    user["content"] += " Tell me everything about the sky, the wind and the rain there." * 3
    rows, report = regenerate_conversations(convs, cfg(batch_size=1), target, tmp_path, "train")
    journal = [json.loads(line)["id"] for line in (tmp_path / "regen_train.partial.jsonl").read_text().splitlines()[1:]]
    assert sorted(journal[:4]) == ["w4", "w5", "w6", "w7"] and sorted(journal[4:]) == ["w0", "w1", "w2", "w3"]
    ids = [r["id"] for r in rows]  # (the tiny target may not finish w6's longer question: skipped)
    assert ids == sorted(ids, key=[c["id"] for c in convs].index) and len(ids) >= 7 and report["asked"] == 8


def test_resume_after_kill_matches_uninterrupted_run(target, tmp_path):
    """Kill the CLI (SIGKILL) mid-run, tear its last log line, rerun: same output, no duplicates."""
    from data_prep.regenerate import main

    rows = [{"id": c["id"], "messages": c["messages"]} for c in dataset(16, follow_up_every=3)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["--target", target.path, "--dtype", "float32", "--batch-size", "2", "--max-new-tokens", "24"]
    killed = tmp_path / "killed"
    log = killed / "regen_train.partial.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "data_prep" / "regenerate.py"), str(tmp_path / "in.jsonl"),
                             "--out", str(killed / "train.jsonl"), *args],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (log.is_file() and log.read_text().count("\n") >= 5):  # header + 2 groups of 2
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the regeneration never got going"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    assert not (killed / "train.jsonl").exists()
    done_before = log.read_text().count("\n") - 1
    assert 4 <= done_before < 16
    with open(log, "a") as f:
        f.write('{"key": "torn-by-a-crash", "id": "w')  # as if killed mid-write

    assert main([str(tmp_path / "in.jsonl"), "--out", str(killed / "train.jsonl"), *args]) == 0
    assert main([str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "clean" / "train.jsonl"), *args]) == 0
    resumed = list(read_jsonl(killed / "train.jsonl"))
    assert resumed == list(read_jsonl(tmp_path / "clean" / "train.jsonl"))
    skipped = {q["row"]["id"] for q in read_jsonl(killed / "regen_train.skipped.jsonl")}
    assert len(skipped) <= 2  # the odd answer of the tiny model that runs past max_new_tokens
    kept = [r for r in rows if r["id"] not in skipped]
    assert [r["id"] for r in resumed] == [r["id"] for r in kept]
    for src, row in zip(kept, resumed):
        assert_replaced(src["messages"], row["messages"])
    report = json.loads((killed / "regen_train.report.json").read_text())
    assert report["resumed"] >= done_before and report["resumed"] + report["asked"] == 16
    records = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert len(records) == len({r["key"] for r in records}) == 16


def test_another_chat_template_file_answers_everything_again(target, tmp_path):
    """target.chat_template decides the prompts the target answers: the resume log of answers
    to the prompts of another template is not reused (the same template's is)."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(target.path).chat_template
    (tmp_path / "same.jinja").write_text(template)
    (tmp_path / "brief.jinja").write_text("{{- 'Answer briefly.\\n' }}" + template)
    rows = dataset(4)
    runs = [regenerate_conversations(rows, cfg(), replace(target, chat_template=str(tmp_path / name)),
                                     tmp_path / "work", "train")[1] for name in ("same.jinja", "same.jinja", "brief.jinja")]
    assert [(r["resumed"], r["asked"]) for r in runs] == [(0, 4), (4, 0), (0, 4)]


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    return ids


def test_the_kv_cache_goes_under_the_name_the_forward_takes(tiny_target_dir):
    """transformers 5.19 (the sglang extra's pin) takes `past_key_values`; later releases take
    `cache` and drop the old name in 5.40: the decoder and the engine ask the signature."""
    import inspect

    from transformers import AutoModelForCausalLM

    from specforge.targets.loader import with_cache

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32)
    (name,) = with_cache(model, None)
    assert name in inspect.signature(model.forward).parameters

    class OldForward(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return past_key_values

    assert with_cache(OldForward(), "kv") == {"past_key_values": "kv"}
    assert OldForward()(None, **with_cache(OldForward(), "kv")) == "kv"


def test_refill_decoder_answers_as_generate_does_one_at_a_time(target):
    """Rows leave and join the batch (follow-ups first, longer prompts that grow the cache in
    front, free rows compacted away at the end): each answer is what `generate` says for that
    prompt alone, in fp32, and a repetition penalty in the target's generation_config applies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specforge.data.regen.decode import RefillDecoder, Request

    tok = AutoTokenizer.from_pretrained(target.path)
    model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).to(DEVICE).eval()
    convs = dataset(12, follow_up_every=3)
    firsts = [prompt_ids(tok, c["messages"][: next(i for i, m in enumerate(c["messages"]) if m["role"] == "assistant")])
              for c in convs]
    firsts[5] = firsts[5] + firsts[2]  # one prompt longer than any cache it joins
    stop = {tok.eos_token_id}

    def alone(ids: list[int], max_new: int) -> list[int]:
        out = model.generate(torch.tensor([ids], device=DEVICE), attention_mask=torch.ones(1, len(ids), device=DEVICE),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(stop),
                             pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        return out[: next((i for i, t in enumerate(out) if t in stop), len(out))]

    for penalty in (None, 1.3):
        model.generation_config.repetition_penalty = penalty
        answers, follow_ups, widths = {}, {}, []

        def done(request, tokens, truncated):
            answers[request.tag] = (tokens, truncated)
            widths.append(decoder.mask.shape[1])
            if isinstance(request.tag, int) and request.tag % 3 == 0:  # a follow-up turn, asked next
                ids = request.ids + tokens + [tok.eos_token_id] + firsts[request.tag][-6:]
                follow_ups[("again", request.tag)] = ids
                return [Request(ids, tag=("again", request.tag))]
            return []

        decoder = RefillDecoder(model, batch_size=4, max_new_tokens=24, stop_ids=stop, pad_id=tok.pad_token_id)
        decoder.run([Request(ids, tag=i) for i, ids in enumerate(firsts)], done)
        assert set(answers) == set(range(12)) | set(follow_ups)
        for tag, (tokens, truncated) in answers.items():
            ids = follow_ups[tag] if tag in follow_ups else firsts[tag]
            expected = alone(ids, 24)
            assert tokens == expected, (penalty, tag)
            assert truncated == (len(expected) == 24)  # no end of turn within max_new_tokens
        assert any(tokens for tokens, _ in answers.values())
        # the cache spans the live rows only (columns of finished rows dropped), not every step since the start
        assert max(widths) <= max(len(ids) for ids in [*firsts, *follow_ups.values()]) + 24
    model.generation_config.repetition_penalty = None


def test_refill_decoder_samples_per_request(target):
    """Sampling draws from each request's own seed: the same answers whatever shares the batch,
    and the global RNG is not touched."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specforge.data.regen.decode import RefillDecoder, Request

    tok = AutoTokenizer.from_pretrained(target.path)
    model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).to(DEVICE).eval()
    prompts = [prompt_ids(tok, chat(c, 0, False)[:1]) for c in CITIES[:6]]

    def sample(batch_size: int, seeds: list[int]) -> dict:
        answers = {}
        decoder = RefillDecoder(model, batch_size=batch_size, max_new_tokens=12, stop_ids={tok.eos_token_id},
                                pad_id=tok.pad_token_id, temperature=3.0)
        decoder.run([Request(p, tag=i, seed=s) for i, (p, s) in enumerate(zip(prompts, seeds))],
                    lambda r, tokens, truncated: answers.__setitem__(r.tag, tokens) or [])
        return answers

    state = torch.get_rng_state()
    first = sample(6, list(range(6)))
    assert torch.equal(torch.get_rng_state(), state)
    assert sample(2, list(range(6))) == first
    other = sample(6, list(range(6, 12)))
    assert other != first and len(set(map(tuple, first.values()))) > 1


# --------------------------------------------------------------------------- openai backend


class TargetServer(ThreadingHTTPServer):
    """A minimal OpenAI-compatible server: /v1/models and /v1/chat/completions, greedy decoding
    of the tiny target one request at a time. It records every request and the most requests
    it ever had in flight; `fail_markers`: requests mentioning one answer 500; `flaky` makes
    the first attempt of every distinct request answer 500. As SGLang and vLLM, it renders the
    request's `tools`, parses a call's JSON arguments back into an object for the template, and
    refuses a tool result without a `tool_call_id`; `call_tools` answers with a parsed call;
    `refuse_one_token` answers 400 to a request for one token (the template check's probe),
    `reject_all` 400 to every chat request, `not_chat` 200 with no completion; `api_key` wants it as
    a Bearer token (401 otherwise); a model other than tiny-chat is 404, as vLLM answers it."""

    daemon_threads = True

    def __init__(self, target_cfg):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        super().__init__(("127.0.0.1", 0), Handler)
        self.tok = AutoTokenizer.from_pretrained(target_cfg.path)
        self.model = AutoModelForCausalLM.from_pretrained(target_cfg.path, dtype=torch.float32).to(DEVICE).eval()
        self.lock, self.gpu = threading.Lock(), threading.Lock()
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.fail_markers: tuple[str, ...] = ()
        self.flaky = self.call_tools = self.refuse_one_token = self.reject_all = self.not_chat = False
        self.api_key: str | None = None  # as --api-key KEY
        self.chat_template: str | None = None  # as --chat-template FILE: instead of the tokenizer's
        self.seen: set[str] = set()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def complete(self, body: dict) -> dict:
        if self.call_tools:
            return {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "forecast", "arguments": "{}"}}]}}],
                "usage": {"completion_tokens": 9}}
        messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in body["messages"]]
        # images as a vision-language server takes them: IMAGE_TOKENS more prompt tokens each (the
        # tiny text target reads the text around them)
        images = sum(p.get("type") == "image_url" for m in messages if isinstance(m["content"], list)
                     for p in m["content"])
        messages = [{**m, "content": "".join(p["text"] for p in m["content"] if p.get("type") == "text")}
                    if isinstance(m["content"], list) else m for m in messages]
        with self.gpu:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True, **({"tools": body["tools"]} if "tools" in body else {}),
                                               **body.get("chat_template_kwargs", {}),
                                               **({"chat_template": self.chat_template} if self.chat_template else {})
                                               ).to(DEVICE)
            with torch.inference_mode():
                out = self.model.generate(**ids, max_new_tokens=body["max_tokens"], do_sample=False)
        new = out[0, ids["input_ids"].shape[1]:].tolist()
        eos = self.tok.eos_token_id
        finished = eos in new
        new = new[: new.index(eos) + 1] if finished else new
        text = self.tok.decode(new, skip_special_tokens=True)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop" if finished else "length"}],
                "usage": {"prompt_tokens": ids["input_ids"].shape[1] + IMAGE_TOKENS * images,
                          "completion_tokens": len(new)}}


IMAGE_TOKENS = 16  # the test server's tokens per image


class Handler(BaseHTTPRequestHandler):
    server: TargetServer

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refused_key(self) -> bool:
        """As a server started with --api-key: 401 without its Bearer token."""
        if self.server.api_key and self.headers.get("Authorization") != f"Bearer {self.server.api_key}":
            self._send(401, {"error": "Unauthorized"})
            return True
        return False

    def do_GET(self):
        if self._refused_key():
            return
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "tiny-chat", "object": "model"}]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        srv = self.server
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        body = json.loads(raw)
        with srv.lock:
            srv.requests.append(body)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            first_try = raw not in srv.seen
            srv.seen.add(raw)
        try:
            time.sleep(0.05)  # a server takes a while to answer; let the client's requests overlap
            if self._refused_key():
                return
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": f"no route {self.path}"})
            if body.get("model") != "tiny-chat":
                return self._send(404, {"error": f"The model `{body.get('model')}` does not exist."})
            if srv.reject_all:
                return self._send(400, {"error": "unsupported parameter (test)"})
            if srv.not_chat:
                return self._send(200, {"status": "ok"})
            if any(m in json.dumps(body["messages"]) for m in srv.fail_markers):
                return self._send(500, {"error": "internal error (test)"})
            if any(m["role"] == "tool" and not m.get("tool_call_id") for m in body["messages"]):
                return self._send(400, {"error": "tool messages need a tool_call_id"})
            if srv.flaky and first_try:
                return self._send(503, {"error": "overloaded (test)"})
            if srv.refuse_one_token and body["max_tokens"] == 1:
                return self._send(400, {"error": "refused (test)"})
            self._send(200, srv.complete(body))
        finally:
            with srv.lock:
                srv.in_flight -= 1


@pytest.fixture(scope="module")
def server(target):
    srv = TargetServer(target)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def fresh(server):
    server.requests.clear()
    server.seen.clear()
    server.max_in_flight, server.fail_markers, server.flaky, server.call_tools = 0, (), False, False
    server.refuse_one_token = server.reject_all = server.not_chat = False
    server.api_key = None
    server.chat_template = None
    return server


def test_openai_backend_matches_embedded_and_overlaps(fresh, target, tmp_path):
    convs = dataset(8)
    c = cfg(backend="openai", urls=[fresh.url, fresh.url + "/v1/"], concurrency=4, thinking=True)
    rows, report = regenerate_conversations(convs, c, target, tmp_path, "train")
    assert report.pop("quarantine") == [] and report["regenerated"] == 8 and report["failed"] == 0
    assert report["tokens_generated"] > 0
    for src, row in zip(convs, rows):
        assert_replaced(src["messages"], row["messages"])
    assert fresh.max_in_flight >= 2, "requests were not concurrent"
    assert len(fresh.requests) == 12  # 8 first turns + 4 follow-ups, no retries
    req = fresh.requests[0]
    assert req["model"] == "tiny-chat" and req["max_tokens"] == 24 and req["temperature"] == 0.0
    assert req["chat_template_kwargs"] == {"enable_thinking": True}
    # Follow-ups were sent with the regenerated first answer (assert_replaced: not the original).
    sent = [r["messages"] for r in fresh.requests]
    follow_ups = [row["messages"][:-1] for row in rows if row["messages"][-2]["content"] == "And tomorrow?"]
    assert len(follow_ups) == 4 and all(f in sent for f in follow_ups)
    # The same prompts, one at a time in-process, give the same answers.
    embedded, _ = regenerate_conversations(convs, cfg(batch_size=1), target, tmp_path / "embedded", "train")
    assert [r["messages"] for r in embedded] == [r["messages"] for r in rows]


def test_openai_failures_retries_and_rerun(fresh, target, tmp_path):
    convs = dataset(6, follow_up_every=99)  # w1 asks about Oslo, w4 about Cairo
    c = cfg(backend="openai", urls=[fresh.url], concurrency=3)

    fresh.flaky = True  # every request fails once: the retries recover all of them
    rows, report = regenerate_conversations(convs, c, target, tmp_path / "flaky", "train")
    assert report["regenerated"] == 6 and report["failed"] == 0
    assert len(fresh.requests) == 2 * 7  # 6 first turns + 1 follow-up, each tried twice

    fresh.requests.clear()
    fresh.flaky, fresh.fail_markers = False, ("Oslo", "Cairo")
    rows, report = regenerate_conversations(convs, c, target, tmp_path, "train")
    assert report.pop("quarantine") == []
    assert report["regenerated"] == 4 and report["kept_original"] == report["failed"] == 2
    assert report["failures_by_reason"] == {"regen_server_error": 2}
    failures = list(read_jsonl(tmp_path / "regen_train.failures.jsonl"))
    assert [(f["id"], f["action"], f["transient"]) for f in failures] == \
           [("w1", "kept_original", True), ("w4", "kept_original", True)]
    assert "HTTP 500" in failures[0]["reason"] and fresh.url in failures[0]["reason"]
    assert sum(any(c in json.dumps(r["messages"]) for c in ("Oslo", "Cairo")) for r in fresh.requests) == 2 * 4
    assert [r["messages"] for r in rows if r["id"] in ("w1", "w4")] == [convs[1]["messages"], convs[4]["messages"]]

    fresh.fail_markers, n = (), len(fresh.requests)  # the server is fixed: only the failures are asked again
    rows, report = regenerate_conversations(convs, c, target, tmp_path, "train")
    assert report["asked"] == 2 and report["regenerated"] == 6 and report["failed"] == 0
    assert len(fresh.requests) == n + 2
    assert list(read_jsonl(tmp_path / "regen_train.failures.jsonl")) == []


def test_a_server_that_rejects_every_conversation_stops_the_run_and_keeps_none_of_them(fresh, target, tmp_path,
                                                                                       monkeypatch):
    """A server started with --api-key (no key here), a model name it does not serve, or one that
    rejects every request (400): before, each conversation was kept with its original answer and
    logged as done, so the fixed server was never asked again. Now the run stops naming the error;
    a rejection streak keeps none of its conversations, and the next run asks them all."""
    from specforge.errors import InvalidInput

    monkeypatch.delenv("SPECFORGE_API_KEY", raising=False)
    convs = dataset(10, follow_up_every=99)
    c = cfg(backend="openai", urls=[fresh.url], concurrency=2)
    fresh.api_key = "s3cret"
    with pytest.raises(InvalidInput, match=rf"{fresh.url}/v1/models: HTTP 401: the server wants an API key; set "
                                           "SPECFORGE_API_KEY to its --api-key"):
        regenerate_conversations(convs, c, target, tmp_path / "key", "train")
    monkeypatch.setenv("SPECFORGE_API_KEY", "s3cret")
    assert regenerate_conversations(convs[:2], c, target, tmp_path / "key", "train")[1]["regenerated"] == 2
    fresh.api_key = None

    with pytest.raises(InvalidInput, match=r"HTTP 404 .*does not exist.*: no such model or route there; check "
                                           r"data.regenerate.model \('gpt-4'\)"):
        with pytest.warns(UserWarning, match="is not among the served models"):
            regenerate_conversations(convs, cfg(backend="openai", urls=[fresh.url], model="gpt-4"), target,
                                     tmp_path / "model", "train")

    fresh.reject_all = True
    with pytest.raises(InvalidInput, match=r"the servers rejected the last 8 conversations in a row \(or answered them "
                                           r"with no chat completion\); last: regen_request_rejected: .*HTTP 400 "
                                           r".*unsupported parameter \(test\).* None of them is kept"):
        regenerate_conversations(convs, c, target, tmp_path / "rejected", "train")
    fresh.reject_all, fresh.not_chat = False, True  # an endpoint that answers something else
    with pytest.raises(InvalidInput, match=r"last: regen_bad_response: .*not a chat completion"):
        regenerate_conversations(convs, c, target, tmp_path / "rejected", "train")
    fresh.not_chat = False
    log = (tmp_path / "rejected" / "regen_train.partial.jsonl").read_text().splitlines()
    assert len(log) == 1  # the header: not one conversation kept as done
    # the server fixed: every conversation is asked
    rows, report = regenerate_conversations(convs, c, target, tmp_path / "rejected", "train")
    assert report["asked"] == 10 and report["resumed"] == 0
    # none rejected; the random target may run an answer past max_new_tokens on some CPUs (its own greedy tokens)
    assert set(report["failures_by_reason"]) <= {"regen_truncated"}


def test_a_server_rendering_another_template_stops_the_run_before_an_answer_is_kept(fresh, target, tmp_path):
    """target.chat_template set, the server started without it (its tokenizer's template): the
    first answer's prompt tokens differ from ours, the run stops naming the server and the fix,
    nothing is kept; the server restarted with the template, every conversation is answered."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from specforge.errors import InvalidInput

    brief = "{{- 'Answer briefly.\\n' }}" + AutoTokenizer.from_pretrained(target.path).chat_template
    (tmp_path / "brief.jinja").write_text(brief)
    templated = replace(target, chat_template=str(tmp_path / "brief.jinja"))
    convs = dataset(6)
    c = cfg(backend="openai", urls=[fresh.url], concurrency=3, keep_truncated=True)  # the prefix makes it ramble
    with pytest.raises(InvalidInput, match=rf"data.regenerate: {fresh.url} renders the prompts otherwise than the "
                                           rf"target: a prompt of (\d+) tokens with target.chat_template=.*brief.jinja "
                                           rf"is (\d+) tokens there.*--chat-template"):
        regenerate_conversations(convs, c, templated, tmp_path / "work", "train")
    log = (tmp_path / "work" / "regen_train.partial.jsonl").read_text().splitlines()
    assert len(log) == 1  # the header: no answer of that server kept
    unchecked = cfg(backend="openai", urls=[fresh.url], concurrency=3, keep_truncated=True, check_template=False)
    assert regenerate_conversations(convs, unchecked, templated, tmp_path / "unchecked", "train")[1]["asked"] == 6

    fresh.chat_template = brief  # restarted with --chat-template brief.jinja
    rows, report = regenerate_conversations(convs, c, templated, tmp_path / "work", "train")
    assert report["regenerated"] == 6 and report["failed"] == 0 and report["asked"] == 6
    assert all("Answer briefly." in fresh.tok.decode(fresh.tok.apply_chat_template(
        r["messages"], chat_template=brief, add_generation_prompt=True)) for r in fresh.requests[-3:])


def test_prompts_with_images_are_checked_by_their_text_alone(fresh, target, tmp_path):
    """Every prompt with an image (a vision-language dataset): the server counts the image's
    tokens, which we cannot, so its first prompt is asked again without the image, for one token,
    and compared as a text prompt is. A server rendering another template is stopped."""
    from dataclasses import replace

    from PIL import Image
    from transformers import AutoTokenizer

    from specforge.errors import InvalidInput

    Image.new("RGB", (8, 8), "blue").save(tmp_path / "sky.png")
    convs = dataset(4, follow_up_every=99)
    for row in convs:
        first = next(m for m in row["messages"] if m["role"] == "user")
        first["content"] = [{"type": "image", "image": str(tmp_path / "sky.png")},
                            {"type": "text", "text": first["content"]}]
    brief = "{{- 'Answer briefly.\\n' }}" + AutoTokenizer.from_pretrained(target.path).chat_template
    (tmp_path / "brief.jinja").write_text(brief)
    templated = replace(target, chat_template=str(tmp_path / "brief.jinja"))
    c = cfg(backend="openai", urls=[fresh.url], concurrency=1, keep_truncated=True)
    with pytest.raises(InvalidInput, match=rf"data.regenerate: {fresh.url} renders the prompts otherwise"):
        regenerate_conversations(convs, c, templated, tmp_path / "other", "train")
    probe = fresh.requests[1]  # after the first prompt: its text alone, one token
    assert probe["max_tokens"] == 1 and all(isinstance(m["content"], str) for m in probe["messages"])
    assert probe["messages"][-1]["content"] == "What is the weather in " + CITIES[0] + "?"

    fresh.requests.clear()
    fresh.chat_template = brief  # restarted with --chat-template
    rows, report = regenerate_conversations(convs, c, templated, tmp_path / "same", "train")
    assert report["regenerated"] == 4 and report["failed"] == 0
    assert [r["max_tokens"] for r in fresh.requests] == [24, 1, 24, 24, 24, 24]  # 5 turns, one probe after the first
    sent = {p["image_url"]["url"] for r in fresh.requests for m in r["messages"] if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image_url"}  # vLLM takes no bare path; a remote server has no file
    assert sent == {"data:image/png;base64," + base64.b64encode((tmp_path / "sky.png").read_bytes()).decode()}

    fresh.requests.clear()
    fresh.chat_template, fresh.refuse_one_token = None, True  # a server that does not answer the probe
    with pytest.warns(UserWarning, match=rf"{fresh.url} did not answer a prompt's text without its images"):
        rows, report = regenerate_conversations(convs, c, templated, tmp_path / "unprobed", "train")
    assert report["regenerated"] + len(report["quarantine"]) == 4  # not checked: answered, once said
    assert [r["max_tokens"] for r in fresh.requests].count(1) == 1  # asked once, not at every prompt
    assert rows[0]["messages"][0 if rows[0]["messages"][0]["role"] == "user" else 1]["content"][0]["type"] == "image"


@pytest.fixture(scope="module")
def tool_target(target, tmp_path_factory):
    """The taught target with a tool-aware chat template (a Qwen-like ChatML one)."""
    from test_tool_calls import TOOL_TEMPLATE

    out = tmp_path_factory.mktemp("tool_target")
    shutil.copytree(target.path, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return TargetConfig(name="tiny-chat", path=str(out), dtype="float32")


def tool_traces(n: int = 3) -> list[dict]:
    from test_tool_calls import tool_row

    from specforge.data.formats import to_conversation

    rows = []
    for i in range(n):
        row = tool_row(i)
        row["messages"][2].pop("tool_call_id")  # a result without its call's id (LLaMA-Factory's rows)
        rows.append({**to_conversation(row), "fixes": [], "file": "raw.jsonl", "line": i + 1, "source": "test"})
    return rows


def test_agentic_traces_regenerate_the_answer_after_the_tools_in_process_and_served_alike(tool_target, tmp_path):
    """The calls and results stay as written; the final answer is the target's, asked with the row's
    tools in the prompt: in-process, and through a server that takes OpenAI's tool fields."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_tool_calls import TOOLS

    convs = tool_traces()
    c = cfg(keep_truncated=True)  # what the taught target says here may not end within 24 tokens
    rows, report = regenerate_conversations(convs, c, tool_target, tmp_path / "embedded", "train")
    assert report["regenerated"] == report["turns_regenerated"] == report["output_rows"] == 3
    tok = AutoTokenizer.from_pretrained(tool_target.path)
    model = AutoModelForCausalLM.from_pretrained(tool_target.path, dtype=torch.float32).to(DEVICE)
    for src, row in zip(convs, rows):
        assert row["tools"] == TOOLS and row["messages"][:4] == src["messages"][:4]
        assert row["messages"][4]["content"] != src["messages"][4]["content"]
        prompt = tok.apply_chat_template(src["messages"][:4], tools=TOOLS, add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True).to(DEVICE)
        assert tok.decode(prompt["input_ids"][0]).startswith("<|im_start|>system\nTools: forecast")
        gen = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0, prompt["input_ids"].shape[1]:]
        assert tok.decode(gen, skip_special_tokens=True) == row["messages"][4]["content"]

    srv = TargetServer(tool_target)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        served, report = regenerate_conversations(convs, cfg(keep_truncated=True, backend="openai", urls=[srv.url]),
                                                  tool_target, tmp_path / "served", "train")
        assert [r["messages"] for r in served] == [r["messages"] for r in rows]
        request = next(r for r in srv.requests if r["messages"][0]["content"].endswith("day 0?"))  # requests overlap
        assert request["tools"] == TOOLS
        assert request["messages"][1]["tool_calls"][0]["function"]["arguments"] == json.dumps({"day": 0})
        assert [m.get("tool_call_id") for m in request["messages"][2:4]] == ["c1", "c2"]  # the first: its call's

        srv.call_tools = True  # the target calls a tool where the trace answers: kept as written
        kept, report = regenerate_conversations(convs, cfg(backend="openai", urls=[srv.url]),
                                                tool_target, tmp_path / "calls", "train")
        assert report["kept_original"] == 3 and report["failures_by_reason"] == {"regen_tool_call": 3}
        assert [r["messages"] for r in kept] == [c["messages"] for c in convs]
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_cli_writes_the_tools_of_a_regenerated_trace(tool_target, tmp_path):
    """regenerate.py wrote {"id", "messages"} only: an agentic trace lost its `tools`, so the data stage
    rendered its calls without the definitions the target was asked with."""
    from data_prep.regenerate import main

    from test_tool_calls import TOOLS

    write_jsonl(tmp_path / "in.jsonl", [{k: c[k] for k in ("id", "messages", "tools")} for c in tool_traces()])
    assert main([str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out" / "train.jsonl"), "--target",
                 tool_target.path, "--dtype", "float32", "--max-new-tokens", "24", "--keep-truncated"]) == 0
    rows = list(read_jsonl(tmp_path / "out" / "train.jsonl"))
    assert len(rows) == 3 and all(set(r) == {"id", "messages", "tools"} and r["tools"] == TOOLS for r in rows)


# How TOOL_TEMPLATE writes a call, for transformers' response parser (a tokenizer's `response_template`).
CALL_RESPONSE_TEMPLATE = {"start_anchor": "<|im_start|>assistant\n", "fields": {
    "tool_calls": {"open_pattern": r"<tool_call>(?P<name>\w+) ", "close": "</tool_call>", "repeats": True,
                   "content": "json",
                   "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
    "content": {"close": "<|im_end|>", "content": "text"}}}


@pytest.fixture(scope="module")
def calling_target(tool_target, tmp_path_factory):
    """The tool target taught to call `forecast` again where its traces answer; its tokenizer says
    how it writes calls (`response_template`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_tool_calls import TOOLS

    tok = AutoTokenizer.from_pretrained(tool_target.path)
    model = AutoModelForCausalLM.from_pretrained(tool_target.path, dtype=torch.float32)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "forecast", "arguments": {"day": 9}}}]}
    teach(model, tok, [tok.apply_chat_template([*conv["messages"][:4], call], tools=TOOLS, tokenize=False)
                       for conv in tool_traces()])
    tok.response_template = CALL_RESPONSE_TEMPLATE
    out = tmp_path_factory.mktemp("calling_target")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return TargetConfig(name="tiny-chat", path=str(out), dtype="float32")


def test_an_answer_that_calls_a_tool_keeps_the_trace_in_process_as_through_a_server(calling_target, tmp_path):
    """Where the trace answers, the target calls a tool: in-process the call is read from its text
    (transformers' response parser) and the row kept as written, as a server's parsed tool_calls do."""
    convs = tool_traces()
    rows, report = regenerate_conversations(convs, cfg(max_new_tokens=48), calling_target, tmp_path, "train")
    assert report["kept_original"] == 3 and report["failures_by_reason"] == {"regen_tool_call": 3}
    assert [r["messages"] for r in rows] == [c["messages"] for c in convs]
    reasons = [f["reason"] for f in read_jsonl(tmp_path / "regen_train.failures.jsonl")]
    assert reasons == ["regen_tool_call: the target called forecast where the conversation answers"] * 3


def test_qwen_targets_calls_are_read_with_transformers_template_for_the_family():
    """A tokenizer without a response template of its own: transformers' one for the model's family
    is used (Qwen3's reads its calls); a family it has none for (Llama) gets None."""
    from types import SimpleNamespace

    from transformers import AutoConfig
    from transformers.utils.chat_parsing import parse_response

    from specforge.data.regen.embedded import response_template
    from specforge.targets.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(None)
    assert response_template(tok, SimpleNamespace(config=AutoConfig.for_model("llama"))) is None
    template = response_template(tok, SimpleNamespace(config=AutoConfig.for_model("qwen3")))
    answer = '<tool_call>\n{"name": "forecast", "arguments": {"day": 1}}\n</tool_call>'
    message = parse_response(answer, template, prefix="<|im_start|>user\nday 1?<|im_end|>\n<|im_start|>assistant\n")
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "forecast", "arguments": {"day": 1}}}]


def test_openai_nothing_answers_names_the_url(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConnectionError, match=url.replace(".", r"\.")):
        regenerate_conversations(dataset(2), cfg(backend="openai", urls=[url]), None, tmp_path, "train")
    with pytest.raises(ValueError, match="data.regenerate.urls"):
        regenerate_conversations(dataset(2), cfg(backend="openai"), None, tmp_path, "train")
    with pytest.raises(ValueError, match=r"data.regenerate.urls\[1\] '127.0.0.1:30000' is not an http\(s\) URL"):
        regenerate_conversations(dataset(2), cfg(backend="openai", urls=[url, "127.0.0.1:30000"]), None, tmp_path,
                                 "train")
    with pytest.raises(ValueError, match="data.regenerate.backend"):
        regenerate_conversations(dataset(2), cfg(backend="vllm"), None, tmp_path, "train")


@pytest.mark.parametrize("fields, text", [
    ({"reasoning": "\ncold\n"}, "<think>\ncold\n</think>\n\nsky: snow"),  # vLLM (since Jan 2026)
    ({"reasoning_content": "cold"}, "<think>\ncold\n</think>\n\nsky: snow"),  # SGLang, DeepSeek, older vLLM
    ({"reasoning": "cold", "reasoning_content": "cold"}, "<think>\ncold\n</think>\n\nsky: snow"),  # both: once
    ({"reasoning": None, "reasoning_content": ""}, "sky: snow"),
])
def test_openai_answers_get_the_thinking_a_reasoning_parser_split_off(fields, text):
    """The target wrote its thinking first; a draft trained without it would meet it at serving time."""
    from specforge.data.regen.openai_api import _parse

    raw = json.dumps({"choices": [{"message": {"role": "assistant", "content": "sky: snow", **fields},
                                   "finish_reason": "stop"}], "usage": {"completion_tokens": 9}}).encode()
    assert _parse(raw, "http://127.0.0.1:1") == Answer(text=text, tokens=9, truncated=False)


class StubServer(ThreadingHTTPServer):
    """An OpenAI-compatible server without a model: it serves `model` and answers every chat request
    with `reply(body)` -> (HTTP status, JSON), as SGLang or vLLM would in the case at hand."""

    daemon_threads = True

    def __init__(self, model: str, reply) -> None:
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.model, self.reply, self.requests = model, reply, []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class StubHandler(Handler):
    server: StubServer

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": self.server.model, "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        self._send(*self.server.reply(body))


@pytest.fixture
def stub():
    servers = []

    def start(reply, model: str = "tiny-chat") -> StubServer:
        servers.append(StubServer(model, reply))
        return servers[-1]

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def completion(text: str, finish: str | None = "stop") -> tuple[int, dict]:
    return 200, {"choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}],
                 "usage": {"prompt_tokens": 10, "completion_tokens": 3}}


@pytest.mark.parametrize("finish, truncated", [("stop", False), ("tool_calls", False), ("length", True),
                                               ("repetition", True), ("abort", None), ("error", None), (None, None)])
def test_openai_only_an_answer_the_server_finished_counts_as_one(finish, truncated):
    """Only "length" counted as unfinished: an answer vLLM or SGLang aborted ("abort", "error") or
    cut as a loop (vLLM's "repetition") was kept as a finished one. Now "stop" and "tool_calls" end
    an answer, "repetition" is cut as "length" is, and anything else is the server's failure."""
    from specforge.data.regen.openai_api import _parse
    from specforge.data.regen.replay import RegenFailure

    raw = json.dumps(completion("Oslo is", finish)[1]).encode()
    if truncated is not None:
        assert _parse(raw, "http://127.0.0.1:1") == Answer("Oslo is", tokens=3, truncated=truncated, prompt_tokens=10)
        return
    with pytest.raises(RegenFailure, match=rf"finish_reason {finish!r}: the server did not finish") as failed:
        _parse(raw, "http://127.0.0.1:1")
    assert failed.value.code == "regen_server_error" and failed.value.transient


def test_an_answer_the_server_aborted_is_asked_again_not_kept(stub, tmp_path):
    """SGLang answers a request it aborted (abort_request, a shutdown, preemption) with HTTP 200,
    finish_reason "abort" and what it had decoded. Before, that half answer was kept as regenerated
    and logged as done: never asked again. Now it is retried as a 5xx is, then kept with its original
    answer as a transient failure, which the next run asks again."""
    finish = ["abort"]
    srv = stub(lambda body: completion("Oslo is", finish[0]))
    convs = dataset(2, follow_up_every=99)
    c = cfg(backend="openai", urls=[srv.url])
    rows, report = regenerate_conversations(convs, c, None, tmp_path, "train")
    assert report["regenerated"] == 0 and report["kept_original"] == 2
    assert [r["messages"] for r in rows] == [conv["messages"] for conv in convs]
    failures = list(read_jsonl(tmp_path / "regen_train.failures.jsonl"))
    assert all(f["transient"] and "finish_reason 'abort': the server did not finish the answer" in f["reason"]
               for f in failures)
    assert len(srv.requests) == 2 * 4  # the first turn of each: the first attempt and 3 retries
    finish[0] = "stop"
    rows, report = regenerate_conversations(convs, c, None, tmp_path, "train")
    assert report["asked"] == 2 and report["regenerated"] == 2
    assert all(r["messages"][-1]["content"] == "Oslo is" for r in rows)


def test_without_a_model_named_the_resume_log_is_the_served_models(stub, tmp_path):
    """data.regenerate.model unset (data_prep/regenerate.py without --model): the first model a
    server lists answers. Before, the resume log's fingerprint named no model, so the same work dir
    against a server of another model resumed the first model's answers. Now it names the served
    model (asked before the log is read); naming that model resumes the log, as before the fix."""
    from specforge.data.regen.run import FORMAT_VERSION, regen_fingerprint
    from specforge.utils.io import fingerprint

    convs = dataset(2, follow_up_every=99)
    qwen = stub(lambda body: completion("Qwen says"), model="Qwen/Qwen3-8B")
    llama = stub(lambda body: completion("Llama says"), model="meta-llama/Llama-3.1-8B-Instruct")
    rows, report = regenerate_conversations(convs, cfg(backend="openai", urls=[qwen.url]), None, tmp_path, "train")
    assert report["asked"] == 2 and rows[0]["messages"][-1]["content"] == "Qwen says"
    rows, report = regenerate_conversations(convs, cfg(backend="openai", urls=[llama.url]), None, tmp_path, "train")
    assert report["asked"] == 2 and report["resumed"] == 0 and rows[0]["messages"][-1]["content"] == "Llama says"
    named = cfg(backend="openai", urls=[llama.url], model="meta-llama/Llama-3.1-8B-Instruct")
    rows, report = regenerate_conversations(convs, named, None, tmp_path, "train")
    assert report["asked"] == 0 and report["resumed"] == 2 and rows[0]["messages"][-1]["content"] == "Llama says"
    # a named model's fingerprint is the one it had: logs written before the fix resume
    assert regen_fingerprint(named, None, 0) == fingerprint(FORMAT_VERSION, "openai", named.model, 0.0, 24, False, 0,
                                                            None, False)


CONTEXT_ERRORS = [  # the 400s of a prompt that leaves no room for max_tokens
    "This model's maximum context length is 4096 tokens. However, you requested 4352 tokens (4096 in the messages, "
    "256 in the completion). Please reduce the length of the messages or completion.",  # vLLM
    "'max_tokens' or 'max_completion_tokens' is too large: 256. This model's maximum context length is 4096 tokens "
    "and your request has 3900 input tokens (256 > 4096 - 3900).",  # vLLM, later
    "The decoder prompt (length 5000) is longer than the maximum model length of 4096.",  # vLLM's engine
    "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of "
    "4352 tokens: 4096 tokens from the input messages and 256 tokens for the completion.",  # SGLang
    "The input (5000 tokens) is longer than the model's context length (4096 tokens).",  # SGLang
]


def test_a_run_of_prompts_past_the_servers_context_is_theirs_not_the_servers(stub, tmp_path):
    """A 400 saying prompt + max_tokens pass the context counted toward the server-wide rejection
    streak: a dataset with a run of long conversations stopped every rerun at the same place. Now it
    is the conversation's own (regen_prompt_too_long, as in-process): kept with its original answer."""
    def reply(body):
        text = json.dumps(body["messages"])
        if "Long" not in text:
            return completion("Short answer.")
        i = int(re.search(r"Long (\d+)", text)[1])
        return 400, {"object": "error", "message": CONTEXT_ERRORS[i % len(CONTEXT_ERRORS)], "code": 400}

    srv = stub(reply)
    convs = dataset(2, follow_up_every=99) + [
        {"id": f"long{i}", "messages": [{"role": "user", "content": f"Long {i}"},
                                        {"role": "assistant", "content": "x"}]} for i in range(12)]
    c = cfg(backend="openai", urls=[srv.url], concurrency=2)  # a streak of 8 stops a run
    rows, report = regenerate_conversations(convs, c, None, tmp_path, "train")
    assert report["regenerated"] == 2 and report["kept_original"] == 12
    assert report["failures_by_reason"] == {"regen_prompt_too_long": 12}
    assert not any(f["transient"] for f in read_jsonl(tmp_path / "regen_train.failures.jsonl"))
    assert len(srv.requests) == 3 + 12  # each long one asked once: asking again gives the same answer
    assert regenerate_conversations(convs, c, None, tmp_path, "train")[1]["asked"] == 0


def test_greedy_answers_resume_under_another_seed_sampled_ones_do_not(stub, tmp_path):
    """At temperature 0 the seed decides nothing, yet the resume log's fingerprint held it: changing
    the training seed asked every conversation again. Now only sampled answers are keyed by it."""
    srv = stub(lambda body: completion("Sunny."))
    convs = dataset(2, follow_up_every=99)
    for temperature, asked in ((0.0, 0), (0.7, 2)):
        c = cfg(backend="openai", urls=[srv.url], temperature=temperature)
        assert regenerate_conversations(convs, c, None, tmp_path / str(temperature), "train", seed=0)[1]["asked"] == 2
        assert regenerate_conversations(convs, c, None, tmp_path / str(temperature), "train",
                                        seed=1)[1]["asked"] == asked


def test_data_stage_trains_on_the_regenerated_answers(target, tmp_path):
    """`data.regenerate.enabled=true`: the stage's conversations and loss-masked tokens are the
    target's own answers, and every input row is still accounted for."""
    from specforge.data import stage
    from tests.test_data_stage import assert_reconciles, make_cfg

    src = dataset(6)
    write_jsonl(tmp_path / "train.jsonl", src)
    cfg = make_cfg(tmp_path, target.path, tmp_path / "train.jsonl", None,
                   **{"regenerate.enabled": True, "regenerate.max_new_tokens": 24, "regenerate.batch_size": 3})
    cfg.target.dtype = "float32"
    summary = stage.run(cfg, tmp_path / "run")
    counts = summary["train"]
    assert_reconciles(counts)
    assert counts["regenerate"]["requested"] == 6
    out = list(read_jsonl(tmp_path / "run" / "data" / "train.conversations.jsonl"))
    assert out, "regeneration left no training sample"
    by_id = {r["id"]: r for r in src}
    for row in out:
        assert_replaced(by_id[row["id"]]["messages"], row["messages"])


def test_rows_whose_prompt_fills_max_length_are_not_regenerated(target, tmp_path):
    """A row whose turns before its first answer already fill data.max_length keeps no loss token
    (truncate) or is dropped (drop) whatever the target says: it is quarantined before regeneration
    (prompt_overlength) and the target answers the others only; when most rows are such, the stage
    fails before the target answers any."""
    from specforge.data import stage
    from specforge.errors import InvalidInput
    from tests.test_data_stage import assert_reconciles, make_cfg

    src = dataset(6)
    long_system = {"role": "system", "content": "You are a helpful assistant. " * 40}
    for row in src[:2]:
        row["messages"] = [long_system, *(m for m in row["messages"] if m["role"] != "system")]
    write_jsonl(tmp_path / "train.jsonl", src)
    regen = {"regenerate.enabled": True, "regenerate.max_new_tokens": 24, "regenerate.batch_size": 3}
    cfg = make_cfg(tmp_path, target.path, tmp_path / "train.jsonl", None, max_length=128, **regen)
    cfg.target.dtype = "float32"
    counts = stage.run(cfg, tmp_path / "run")["train"]
    assert_reconciles(counts)
    assert counts["by_reason"] == {"prompt_overlength": 2} and counts["regenerate"]["requested"] == 4
    quarantined = list(read_jsonl(tmp_path / "run" / "data" / "quarantine.jsonl"))
    assert [(q["line"], q["reason"].split(":")[0]) for q in quarantined] == [(1, "prompt_overlength"),
                                                                             (2, "prompt_overlength")]
    assert "max_length 128: no answer would fit (not regenerated)" in quarantined[0]["reason"]

    cfg = make_cfg(tmp_path, target.path, tmp_path / "train.jsonl", None, max_length=8, **regen)
    with pytest.raises(InvalidInput, match=r"6 of 6 rows quarantined .*prompt_overlength 6.*Nothing was regenerated"):
        stage.run(cfg, tmp_path / "run8")
    assert not list((tmp_path / "run8" / "data").glob("regen_*"))


def test_truncated_answers_are_kept_as_last_turn_when_configured(target, tmp_path):
    """keep_truncated: a cut-off answer is what the target says; it ends the conversation there."""
    src = dataset(4, follow_up_every=1)
    skip, rep_skip = regenerate_conversations(src, cfg(max_new_tokens=2), target, tmp_path / "a", "train")
    keep, rep_keep = regenerate_conversations(src, cfg(max_new_tokens=2, keep_truncated=True), target,
                                              tmp_path / "b", "train")
    assert rep_skip["skipped"] == 4 and not skip
    assert len(keep) == 4
    for row, original in zip(keep, src):
        first_answer = next(i for i, m in enumerate(original["messages"]) if m["role"] == "assistant")
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in original["messages"][: first_answer + 1]]
        assert row["messages"][-1]["content"].strip()


def test_embedded_regeneration_refuses_vision_language_targets(tiny_vl_dir):
    """The embedded regenerator is text-only: a VL target is sent to a server that takes images,
    before any model is loaded."""
    from specforge.data.regen.embedded import EmbeddedBackend

    target = TargetConfig(name="vl", path=str(tiny_vl_dir), kind="qwen3_vl", dtype="float32")
    with pytest.raises(ValueError, match="text targets only .*backend=openai"):
        EmbeddedBackend(RegenerateConfig(enabled=True), target)


def test_embedded_regeneration_refuses_logit_shaping_it_would_not_apply(target, tmp_path):
    """A generation_config asking for shaping the refill decoder does not apply (no_repeat_ngram_size,
    min_p when sampling, ...) is refused naming the target and the fields, before any conversation
    is asked; neutral values and what it applies (repetition_penalty) pass."""
    import shutil

    from specforge.data.regen.embedded import EmbeddedBackend

    copy = tmp_path / "target"
    shutil.copytree(target.path, copy)
    config_file = copy / "generation_config.json"
    base = json.loads(config_file.read_text())
    shaped = TargetConfig(name="shaped", path=str(copy), dtype="float32")

    def backend(temperature: float = 0.0, **fields):
        config_file.write_text(json.dumps({**base, **fields}))
        return EmbeddedBackend(cfg(temperature=temperature), shaped, device=DEVICE)

    backend(no_repeat_ngram_size=0, typical_p=1.0, repetition_penalty=1.2, min_p=0.05)  # neutral, applied, greedy
    with pytest.raises(ValueError, match=f"{copy}: its generation_config sets no_repeat_ngram_size=3, "
                                         "bad_words_ids=.*backend=openai"):
        backend(no_repeat_ngram_size=3, bad_words_ids=[[5]])
    with pytest.raises(ValueError, match="sets min_p=0.05, which the embedded regeneration does not apply"):
        backend(temperature=0.7, min_p=0.05)


def test_the_cli_refuses_no_rows_and_mostly_quarantined_input_before_the_target_answers(target, tmp_path, capsys):
    """An empty or blank file, and conversations read with the wrong --format (every row
    quarantined): refused (exit 2) before the target loads, the quarantine written, no output."""
    from data_prep.regenerate import main

    args = ["--target", target.path, "--dtype", "float32"]
    for text in ("", "\n \n"):
        (tmp_path / "none.jsonl").write_text(text)
        assert main([str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o" / "none.jsonl"), *args]) == 2
        said = capsys.readouterr().err
        assert ("is empty (0 bytes)" if not text else "holds no rows: nothing to regenerate") in said, said
    write_jsonl(tmp_path / "in.jsonl", [{"id": c["id"], "messages": c["messages"]} for c in dataset(4)])
    assert main([str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o" / "train.jsonl"), "--format", "alpaca",
                 *args]) == 2
    said = capsys.readouterr().err
    assert f"error: {tmp_path / 'in.jsonl'}: 4 of 4 rows quarantined (100.0%), more than " \
           "--max-quarantined-share=0.5; top reasons: invalid_row 4; e.g. line 1: " in said
    assert "Nothing was regenerated" in said and not (tmp_path / "o" / "train.jsonl").exists()
    assert len(list(read_jsonl(tmp_path / "o" / "regen_train.input_quarantine.jsonl"))) == 4


@pytest.mark.parametrize("args, said", [
    (["--backend", "openai", "--url", "http://127.0.0.1:1", "--concurrency", "0"], "--concurrency: must be >= 1, got 0"),
    (["--target", "t", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["--backend", "openai"], "--url: empty; the openai backend needs at least one server URL"),
    (["--backend", "openai", "--url", "localhost:3000"], "--url 'localhost:3000' is not an http(s) URL"),
])
def test_the_cli_names_its_own_flags_in_a_refusal(tmp_path, capsys, args, said):
    """Not data.regenerate.concurrency: the flag the user typed, before any file is read."""
    from data_prep.regenerate import main

    with pytest.raises(SystemExit) as ended:
        main([str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o.jsonl"), *args])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {said}" in err and "data.regenerate" not in err  # prog: regenerate.py when run so
