"""Async streaming serving benchmark, measured and named as `sglang.bench_serving`.

Per request: TTFT (first chunk carrying a token), ITL (the gap between chunks spread over the
tokens a chunk brings: speculative rounds commit several at once), e2e latency and
TPOT = (latency - ttft) / (output_len - 1). Aggregates: request/input/output/total throughput,
mean/median/std/p90/p99 of TTFT, TPOT, ITL and e2e in ms, and the accept length.

Accept length is exact, from the server's per-request counts (docs/contract.md §6):
`accept_length = sum(completion_tokens) / sum(spec_verify_ct)` over the requests that report
verify rounds. The native backend (`sglang`, POST /generate) reads them from the last chunk's
meta_info; the `openai` backend (POST /v1/completions) asks for SGLang's
`return_spec_tokens_details` and reads its `sglext` chunk. `server_avg_spec_accept_length` is the
server's own cumulative figure from /server_info (what sglang.bench_serving prints).

Prompts are the run's held-out prompts (`data/eval.conversations.jsonl`, rendered as the embedded
evaluation renders them), a file of one's own workload rendered alike (`--prompts`, eval.prompts),
or random token ids of a given length; all are sent as token ids so every server sees the same tokens.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import httpx
import numpy as np

from specforge.errors import InputError, InvalidInput, SpecForgeWarning
from specforge.eval.scenarios import Scenario
from specforge.launch.process import api_key_from_env, auth_headers, url_problem
from specforge.launch.process import server_info as read_server_info
from specforge.run_layout import RunLayout
from specforge.utils.io import write_json

BACKENDS = ("sglang", "openai")


class ServerUnreachable(RuntimeError):
    """The server did not answer the warm-up request: nothing was measured."""


@dataclass
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    images: list[str] = field(default_factory=list)  # SGLang's `image_data`: data URIs, URLs or paths


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # s
    latency: float = 0.0  # s, e2e as the client sees it
    itl: list[float] = field(default_factory=list)  # s, one per token after the first
    start_time: float = 0.0
    spec_verify_ct: int | None = None
    output_ids: list[int] | None = None
    text: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else math.nan

    @property
    def accept_length(self) -> float:
        return self.output_len / self.spec_verify_ct if self.spec_verify_ct else math.nan


@dataclass
class BenchResult:
    metrics: dict
    requests: list[RequestResult]
    config: dict

    def to_dict(self, with_requests: bool = True) -> dict:
        d = {"metrics": self.metrics, "config": self.config}
        if with_requests:
            d["requests"] = [{**asdict(r), "tpot": _finite(r.tpot), "accept_length": _finite(r.accept_length)}
                             for r in self.requests]
        return d

    def save(self, path) -> Path:
        write_json(path, self.to_dict())  # atomically: an evaluation resumed after a crash reads it
        return Path(path)


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


# ---- prompts ---------------------------------------------------------------------------------------


def random_token_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, *,
                          exclude_ids: Iterable[int] = (), seed: int = 0) -> list[BenchRequest]:
    """Prompts of `input_len` random token ids (special tokens excluded), reproducible by seed."""
    rng = random.Random(seed)
    excluded = set(exclude_ids)
    allowed = [i for i in range(vocab_size) if i not in excluded]
    return [BenchRequest([rng.choice(allowed) for _ in range(input_len)], input_len, output_len)
            for _ in range(num_prompts)]


def conversation_requests(path, tokenizer, num_prompts: int, output_len: int,
                          with_images: bool = False, thinking: bool | None = None) -> list[BenchRequest]:
    """The held-out prompts of the embedded evaluation (specforge.eval.prompts: each conversation up
    to its first assistant turn, with the generation prompt), from a run dir or a .jsonl file;
    cycled when there are fewer conversations than `num_prompts`. `with_images` (vision-language
    targets): a prompt with images goes as its rendered text plus `image_data`, and the server
    expands the image placeholders itself. `thinking`: eval.thinking (prompts.thinking_kwargs)."""
    from specforge.eval.prompts import heldout_prompts, thinking_kwargs

    path = Path(path)
    if path.is_dir():
        path = RunLayout(path).conversations("eval")
    prompts = heldout_prompts(path, tokenizer, num_prompts, template_kwargs=thinking_kwargs(tokenizer, thinking, path))
    return _requests(prompts, tokenizer, num_prompts, output_len, with_images)


def file_requests(path: str, tokenizer, num_prompts: int, output_len: int, with_images: bool = False,
                  thinking: bool | None = None, setting: str = "--prompts",
                  conversations_file: Path | None = None) -> list[BenchRequest]:
    """The prompts of a file of one's own workload (anything eval.suites takes: conversations in any
    format the data stage reads, or {"prompt": ...} rows; .jsonl, .json, .parquet, .arrow, hub:...),
    each up to its first assistant turn, rendered as conversation_requests renders them (thinking
    mode: `thinking`, else as the run's held-out answers in `conversations_file` were written, as
    the embedded evaluation renders its suites); the file checked whole first, a bad row refused
    naming `setting`, the file and the row."""
    from specforge.data.vl_render import image_paths
    from specforge.eval.prompts import file_conversations, file_prompt, thinking_kwargs

    rows = file_conversations(path, setting)[:num_prompts]
    if not with_images and (pictured := next((r for r in rows if image_paths(r.get("messages", []))), None)):
        raise InvalidInput(f"{setting}: {path}: prompt {pictured['id']!r} has images, which a text target cannot see")
    template_kwargs = thinking_kwargs(tokenizer, thinking, conversations_file)
    prompts = [file_prompt(r, tokenizer, None, template_kwargs) for r in rows]
    return _requests(prompts, tokenizer, num_prompts, output_len, with_images)


def _requests(prompts: list[dict], tokenizer, num_prompts: int, output_len: int,
              with_images: bool) -> list[BenchRequest]:
    """Rendered prompts as requests (token ids; with images, the rendered text plus the images as
    data URIs, which a server on another machine can read too), cycled to `num_prompts`."""
    from specforge.data.vl_render import image_paths
    from specforge.utils.images import as_data_uri

    requests = []
    for p in prompts:
        paths = image_paths(p["messages"]) if with_images else []
        if paths:
            text = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False,
                                                 **p["template_kwargs"])
            requests.append(BenchRequest(text, len(p["input_ids"]), output_len, [as_data_uri(x) for x in paths]))
        else:
            requests.append(BenchRequest(p["input_ids"], len(p["input_ids"]), output_len))
    return [requests[i % len(requests)] for i in range(num_prompts)]


# ---- one request -----------------------------------------------------------------------------------


async def _sse_events(response: httpx.Response):
    """JSON payloads of `data: ...` lines, with the arrival time of each; stops at [DONE]. Lines end at
    b"\n" alone: httpx's aiter_lines also splits at U+2028, U+2029 and U+0085, which SGLang's orjson (and
    pydantic) write raw inside a JSON string, so a generated one cut the event in two."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter()
            if data == "[DONE]":
                return
            yield now, json.loads(data)


