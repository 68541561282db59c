"""The embedded server on 127.0.0.1 (tiny target, lightly trained draft, fp32, temperature 0),
measured by the streaming benchmark client against the in-process engine; and server processes
that are always stopped."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from specforge.checkpoint import load_draft, save_checkpoint
from specforge.config import Config
from specforge.engine.speculative import SpeculativeEngine
from specforge.errors import InvalidInput
from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.eval import bench_client as bc
from specforge.eval.server_eval import eval_with_servers
from specforge.launch.embedded_commands import embedded_server_command
from specforge.serving.app import EmbeddedServer
from specforge.serving.model import load_model
from specforge.launch.process import ServerProcess, ServerStartError, free_port, http_status

TREE = "4_2_8"
MAX_NEW = 24
AUX = [0, 1, 2]



@pytest.fixture(scope="module")
def model_dirs(tiny_target_dir, tmp_path_factory):
    """The tiny target (weights redrawn at std 0.2: varied greedy text) and a draft lightly trained
    (one-step cross-entropy, ~100 Adam steps) on the target's own continuations of the test prompts,
    so it is accepted often (accept length ~2) and the measured figures mean something."""
    root = tmp_path_factory.mktemp("served")
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    target.save_pretrained(root / "target")
    AutoTokenizer.from_pretrained(str(tiny_target_dir)).save_pretrained(root / "target")
    vocab = target.config.vocab_size
    prompts = [torch.randint(3, vocab, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    base = SpeculativeEngine(target, None)
    seqs = [torch.tensor(p + base.generate_base(p, MAX_NEW)[0].tolist()) for p in prompts]
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.from_target(target.config, AUX))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        feats = [torch.cat([h[0] for h in target(s[None], output_hidden_states=True).hidden_states[1:4]], -1)
                 for s in seqs]  # outputs of layers AUX = 0, 1, 2
    params = [p for n, p in draft.named_parameters() if n != "embed_tokens.weight"]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(100):  # the draft at position p reads (token p+1, feature p) and predicts token p+2
        loss = sum(torch.nn.functional.cross_entropy(
            draft.step(s[None, 1:-1], draft.project(f[None, :-2]), torch.arange(len(s) - 2)[None])[1][0], s[2:])
            for s, f in zip(seqs, feats))
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_checkpoint(draft.eval(), root / "ckpt", dtype=torch.float32)
    return root / "target", root / "ckpt", prompts


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The in-process engine on the same files and prompts: [(output ids, GenerationStats)] for
    speculative and for base decoding."""
    target_dir, ckpt, prompts = model_dirs
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    engine = SpeculativeEngine(target, load_draft(ckpt, dtype=torch.float32), TREE)
    return [engine.generate(p, MAX_NEW) for p in prompts], [engine.generate_base(p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def servers(model_dirs):
    """An EAGLE3 server and a base server, in this process (threads), on free ports."""
    target, ckpt, _ = model_dirs
    eagle = EmbeddedServer(lambda: load_model(target, ckpt, TREE, dtype="float32")).start()
    base = EmbeddedServer(lambda: load_model(target, dtype="float32")).start()
    eagle.wait_ready(120), base.wait_ready(120)
    yield eagle, base
    eagle.close(), base.close()


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for 127.0.0.1


def post(url, body, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with DIRECT.open(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get_json(url):
    with DIRECT.open(url, timeout=10) as r:
        return json.loads(r.read())


def test_bench_client_measures_the_engines_accept_length(model_dirs, servers, reference):
    prompts = model_dirs[2]
    eagle, base = servers
    spec_runs, base_runs = reference
    requests = [bc.BenchRequest(p, len(p), MAX_NEW) for p in prompts]

    result = bc.run_benchmark(eagle.url, requests, max_concurrency=2, warmup=0)  # server avg: these rounds only
    assert result.metrics["completed"] == 4, result.metrics["errors"]
    for r, (out, stats) in zip(result.requests, spec_runs):
        assert r.output_ids == out.tolist()
        assert (r.output_len, r.spec_verify_ct) == (stats.completion_tokens, stats.spec_verify_ct)
        assert r.accept_length == stats.accept_length
        assert r.ttft < r.latency
    pooled = sum(s.completion_tokens for _, s in spec_runs) / sum(s.spec_verify_ct for _, s in spec_runs)
    assert result.metrics["accept_length"] == pooled > 1.5
    rounds = [a for _, s in spec_runs for a in s.accepted_drafts]
    assert result.metrics["server_avg_spec_accept_length"] == pytest.approx(sum(a + 1 for a in rounds) / len(rounds))
    # Tokens were streamed as committed, in several chunks (groups that queued up while the server
    # was writing are merged, so a busy machine may give fewer chunks than rounds).
    assert all(0 < len(r.itl) <= r.output_len - 1 for r in result.requests)

    openai = bc.run_benchmark(eagle.url, requests, backend="openai", max_concurrency=4)
    assert [r.spec_verify_ct for r in openai.requests] == [s.spec_verify_ct for _, s in spec_runs]
    assert openai.metrics["accept_length"] == pooled

    baseline = bc.run_benchmark(base.url, requests, max_concurrency=4)
    assert [r.output_ids for r in baseline.requests] == [o.tolist() for o, _ in base_runs]
    assert [o.tolist() for o, _ in base_runs] == [o.tolist() for o, _ in spec_runs]  # lossless
    assert baseline.metrics["accept_length"] is None and baseline.metrics["server_avg_spec_accept_length"] is None
    assert "| accept_length | - |" in bc.comparison_table(baseline.metrics, result.metrics)


def test_generate_and_completions_protocol(servers, tiny_tokenizer):
    eagle, base = servers
    status, body = post(eagle.url + "/generate", {"text": "What is the weather in Oslo?",
                                                  "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert status == 200
    out = json.loads(body)
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 6 and isinstance(out["text"], str)
    assert meta["prompt_tokens"] == len(tiny_tokenizer("What is the weather in Oslo?")["input_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["e2e_latency"] > 0
    assert meta["spec_accept_length"] == 6 / meta["spec_verify_ct"]
    assert 0 <= meta["spec_accept_rate"] <= 1 and len(meta["spec_correct_drafts_histogram"]) == 5

    status, body = post(base.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                                       "ignore_eos": True})
    resp = json.loads(body)
    assert status == 200 and resp["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert resp["choices"][0]["finish_reason"] == "length" and "sglext" not in resp
    status, body = post(base.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 5

    info = get_json(eagle.url + "/server_info")
    assert info["speculative_algorithm"] == "EAGLE3" and info["speculative_num_draft_tokens"] == 8
    assert get_json(base.url + "/server_info")["speculative_algorithm"] is None
    assert get_json(base.url + "/v1/models")["data"][0]["object"] == "model"


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [[1, 2], [3]]}, "batch requests are not supported"),
    ({"text": "hi", "sampling_params": {"top_p": 0.5}}, "top_p=0.5 is not supported"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be an integer >= 1"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 5000}}, "exceeds the model's context length"),
    ({"input_ids": [1, 10**6]}, "token ids must be in"),
    ({"text": "hi", "return_logprob": True}, "return_logprob is not supported"),
    ({"sampling_params": {}}, "give `text` or `input_ids`"),
    # these reached the engine thread and came back as 500s
    ({"text": "hi", "sampling_params": {"temperature": float("nan")}}, "temperature must be a finite number >= 0"),
    ({"text": "hi", "sampling_params": {"temperature": 0.7, "sampling_seed": "abc"}}, "seed must be an integer"),
    ({"text": "hi", "sampling_params": {"temperature": 0.7, "sampling_seed": 1.5}}, "seed must be an integer"),
])
def test_bad_requests_get_400(servers, body, message):
    status, text = post(servers[0].url + "/generate", body)
    assert status == 400 and message in json.loads(text)["error"]["message"]


def test_a_stop_token_that_ends_the_output_is_not_in_its_text(servers, tiny_tokenizer):
    """SGLang's detokenizer trims a matched stop token (vLLM leaves a stop's text out too); the text had it."""
    eagle, _ = servers
    greedy = json.loads(post(eagle.url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})[1])["output_ids"]
    stop = next(t for t in greedy[2:] if t not in greedy[:2] and t not in tiny_tokenizer.all_special_ids)
    upto = greedy[:greedy.index(stop) + 1]
    out = json.loads(post(eagle.url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]}})[1])
    assert out["output_ids"] == upto and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == tiny_tokenizer.decode(upto[:-1], skip_special_tokens=True)
    resp = json.loads(post(eagle.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
                                                           "ignore_eos": True, "stop_token_ids": [stop]})[1])
    assert resp["choices"][0]["text"] == out["text"] and resp["choices"][0]["finish_reason"] == "stop"
    body = post(eagle.url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True, "stop_token_ids": [stop], "stream": True})[1]
    deltas = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert "".join(d["choices"][0]["text"] for d in deltas if d["choices"]) == out["text"]


