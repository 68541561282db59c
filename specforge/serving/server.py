"""`specforge serve`: the embedded engine behind an HTTP server that speaks SGLang's protocol.

One target (and optionally one EAGLE3 draft checkpoint with one tree `T_K_N`) served on
127.0.0.1, so base and EAGLE3 are measured by the same client as a real SGLang server:

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
- Vision-language targets (Qwen3-VL, Qwen2.5-VL): `/generate` takes `image_data` (local image
  paths, one per image placeholder of the prompt, as SGLang takes them); the placeholders are
  expanded to the images' token counts and the engine prefills with the pixels.
- Hidden states, as SGLang returns them (contract §7), for the `server` extract backend: started
  with `--enable-return-hidden-states`, a `/generate` request with `return_hidden_states: true`
  and `max_new_tokens: 1` gets `meta_info.hidden_states = [rows]`, one row per prompt token: the
  final post-norm state, or, with `--enable-return-aux-hidden-states
  --return-aux-hidden-state-layer-ids a b c`, the aux layers' outputs concatenated (SGLang's
  capture returns them in place of the final state). `input_ids` may be a batch (a list of
  lists): one padded forward, a list of results.

The engine runs batch 1: requests queue (FIFO) for one engine thread; HTTP handling is threaded,
so any number of clients may connect and stream concurrently.
"""
from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

log = logging.getLogger("specforge.serve")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Sampling parameters the engine does not implement, accepted only at their neutral value.
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                    "frequency_penalty": 0.0, "presence_penalty": 0.0, "n": 1}
UNSUPPORTED_FEATURES = ("return_logprob", "return_hidden_states", "image_data", "lora_path",
                        "logprobs", "echo", "suffix")
