"""The HTTP routes of `specforge serve`: requests in SGLang's protocol turned into engine jobs,
and the engine's tokens and statistics turned into SGLang's answers.

One target (and optionally one EAGLE3 draft checkpoint with one tree `T_K_N`), so base and EAGLE3
are measured by the same client as a real SGLang server:

- `POST /generate` (SGLang native): `text` or `input_ids`, `sampling_params` {max_new_tokens,
  temperature, ignore_eos, stop_token_ids, sampling_seed}, `stream`. Returns `text`, `output_ids`
  and `meta_info` {id, prompt_tokens, completion_tokens, finish_reason, e2e_latency, and for
  EAGLE3 spec_verify_ct, spec_accept_length, spec_accept_rate, ...}. Streaming sends SGLang's
  default (non-incremental) chunks `data: {...}` with the cumulative text and ids, then
  `data: [DONE]`; the speculative metrics come with the last chunk, as in SGLang.
- `POST /v1/completions` (OpenAI): `stream: true` gives SSE text deltas; SGLang's extensions
  `ignore_eos`, `return_spec_tokens_details` (an `sglext` chunk) and `stream_options`
  {include_usage, continuous_usage_stats} are honoured.
- `GET /health` (503 while the model loads, 200 after), `GET /server_info` (server args and
  `internal_states[0].avg_spec_accept_length`, cumulative since start), `GET /v1/models`.
- Vision-language targets (Qwen3-VL, Qwen2.5-VL): `/generate` takes `image_data` (one image per
  placeholder of the prompt, as SGLang takes them: a local path under `--image-root`, or a base64
  `data:` URI; images.py); the placeholders are expanded to the images' token counts and the
  engine prefills with the pixels.
- Hidden states, as SGLang returns them (docs/contract.md §7), for the `server` extract backend: started
  with `--enable-return-hidden-states`, a `/generate` request with `return_hidden_states: true`
  and `max_new_tokens: 1` gets `meta_info.hidden_states = [rows]`, one row per prompt token: the
  final post-norm state, or, with `--enable-return-aux-hidden-states
  --return-aux-hidden-state-layer-ids a b c`, the aux layers' outputs concatenated (SGLang's
  capture returns them in place of the final state). `input_ids` may be a batch (a list of
  lists): one padded forward, a list of results.

The engine runs batch 1: requests queue (FIFO) for one engine thread; HTTP handling is threaded,
so any number of clients may connect and stream concurrently.

Every request first passes the server's ServePolicy (policy.py): the API key (`--api-key`, all
routes but /health), the body's size (`--max-request-bytes`) and the time to read it
(`--read-timeout-s`). Every refusal and every failure is answered with a JSON error
`{"error": {"message", "code"}}`; a connection whose request was not read to its end is closed
after the answer.
"""
from __future__ import annotations

import json
import logging
import math
import queue
import select
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Callable

from specforge.serving.images import load_image_data
from specforge.serving.model import LoadedModel
from specforge.serving.policy import UNAUTHENTICATED_GETS, RequestError, content_length, is_authorized
from specforge.serving.worker import Job

log = logging.getLogger("specforge.serve")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Sampling parameters the engine does not implement, accepted only at their neutral value.
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                    "frequency_penalty": 0.0, "presence_penalty": 0.0, "n": 1}
UNSUPPORTED_FEATURES = ("return_logprob", "return_hidden_states", "image_data", "lora_path",
                        "logprobs", "echo", "suffix")
DISCARD_BODY_BYTES = 1 << 16  # the largest unread body read (and dropped) to keep a connection after an error
HIDDEN_STATES_DISABLED = ("The server is not configured to return the hidden states. "
                          "Please set `--enable-return-hidden-states` to enable this feature.")  # SGLang's words