class _Timing:
    """TTFT / ITL bookkeeping from (time, cumulative completion tokens) observations."""

    def __init__(self, result: RequestResult):
        self.r, self.last_n, self.last_t = result, 0, None

    def tokens(self, now: float, n: int):
        r = self.r
        if n <= self.last_n:
            return
        if self.last_t is None:
            r.ttft = now - r.start_time
        else:
            r.itl += [(now - self.last_t) / (n - self.last_n)] * (n - self.last_n)
        self.last_n, self.last_t = n, now
        r.output_len = n


def _check_error(data: dict):
    err = data.get("error")
    if err:
        raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    # SGLang streams a request its scheduler aborts (past the context, say) as a chunk, then [DONE]
    finish = (data.get("meta_info") or {}).get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise RuntimeError(f"aborted by the server: {finish.get('message', finish)}")


async def _post_stream(client: httpx.AsyncClient, url: str, payload: dict):
    """POST a streaming request; yield (arrival time, event) per SSE event, raising on an HTTP error
    status or an error event."""
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:500]}")
        async for now, data in _sse_events(resp):
            _check_error(data)
            yield now, data


async def request_generate(client: httpx.AsyncClient, base_url: str, req: BenchRequest,
                           temperature: float, ignore_eos: bool) -> RequestResult:
    """SGLang native streaming: POST /generate, cumulative chunks, meta_info on each."""
    payload = {("text" if isinstance(req.prompt, str) else "input_ids"): req.prompt,
               "sampling_params": {"max_new_tokens": req.output_len, "temperature": temperature,
                                   "ignore_eos": ignore_eos},
               "stream": True}
    if req.images:
        payload["image_data"] = req.images
    r = RequestResult(prompt_len=req.prompt_len)
    timing = _Timing(r)
    r.start_time = time.perf_counter()
    async for now, data in _post_stream(client, base_url + "/generate", payload):
        meta = data.get("meta_info") or {}
        timing.tokens(now, int(meta.get("completion_tokens", len(data.get("output_ids") or []))))
        r.prompt_len = meta.get("prompt_tokens") or r.prompt_len
        if data.get("text"):
            r.text = data["text"]
        if data.get("output_ids") is not None:
            r.output_ids = list(data["output_ids"])
        if meta.get("spec_verify_ct"):
            r.spec_verify_ct = int(meta["spec_verify_ct"])
    r.latency = time.perf_counter() - r.start_time  # end of stream, as bench_serving
    r.success = True
    return r


