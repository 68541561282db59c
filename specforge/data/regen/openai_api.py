"""Regeneration through OpenAI-compatible servers (SGLang, vLLM): POST /v1/chat/completions.

Standard library HTTP in a thread pool: `concurrency` conversations in flight, each replayed turn
by turn; requests go round-robin over the URLs and a retry moves on to the next URL, with the key
of $SPECFORGE_API_KEY (the servers' --api-key) as a Bearer token. Connection errors, timeouts, 429
and 5xx are retried with exponential backoff; other 4xx are not (asking again gives the same
answer). 401, 403 and 404 say the server or model is wrong, not the conversation: the run stops.
So does a streak of rejected conversations, none of which is kept: the next run asks them again.
A 400 saying the prompt and max_tokens pass the context is the conversation's own (regen_prompt_too_long).
An answer is finished when its finish_reason says so (stop, tool_calls); length and vLLM's repetition
(a loop it cut) are truncated; any other (abort, error, none) is the server's failure, retried as a 5xx.

A server renders the prompt with its own chat template. Given the target's (`prompts`), the first
prompt each server answers is checked: as many prompt tokens there (OpenAI's usage) as here, or the
run stops before any of that server's answers is kept, naming the difference. Images count only
there, so a prompt with images is checked by asking its text alone once more (one token answered).
"""
from __future__ import annotations

import http.client
import itertools
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, Iterator

from specforge.data.formats import REASONING_KEYS, tools_entry, with_reasoning
from specforge.data.regen.prompt import PromptRenderer
from specforge.data.regen.replay import Answer, RegenFailure, Replay
from specforge.data.template import THINKING_SWITCH
from specforge.errors import InvalidInput, SpecForgeWarning
from specforge.launch.process import api_key_from_env, auth_headers
from specforge.utils.images import as_data_uri
from specforge.utils.io import fingerprint

RETRIES = 3  # after the first attempt; backoff 0.5 s, 1 s, 2 s
BACKOFF_S = 0.5
REQUEST_TIMEOUT_S = 600.0  # a long answer on a busy server takes minutes
PROBE_TIMEOUT_S = 10.0
# Failures that are the conversation's own now and then, but the server's when they come in a streak
# (an option it does not take, an endpoint that answers something else than a chat completion).
SERVER_WIDE = ("regen_request_rejected", "regen_bad_response")
# vLLM's and SGLang's words for a prompt that leaves no room for max_tokens: that conversation's, not the server's
TOO_LONG = re.compile(r"context length|maximum model length|is too long", re.IGNORECASE)
FINISHED = ("stop", "tool_calls")
CUT = ("length", "repetition")  # max_tokens, or vLLM's repetition detection: an answer the target did not end
NEEDS_KEY = "the server wants an API key; set SPECFORGE_API_KEY to its --api-key"  # its answer to 401 / 403
TRANSPORT_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout, http.client.HTTPException)


def normalise_url(url: str) -> str:
    """'http://host:30000', '.../' and '.../v1' all name the same server."""
    url = str(url).strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"data.regenerate.urls: {url!r} is not an http(s) URL")
    return url[:-3] if url.endswith("/v1") else url


def _excerpt(err: urllib.error.HTTPError) -> str:
    try:
        return err.read(300).decode("utf-8", "replace").strip()
    except Exception:  # the body is only a hint for the message
        return ""