def test_a_temperature_below_sglangs_epsilon_decodes_greedily(servers):
    """A softmax at temperature 1e-39 overflows to nan: a 500 from the engine thread; SGLang decodes greedily."""
    eagle, _ = servers
    ask = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    greedy = json.loads(post(eagle.url + "/generate", ask)[1])["output_ids"]
    ask["sampling_params"]["temperature"] = 1e-39
    status, body = post(eagle.url + "/generate", ask)
    assert status == 200 and json.loads(body)["output_ids"] == greedy


def test_a_client_that_leaves_a_request_that_does_not_stream_cancels_it(servers, caplog):
    """Only a stream's write noticed a gone client: a request that does not stream (a client timing out) kept
    the one engine thread generating up to max_new_tokens while every request queued behind it."""
    import logging
    import socket

    eagle, _ = servers
    host, port = eagle.httpd.server_address[:2]
    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2000, "temperature": 0,
                                                                  "ignore_eos": True}}).encode()
    with caplog.at_level(logging.INFO, logger="specforge.serve"):
        with socket.create_connection((host, port)) as client:
            client.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while "cancelled (client gone)" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
    assert "cancelled (client gone)" in caplog.text


def test_health_is_503_while_loading(model_dirs):
    target, _, _ = model_dirs
    release = threading.Event()

    def slow_loader():
        release.wait(30)
        return load_model(target, dtype="float32")

    with EmbeddedServer(slow_loader) as server:
        assert http_status(server.url + "/health") == 503
        assert post(server.url + "/generate", {"input_ids": [1, 2]})[0] == 503
        release.set()
        server.wait_ready(60)
        assert http_status(server.url + "/health") == 200
    with EmbeddedServer(lambda: load_model(target / "missing")) as broken:
        with pytest.raises(RuntimeError, match="failed to load"):
            broken.wait_ready(30)
        assert http_status(broken.url + "/health") == 503


