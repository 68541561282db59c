"""The streaming benchmark client against a real HTTP server with KNOWN delays: the first token
after 200 ms, then two tokens every 100 ms (50 ms per token, as a speculative server commits
several tokens per round). TTFT, ITL, TPOT, e2e and the accept length must come out as designed."""
import asyncio
import json
import math
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specforge.eval import bench_client as bc
from specforge.eval.scenarios import SCENARIOS, get_scenario

TTFT, PER_TOKEN, PER_CHUNK, OUTPUT_LEN, VERIFY_CT = 0.200, 0.050, 2, 9, 4


class DelayHandler(BaseHTTPRequestHandler):
    """SGLang-style streams: 1 token at TTFT, then PER_CHUNK tokens every PER_CHUNK * PER_TOKEN."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _sse(self, obj):
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        body = json.dumps({"internal_states": [{"avg_spec_accept_length": 2.0}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
            self.server.bodies.append(req)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        openai = self.path == "/v1/completions"
        n, t0 = 0, time.perf_counter()
        schedule = [(TTFT, 1)] + [(TTFT + PER_TOKEN * PER_CHUNK * (i + 1), PER_CHUNK)
                                  for i in range((OUTPUT_LEN - 1) // PER_CHUNK)]
        for at, k in schedule:
            time.sleep(max(0.0, at - (time.perf_counter() - t0)))
            n += k
            if openai:
                self._sse({"choices": [{"index": 0, "text": "ab"[: k], "finish_reason": None}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": n}})
            else:
                meta = {"prompt_tokens": 5, "completion_tokens": n}
                if n == OUTPUT_LEN:
                    meta.update(spec_verify_ct=VERIFY_CT, spec_accept_length=OUTPUT_LEN / VERIFY_CT)
                self._sse({"text": "x" * n, "output_ids": list(range(n)), "meta_info": meta})
        if openai:
            self._sse({"choices": [], "sglext": {"spec_tokens_details": {"spec_verify_ct": VERIFY_CT}}})
        self._sse(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        with self.server.lock:
            self.server.in_flight -= 1


@pytest.fixture(scope="module")
def delay_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), DelayHandler)
    server.daemon_threads = True
    server.lock, server.in_flight, server.max_in_flight, server.bodies = threading.Lock(), 0, 0, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def url(server):
    return f"http://127.0.0.1:{server.server_address[1]}"


def check_timings(result, n_requests):
    m = result.metrics  # upper bounds leave room for a busy machine's scheduling delays
    assert m["completed"] == n_requests and m["failed"] == 0, m["errors"]
    for r in result.requests:
        assert r.output_len == OUTPUT_LEN
        assert TTFT - 0.005 <= r.ttft <= TTFT + 0.15, r.ttft
        assert len(r.itl) == OUTPUT_LEN - 1
        # A chunk's gap is shared by its tokens; each chunk arrives no earlier than the server
        # sends it (the server's clock starts after the client's) and, on a busy machine, late
        # by some scheduling delay that the next chunk may make up: bound arrivals, not gaps.
        chunks = [r.itl[i:i + PER_CHUNK] for i in range(0, len(r.itl), PER_CHUNK)]
        assert all(c == pytest.approx([c[0]] * PER_CHUNK) for c in chunks), r.itl
        arrivals = [r.ttft + sum(r.itl[:i + PER_CHUNK]) for i in range(0, len(r.itl), PER_CHUNK)]
        scheduled = [TTFT + PER_TOKEN * PER_CHUNK * (i + 1) for i in range(len(chunks))]
        assert all(s - 1e-3 <= a <= s + 0.2 for a, s in zip(arrivals, scheduled)), (arrivals, scheduled)
        assert r.tpot == pytest.approx((r.latency - r.ttft) / (OUTPUT_LEN - 1))
        assert scheduled[-1] - 1e-3 <= r.latency <= scheduled[-1] + 0.2, r.latency
        assert r.accept_length == OUTPUT_LEN / VERIFY_CT
    reqs = result.requests  # the aggregates are the per-request numbers bounded above
    assert m["mean_ttft_ms"] == pytest.approx(1000 * statistics.mean(r.ttft for r in reqs))
    assert m["median_itl_ms"] == pytest.approx(1000 * statistics.median(x for r in reqs for x in r.itl))
    assert m["mean_tpot_ms"] == pytest.approx(1000 * statistics.mean(r.tpot for r in reqs))
    assert m["mean_e2e_latency_ms"] == pytest.approx(1000 * statistics.mean(r.latency for r in reqs))
    assert m["accept_length"] == OUTPUT_LEN / VERIFY_CT
    assert m["server_avg_spec_accept_length"] == 2.0
    assert m["total_output_tokens"] == n_requests * OUTPUT_LEN
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration"])


def test_native_streaming_timings_and_concurrency_cap(delay_server):
    requests = bc.random_token_requests(4, 5, OUTPUT_LEN, 100, seed=0)
    result = bc.run_benchmark(url(delay_server), requests, max_concurrency=2, warmup=0)
    check_timings(result, 4)
    assert delay_server.max_in_flight == 2
    # Two waves of two: the benchmark lasts about two requests' e2e.
    assert result.metrics["duration"] == pytest.approx(2 * (TTFT + PER_TOKEN * (OUTPUT_LEN - 1)), abs=0.25)
    body = delay_server.bodies[-1]
    assert body["stream"] is True and body["sampling_params"] == {
        "max_new_tokens": OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True}
    assert body["input_ids"] in [r.prompt for r in requests]


def test_openai_streaming_timings(delay_server):
    result = bc.run_benchmark(url(delay_server), bc.random_token_requests(2, 5, OUTPUT_LEN, 100),
                              backend="openai", model="m", warmup=0)
    check_timings(result, 2)
    body = delay_server.bodies[-1]
    assert body["return_spec_tokens_details"] and body["stream_options"]["continuous_usage_stats"]


def test_failures_are_counted_not_fatal():
    requests = bc.random_token_requests(2, 4, 4, 50)
    result = bc.run_benchmark("http://127.0.0.1:9", requests, warmup=0)
    assert result.metrics["completed"] == 0 and result.metrics["failed"] == 2
    assert result.metrics["errors"] and result.metrics["mean_ttft_ms"] is None
    with pytest.raises(RuntimeError, match="warmup request to http://127.0.0.1:9 failed"):
        bc.run_benchmark("http://127.0.0.1:9", requests)


def test_metrics_and_comparison_table():
    def req(ttft, latency, n, ct):
        return bc.RequestResult(success=True, prompt_len=10, output_len=n, ttft=ttft, latency=latency,
                                itl=[(latency - ttft) / (n - 1)] * (n - 1), spec_verify_ct=ct)

    results = [req(0.1, 1.1, 11, 4), req(0.3, 2.3, 21, 6), bc.RequestResult(error="boom")]
    m = bc.compute_metrics(results, duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["boom"]
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (1.1-0.1)/10 and (2.3-0.3)/20
    assert m["median_ttft_ms"] == pytest.approx(200.0) and m["p99_ttft_ms"] == pytest.approx(298.0)
    assert m["output_throughput"] == 16.0 and m["total_throughput"] == 26.0 and m["request_throughput"] == 1.0
    assert m["accept_length"] == 32 / 10  # pooled: sum(completion_tokens) / sum(spec_verify_ct)

    base = {"output_throughput": 10.0, "mean_tpot_ms": 100.0, "accept_length": None}
    eagle = {"output_throughput": 25.0, "mean_tpot_ms": 40.0, "accept_length": 3.2}
    table = bc.comparison_table(base, eagle)
    assert table.startswith("| metric | baseline | EAGLE3 | change |\n|---|")
    assert "| output_throughput (tok/s) | 10.00 | 25.00 | 2.50x |" in table
    assert "| mean_tpot_ms (ms) | 100.00 | 40.00 | -60.0% |" in table
    assert "| accept_length | - | 3.20 | - |" in table
    assert bc.comparison(base, eagle)["output_throughput"]["ratio"] == 2.5


def test_poisson_arrivals(monkeypatch):
    import asyncio

    sleeps = []

    async def record(s):
        sleeps.append(s)

    monkeypatch.setattr(asyncio, "sleep", record)

    async def drain(rate):
        return [i async for i in bc._arrivals(2001, rate, seed=0)]

    assert asyncio.run(drain(math.inf)) == list(range(2001)) and sleeps == []
    asyncio.run(drain(8.0))
    assert len(sleeps) == 2000 and sum(sleeps) / 2000 == pytest.approx(1 / 8.0, rel=0.08)


def test_scenarios_and_conversation_prompts(tmp_path, tiny_tokenizer):
    assert (SCENARIOS["code"].num_prompts, SCENARIOS["code"].input_len, SCENARIOS["code"].output_len,
            SCENARIOS["code"].max_concurrency) == (128, 512, 1024, 64)
    assert SCENARIOS["chat"].request_rate == 8.0 and math.isinf(SCENARIOS["completion"].request_rate)
    small = get_scenario("chat").scaled(num_prompts=4, output_len=16)
    assert (small.num_prompts, small.input_len, small.output_len, small.request_rate) == (4, 256, 16, 8.0)
    with pytest.raises(ValueError, match="known"):
        get_scenario("nope")

    conv = [{"id": "a", "messages": [{"role": "user", "content": "weather in Oslo?"},
                                     {"role": "assistant", "content": "sunny"}]},
            {"id": "b", "messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "Lima?"}]}]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "eval.conversations.jsonl").write_text("\n".join(json.dumps(c) for c in conv) + "\n")
    reqs = bc.conversation_requests(tmp_path, tiny_tokenizer, 3, 32)
    assert [r.output_len for r in reqs] == [32] * 3 and reqs[2].prompt == reqs[0].prompt
    text = tiny_tokenizer.decode(reqs[0].prompt)
    assert text.endswith("<|im_start|>assistant\n") and "sunny" not in text
    assert reqs[1].prompt_len == len(reqs[1].prompt)


def test_conversation_requests_send_images_as_sglang_image_data(tmp_path, tiny_vl_dir):
    """A vision-language prompt goes as its rendered text with one placeholder per image plus
    `image_data`, each a data URI (a server on another machine has not the file; the server expands
    the placeholders); text prompts stay token ids."""
    import base64

    from PIL import Image

    from specforge.eval.bench_client import conversation_requests, request_openai
    from specforge.targets.loader import load_tokenizer
    from specforge.config import TargetConfig
    from specforge.utils.io import write_jsonl

    Image.new("RGB", (64, 64), (10, 200, 30)).save(tmp_path / "w.png")
    img = str(tmp_path / "w.png")
    write_jsonl(tmp_path / "eval.conversations.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": [{"type": "image", "image": img},
                                                               {"type": "text", "text": "Weather?"}]},
                                 {"role": "assistant", "content": "sunny"}]},
        {"id": "b", "messages": [{"role": "user", "content": "Rain?"}, {"role": "assistant", "content": "no"}]}])
    tok = load_tokenizer(TargetConfig(name="t", path=str(tiny_vl_dir), kind="qwen3_vl"))
    with_images = conversation_requests(tmp_path / "eval.conversations.jsonl", tok, 2, 8, with_images=True)
    png = base64.b64encode((tmp_path / "w.png").read_bytes()).decode()
    assert with_images[0].images == ["data:image/png;base64," + png]
    assert with_images[0].prompt.count("<|image_pad|>") == 1 and "Weather?" in with_images[0].prompt
    assert isinstance(with_images[1].prompt, list) and with_images[1].images == []
    with pytest.raises(ValueError, match="need the SGLang /generate endpoint"):
        asyncio.run(request_openai(None, "http://127.0.0.1:1", with_images[0], 0.0, True, None))


@pytest.mark.parametrize("args, message", [
    (["--num-prompts", "0"], "bench: scenario chat: num_prompts must be >= 1, got 0"),
    (["--scenario", "bogus"], "bench: unknown scenario 'bogus'; known: ['chat', 'code', 'completion']"),
    (["--url", "127.0.0.1:30000"], "bench: --url '127.0.0.1:30000' is not an http(s) URL (e.g. http://127.0.0.1:30000)"),
    (["--baseline-url", "localhost"], "bench: --baseline-url 'localhost' is not an http(s) URL (e.g. http://127.0.0.1:30000)"),
    (["--temperature", "-1"], "bench: --temperature must be >= 0 (0: greedy), got -1.0"),
    (["--vocab-size", "0"], "bench: --vocab-size must be >= 2, got 0"),
    (["--tokenizer", "/no/such/dir"], "bench: --tokenizer /no/such/dir: not a directory (the target's, with its tokenizer)"),
    # a server that is not there: the warm-up's failure, one line (nothing was measured)
    (["--num-prompts", "2"], "bench: benchmark warmup request to http://127.0.0.1:9 failed: ConnectError: "
                             "All connection attempts failed; is the server up at http://127.0.0.1:9?"),
])
def test_bench_command_refuses_bad_values_with_the_message_not_a_traceback(args, message):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "bench", "--url", "http://127.0.0.1:9",
                           "--vocab-size", "100", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == message  # no request was sent: the refusal comes first


class SGLangBytesHandler(BaseHTTPRequestHandler):
    """Streams as SGLang writes them (orjson: non-ASCII raw UTF-8, U+2028 not escaped); a prompt of more than 4
    tokens is aborted by the "scheduler" (one chunk, finish_reason abort, then [DONE]); /server_info needs the
    key s3cret, as a server started with --api-key."""

    protocol_version = "HTTP/1.1"
    TEXT = ["Hello", "Hello\u2028", "Hello\u2028world\u0085!"]

    def log_message(self, *args):
        pass

    def _sse(self, raw: bytes):
        data = b"data: " + raw + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        ok = self.headers.get("Authorization") == "Bearer s3cret"
        body = json.dumps({"model_path": "/m/tgt", "speculative_algorithm": None} if ok else
                          {"error": {"message": "Unauthorized"}}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if len(req["input_ids"]) > 4:
            meta = {"prompt_tokens": len(req["input_ids"]), "completion_tokens": 0,
                    "finish_reason": {"type": "abort", "status_code": 400, "message": "input too long"}}
            self._sse(json.dumps({"text": "", "output_ids": [], "meta_info": meta}).encode())
        else:
            for i, text in enumerate(self.TEXT, 1):
                meta = {"prompt_tokens": 3, "completion_tokens": i, **({"spec_verify_ct": 2} if i == 3 else {})}
                self._sse(json.dumps({"text": text, "meta_info": meta}, ensure_ascii=False, separators=(",", ":"))
                          .encode())
        self._sse(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@pytest.fixture
def sglang_bytes_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SGLangBytesHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_generated_line_separator_does_not_cut_the_event(sglang_bytes_server):
    """httpx's aiter_lines splits at U+2028, U+2029 and U+0085 too, which SGLang writes raw inside a JSON
    string: every request whose text held one failed (JSONDecodeError), or the warm-up stopped the run as
    'is the server up?'."""
    result = bc.run_benchmark(sglang_bytes_server, [bc.BenchRequest([1, 2, 3], 3, 3) for _ in range(4)])
    m = result.metrics
    assert (m["completed"], m["failed"], m["total_output_tokens"], m["accept_length"]) == (4, 0, 12, 1.5)
    assert {r.text for r in result.requests} == {"Hello\u2028world\u0085!"}


def test_a_request_the_server_aborts_counts_as_failed(sglang_bytes_server):
    """SGLang streams an aborted request (input past the context) as a chunk and [DONE]: it was counted as
    completed with 0 tokens and a TTFT of 0, halving the mean TTFT."""
    m = bc.run_benchmark(sglang_bytes_server, [bc.BenchRequest([1, 2, 3], 3, 3),
                                               bc.BenchRequest(list(range(10)), 10, 3)], warmup=0).metrics
    assert (m["completed"], m["failed"]) == (1, 1)
    assert m["errors"] == ["RuntimeError: aborted by the server: input too long"]


def test_the_api_key_flag_reaches_the_server_info_check(sglang_bytes_server, monkeypatch):
    """`specforge bench --api-key`: the swapped-URL check read /server_info without it (401, taken as a
    server without /server_info), so swapped URLs went unsaid."""
    monkeypatch.delenv("SPECFORGE_API_KEY", raising=False)
    with pytest.warns(UserWarning, match="without speculative decoding"):
        served = bc.served_by(sglang_bytes_server, None, strict=False, api_key="s3cret")
    assert served == {"server": {"model_path": "/m/tgt", "speculative_algorithm": None}}
    assert bc.served_by(sglang_bytes_server, None, strict=False) == {}  # no key: the server said nothing