async def request_openai(client: httpx.AsyncClient, base_url: str, req: BenchRequest,
                         temperature: float, ignore_eos: bool, model: str | None) -> RequestResult:
    """OpenAI completions streaming, with SGLang's extensions for exact token counts: continuous
    usage stats on every chunk and the spec details (`sglext`) at the end."""
    if req.images:
        raise ValueError("requests with images need the SGLang /generate endpoint (eval.bench_backend=sglang)")
    payload = {"prompt": req.prompt, "max_tokens": req.output_len, "temperature": temperature,
               "stream": True, "ignore_eos": ignore_eos, "return_spec_tokens_details": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if model:
        payload["model"] = model
    r = RequestResult(prompt_len=req.prompt_len)
    timing = _Timing(r)
    r.start_time = time.perf_counter()
    counted = 0  # chunks counted when the server gives no usage per chunk
    async for now, data in _post_stream(client, base_url + "/v1/completions", payload):
        usage = data.get("usage") or {}
        choices = data.get("choices") or []
        text = choices[0].get("text", "") if choices else ""
        r.text += text
        if choices and "completion_tokens" in usage:
            timing.tokens(now, int(usage["completion_tokens"]))
        elif text:
            counted += 1  # no per-chunk usage: one token per text chunk, as bench_serving
            timing.tokens(now, counted)
        elif usage.get("completion_tokens"):  # final usage chunk
            r.output_len = int(usage["completion_tokens"])
        details = (data.get("sglext") or {}).get("spec_tokens_details")
        if isinstance(details, dict) and details.get("spec_verify_ct"):
            r.spec_verify_ct = int(details["spec_verify_ct"])
        if usage.get("prompt_tokens"):
            r.prompt_len = int(usage["prompt_tokens"])
    r.latency = time.perf_counter() - r.start_time
    r.success = True
    return r


# ---- the benchmark ---------------------------------------------------------------------------------


async def _arrivals(n: int, request_rate: float, seed: int):
    """Yield 0..n-1, waiting Poisson inter-arrival times (exponential, mean 1/rate) between them."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if math.isfinite(request_rate) and i + 1 < n:
            await asyncio.sleep(rng.expovariate(request_rate))


async def run_benchmark_async(base_url: str, requests: Sequence[BenchRequest], *, backend: str = "sglang",
                              request_rate: float = math.inf, max_concurrency: int | None = None,
                              temperature: float = 0.0, ignore_eos: bool = True, model: str | None = None,
                              seed: int = 0, timeout_s: float = 3600.0, label: str = "",
                              warmup: int = 1, api_key: str | None = None, on_request=None) -> BenchResult:
    """Send `requests` (after `warmup` untimed requests, as bench_serving) and measure them.
    A failed warmup raises (the server is not usable); failed timed requests are counted.
    `api_key` (default: $SPECFORGE_API_KEY): sent as `Authorization: Bearer` (SGLang's and
    `specforge serve`'s --api-key). `on_request()` after each timed request (a progress bar)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {BACKENDS}")
    base_url = base_url.rstrip("/")
    limit = max_concurrency or len(requests) or 1
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    # trust_env=False: never send localhost benchmark traffic through a proxy from the environment.
    headers = auth_headers(api_key or api_key_from_env())
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits,
                                 trust_env=False, headers=headers) as client:

        async def one(req: BenchRequest) -> RequestResult:
            async with semaphore:
                try:
                    if backend == "sglang":
                        return await request_generate(client, base_url, req, temperature, ignore_eos)
                    return await request_openai(client, base_url, req, temperature, ignore_eos, model)
                except Exception as e:  # a failed request is counted, not fatal (as bench_serving)
                    return RequestResult(success=False, error=f"{type(e).__name__}: {e}", prompt_len=req.prompt_len)

        for req in requests[:warmup]:
            r = await one(BenchRequest(req.prompt, req.prompt_len, min(req.output_len, 16), req.images))
            if not r.success:
                raise ServerUnreachable(f"benchmark warmup request to {base_url} failed: {r.error}")
        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), request_rate, seed):
            tasks.append(asyncio.create_task(one(requests[i])))
            if on_request is not None:
                tasks[-1].add_done_callback(lambda _: on_request())
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        server_info = await _server_info(client, base_url)

    metrics = compute_metrics(results, duration)
    internal = (server_info or {}).get("internal_states") or [{}]
    metrics["server_avg_spec_accept_length"] = internal[0].get("avg_spec_accept_length") if internal else None
    config = {"label": label, "base_url": base_url, "backend": backend, "num_prompts": len(requests),
              "request_rate": "inf" if math.isinf(request_rate) else request_rate,
              "max_concurrency": max_concurrency, "temperature": temperature, "ignore_eos": ignore_eos,
              "seed": seed, "warmup": warmup, "server_info": server_info}
    return BenchResult(metrics, list(results), config)