def test_evaluate_serving_against_running_servers(model_dirs, servers, tmp_path):
    target, _, _ = model_dirs
    eagle, base = servers
    convs = [{"id": str(i), "messages": [{"role": "user", "content": f"weather in {c}?"}]}
             for i, c in enumerate(["Oslo", "Lima", "Perth"])]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "eval.conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = OmegaConf.structured(Config)
    cfg.run_name, cfg.target.name, cfg.target.path = "t", "tiny", str(target)
    cfg.eval.engine, cfg.eval.url, cfg.eval.baseline_url = "server", eagle.url, base.url
    cfg.eval.num_prompts, cfg.eval.max_new_tokens = 3, 12
    summary = eval_with_servers(cfg, [], cfg.eval, tmp_path)
    assert summary["scenario"]["max_concurrency"] == 1 and summary["metrics"]["server"]["completed"] == 3
    assert summary["comparisons"]["server"]["accept_length"]["eagle3"] > 1
    report = (tmp_path / "eval" / "serving" / "report.md").read_text()
    assert "| metric | baseline | server | change |" in report
    assert json.loads((tmp_path / "eval" / "serving" / "baseline.json").read_text())["metrics"]["completed"] == 3
    assert summary["served"]["baseline"] == {"model_path": str(target), "speculative_algorithm": None,
                                             "speculative_draft_model_path": None, "speculative_num_steps": None,
                                             "speculative_eagle_topk": None, "speculative_num_draft_tokens": None}
    assert f"- baseline: `{target}` alone" in report
    assert f"- server: `{target}` with EAGLE3 draft `{model_dirs[1]}` (steps " in report


