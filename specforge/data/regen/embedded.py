"""Regeneration with the target loaded in-process through transformers.

Conversations are taken in groups of GROUP_BATCHES x `batch_size`; a group's turns are decoded
by a RefillDecoder with `batch_size` rows in flight, a conversation's next turn asked as soon as
its previous answer ends. Groups are cut by position in the full input, not among the pending
ones, so a resumed run batches exactly like an uninterrupted one and gives the same answers. The
group with the longest conversation goes first: a batch too large for the GPU's memory fails in
the first minutes rather than hours in (each group decodes alone: their order changes no answer).
An answer that is a tool call, read with transformers' response template for the target (as a
server's tool parser reads it), keeps the row as written, as it does through a server.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Iterator

import torch

from specforge.data.fix.conversations import message_chars
from specforge.data.regen.decode import RefillDecoder, Request, logits_processors
from specforge.data.regen.prompt import target_renderer
from specforge.data.regen.replay import Answer, RegenFailure, Replay
from specforge.utils.io import fingerprint


# Conversations per resume unit, in batches: enough queued prompts to keep the batch full
# until the group's last answers.
GROUP_BATCHES = 4


class EmbeddedBackend:
    name = "embedded"

    def __init__(self, cfg, target_cfg, seed: int = 0, device: str | None = None) -> None:
        from specforge.targets.loader import load_target, resolve_target_path, stop_token_ids, text_config

        if target_cfg is None:
            raise ValueError("data.regenerate.backend=embedded needs a target (target.path)")
        if getattr(target_cfg, "kind", "causal_lm") != "causal_lm":
            raise ValueError(f"data.regenerate.backend=embedded: text targets only (target.kind={target_cfg.kind}); "
                             "regenerate vision-language answers through a server that takes images: "
                             "data.regenerate.backend=openai data.regenerate.urls=[http://127.0.0.1:30000] (SGLang)")
        self.cfg, self.seed = cfg, seed
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.prompts = target_renderer(cfg, target_cfg)
        self.tokenizer = self.prompts.tokenizer
        path = resolve_target_path(target_cfg)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_target(target_cfg, self.device)
        # logit shaping the decoder cannot apply is refused here, before any conversation is asked
        logits_processors(self.model.generation_config, cfg.temperature, source=str(path))
        self.max_positions = getattr(text_config(self.model.config), "max_position_embeddings", None)
        self.stop_ids = set(stop_token_ids(self.model, self.tokenizer))
        self.response_template = response_template(self.tokenizer, self.model)

    def run(self, replays: list[Replay], on_answer: Callable[[int], None] | None = None) -> Iterator[Replay]:
        """Yield each conversation once all its turns are answered (or it failed), a group at a
        time, the longest conversation's group first; `on_answer(tokens)` is called after every
        answered turn."""
        size = GROUP_BATCHES * max(1, int(self.cfg.batch_size))
        groups = [list(members) for _, members in itertools.groupby(replays, key=lambda r: r.index // size)]
        groups.sort(key=lambda group: -max(message_chars(r.source) for r in group))  # the heaviest first
        for members in groups:
            self._run_group(members, on_answer)
            yield from members

    def _run_group(self, group: list[Replay], on_answer: Callable[[int], None] | None) -> None:
        decoder = RefillDecoder(self.model, batch_size=self.cfg.batch_size, max_new_tokens=self.cfg.max_new_tokens,
                                stop_ids=self.stop_ids, pad_id=self.tokenizer.pad_token_id,
                                temperature=self.cfg.temperature)

        def ask(replay: Replay) -> list[Request]:
            """The replay's next turn as a request, or nothing when it is finished (or failed)."""
            messages = replay.prompt()
            if messages is None:
                return []
            try:
                ids = self._prompt_ids(messages, replay.tools)
            except RegenFailure as e:
                replay.fail(e)
                return []
            # One seed per (conversation, turn): the same samples whatever shares the batch.
            seed = int(fingerprint(self.seed, replay.key, replay.turns), 16) % (2**63)
            return [Request(ids, tag=replay, seed=seed)]

        def done(request: Request, tokens: list[int], truncated: bool) -> list[Request]:
            replay = request.tag
            called = self._called_tools(request.ids, tokens, replay.tools)
            if called:  # its own call would not match the results recorded after it
                replay.fail(RegenFailure("regen_tool_call",
                                         f"the target called {called} where the conversation answers"))
                return []
            answer = Answer(text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                            tokens=len(tokens) + (0 if truncated else 1), truncated=truncated)
            replay.answer(answer)
            if on_answer is not None:
                on_answer(answer.tokens)
            return ask(replay)

        decoder.run([q for r in group for q in ask(r)], done)

    def _called_tools(self, prompt_ids: list[int], tokens: list[int], tools: list[dict] | None) -> str | None:
        """The names of the tools an answer calls (a call the parser cannot read: "a tool"), or None."""
        if self.response_template is None:
            return None
        from transformers.utils.chat_parsing import parse_response

        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        try:
            message = parse_response(decode(tokens), self.response_template, prefix=decode(prompt_ids), tools=tools)
        except ValueError:  # a call region whose arguments do not parse (cut by max_new_tokens, say)
            return "a tool"
        calls = message.get("tool_calls") or []
        return ", ".join(str((c.get("function") or {}).get("name", "?")) for c in calls) or None

    def _prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = self.prompts.ids(messages, tools)
        if self.max_positions and len(ids) + self.cfg.max_new_tokens > self.max_positions:
            raise RegenFailure("regen_prompt_too_long", f"{len(ids)} prompt tokens + max_new_tokens "
                               f"{self.cfg.max_new_tokens} > the model's {self.max_positions} positions")
        return ids


def response_template(tokenizer, model) -> dict | None:
    """How the target writes a tool call, as transformers reads it: the tokenizer's own
    `response_template`, else the one `transformers serve` keeps for the model's family (Qwen2/3,
    Qwen3.5, Gemma 4, ...). None where neither exists (or this transformers predates them): answers
    are then kept as generated."""
    try:
        from transformers.cli.serving.utils import get_response_template
    except ImportError:
        return getattr(tokenizer, "response_template", None)
    return get_response_template(tokenizer, model)