async def _server_info(client: httpx.AsyncClient, base_url: str) -> dict | None:
    for path in ("/server_info", "/get_server_info"):
        try:
            resp = await client.get(base_url + path)
        except httpx.HTTPError:
            return None
        if resp.status_code == 200:
            return resp.json()
    return None


def run_benchmark(base_url: str, requests: Sequence[BenchRequest], **kwargs) -> BenchResult:
    """Synchronous wrapper of run_benchmark_async (same keyword arguments)."""
    return asyncio.run(run_benchmark_async(base_url, requests, **kwargs))


def run_scenario(base_url: str, scenario: Scenario, requests: Sequence[BenchRequest], **kwargs) -> BenchResult:
    """Run `requests` with the scenario's arrival rate and concurrency cap."""
    return run_benchmark(base_url, requests, request_rate=scenario.request_rate,
                         max_concurrency=scenario.max_concurrency, **kwargs)


# ---- metrics and reports ---------------------------------------------------------------------------

SUMMARY_FIELDS = ("ttft", "tpot", "itl", "e2e_latency")


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> dict:
    """sglang.bench_serving's figures (times in ms)."""
    ok = [r for r in results if r.success]
    output = sum(r.output_len for r in ok)
    inputs = sum(r.prompt_len for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_len > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2e_latency": [r.latency for r in ok],
    }
    m = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration_s,
         "total_input_tokens": inputs, "total_output_tokens": output,
         "request_throughput": len(ok) / duration_s, "input_throughput": inputs / duration_s,
         "output_throughput": output / duration_s, "total_throughput": (inputs + output) / duration_s}
    for name in SUMMARY_FIELDS:
        xs = np.asarray(series[name], dtype=float) * 1000.0
        stats = {"mean": np.mean, "median": np.median, "std": np.std,
                 "p90": lambda a: np.percentile(a, 90), "p99": lambda a: np.percentile(a, 99)}
        for stat, fn in stats.items():
            m[f"{stat}_{name}_ms"] = float(fn(xs)) if xs.size else None
    m["concurrency"] = sum(series["e2e_latency"]) / duration_s
    spec = [r for r in ok if r.spec_verify_ct]
    m["accept_length"] = (sum(r.output_len for r in spec) / sum(r.spec_verify_ct for r in spec)) if spec else None
    m["errors"] = sorted({r.error for r in results if not r.success})[:5]
    return m