def test_swapped_or_identical_server_urls_are_refused_before_a_request_is_timed(model_dirs, servers, tmp_path):
    """eval.url must draft and eval.baseline_url must not: swapped, the report would call the base
    model's speed the speculative one's (as /server_info says; vLLM's servers have none and are
    taken at their word)."""
    target, _, _ = model_dirs
    eagle, base = servers
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "eval.conversations.jsonl").write_text(
        json.dumps({"id": "0", "messages": [{"role": "user", "content": "weather in Oslo?"}]}) + "\n")
    cfg = OmegaConf.structured(Config)
    cfg.run_name, cfg.target.name, cfg.target.path = "t", "tiny", str(target)
    cfg.eval.engine, cfg.eval.url, cfg.eval.baseline_url = "server", base.url, eagle.url
    with pytest.raises(InvalidInput, match=rf"eval.url {base.url} serves {re.escape(str(target))} without "
                                           r"speculative decoding .*--speculative-algorithm EAGLE3 .*, or swap "
                                           r"eval.url and eval.baseline_url"):
        eval_with_servers(cfg, [], cfg.eval, tmp_path)
    cfg.eval.url = cfg.eval.baseline_url = eagle.url
    with pytest.raises(InvalidInput, match=rf"eval.url and eval.baseline_url both name {eagle.url}"):
        eval_with_servers(cfg, [], cfg.eval, tmp_path)
    cfg.eval.url, cfg.eval.baseline_url = base.url, None  # the base model's server alone: refused too
    with pytest.raises(InvalidInput, match="without speculative decoding"):
        eval_with_servers(cfg, [], cfg.eval, tmp_path)
    assert not (tmp_path / "eval").exists()


def test_the_bench_command_warns_of_swapped_urls_and_refuses_identical_ones(model_dirs, servers, tmp_path):
    """`specforge bench --url --baseline-url` asks the servers what they serve as the evaluation does and
    names its own flags: swapped roles are said before the first request (a generic benchmark may
    compare two drafts or two plain servers), one server for both is refused."""
    import subprocess
    import sys

    target, _, _ = model_dirs
    eagle, base = servers
    out = tmp_path / "bench.json"

    def bench(url, baseline):
        return subprocess.run([sys.executable, "-m", "specforge.cli", "bench", "--url", url, "--baseline-url",
                               baseline, "--vocab-size", "100", "--num-prompts", "2", "--output-len", "4",
                               "--out", str(out)], capture_output=True, text=True, timeout=300)

    proc = bench(base.url, eagle.url)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stderr.strip().splitlines()
    assert re.fullmatch(rf"specforge: warning: --url {base.url} serves {re.escape(str(target))} without "
                        r"speculative decoding .*, or swap --url and --baseline-url", said[0])
    assert said[1].startswith(f"specforge: warning: --baseline-url {eagle.url} drafts with EAGLE3 (")
    served = json.loads(out.read_text())["served"]
    assert served["server"]["speculative_algorithm"] is None and served["baseline"]["speculative_algorithm"] == "EAGLE3"
    out.unlink()
    proc = bench(eagle.url, eagle.url + "/")
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"bench: --url and --baseline-url both name {eagle.url}: the server would be measured against itself; "
        "give the base model's server as --baseline-url"), proc.stderr
    assert not out.exists()  # refused before a request