HIDDEN_STATES_DISABLED = ("The server is not configured to return the hidden states. "
                          "Please set `--enable-return-hidden-states` to enable this feature.")  # SGLang's words


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and this message."""


# ---- the engine ------------------------------------------------------------------------------------


_LOAD_LOCK = threading.Lock()


@dataclass
class LoadedModel:
    engine: object  # SpeculativeEngine
    tokenizer: object
    info: dict  # server_info fields: model_path, speculative_*, dtype, ...
    eos_token_ids: list[int]
    vocab_size: int
    max_context: int | None
    hidden_state_extractor: object = None  # EmbeddedExtractor when hidden states may be returned
    vl: tuple | None = None  # (image processor, VLInfo) of a vision-language target


def load_model(target_path, draft_path=None, tree: str | None = None, *, dtype: str = "bfloat16",
               device: str = "cpu", exact_ancestor_attention: bool = False, return_hidden_states: bool = False,
               aux_hidden_state_layer_ids=None, image_min_pixels: int | None = None,
               image_max_pixels: int | None = None) -> LoadedModel:
    """Target (+ draft checkpoint) as a streaming engine, with the tokenizer and the eos ids.
    `return_hidden_states`: answer `return_hidden_states` requests with the final post-norm
    states, or with the outputs of decoder layers `aux_hidden_state_layer_ids` concatenated.
    A vision-language target (by its config.json) loads with its image processor (pixel bounds:
    `image_*_pixels`, as data.image_*_pixels; None: the processor's own)."""
    import torch
    from transformers import AutoTokenizer

    from specforge.checkpoint import load_draft
    from specforge.engine.tree import TreeSpec
    from specforge.targets.loader import model_class, text_config, torch_dtype
    from specforge.targets.vl import is_vl_config, load_image_processor, vl_info

    if draft_path is not None and tree is None:
        raise ValueError("serve: a draft needs a tree T_K_N (e.g. --tree 8_2_16)")
    spec = TreeSpec.parse(tree) if draft_path is not None else None
    torch_type = torch_dtype(dtype)
    config_file = Path(target_path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    kind = config["model_type"] if is_vl_config(config) else "causal_lm"
    if kind != "causal_lm" and return_hidden_states:
        raise ValueError("hidden states of vision-language targets: use the embedded extract backend")
    with _LOAD_LOCK:  # from_pretrained's meta-device init is process-global: one load at a time
        target = model_class(kind).from_pretrained(str(target_path), dtype=torch_type)
    target.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    draft = None
    if draft_path is not None:
        draft = load_draft(draft_path, device=device, dtype=torch_type,
                           embed_tokens=target.get_input_embeddings().weight.detach())
    from specforge.engine.speculative import SpeculativeEngine

    engine = SpeculativeEngine(target, draft, spec or "1_1_2", exact_ancestor_attention=exact_ancestor_attention)
    if aux_hidden_state_layer_ids is not None and not return_hidden_states:
        raise ValueError("aux hidden states are returned through return_hidden_states: enable it too")
    hidden = None
    if return_hidden_states:
        from specforge.extract.embedded import EmbeddedExtractor

        # float32 rows: a bf16 target's values come back exactly, as SGLang's .tolist() gives them
        hidden = EmbeddedExtractor(target, list(aux_hidden_state_layer_ids or []), batch_tokens=1 << 30,
                                   storage_dtype=torch.float32)

    eos: list[int] = []
    for ids in (getattr(target.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for i in ([ids] if isinstance(ids, int) else ids or []):
            if i not in eos:
                eos.append(int(i))
    info = {
        "model_path": str(target_path),
        "speculative_algorithm": "EAGLE3" if draft is not None else None,
        "speculative_draft_model_path": str(draft_path) if draft_path is not None else None,
        "speculative_num_steps": spec.steps if spec else None,
        "speculative_eagle_topk": spec.topk if spec else None,
        "speculative_num_draft_tokens": spec.num_draft_tokens if spec else None,
        "exact_ancestor_attention": exact_ancestor_attention,
        "enable_return_hidden_states": return_hidden_states,
        "enable_return_aux_hidden_states": aux_hidden_state_layer_ids is not None,
        "return_aux_hidden_state_layer_ids": list(aux_hidden_state_layer_ids) if aux_hidden_state_layer_ids is not None else None,
        "dtype": dtype,
        "device": device,
        "torch_num_threads": torch.get_num_threads(),
    }
    cfg = text_config(target.config)
    vl = None
    if kind != "causal_lm":
        vl = (load_image_processor(target_path, image_min_pixels, image_max_pixels), vl_info(target.config))
    return LoadedModel(engine, tokenizer, info, eos, cfg.vocab_size, getattr(cfg, "max_position_embeddings", None),
                       hidden, vl)


# ---- one request -----------------------------------------------------------------------------------


@dataclass
class Job:
    """A generation request queued for the engine thread; its events come back on `events`:
    ("tokens", [ids]) per committed group, then ("done", stats) or ("error", message).
    A hidden-states request has `batch` (the prompts of one forward); it ends with
    ("done", [(rows [S, D] float32, next token)]) per prompt."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    stop_token_ids: list[int] | None  # None: no stop (ignore_eos)
    seed: int | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.perf_counter)
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: bool = False
    batch: list[list[int]] | None = None
    images: dict | None = None  # {"pixel_values", "image_grid_thw"} of a vision-language prompt


class _Cancelled(Exception):
    pass


class EngineWorker:
    """The one thread that loads the model and runs the engine, one job at a time (FIFO)."""

    def __init__(self, loader: Callable[[], LoadedModel]):
        self.loader = loader
        self.model: LoadedModel | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.jobs: "queue.Queue[Job | None]" = queue.Queue()
        self.lock = threading.Lock()
        self.num_requests = 0
        self.spec_rounds = 0  # verify rounds, all requests since start
        self.spec_round_tokens = 0  # tokens those rounds produced (accepted drafts + bonus)
        self.thread = threading.Thread(target=self._main, name="specforge-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        self.jobs.put(None)

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def _main(self):
        try:
            self.model = self.loader()
        except BaseException as e:  # reported by /health and every request
            self.load_error = f"{type(e).__name__}: {e}"
            log.exception("loading the model failed")
            return
        self.ready.set()
        log.info("model ready: %s", self.model.info)
        while (job := self.jobs.get()) is not None:
            if job.cancelled:
                continue
            try:
                self._run(job)
            except _Cancelled:
                log.info("request %s cancelled (client gone)", job.rid)
            except Exception as e:
                log.exception("request %s failed", job.rid)
                job.events.put(("error", f"{type(e).__name__}: {e}"))

    def _run(self, job: Job):
        import torch

        engine = self.model.engine

        def on_tokens(tokens):
            if job.cancelled:
                raise _Cancelled()
            job.events.put(("tokens", list(tokens)))

        generator = None
        if job.temperature > 0 and job.seed is not None:
            generator = torch.Generator(device=engine.device).manual_seed(int(job.seed))
        if job.batch is not None:
            return self._hidden_states(job, generator)
        generate = engine.generate if engine.draft is not None else engine.generate_base
        _, stats = generate(job.input_ids, job.max_new_tokens, temperature=job.temperature,
                            eos_token_id=job.stop_token_ids, generator=generator, on_tokens=on_tokens,
                            images=job.images)
        with self.lock:
            self.num_requests += 1
            self.spec_rounds += stats.spec_verify_ct
            self.spec_round_tokens += sum(a + 1 for a in stats.accepted_drafts)
        job.events.put(("done", stats))

    def _hidden_states(self, job: Job, generator):
        """One padded prefill over job.batch: the rows SGLang would return, and one sampled token."""
        import torch

        from specforge.engine.speculative import sample_token

        extractor = self.model.hidden_state_extractor
        head = extractor.model.get_output_embeddings()
        results = []
        for aux, last in extractor.forward(job.batch):
            with torch.inference_mode():
                logits = head(last[-1].to(head.weight.device, head.weight.dtype)).float()
            token = int(sample_token(logits, job.temperature, generator))
            results.append((aux if extractor.aux_layer_ids else last, token))
        with self.lock:
            self.num_requests += len(job.batch)
        job.events.put(("done", results))

    def internal_state(self) -> dict:
        with self.lock:
            state = {"num_finished_requests": self.num_requests, "queued_requests": self.jobs.qsize()}
            if self.model is not None and self.model.engine.draft is not None and self.spec_rounds:
                state["avg_spec_accept_length"] = self.spec_round_tokens / self.spec_rounds
        return state


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


class _TextDeltas:
    """Incremental detokenization: the text so far, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sent = tokenizer, ""

    def full(self, ids) -> str:
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
    server: "_HTTPServer"

    def log_message(self, fmt, *args):
        log.debug("%s - %s", self.address_string(), fmt % args)

    # -- plumbing
    def _send_json(self, obj, status=HTTPStatus.OK):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_error(self, status, message):
        self._send_json({"error": {"message": message, "code": int(status)}}, status)

    def _start_stream(self):
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

    def _read_json(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as e:
            raise RequestError(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the JSON body must be an object")
        return body

    # -- routes
    def do_GET(self):
        worker = self.server.worker
        path = self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            if worker.ready.is_set():
                return self._send_json({"status": "ok"})
            status = "loading" if worker.load_error is None else f"failed: {worker.load_error}"
            return self._send_json({"status": status}, HTTPStatus.SERVICE_UNAVAILABLE)
        if path in ("/server_info", "/get_server_info"):
            info = dict(worker.model.info) if worker.model else {}
            info.update(host=self.server.server_address[0], port=self.server.server_address[1],
                        internal_states=[worker.internal_state()],
                        version=_version(), frontend="specforge-embedded")
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
        path = self.path.split("?")[0]
        routes = {"/generate": self._generate, "/v1/completions": self._completions}
        if path not in routes:
            return self._send_error(HTTPStatus.NOT_FOUND, f"no route POST {path}")
        try:
            body = self._read_json()
            worker = self.server.worker
            if not worker.ready.is_set():
                msg = "model is loading" if worker.load_error is None else f"model failed to load: {worker.load_error}"
                return self._send_error(HTTPStatus.SERVICE_UNAVAILABLE, msg)
            routes[path](body)
        except RequestError as e:
            self._send_error(HTTPStatus.BAD_REQUEST, str(e))
        except (BrokenPipeError, ConnectionResetError):
            pass

    # -- request -> job
    def _job(self, prompt, params: dict, ignore_eos: bool, seed) -> Job:
        model = self.server.worker.model
        if isinstance(prompt, str):
            ids = model.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
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
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise RequestError(f"temperature must be a number >= 0, got {temperature!r}")
        for key, neutral in NEUTRAL_SAMPLING.items():
            if params.get(key, neutral) != neutral:
                raise RequestError(f"{key}={params[key]!r} is not supported by the embedded engine "
                                   f"(only {neutral!r})")
        # As SGLang: ignore_eos drops the eos ids, explicit stop_token_ids still stop.
        stop = ([] if ignore_eos else list(model.eos_token_ids)) + [int(t) for t in params.get("stop_token_ids") or []]
        return Job(ids, max_new, float(temperature), stop or None, seed)

    def _attach_images(self, job: Job, image_data) -> None:
        """SGLang's `image_data` (one local path per image placeholder of the prompt, in order):
        the placeholders expanded to the images' token counts, the pixels kept for the prefill."""
        from specforge.data.vl_render import prompt_with_images

        model = self.server.worker.model
        if model.vl is None:
            raise RequestError("image_data needs a vision-language target; this server serves a text model")
        paths = [image_data] if isinstance(image_data, str) else image_data
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise RequestError("image_data must be an image path or a list of image paths")
        if any(p.startswith(("http://", "https://", "data:")) for p in paths):
            raise RequestError("image_data: the embedded server reads local image files only (no URLs or base64)")
        try:
            ids, images = prompt_with_images(job.input_ids, paths, *model.vl)
        except (OSError, ValueError) as e:
            raise RequestError(f"image_data: {e}") from None
        self._check_context(len(ids), job.max_new_tokens, "prompt with images")
        job.input_ids, job.images = ids, images

    def _check_context(self, prompt_tokens: int, max_new: int, what: str) -> None:
        limit = self.server.worker.model.max_context
        if limit and prompt_tokens + max_new > limit:
            raise RequestError(f"{what} ({prompt_tokens} tokens) + max_new_tokens ({max_new}) exceeds the "
                               f"model's context length {limit}")

    def _wait_events(self, job: Job):
        """Yield ("tokens", ids) ... then ("done", stats); raise on errors. Token groups that
        queued up while the client was being written to are merged into one chunk."""
        while True:
            kind, value = job.events.get()
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
        sp = dict(body.get("sampling_params") or {})
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
        model = self.server.worker.model
        text = _TextDeltas(model.tokenizer)

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
        model = self.server.worker.model
        name = self.server.model_name
        created = int(time.time())
        rid = f"cmpl-{job.rid}"
        text = _TextDeltas(model.tokenizer)
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


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    worker: EngineWorker
    model_name: str

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):  # a client went away
            return
        log.exception("error while serving %s", client_address)


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"specforge-eagle3 {version('specforge-eagle3')}"
    except Exception:
        return "specforge-eagle3"


class EmbeddedServer:
    """The HTTP server and its engine thread. `loader` builds the LoadedModel in the engine
    thread, after the port is open (so /health answers 503 meanwhile). Use as a context manager
    or call start() / close(). port=0 picks a free port."""

    def __init__(self, loader: Callable[[], LoadedModel], *, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "default"):
        self.worker = EngineWorker(loader)
        self.httpd = _HTTPServer((host, port), Handler)
        self.httpd.worker = self.worker
        self.httpd.model_name = model_name
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="specforge-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "EmbeddedServer":
        self._thread.start()
        self.worker.start()
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> "EmbeddedServer":
        deadline = time.monotonic() + timeout_s
        while not self.worker.ready.wait(0.1):
            if self.worker.load_error is not None:
                raise RuntimeError(f"the model failed to load: {self.worker.load_error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the model did not load within {timeout_s:.0f} s")
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.worker.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


# ---- command line ----------------------------------------------------------------------------------


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", "--model-path", dest="target", required=True, help="target model directory")
    p.add_argument("--draft", "--speculative-draft-model-path", dest="draft", default=None,
                   help="EAGLE3 draft checkpoint directory (omit to serve the base model)")
    p.add_argument("--tree", default="8_2_16", help="draft tree T_K_N (steps_topk_drafttokens)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--exact-ancestor-attention", action="store_true",
                   help="draft beams attend to their real ancestors (default: SGLang's lanes)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--image-min-pixels", type=int, default=None,
                   help="vision-language targets: resize images to at least this many pixels (data.image_min_pixels)")
    p.add_argument("--image-max-pixels", type=int, default=None,
                   help="vision-language targets: resize images to at most this many pixels (data.image_max_pixels)")
    p.add_argument("--enable-return-hidden-states", action="store_true",
                   help="answer /generate requests with return_hidden_states (prefill rows, as SGLang)")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true",
                   help="return the aux layers' outputs (concatenated) in place of the final state")
    p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+", default=None,
                   help="decoder layers whose outputs are the aux hidden states (with the flag above)")
    p.add_argument("--log-level", default="info")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def serve(args: argparse.Namespace) -> None:
    """Run until SIGINT/SIGTERM; exit non-zero when the model cannot be loaded."""
    import signal

    from specforge.engine.tree import TreeSpec

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for path in (args.target, args.draft):
        if path is not None and not Path(path).is_dir():
            raise SystemExit(f"serve: {path} is not a directory")
    if args.draft:
        TreeSpec.parse(args.tree)  # a bad tree fails before anything loads
    aux_ids = None
    if args.enable_return_aux_hidden_states or args.return_aux_hidden_state_layer_ids:
        if not (args.enable_return_aux_hidden_states and args.return_aux_hidden_state_layer_ids
                and args.enable_return_hidden_states):
            raise SystemExit("serve: aux hidden states need --enable-return-hidden-states, "
                             "--enable-return-aux-hidden-states and --return-aux-hidden-state-layer-ids")
        aux_ids = args.return_aux_hidden_state_layer_ids
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    def loader():
        return load_model(args.target, args.draft, args.tree if args.draft else None, dtype=args.dtype,
                          device=args.device, exact_ancestor_attention=args.exact_ancestor_attention,
                          return_hidden_states=args.enable_return_hidden_states, aux_hidden_state_layer_ids=aux_ids,
                          image_min_pixels=args.image_min_pixels, image_max_pixels=args.image_max_pixels)

    name = args.served_model_name or Path(args.target).name
    try:
        server = EmbeddedServer(loader, host=args.host, port=args.port, model_name=name)
    except OSError as e:
        raise SystemExit(f"serve: cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    signal.signal(signal.SIGTERM, _interrupt)
    log.info("serving %s%s on %s", args.target, f" + {args.draft} ({args.tree})" if args.draft else "", server.url)
    server.start()
    try:
        while server.worker.load_error is None:
            time.sleep(0.5)
        raise SystemExit(f"serve: the model failed to load: {server.worker.load_error}")
    except KeyboardInterrupt:
        log.info("shutting down")
    finally:
        server.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="specforge serve", description=__doc__.split("\n")[0])
    add_serve_args(p)
    serve(p.parse_args(argv))


if __name__ == "__main__":
    main()