TABLE_ROWS = (
    ("output_throughput", "tok/s", True), ("total_throughput", "tok/s", True),
    ("request_throughput", "req/s", True),
    ("mean_ttft_ms", "ms", False), ("median_ttft_ms", "ms", False), ("p99_ttft_ms", "ms", False),
    ("mean_tpot_ms", "ms", False), ("median_tpot_ms", "ms", False), ("p99_tpot_ms", "ms", False),
    ("mean_itl_ms", "ms", False), ("median_itl_ms", "ms", False), ("p99_itl_ms", "ms", False),
    ("mean_e2e_latency_ms", "ms", False), ("median_e2e_latency_ms", "ms", False),
    ("p99_e2e_latency_ms", "ms", False), ("accept_length", "", True),
)


def comparison(baseline: dict, eagle: dict) -> dict:
    """{metric: {"baseline", "eagle3", "ratio"}}: ratio = eagle3 / baseline (speed-up for
    throughputs, < 1 is better for latencies)."""
    out = {}
    for name, _, _ in TABLE_ROWS:
        b, e = baseline.get(name), eagle.get(name)
        ratio = e / b if isinstance(b, (int, float)) and isinstance(e, (int, float)) and b else None
        out[name] = {"baseline": b, "eagle3": e, "ratio": ratio}
    return out


def comparison_table(baseline: dict, eagle: dict, eagle_label: str = "EAGLE3") -> str:
    """Markdown `| metric | baseline | EAGLE3 | change |`; change = relative change, with the
    speed-up factor for throughputs."""
    def fmt(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [f"| metric | baseline | {eagle_label} | change |", "|---|---:|---:|---:|"]
    rows = comparison(baseline, eagle)
    for name, unit, higher_better in TABLE_ROWS:
        row = rows[name]
        b, e, ratio = row["baseline"], row["eagle3"], row["ratio"]
        if name == "accept_length" or ratio is None:
            change = "-"
        elif higher_better:
            change = f"{ratio:.2f}x"
        else:
            change = f"{(ratio - 1) * 100:+.1f}%"
        label = f"{name} ({unit})" if unit else name
        lines.append(f"| {label} | {fmt(b)} | {fmt(e)} | {change} |")
    return "\n".join(lines) + "\n"


# ---- command line ----------------------------------------------------------------------------------


def add_bench_args(p) -> None:
    p.add_argument("--url", required=True, help="base URL of the server (EAGLE3 or any)")
    p.add_argument("--baseline-url", default=None, help="base URL of a base-model server to compare with")
    p.add_argument("--scenario", default="chat", help="code | chat | completion")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--backend", default="sglang", choices=BACKENDS)
    p.add_argument("--tokenizer", default=None, help="target dir: vocab for random prompts / chat template")
    p.add_argument("--run-dir", default=None, help="use run_dir/data/eval.conversations.jsonl as prompts")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file used instead of --tokenizer's (the target.chat_template of the run)")
    p.add_argument("--prompts", default=None,
                   help="a file of one's own prompts: conversations or {\"prompt\": ...} rows (.jsonl, .json, "
                        ".parquet, .arrow, hub:OWNER/NAME), each up to its first assistant turn")
    p.add_argument("--vocab-size", type=int, default=None, help="random prompts without a tokenizer")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--api-key", default=None,
                   help="the servers' --api-key, sent as Authorization: Bearer (default: $SPECFORGE_API_KEY)")


