"""One conversation replayed against the target, and what may go wrong with it.

User and system turns are copied; each assistant turn is asked of the target given the
conversation so far, where earlier assistant turns are the target's own (regenerated) answers,
so a follow-up is conditioned on what the target actually said. In an agentic trace the calls
and tool results are kept as written, and the answers after the last of them are asked with the
row's tools in the prompt.

Failure policy (one place, so the report and the docs cannot drift apart):
- the target could not be asked (server down after retries, request rejected, bad response,
  the chat template cannot render the turn, the prompt does not fit the model), or it called a
  tool where the trace answers (a server's parsed `tool_calls`): the sample is
  KEPT WITH ITS ORIGINAL ANSWERS (all of them, so the conversation stays coherent). It is still
  valid training data and an outage must not shrink the dataset; transient failures (connection
  errors, 5xx, 429, an answer the server did not finish) are asked again on the next run.
- the target answered but the answer is unusable: an EMPTY answer (nothing to learn, and an
  empty turn breaks role alternation) or a TRUNCATED one (it hit max_new_tokens: the rendered
  sample would teach an end of turn where the target does not end, and later turns would be
  conditioned on a cut answer): the sample is SKIPPED. Raise max_new_tokens if many are.
"""
from __future__ import annotations

from dataclasses import dataclass

from specforge.data.formats import is_tool_turn, uses_tools
from specforge.utils.io import fingerprint

KEEP_ORIGINAL = ("regen_server_error", "regen_request_rejected", "regen_bad_response",
                 "regen_template_error", "regen_prompt_too_long", "regen_tool_call")
SKIP = ("regen_empty_answer", "regen_truncated")


class RegenFailure(Exception):
    """Why a conversation could not be regenerated; `code` decides what happens to it."""

    def __init__(self, code: str, detail: str, transient: bool = False) -> None:
        if code not in KEEP_ORIGINAL + SKIP:
            raise ValueError(f"unknown regeneration failure code {code!r}")
        super().__init__(f"{code}: {detail}")
        self.code, self.detail, self.transient = code, detail, transient

    @property
    def reason(self) -> str:
        return f"{self.code}: {self.detail}"

    @property
    def action(self) -> str:
        return "kept_original" if self.code in KEEP_ORIGINAL else "skipped"


@dataclass
class Answer:
    text: str
    tokens: int  # generated tokens, end-of-turn token included
    truncated: bool  # stopped by max_new_tokens rather than by an end of turn
    prompt_tokens: int | None = None  # as a server counted the prompt (OpenAI's usage), where it says


def conversation_key(conv: dict) -> str:
    """Identity of a source conversation in the resume log: its id AND its messages (and tools),
    so an edited row with the same id is regenerated instead of reusing a stale answer."""
    return fingerprint(conv["id"], conv["messages"], *([conv["tools"]] if conv.get("tools") else []))


def first_answerable(messages: list[dict], tools=None) -> int:
    """Where the turns the target may answer begin: after the last tool call or result of an agentic
    trace (everything up to it is kept as written: the target's own calls would not match the
    results recorded after them; the answers after it read those results as they are)."""
    if not uses_tools(messages, tools):
        return 0
    return 1 + max((i for i, m in enumerate(messages) if is_tool_turn(m)), default=-1)


def turns_to_answer(messages: list[dict], tools=None) -> int:
    """The assistant turns the target is asked for: those after a user turn (a canned greeting
    before any is copied as it is), from `first_answerable` on."""
    asked, user_seen, start = 0, False, first_answerable(messages, tools)
    for i, message in enumerate(messages):
        user_seen = user_seen or message["role"] == "user"
        asked += i >= start and message["role"] == "assistant" and user_seen
    return asked


class Replay:
    """Walks one conversation turn by turn; backends call `prompt()` then `answer()` or `fail()`."""

    def __init__(self, key: str, index: int, conv: dict, max_new_tokens: int,
                 keep_truncated: bool = False) -> None:
        self.key, self.index, self.id = key, index, conv["id"]
        self.source: list[dict] = conv["messages"]
        self.tools: list[dict] | None = conv.get("tools")  # rendered into every prompt, as in training
        self.max_new_tokens = max_new_tokens
        self.keep_truncated = keep_truncated
        self.pos = first_answerable(self.source, self.tools)  # next source message to copy or answer
        # the new conversation so far: an agentic trace's calls and results as written
        self.messages: list[dict] = list(self.source[: self.pos])
        self.turns = 0  # assistant turns regenerated
        self.asked = turns_to_answer(self.source, self.tools)  # at most this many answers (a failure ends it early)
        self.answers = 0  # answers received, usable or not
        self.tokens = 0
        self.failure: RegenFailure | None = None
        self.unusable: str | None = None  # the empty/truncated answer, kept for the failures file

    def prompt(self) -> list[dict] | None:
        """The messages to answer next (ending before an assistant turn), or None when done.

        An assistant turn with no user turn before it (a canned greeting) is not conditioned on
        anything the target could answer, so it is copied as is."""
        if self.failure is not None:
            return None
        while self.pos < len(self.source):
            msg = self.source[self.pos]
            if msg["role"] == "assistant" and any(m["role"] == "user" for m in self.messages):
                return list(self.messages)
            self.messages.append(msg)
            self.pos += 1
        return None

    def answer(self, answer: Answer) -> None:
        turn = self.turns + 1
        self.answers += 1
        self.tokens += answer.tokens
        if answer.truncated and self.keep_truncated and answer.text.strip():
            # Kept as the last turn: later turns would build on an answer the target never finished.
            self.messages.append({"role": "assistant", "content": answer.text})
            self.pos = len(self.source)
            self.turns += 1
            return
        if not answer.text.strip() or answer.truncated:
            self.unusable = answer.text
        if not answer.text.strip():
            self.fail(RegenFailure("regen_empty_answer", f"assistant turn {turn}: the target answered nothing"))
        elif answer.truncated:
            self.fail(RegenFailure(
                "regen_truncated", f"assistant turn {turn}: the answer hit max_new_tokens={self.max_new_tokens}"))
        else:
            self.messages.append({"role": "assistant", "content": answer.text})
            self.pos += 1
            self.turns += 1

    def fail(self, failure: RegenFailure) -> None:
        self.failure = failure

    def record(self) -> dict:
        """The resume-log line of the finished conversation."""
        if self.failure is None:
            status, messages, failure = ("regenerated" if self.turns else "unchanged"), self.messages, None
        else:
            status = self.failure.action
            messages = self.source if status == "kept_original" else None
            failure = {"reason": self.failure.reason, "transient": self.failure.transient, "answer": self.unusable}
        return {"key": self.key, "id": self.id, "status": status, "messages": messages,
                "turns": self.turns, "tokens": self.tokens, "failure": failure}