def _meta_info(job: Job, prompt_tokens: int, output_ids: list[int], stats, model: LoadedModel) -> dict:
    """SGLang's meta_info; `stats` (GenerationStats) is given once the request finished."""
    meta = {"id": job.rid, "prompt_tokens": prompt_tokens, "completion_tokens": len(output_ids),
            "cached_tokens": 0, "finish_reason": None}
    if stats is None:
        return meta
    if job.stop_token_ids and output_ids and output_ids[-1] in job.stop_token_ids:
        meta["finish_reason"] = {"type": "stop", "matched": output_ids[-1]}
    else:
        meta["finish_reason"] = {"type": "length", "length": len(output_ids)}
    meta["e2e_latency"] = time.perf_counter() - job.arrival
    if model.engine.draft is not None and stats.spec_verify_ct > 0:
        n = stats.num_draft_tokens
        meta.update(
            spec_verify_ct=stats.spec_verify_ct,
            spec_accept_length=stats.accept_length,
            spec_accept_rate=stats.accept_rate,
            spec_num_correct_drafts=sum(stats.accepted_drafts),
            spec_num_proposed_drafts=stats.spec_verify_ct * (n - 1),
            spec_correct_drafts_histogram=stats.accept_histogram(model.engine.spec.steps),
        )
    return meta


CLIENT_CHECK_S = 1.0  # how often a request that does not stream looks whether its client is still there


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class _TextDeltas:
    """Incremental detokenization: the text so far, holding back an incomplete UTF-8 character. A stop
    token that ends the output is not shown, as SGLang's detokenizer trims a matched stop (and vLLM
    leaves a stop's text out); output_ids keep it."""

    def __init__(self, tokenizer, stop_token_ids=None):
        self.tokenizer, self.sent, self.stop = tokenizer, "", set(stop_token_ids or ())

    def full(self, ids) -> str:
        ids = list(ids)
        if ids and ids[-1] in self.stop:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def delta(self, ids, final: bool) -> str:
        text = self.full(ids)
        if not final and text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