class OpenAIBackend:
    name = "openai"

    def __init__(self, cfg, seed: int = 0, retries: int = RETRIES, backoff_s: float = BACKOFF_S,
                 prompts: PromptRenderer | None = None) -> None:
        if not cfg.urls:
            raise ValueError("data.regenerate.urls: empty; the openai backend needs at least one server URL "
                             "(e.g. http://127.0.0.1:30000)")
        self.cfg, self.seed, self.retries, self.backoff_s = cfg, seed, retries, backoff_s
        self.concurrency = max(1, int(cfg.concurrency))
        self.auth = auth_headers(api_key_from_env())
        self.urls, served = self._probe([normalise_url(u) for u in cfg.urls])
        self.model = cfg.model or (served[0] if served else None)
        if self.model is None:
            raise ValueError(f"data.regenerate.model: not set and {self.urls[0]}/v1/models lists no model")
        if served and self.model not in served:
            warnings.warn(f"data.regenerate.model={self.model!r} is not among the served models {served}",
                          category=SpecForgeWarning, stacklevel=2)
        self._turn = itertools.count()  # round-robin position (next() on a count is atomic in CPython)
        self.prompts = prompts
        self._renders_alike: set[str] = set()  # servers whose prompt tokens matched ours once
        self._unprobed: set[str] = set()  # servers that did not answer a prompt's text alone
        self._mismatch: InvalidInput | None = None
        self._check_lock = threading.Lock()

    def _probe(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """(URLs that answer, model ids they serve). Any HTTP answer counts as alive; if none
        answers, fail now with every URL and its error rather than after thousands of retries."""
        alive, served, dead = [], [], []
        for url in urls:
            try:
                req = urllib.request.Request(f"{url}/v1/models", headers=self.auth)
                with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):
                    raise InvalidInput(f"data.regenerate.urls: {url}/v1/models: HTTP {e.code}: {NEEDS_KEY}") from None
                alive.append(url)
                continue
            except TRANSPORT_ERRORS as e:
                dead.append(f"{url} ({getattr(e, 'reason', None) or e})")
                continue
            alive.append(url)
            try:
                listed = json.loads(raw).get("data") or []
            except (ValueError, AttributeError):
                listed = []
            served += [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if not alive:
            raise ConnectionError("data.regenerate.urls: no OpenAI-compatible server answers at " + ", ".join(dead))
        for d in dead:
            warnings.warn(f"data.regenerate.urls: {d} does not answer; using the others", category=SpecForgeWarning,
                          stacklevel=3)
        return alive, served

    def run(self, replays: list[Replay], on_answer: Callable[[int], None] | None = None) -> Iterator[Replay]:
        """Yield conversations as they finish; `on_answer(tokens)` is called after every answered
        turn, from the worker threads. Stops with ConnectionError when the servers stop answering
        (a streak of conversations failing transiently), and with InvalidInput when they reject
        conversation after conversation (a streak of rejections, held back until one goes through,
        so that none of a streak is kept as done); what finished is kept."""
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="regen")
        todo = iter(replays)
        running: set = set()
        streak, give_up = 0, max(8, 2 * self.concurrency)
        rejected: list[Replay] = []  # rejected in a row: theirs, or the servers' (then never kept)
        try:
            while True:
                while len(running) < self.concurrency and (r := next(todo, None)) is not None:
                    running.add(pool.submit(self._replay, r, on_answer))
                if not running:
                    yield from rejected  # fewer than a streak: kept with their original answers, counted
                    return
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                if self._mismatch is not None:  # nothing of this batch is kept: it may be that server's
                    raise self._mismatch
                for fut in finished:
                    r = fut.result()
                    if r.failure is not None and r.failure.code in SERVER_WIDE:
                        rejected.append(r)
                        if len(rejected) >= give_up:
                            raise _rejected_all(rejected)
                        continue
                    yield from rejected  # another conversation went through: the rejections were theirs
                    rejected.clear()
                    yield r
                    streak = streak + 1 if r.failure is not None and r.failure.transient else 0
                    if streak >= give_up:
                        raise ConnectionError(
                            f"data.regenerate: the last {streak} conversations all failed to reach "
                            f"{', '.join(self.urls)}; last error: {r.failure.detail}. Finished results are "
                            "kept; run again to resume")
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _replay(self, r: Replay, on_answer: Callable[[int], None] | None) -> Replay:
        while (messages := r.prompt()) is not None:
            try:
                answer = self._ask(messages, r.key, r.turns, r.tools)
            except RegenFailure as e:
                r.fail(e)
                continue
            r.answer(answer)
            if on_answer is not None:
                on_answer(answer.tokens)
        return r

    def _body(self, messages: list[dict], tools: list[dict] | None, seed: int, max_tokens: int) -> bytes:
        return json.dumps({
            "model": self.model,
            "messages": _openai_messages(messages),
            **tools_entry(tools),  # the server's default tool_choice: a call back is kept_original
            "temperature": float(self.cfg.temperature),
            "max_tokens": max_tokens,
            "seed": seed,
            "chat_template_kwargs": {THINKING_SWITCH: bool(self.cfg.thinking)},
        }).encode()

    def _ask(self, messages: list[dict], key: str, turn: int, tools: list[dict] | None = None) -> Answer:
        seed = int(fingerprint(self.seed, key, turn), 16) % (2**31)  # reproducible sampling
        body = self._body(messages, tools, seed, int(self.cfg.max_new_tokens))
        last = ""
        for attempt in range(self.retries + 1):
            url = self.urls[next(self._turn) % len(self.urls)]
            try:
                answer = self._post(url, body)
                self._check_rendering(url, messages, tools, answer.prompt_tokens)
                return answer
            except urllib.error.HTTPError as e:
                last = f"{url}/v1/chat/completions: HTTP {e.code} {_excerpt(e)}".rstrip()
                if e.code in (401, 403):
                    raise InvalidInput(f"data.regenerate: {last}: {NEEDS_KEY}. Finished results are kept; run again "
                                       "to resume") from None
                if e.code == 404:
                    raise InvalidInput(f"data.regenerate: {last}: no such model or route there; check "
                                       f"data.regenerate.model ({self.model!r}) and that the URL is an "
                                       "OpenAI-compatible server. Finished results are kept; run again to resume"
                                       ) from None
                if e.code != 429 and e.code < 500:
                    raise RegenFailure("regen_prompt_too_long" if TOO_LONG.search(last) else "regen_request_rejected",
                                       last) from None
            except TRANSPORT_ERRORS as e:
                last = f"{url}/v1/chat/completions: {getattr(e, 'reason', None) or e!r}"
            except RegenFailure as e:  # answered, but not finished (aborted): asked again as after a 5xx
                if not e.transient:
                    raise
                last = e.detail
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise RegenFailure("regen_server_error", f"{self.retries + 1} attempts failed; last: {last}", transient=True)

    def _check_rendering(self, url: str, messages: list[dict], tools: list[dict] | None, served: int | None) -> None:
        """Until `url` has once counted a prompt as we do: the same count, or stop the run. One
        thread at a time (a few times per run): the tokenizer is not shared across threads."""
        if self.prompts is None or served is None:
            return
        with self._check_lock:
            if url in self._renders_alike or self._mismatch is not None:
                return
            if any(not isinstance(m["content"], str) for m in messages):  # images: the server counts them alone
                if url in self._unprobed:
                    return  # a later text prompt may still check it
                messages = [{**m, "content": _text_of(m["content"])} for m in messages]
                if (served := self._prompt_tokens(url, messages, tools)) is None:
                    self._unprobed.add(url)
                    warnings.warn(f"data.regenerate: {url} did not answer a prompt's text without its images, so "
                                  "its chat template is not checked against the target's until it answers a text "
                                  "prompt", category=SpecForgeWarning, stacklevel=2)
                    return
            ours = len(self.prompts.ids(messages, tools))
            if ours == served:
                self._renders_alike.add(url)
                return
            self._mismatch = InvalidInput(
                f"data.regenerate: {url} renders the prompts otherwise than the target: a prompt of {ours} tokens "
                f"with {self.prompts.source} is {served} tokens there, so its answers would answer other prompts "
                "than the draft is trained on. Start the server with this template (SGLang's and vLLM's "
                "--chat-template FILE, as target.chat_template names it) and the same model, or name the server's model "
                "(data.regenerate.model); the answers of servers that matched are kept, run again to go on "
                "(data.regenerate.check_template=false skips this check)")
        raise self._mismatch

    def _post(self, url: str, body: bytes) -> Answer:
        """One chat completion of `url` (an HTTP or transport error, or no completion, raises)."""
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", **self.auth})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return _parse(resp.read(), url)

    def _prompt_tokens(self, url: str, messages: list[dict], tools: list[dict] | None) -> int | None:
        """`url`'s count of this prompt's tokens, asked for one answered token (None: no answer)."""
        try:
            return self._post(url, self._body(messages, tools, 0, 1)).prompt_tokens
        except (urllib.error.HTTPError, RegenFailure, *TRANSPORT_ERRORS):
            return None