def test_ones_own_prompt_file_through_evaluate_and_the_bench_command(model_dirs, servers, tmp_path):
    """The workload to serve, as a file (a prompt row and a conversation whose answer is left out):
    eval.prompts=<file> for the serving evaluation, `specforge bench --prompts <file>` on the command
    line; both send the file's prompts, rendered with the chat template, to the running servers."""
    import subprocess
    import sys

    from specforge.eval.prompts import render_prompt

    target, _, _ = model_dirs
    eagle, base = servers
    workload = tmp_path / "workload.jsonl"
    workload.write_text(json.dumps({"prompt": "weather in Oslo?"}) + "\n" + json.dumps(
        {"id": "c", "messages": [{"role": "user", "content": "and what about Lima, tomorrow morning?"},
                                 {"role": "assistant", "content": "dry"}]})
        + "\n")
    cfg = OmegaConf.structured(Config)
    cfg.run_name, cfg.target.name, cfg.target.path = "t", "tiny", str(target)
    cfg.eval.engine, cfg.eval.url, cfg.eval.baseline_url = "server", eagle.url, base.url
    cfg.eval.num_prompts, cfg.eval.max_new_tokens, cfg.eval.prompts = 4, 12, str(workload)
    summary = eval_with_servers(cfg, [], cfg.eval, tmp_path)
    assert summary["prompts"] == str(workload) and summary["metrics"]["server"]["completed"] == 4
    runs = json.loads((tmp_path / "eval" / "serving" / "server.json").read_text())["requests"]
    tok = AutoTokenizer.from_pretrained(str(target))
    rendered = [len(render_prompt([{"role": "user", "content": text}], tok)["input_ids"])
                for text in ("weather in Oslo?", "and what about Lima, tomorrow morning?")]
    assert rendered[0] != rendered[1] and [r["prompt_len"] for r in runs] == rendered * 2  # no answer; cycled

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "bench", "--url", eagle.url, "--baseline-url",
                           base.url, "--tokenizer", str(target), "--prompts", str(workload), "--num-prompts", "2",
                           "--output-len", "8", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["eagle3"]["metrics"]["completed"] == 2
    served = json.loads(out.read_text())["served"]
    assert served["server"]["speculative_algorithm"] == "EAGLE3" and served["baseline"]["speculative_algorithm"] is None
    assert "bench: 4/4 (100%)" in proc.stderr and "bench" not in proc.stdout.split("\n")[0]  # the bar on stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"text": "no prompt here"}) + "\n")
    for args, said in ((["--prompts", str(bad), "--tokenizer", str(target)], f"bench: --prompts: {bad}, line 2: "),
                       (["--prompts", str(workload)], "bench: --prompts needs --tokenizer (the target dir)"),
                       (["--prompts", str(workload), "--run-dir", str(tmp_path), "--tokenizer", str(target)],
                        "bench: --run-dir and --prompts both name the prompts; give one"),
                       (["--prompts", str(tmp_path / "none.jsonl"), "--tokenizer", str(target)],
                        f"bench: data file {tmp_path / 'none.jsonl'} not found")):
        proc = subprocess.run([sys.executable, "-m", "specforge.cli", "bench", "--url", eagle.url, *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.strip().startswith(said), proc.stderr


# ---- server processes ------------------------------------------------------------------------------


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_evaluate_serving_launches_and_stops_every_server(model_dirs, tmp_path, capsys, monkeypatch):
    """eval.engine=sglang's orchestration with our own server as the launched process: base, then
    checkpoint x tree, each started, waited for (/health), benchmarked and stopped."""
    target, trained, _ = model_dirs
    ckpt = shutil.copytree(trained, tmp_path / "ckpt")  # retrained below
    cfg = OmegaConf.structured(Config)
    cfg.run_name, cfg.target.name, cfg.target.path = "t", "tiny", str(target)
    cfg.eval.engine, cfg.eval.trees, cfg.eval.prompts = "sglang", [TREE], "random"
    cfg.eval.num_prompts, cfg.eval.max_new_tokens, cfg.eval.bench_input_len = 2, 16, 12
    builder = partial(embedded_server_command, dtype="float32", threads=1)
    summary = eval_with_servers(cfg, [ckpt], cfg.eval, tmp_path, command_builder=builder)
    said = capsys.readouterr()
    assert "eval: 4/4 (100%)" in said.out + said.err  # the progress over 2 servers x 2 requests
    out = tmp_path / "eval" / "serving"
    runs = {label: json.loads((out / f"{label}.json").read_text()) for label in ("baseline", f"ckpt_{TREE}")}
    assert summary["metrics"][f"ckpt_{TREE}"]["accept_length"] > 1.0
    assert [r["output_ids"] for r in runs["baseline"]["requests"]] == \
           [r["output_ids"] for r in runs[f"ckpt_{TREE}"]["requests"]]  # lossless, across two processes
    for run in runs.values():
        cmd = run["config"]["launch"]["command"]
        port = cmd[cmd.index("--port") + 1]
        assert "serving" in open(run["config"]["launch"]["log"]).read()
        assert http_status(f"http://127.0.0.1:{port}/health", timeout=1) is None
        assert not any(f"--port\0{port}\0".encode() in _cmdline(p) for p in os.listdir("/proc") if p.isdigit())

    # run again (as after a crash or a stop late in a long evaluation): what was measured is kept, no server
    # starts again; a configuration whose result is gone (or cut short) is measured again
    logs = {label: (out / "logs" / f"{label}.log").stat().st_mtime_ns for label in runs}
    (out / f"ckpt_{TREE}.json").write_text((out / f"ckpt_{TREE}.json").read_text()[:100])  # cut short
    again = eval_with_servers(cfg, [ckpt], cfg.eval, tmp_path, command_builder=builder)
    assert (out / "logs" / "baseline.log").stat().st_mtime_ns == logs["baseline"]
    assert (out / "logs" / f"ckpt_{TREE}.log").stat().st_mtime_ns != logs[f"ckpt_{TREE}"]
    assert again["metrics"]["baseline"] == summary["metrics"]["baseline"]
    assert again["metrics"][f"ckpt_{TREE}"]["completed"] == 2
    logs = {label: (out / "logs" / f"{label}.log").stat().st_mtime_ns for label in runs}
    draft = load_draft(ckpt)
    with torch.no_grad():
        draft.fc.weight.mul_(0.5)
    save_checkpoint(draft, ckpt, dtype=torch.float32)  # retrained: the same path and command, other bytes
    eval_with_servers(cfg, [ckpt], cfg.eval, tmp_path, command_builder=builder)
    assert (out / "logs" / "baseline.log").stat().st_mtime_ns == logs["baseline"]
    assert (out / "logs" / f"ckpt_{TREE}.log").stat().st_mtime_ns != logs[f"ckpt_{TREE}"]
    cfg.eval.max_new_tokens = 12  # measured otherwise: nothing kept
    eval_with_servers(cfg, [ckpt], cfg.eval, tmp_path, command_builder=builder)
    assert (out / "logs" / "baseline.log").stat().st_mtime_ns != logs["baseline"]
    # another SGLang installed (the same command line): nothing kept either, the baseline included
    logs = {label: (out / "logs" / f"{label}.log").stat().st_mtime_ns for label in runs}
    import specforge.launch.sglang_commands as sglang_commands

    monkeypatch.setattr(sglang_commands, "installed_sglang_version", lambda: "99.0.0")
    eval_with_servers(cfg, [ckpt], cfg.eval, tmp_path, command_builder=builder)
    assert all((out / "logs" / f"{label}.log").stat().st_mtime_ns != logs[label] for label in runs)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def http_server_command(port, child_pid_file):
    """A trivial server whose shell first starts a child in the same process group."""
    return ["sh", "-c", f"sleep 300 & echo $! > {child_pid_file}; "
                        f"exec {sys.executable} -m http.server --bind 127.0.0.1 {port}"]


def test_server_is_stopped_when_the_benchmark_raises(tmp_path):
    port = free_port()
    with pytest.raises(RuntimeError, match="benchmark failed"):
        with ServerProcess(http_server_command(port, tmp_path / "child"), port, tmp_path / "server.log",
                           health_path="/", startup_timeout_s=30) as server:
            pid = server.pid
            assert alive(pid) and http_status(server.base_url + "/") == 200
            raise RuntimeError("benchmark failed")
    child = int((tmp_path / "child").read_text())
    assert not alive(pid) and not alive(child)  # the whole process group is gone

    with pytest.raises(ServerStartError, match="exited with code 3"):
        with ServerProcess(["sh", "-c", "echo cannot start; exit 3"], free_port(), tmp_path / "bad.log"):
            pass
    assert "cannot start" in (tmp_path / "bad.log").read_text()


PARENT = textwrap.dedent("""
    import signal, sys, time
    from specforge.launch.process import ServerProcess
    # Ctrl-C as in a terminal, however pytest was started (a background job of a non-interactive
    # shell inherits SIGINT ignored, and so would this parent)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    port, log, child = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    cmd = ["sh", "-c", f"sleep 300 & echo $! > {child}; exec {sys.executable} -m http.server --bind 127.0.0.1 {port}"]
    with ServerProcess(cmd, port, log, health_path="/", startup_timeout_s=30) as server:
        print(server.pid, flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_server_is_stopped_when_the_parent_is_interrupted(tmp_path, sig):
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(port), str(tmp_path / "log"), str(tmp_path / "child")],
                              stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid)
        parent.send_signal(sig)
        assert parent.wait(timeout=30) != 0
    finally:
        if parent.poll() is None:
            parent.kill()
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid) and not alive(int((tmp_path / "child").read_text()))