# What a server's /server_info (SGLang's server args; `specforge serve` answers the same keys) says it
# serves, kept in the summary and named in the report.
SERVED_KEYS = ("model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
               "speculative_eagle_topk", "speculative_num_draft_tokens")


def served_by(url: str, baseline_url: str | None, names: tuple[str, str] = ("eval.url", "eval.baseline_url"),
              strict: bool = True, api_key: str | None = None) -> dict[str, dict]:
    """What each running server serves, asked before a request is timed: the URL named first
    (`names`: how the user gave the two) should draft and the baseline should not (swapped URLs
    report the target alone as the speed-up), and they should serve one target. `strict` (the
    evaluation, which reports a speculative speed-up): a role broken is refused; otherwise (`specforge
    bench`, which also compares two drafts or two plain servers) it is a warning. One URL for both
    is refused either way. A server without /server_info (vLLM) is taken at its word.
    -> {label: its SERVED_KEYS} for the servers that said."""
    url_name, base_name = names
    if baseline_url and url.rstrip("/") == baseline_url.rstrip("/"):
        raise InvalidInput(f"{url_name} and {base_name} both name {url}: the server would be measured "
                           f"against itself; give the base model's server as {base_name}")
    said = {}
    for label, where in (("server", url), ("baseline", baseline_url)):
        if where:
            try:
                info = read_server_info(where.rstrip("/"), api_key=api_key)
            except (RuntimeError, ConnectionError):  # none (vLLM), or not answering: the benchmark says so
                continue
            if isinstance(info, dict):
                said[label] = {key: info.get(key) for key in SERVED_KEYS if key in info}
    spec, base = said.get("server", {}), said.get("baseline", {})
    roles = []
    if "speculative_algorithm" in spec and not spec["speculative_algorithm"]:
        roles.append(f"{url_name} {url} serves {spec.get('model_path')} without speculative decoding (its "
                     "/server_info: speculative_algorithm null): start it with the run report's SGLang command "
                     "(--speculative-algorithm EAGLE3 --speculative-draft-model-path <run>/epoch_<k>)"
                     + (f", or swap {url_name} and {base_name}" if base.get("speculative_algorithm") else ""))
    if base.get("speculative_algorithm"):
        roles.append(f"{base_name} {baseline_url} drafts with {base['speculative_algorithm']} "
                     f"({base.get('speculative_draft_model_path')}): the baseline is the target alone; start it "
                     "without --speculative-algorithm")
    if roles and strict:
        raise InvalidInput(roles[0])
    for problem in roles:
        warnings.warn(problem, category=SpecForgeWarning, stacklevel=2)
    models = {Path(str(info["model_path"])).name for info in said.values() if info.get("model_path")}
    if len(models) > 1:
        warnings.warn(f"{url_name} serves {spec['model_path']}, {base_name} {base['model_path']}: the speed-up "
                      "compares two different targets", category=SpecForgeWarning, stacklevel=2)
    return said


def _run_or_exit(url: str, *a, **kw):
    """run_scenario, where a server that does not answer the warm-up is one line, not a traceback."""
    try:
        return run_scenario(url, *a, **kw)
    except ServerUnreachable as e:
        raise SystemExit(f"bench: {e}; is the server up at {url}?") from None