# ---- HTTP ------------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_HTTPServer"  # specforge.serving.app._HTTPServer: .worker, .model_name, .version, .policy
    _unread_body = False  # the request's body is still on the socket: close after answering
    _responded = False  # the status line of this request's answer is sent

    def setup(self):
        # Every socket read waits at most this long: a silent client cannot hold a thread forever.
        self.timeout = self.server.policy.read_timeout_s
        super().setup()

    def log_message(self, fmt, *args):
        log.debug("%s - %s", self.address_string(), fmt % args)

    # -- plumbing
    def _send_json(self, obj, status=HTTPStatus.OK):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        if self._unread_body:  # the next bytes on this connection are no request
            self.send_header("Connection", "close")
        self.end_headers()
        self._responded = True
        self.wfile.write(body)

    def _send_error(self, status, message):
        self._send_json({"error": {"message": message, "code": int(status)}}, status)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (bad request line, headers too long, unknown method) as JSON too."""
        self._unread_body = True
        self._send_error(code, message or HTTPStatus(code).phrase)

    def parse_request(self):
        """http.server's request line + headers; headers that stop arriving get a 408, not silence."""
        try:
            return super().parse_request()
        except TimeoutError:
            self.send_error(HTTPStatus.REQUEST_TIMEOUT,
                            f"the request headers were not received within --read-timeout-s "
                            f"({self.server.policy.read_timeout_s:g} s)")
            return False

    def handle_expect_100(self):
        """`Expect: 100-continue`: refuse a bad key or size before the client sends the body."""
        if self.command == "POST":
            try:
                self._authorize()
                content_length(self.headers, self.server.policy.max_request_bytes)
            except RequestError as e:
                self._unread_body = True
                self._send_error(e.status, str(e))
                return False
        return super().handle_expect_100()

    def _answer_failure(self, status, message):
        """An error answer, or, when an answer (a stream) already started, the end of the connection."""
        if self._responded:
            self.close_connection = True
        else:
            self._send_error(status, message)

    def _start_stream(self):
        self._responded = True
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _sse(self, payload):
        data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self):
        self._sse(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _authorize(self):
        if not is_authorized(self.headers.get("Authorization"), self.server.policy.api_key):
            raise RequestError("a valid API key is required: send the header Authorization: Bearer <key>",
                               HTTPStatus.UNAUTHORIZED)

    def _read_body(self, length: int) -> bytes:
        """`length` bytes of body, read within --read-timeout-s in all (not per read, so a trickling
        client is cut off too); 400 when the body ends early, 408 when it is too slow."""
        policy = self.server.policy
        deadline = time.monotonic() + policy.read_timeout_s
        chunks, received = [], 0
        try:
            while received < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(length - received, 1 << 20))
                if not chunk:
                    raise RequestError(f"the request body ended after {received} of {length} bytes (Content-Length)")
                chunks.append(chunk)
                received += len(chunk)
        except TimeoutError:
            raise RequestError(f"the request body was not received within --read-timeout-s "
                               f"({policy.read_timeout_s:g} s): {received} of {length} bytes",
                               HTTPStatus.REQUEST_TIMEOUT) from None
        self.connection.settimeout(policy.read_timeout_s)
        self._unread_body = False
        return b"".join(chunks)

    def _discard_small_body(self) -> None:
        """Before an error answer to a request whose body was not read: read and drop a small body,
        so the connection stays usable and the client is not reset before it reads the answer; a
        large or bad one is left, and the connection closed."""
        try:
            limit = min(DISCARD_BODY_BYTES, self.server.policy.max_request_bytes)
            self._read_body(content_length(self.headers, limit))
        except (RequestError, OSError):
            pass

    def _read_json(self) -> dict:
        raw = self._read_body(content_length(self.headers, self.server.policy.max_request_bytes))
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, nesting too deep
            raise RequestError(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the JSON body must be an object")
        return body

    # -- routes
    def do_GET(self):
        self._unread_body = self._responded = False
        worker = self.server.worker
        path = self.path.split("?")[0]
        if path not in UNAUTHENTICATED_GETS:
            try:
                self._authorize()
            except RequestError as e:
                return self._send_error(e.status, str(e))
        if path in ("/health", "/health_generate"):
            if worker.ready.is_set():
                return self._send_json({"status": "ok"})
            status = "loading" if worker.load_error is None else f"failed: {worker.load_error}"
            return self._send_json({"status": status}, HTTPStatus.SERVICE_UNAVAILABLE)
        if path in ("/server_info", "/get_server_info"):
            info = dict(worker.model.info) if worker.model else {}
            info.update(host=self.server.server_address[0], port=self.server.server_address[1],
                        internal_states=[worker.internal_state()],
                        version=self.server.version, frontend="specforge-embedded")
            return self._send_json(info)
        if path in ("/v1/models", "/model_info", "/get_model_info"):
            if not worker.ready.is_set():
                return self._send_error(HTTPStatus.SERVICE_UNAVAILABLE, "model is loading")
            name = self.server.model_name
            if path == "/v1/models":
                return self._send_json({"object": "list", "data": [
                    {"id": name, "object": "model", "owned_by": "specforge", "root": name}]})
            return self._send_json({"model_path": worker.model.info["model_path"],
                                    "served_model_name": name, "is_generation": True})
        self._send_error(HTTPStatus.NOT_FOUND, f"no route GET {path}")

    def do_POST(self):
        """Credentials, route and body are checked before anything reaches the engine; whatever
        fails later is still answered (500), never a dropped connection."""
        self._unread_body, self._responded = True, False
        path = self.path.split("?")[0]
        routes = {"/generate": self._generate, "/v1/completions": self._completions}
        try:
            self._authorize()
            if path not in routes:
                raise RequestError(f"no route POST {path}", HTTPStatus.NOT_FOUND)
            body = self._read_json()
            worker = self.server.worker
            if not worker.ready.is_set():
                msg = "model is loading" if worker.load_error is None else f"model failed to load: {worker.load_error}"
                raise RequestError(msg, HTTPStatus.SERVICE_UNAVAILABLE)
            routes[path](body)
        except RequestError as e:
            if self._unread_body and e.status in (HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND):
                self._discard_small_body()
            self._answer_failure(e.status, str(e))
        except (ConnectionError, TimeoutError):  # the client went away or stopped reading
            self.close_connection = True
        except Exception as e:
            log.exception("POST %s failed", path)
            self._answer_failure(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(e).__name__}: {e}")

    # -- request -> job
    def _job(self, prompt, params: dict, ignore_eos: bool, seed) -> Job:
        model = self.server.worker.model
        if isinstance(prompt, str):
            ids = model.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
            raise RequestError("batch requests are not supported (the engine runs batch 1): send one prompt per request")
        else:
            raise RequestError("the prompt must be a non-empty string or a non-empty list of token ids")
        if not ids:
            raise RequestError("the prompt is empty after tokenization")
        if any(not 0 <= t < model.vocab_size for t in ids):
            raise RequestError(f"token ids must be in [0, {model.vocab_size})")
        max_new = params["max_new_tokens"]
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
        self._check_context(len(ids), max_new, "prompt")
        temperature = params["temperature"]
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not 0 <= temperature < math.inf:
            raise RequestError(f"temperature must be a finite number >= 0, got {temperature!r}")  # JSON reads NaN
        if seed is not None and not (_is_token_id(seed) and -2 ** 63 <= seed < 2 ** 64):  # what manual_seed takes
            raise RequestError(f"the seed must be an integer, got {seed!r}")
        for key, neutral in NEUTRAL_SAMPLING.items():
            if params.get(key, neutral) != neutral:
                raise RequestError(f"{key}={params[key]!r} is not supported by the embedded engine "
                                   f"(only {neutral!r})")
        extra_stop = params.get("stop_token_ids") or []
        if not isinstance(extra_stop, list) or not all(_is_token_id(t) for t in extra_stop):
            raise RequestError(f"stop_token_ids must be a list of token ids, got {extra_stop!r}")
        # As SGLang: ignore_eos drops the eos ids, explicit stop_token_ids still stop.
        stop = ([] if ignore_eos else list(model.eos_token_ids)) + extra_stop
        return Job(ids, max_new, float(temperature), stop or None, seed)

    def _attach_images(self, job: Job, image_data) -> None:
        """SGLang's `image_data` (one image per placeholder of the prompt, in order; images.py says
        which are accepted): the placeholders expanded to the images' token counts, the pixels kept
        for the prefill (data/vl_render.prompt_with_pictures)."""
        from specforge.data.vl_render import prompt_with_pictures

        model = self.server.worker.model
        if model.vl is None:
            raise RequestError("image_data needs a vision-language target; this server serves a text model")
        pictures = load_image_data(image_data, self.server.policy)
        try:
            ids, images = prompt_with_pictures(job.input_ids, pictures, *model.vl)
        except ValueError as e:
            raise RequestError(f"image_data: {e}") from None
        self._check_context(len(ids), job.max_new_tokens, "prompt with images")
        job.input_ids, job.images = ids, images

    def _check_placeholders(self, job: Job) -> None:
        """A vision-language prompt's image/video placeholder tokens need their pixels: without them
        the engine fails mid-prefill (a 500), so they are the request's error (400)."""
        vl = self.server.worker.model.vl
        if vl is None:
            return
        info = vl[1]
        if info.video_token_id is not None and info.video_token_id in job.input_ids:
            raise RequestError(f"the prompt holds video placeholder tokens (id {info.video_token_id}): "
                               "video inputs are not supported by the embedded server")
        if job.images is None and info.image_token_id in job.input_ids:
            raise RequestError(f"the prompt holds {job.input_ids.count(info.image_token_id)} image placeholder "
                               f"tokens (id {info.image_token_id}) but no image_data")

    def _check_context(self, prompt_tokens: int, max_new: int, what: str) -> None:
        limit = self.server.worker.model.max_context
        if limit and prompt_tokens + max_new > limit:
            raise RequestError(f"{what} ({prompt_tokens} tokens) + max_new_tokens ({max_new}) exceeds the "
                               f"model's context length {limit}")

    def _wait_events(self, job: Job):
        """Yield ("tokens", ids) ... then ("done", stats); raise on errors. Token groups that
        queued up while the client was being written to are merged into one chunk. A client that
        closes its connection meanwhile (a timeout: nothing is written to it before the answer of a
        request that does not stream) raises ConnectionError within a second, as SGLang checks."""
        checked = time.monotonic()
        while True:
            try:
                kind, value = job.events.get(timeout=CLIENT_CHECK_S)
            except queue.Empty:
                kind = None
            if time.monotonic() - checked >= CLIENT_CHECK_S:
                if self._client_gone():
                    raise ConnectionError("the client closed the connection")
                checked = time.monotonic()
            if kind is None:
                continue
            while kind == "tokens" and not job.events.empty():
                nxt = job.events.get()
                if nxt[0] != "tokens":
                    yield kind, value
                    kind, value = nxt
                    break
                value = value + nxt[1]
            if kind == "error":
                raise RuntimeError(value)
            yield kind, value
            if kind == "done":
                return

    def _client_gone(self) -> bool:
        """Readable with nothing to read: the client closed its end (a pipelined next request is data)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _run_job(self, job: Job, on_tokens: Callable[[list[int]], None]):
        """Queue the job, feed committed tokens to `on_tokens` (in this thread); returns
        (output ids, stats). A dropped client cancels the job."""
        self.server.worker.submit(job)
        output: list[int] = []
        try:
            for kind, value in self._wait_events(job):
                if kind == "tokens":
                    output += value
                    on_tokens(output)
                else:
                    return output, value
        except BaseException:
            job.cancelled = True
            raise

    @staticmethod
    def _check_features(body: dict, allowed=()):
        for key in UNSUPPORTED_FEATURES:
            if body.get(key) and key not in allowed:
                raise RequestError(f"{key} is not supported by the embedded server")

    @staticmethod
    def _sampling(body: dict) -> tuple[dict, bool, object]:
        """/generate's sampling_params -> (params for _job, ignore_eos, seed)."""
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise RequestError(f"sampling_params must be an object, got {sp!r}")
        sp = dict(sp)
        params = {"max_new_tokens": sp.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
                  "temperature": sp.pop("temperature", 1.0),
                  "stop_token_ids": sp.pop("stop_token_ids", None)}
        ignore_eos, seed = bool(sp.pop("ignore_eos", False)), sp.pop("sampling_seed", None)
        unknown = set(sp) - set(NEUTRAL_SAMPLING)
        if unknown:
            raise RequestError(f"unsupported sampling_params {sorted(unknown)}")
        params.update(sp)
        return params, ignore_eos, seed

    # -- /generate
    def _generate(self, body: dict):
        self._check_features(body, allowed=("return_hidden_states", "image_data"))
        prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
        if prompt is None:
            raise RequestError("give `text` or `input_ids`")
        if body.get("return_hidden_states"):
            if body.get("image_data"):
                raise RequestError("return_hidden_states with image_data is not supported by the embedded server")
            return self._generate_hidden_states(body, prompt)
        params, ignore_eos, seed = self._sampling(body)
        job = self._job(prompt, params, ignore_eos, seed)
        if body.get("image_data"):
            self._attach_images(job, body["image_data"])
        self._check_placeholders(job)
        model = self.server.worker.model
        text = _TextDeltas(model.tokenizer, job.stop_token_ids)

        def response(output, stats):
            return {"text": text.full(output), "output_ids": list(output),
                    "meta_info": _meta_info(job, len(job.input_ids), output, stats, model)}

        if not body.get("stream"):
            try:
                output, stats = self._run_job(job, lambda _: None)
            except RuntimeError as e:
                return self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, str(e))
            return self._send_json(response(output, stats))
        self._start_stream()
        try:
            output, stats = self._run_job(job, lambda out: self._sse(response(out, None)))
            self._sse(response(output, stats))
        except RuntimeError as e:
            self._sse({"error": {"message": str(e), "code": 500}})
        self._end_stream()

    def _generate_hidden_states(self, body: dict, prompt):
        """return_hidden_states: prefill only (max_new_tokens=1, what extraction sends); a batch of
        prompts is one forward and gets a list of results, in order."""
        model = self.server.worker.model
        if model.hidden_state_extractor is None:
            raise RequestError(HIDDEN_STATES_DISABLED)
        if body.get("stream"):
            raise RequestError("return_hidden_states with stream is not supported by the embedded server")
        params, ignore_eos, seed = self._sampling(body)
        if params["max_new_tokens"] != 1:
            raise RequestError("the embedded server returns hidden states of the prompt only: send "
                               f"sampling_params.max_new_tokens=1 (got {params['max_new_tokens']!r})")
        batched = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (list, str)) for p in prompt)
        jobs = [self._job(p, params, ignore_eos, seed) for p in (prompt if batched else [prompt])]
        job = Job(jobs[0].input_ids, 1, jobs[0].temperature, jobs[0].stop_token_ids, seed,
                  batch=[j.input_ids for j in jobs])
        try:
            _, results = self._run_job(job, lambda _: None)
        except RuntimeError as e:
            return self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, str(e))
        latency = time.perf_counter() - job.arrival
        out = []
        for i, (ids, (rows, token)) in enumerate(zip(job.batch, results)):
            stop = bool(job.stop_token_ids) and token in job.stop_token_ids
            out.append({"text": model.tokenizer.decode([token], skip_special_tokens=True), "output_ids": [token],
                        "meta_info": {"id": f"{job.rid}-{i}" if batched else job.rid, "prompt_tokens": len(ids),
                                      "completion_tokens": 1, "cached_tokens": 0, "e2e_latency": latency,
                                      "finish_reason": {"type": "stop", "matched": token} if stop
                                      else {"type": "length", "length": 1},
                                      "hidden_states": [rows.tolist()]}})
        self._send_json(out if batched else out[0])

    # -- /v1/completions
    def _completions(self, body: dict):
        self._check_features(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
            raise RequestError("n and best_of must be 1")
        params = {"max_new_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 1.0),
                  "stop_token_ids": body.get("stop_token_ids"),
                  **{k: body[k] for k in NEUTRAL_SAMPLING if k in body and k != "n"}}
        if body.get("stop"):
            raise RequestError("`stop` strings are not supported by the embedded server; use stop_token_ids")
        job = self._job(prompt, params, bool(body.get("ignore_eos", False)), body.get("seed"))
        self._check_placeholders(job)
        model = self.server.worker.model
        name = self.server.model_name
        created = int(time.time())
        rid = f"cmpl-{job.rid}"
        text = _TextDeltas(model.tokenizer, job.stop_token_ids)
        stream_options = body.get("stream_options") or {}
        spec_details = bool(body.get("return_spec_tokens_details"))

        def usage(output):
            return {"prompt_tokens": len(job.input_ids), "completion_tokens": len(output),
                    "total_tokens": len(job.input_ids) + len(output)}

        def finish_reason(meta):
            return "stop" if meta["finish_reason"]["type"] == "stop" else "length"

        def spec_tokens_details(meta):
            keys = ("spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts",
                    "spec_num_proposed_drafts", "spec_verify_ct", "spec_correct_drafts_histogram")
            return {k: meta[k] for k in keys if k in meta} or None

        def chunk(delta, output, reason=None):
            c = {"id": rid, "object": "text_completion", "created": created, "model": name,
                 "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]}
            if stream_options.get("continuous_usage_stats"):
                c["usage"] = usage(output)
            return c

        if not body.get("stream"):
            try:
                output, stats = self._run_job(job, lambda _: None)
            except RuntimeError as e:
                return self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, str(e))
            meta = _meta_info(job, len(job.input_ids), output, stats, model)
            resp = {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text.full(output), "logprobs": None,
                                 "finish_reason": finish_reason(meta)}],
                    "usage": usage(output)}
            if spec_details:
                resp["sglext"] = {"spec_tokens_details": spec_tokens_details(meta)}
            return self._send_json(resp)

        self._start_stream()
        try:
            output, stats = self._run_job(job, lambda out: self._sse(chunk(text.delta(out, False), out)))
            meta = _meta_info(job, len(job.input_ids), output, stats, model)
            self._sse(chunk(text.delta(output, True), output, finish_reason(meta)))
            if spec_details:
                self._sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                           "choices": [], "sglext": {"spec_tokens_details": spec_tokens_details(meta)}})
            if stream_options.get("include_usage"):
                self._sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                           "choices": [], "usage": usage(output)})
        except RuntimeError as e:
            self._sse({"error": {"message": str(e), "code": 500}})
        self._end_stream()