def _rejected_all(rejected: list[Replay]) -> InvalidInput:
    return InvalidInput(f"data.regenerate: the servers rejected the last {len(rejected)} conversations in a row "
                        f"(or answered them with no chat completion); last: {rejected[-1].failure.reason}. None of "
                        "them is kept; check the servers' options (data.regenerate.model, --chat-template, the "
                        "context length) and that data.regenerate.urls are OpenAI-compatible servers, and run again "
                        "to resume")


def _text_of(content: str | list) -> str:
    """A message's text without its images (their parts' texts, as chat templates join them)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p.get("type") == "text")


def _openai_messages(messages: list[dict]) -> list[dict]:
    """Our messages as OpenAI's API takes them: a call's arguments as JSON text, each call with an id
    and each tool result with the id of the call it answers (in order) where the data had none."""
    out, pending = [], []  # ids of the last assistant turn's calls, for results without one
    for i, m in enumerate(messages):
        wire = {"role": m["role"], "content": _openai_content(m["content"])}
        if m.get("tool_calls"):
            wire["tool_calls"] = [{"id": c.get("id") or f"call_{i}_{j}", "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                for j, c in enumerate(m["tool_calls"])]
            pending = [c["id"] for c in wire["tool_calls"]]
        if m["role"] == "tool":
            wire["tool_call_id"] = m.get("tool_call_id") or (pending.pop(0) if pending else f"call_{i}")
            if m.get("name"):
                wire["name"] = m["name"]
        out.append(wire)
    return out


def _openai_content(content: str | list) -> str | list:
    """Our parts ({"type": "text"|"image"}) in the OpenAI spelling; an image file as a data URI (a URL
    as given)."""
    if isinstance(content, str):
        return content
    return [p if p.get("type") == "text" else {"type": "image_url", "image_url": {"url": as_data_uri(p["image"])}}
            for p in content]


def _parse(raw: bytes, url: str) -> Answer:
    try:
        data = json.loads(raw)
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = next((message[k] for k in REASONING_KEYS if isinstance(message.get(k), str) and message[k]), None)
        finish = choice.get("finish_reason")
        calls = [c["function"]["name"] for c in message.get("tool_calls") or ()]
        usage = data.get("usage") or {}
        tokens = int(usage.get("completion_tokens") or 0)
        prompt_tokens = int(usage["prompt_tokens"]) if usage.get("prompt_tokens") is not None else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise RegenFailure("regen_bad_response",
                           f"{url}/v1/chat/completions: not a chat completion ({type(e).__name__}: {e})") from None
    if calls:  # its parser took the answer for calls; the results recorded after them are not theirs
        raise RegenFailure("regen_tool_call", f"{url}/v1/chat/completions: the target called {', '.join(calls)} "
                                              "where the conversation answers")
    if finish not in FINISHED + CUT:  # SGLang answers an aborted request 200, with what it had decoded
        raise RegenFailure("regen_server_error", f"{url}/v1/chat/completions: finish_reason {finish!r}: the server "
                                                 "did not finish the answer", transient=True)
    return Answer(text=with_reasoning(content, reasoning), tokens=tokens, truncated=finish in CUT,
                  prompt_tokens=prompt_tokens)