def bench(args) -> dict:
    from specforge.eval.scenarios import get_scenario

    try:
        scenario = get_scenario(args.scenario).scaled(
            num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
            request_rate=args.request_rate, max_concurrency=args.max_concurrency)
    except ValueError as e:  # an unknown scenario or a value it cannot run: the message, not a traceback
        raise SystemExit(f"bench: {e}") from None
    for flag, value in (("--url", args.url), ("--baseline-url", args.baseline_url)):
        if (problem := url_problem(flag, value)) is not None:
            raise SystemExit(f"bench: {problem}")
    if args.temperature < 0:
        raise SystemExit(f"bench: --temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise SystemExit(f"bench: --vocab-size must be >= 2, got {args.vocab_size}")
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        if not Path(args.tokenizer).is_dir():
            raise SystemExit(f"bench: --tokenizer {args.tokenizer}: not a directory (the target's, with its tokenizer)")
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        if args.chat_template:
            from specforge.targets.loader import read_chat_template

            try:
                tokenizer.chat_template = read_chat_template(args.chat_template, "--chat-template")
            except InputError as e:
                raise SystemExit(f"bench: {e}") from None
    if args.run_dir and args.prompts:
        raise SystemExit("bench: --run-dir and --prompts both name the prompts; give one")
    if (args.run_dir or args.prompts) and tokenizer is None:
        flag = "--run-dir" if args.run_dir else "--prompts"
        raise SystemExit(f"bench: {flag} needs --tokenizer (the target dir) to render the chat template")
    if args.run_dir:
        try:
            requests = conversation_requests(args.run_dir, tokenizer, scenario.num_prompts, scenario.output_len)
        except InputError as e:  # no held-out conversations there: the message, not a traceback
            raise SystemExit(f"bench: --run-dir {e}") from None
    elif args.prompts:
        from specforge.data.sources import check_source

        try:
            check_source(args.prompts)
            requests = file_requests(args.prompts, tokenizer, scenario.num_prompts, scenario.output_len)
        except InputError as e:  # a missing file, a bad row: named, not a traceback
            raise SystemExit(f"bench: {e}") from None
    else:
        vocab = len(tokenizer) if tokenizer is not None else args.vocab_size
        if vocab is None:
            raise SystemExit("bench: random prompts need --tokenizer or --vocab-size")
        special = tokenizer.all_special_ids if tokenizer is not None else ()
        requests = random_token_requests(scenario.num_prompts, scenario.input_len, scenario.output_len,
                                         vocab, exclude_ids=special, seed=args.seed)
    served = None
    if args.baseline_url:  # swapped URLs would time the target alone as the speed-up: said before a request
        try:
            served = served_by(args.url, args.baseline_url, names=("--url", "--baseline-url"), strict=False,
                               api_key=args.api_key)
        except InvalidInput as e:
            raise SystemExit(f"bench: {e}") from None
    from rich.console import Console

    from specforge.utils.progress import progress_bar

    results = {"scenario": scenario.to_dict(), **({"served": served} if served is not None else {})}
    # stderr: stdout has the tables; transient: a refused warm-up leaves its one line alone
    with progress_bar(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("bench", total=len(requests) * (1 + bool(args.baseline_url)), info="eagle3")
        kw = dict(backend=args.backend, temperature=args.temperature, seed=args.seed, api_key=args.api_key,
                  on_request=lambda: bar.advance(task))
        eagle = _run_or_exit(args.url, scenario, requests, label="eagle3", **kw)
        if args.baseline_url:
            bar.update(task, info="baseline")
            base = _run_or_exit(args.baseline_url, scenario, requests, label="baseline", **kw)
    results["eagle3"] = eagle.to_dict(with_requests=False)
    if args.baseline_url:
        results["baseline"] = base.to_dict(with_requests=False)
        results["comparison"] = comparison(base.metrics, eagle.metrics)
        print(comparison_table(base.metrics, eagle.metrics))
    else:
        for name, _, _ in TABLE_ROWS:
            v = eagle.metrics.get(name)
            print(f"{name:<28} {'-' if v is None else f'{v:.2f}'}")
    if args.out:
        write_json(args.out, results)
    return results
