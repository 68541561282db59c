"""Batched decoding with refill: a finished sequence's row is handed to the next prompt.

`transformers`' `generate` decodes a batch until its longest answer ends, so every row that
stopped early, and every follow-up turn asked in a later, smaller batch, costs a full decode
step for nothing; its continuous-batching API (`generate_batch`) ran at less than half of
`generate`'s speed on a 2-core CPU (paged eager attention). Here the batch changes between steps instead: waiting
prompts are prefilled together into the rows of finished answers, their keys right-aligned at
the end of the shared cache, and a 2D attention mask per row and per-row positions say which
cache columns are whose (as the left padding of `generate`'s batch does). A prefix the joining
prompts share, such as a system prompt, is prefilled once.

Which prompts share a step depends only on the prompts and on the tokens generated, never on
timing: the same requests give the same answers on the same machine.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specforge.targets.loader import last_position, with_cache


@dataclass
class Request:
    ids: list[int]  # the prompt's token ids
    tag: object  # the caller's handle, given back with the answer
    seed: int = 0  # this request's sampling seed (unused when greedy)


@dataclass
class _Row:
    request: Request
    position: int  # the position id of the next token this row feeds
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


# generation_config fields `generate` would turn into logit shaping that the decoder does not
# apply, with their neutral values; a field set otherwise is refused, not silently dropped.
UNAPPLIED = {"no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0,
             "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
             "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
             "encoder_repetition_penalty": 1.0, "guidance_scale": 1.0, "num_beams": 1}
UNAPPLIED_WHEN_SAMPLING = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


def unapplied_settings(generation_config, temperature: float) -> dict:
    """The fields of UNAPPLIED (and, when sampling, UNAPPLIED_WHEN_SAMPLING) set to a value that
    would change what `generate` says."""
    fields = {**UNAPPLIED, **(UNAPPLIED_WHEN_SAMPLING if temperature > 0 else {})}
    found = {}
    for name, neutral in fields.items():
        value = getattr(generation_config, name, None)
        if value is None or value == neutral or (isinstance(value, (list, dict)) and not value):
            continue
        found[name] = value
    return found


def logits_processors(generation_config, temperature: float, source: str = "the target") -> LogitsProcessorList:
    """The target's own logit shaping, as `generate` applies it: a repetition penalty always,
    temperature/top-k/top-p only when sampling (temperature > 0). Any other shaping the
    generation_config asks for is refused with the fields named (`source`: where it was read)."""
    unapplied = unapplied_settings(generation_config, temperature)
    if unapplied:
        listed = ", ".join(f"{k}={v!r}" for k, v in unapplied.items())
        raise ValueError(f"{source}: its generation_config sets {listed}, which the embedded regeneration does "
                         "not apply (it applies repetition_penalty, and temperature/top_k/top_p when sampling); "
                         "regenerate through a server that applies them (data.regenerate.backend=openai, e.g. "
                         "SGLang) or remove them from the target's generation_config.json")
    procs = LogitsProcessorList()
    penalty = getattr(generation_config, "repetition_penalty", None)
    if penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(float(penalty)))
    if temperature > 0:
        procs.append(TemperatureLogitsWarper(float(temperature)))
        top_k = getattr(generation_config, "top_k", None)
        if top_k:
            procs.append(TopKLogitsWarper(int(top_k)))
        top_p = getattr(generation_config, "top_p", None)
        if top_p is not None and top_p < 1.0:
            procs.append(TopPLogitsWarper(float(top_p)))
    return procs


# A prefix shorter than this is prefilled with each prompt rather than once for all.
MIN_SHARED_PREFIX = 16


class RefillDecoder:
    """Decode many prompts with at most `batch_size` rows in flight.

    `run(requests, done)`: `done(request, tokens, truncated)` is called as each answer ends
    (`tokens` without the stop token) and returns follow-up requests, which are asked before the
    remaining ones (a multi-turn conversation finishes without waiting for the whole queue).

    A finished row stays in the batch, its output ignored, until enough rows are free to prefill
    a few waiting prompts together into their slots: copying the cache on every finished answer
    would cost more than decoding a few idle rows."""

    def __init__(self, model, *, batch_size: int, max_new_tokens: int, stop_ids: Iterable[int], pad_id: int,
                 temperature: float = 0.0) -> None:
        self.model, self.batch_size, self.max_new_tokens = model, max(1, int(batch_size)), int(max_new_tokens)
        self.stop_ids, self.pad_id, self.temperature = set(stop_ids), int(pad_id), float(temperature)
        self.processors = logits_processors(model.generation_config, self.temperature)
        self.device = model.device

    @torch.inference_mode()
    def run(self, requests: Iterable[Request], done: Callable[[Request, list[int], bool], Iterable[Request]]) -> None:
        queue = deque(requests)
        self.slots: list[_Row | None] = []  # one per batch row; None: free
        self.cache = DynamicCache()  # the shared KV cache
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [rows, cache columns]
        last = torch.zeros((0, 1), dtype=torch.long, device=self.device)  # the token each row feeds next
        while queue or any(self.slots):
            live = sum(r is not None for r in self.slots)
            if queue and (live == 0 or self.batch_size - live >= max(1, self.batch_size // 4)):
                # Prefill a few prompts at a time: wide prefill GEMMs, a nearly full decode batch.
                joiners = [queue.popleft() for _ in range(min(self.batch_size - live, len(queue)))]
                asked, first = self._join(joiners)
                if last.shape[0] < len(self.slots):
                    last = torch.cat([last, last.new_zeros(len(self.slots) - last.shape[0], 1)])
                last[asked] = first
            else:
                if not queue and live <= len(self.slots) // 2:
                    last = self._compact(last)  # the queue is empty: idle rows would decode for nothing
                logits = self._step(last)
                asked = [i for i, r in enumerate(self.slots) if r is not None]
                last = self._pick(self.slots, logits, asked, last)
            for i in asked:
                row, token = self.slots[i], int(last[i, 0])
                if token in self.stop_ids:
                    follow = done(row.request, row.tokens, False)
                elif len(row.tokens) + 1 >= self.max_new_tokens:
                    follow = done(row.request, row.tokens + [token], True)
                else:
                    row.tokens.append(token)
                    continue
                self.slots[i] = None
                queue.extendleft(reversed(list(follow)))

    def _step(self, last: torch.Tensor) -> torch.Tensor:
        self._trim()
        positions = torch.tensor([[r.position if r else 0] for r in self.slots], device=self.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.slots), 1)], dim=1)
        out = self.model(input_ids=last, attention_mask=self.mask, position_ids=positions,
                         **with_cache(self.model, self.cache), use_cache=True)
        for row in self.slots:
            if row is not None:
                row.position += 1
        return out.logits[:, -1]

    def _prefill(self, joiners: list[Request]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """(cache, mask, last logits) of `joiners` prefilled together. A prefix they all share
        (a system prompt) is computed once and its keys copied to every row, the rest of each
        prompt left-padded after it: the padding sits between prefix and suffix, masked."""
        shared = 0
        if len(joiners) > 1:
            first, shortest = joiners[0].ids, min(len(r.ids) for r in joiners)
            while shared < shortest - 1 and all(r.ids[shared] == first[shared] for r in joiners):
                shared += 1
            shared = shared if shared >= MIN_SHARED_PREFIX else 0
        cache = DynamicCache()
        if shared:
            prefix = torch.tensor([joiners[0].ids[:shared]], device=self.device)
            self.model(input_ids=prefix, **with_cache(self.model, cache), use_cache=True,
                       logits_to_keep=last_position(prefix))
            cache = DynamicCache([(k.expand(len(joiners), -1, -1, -1), v.expand(len(joiners), -1, -1, -1))
                                  for k, v, _ in cache])
        width = max(len(r.ids) for r in joiners) - shared
        ids = torch.full((len(joiners), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(joiners), width), dtype=torch.long)
        for i, r in enumerate(joiners):
            ids[i, width - len(r.ids) + shared:] = torch.tensor(r.ids[shared:])
            mask[i, width - len(r.ids) + shared:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = shared + (mask.cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([mask.new_ones(len(joiners), shared), mask], dim=1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(self.model, cache),
                         use_cache=True, logits_to_keep=last_position(ids))
        return cache, mask, out.logits[:, -1]

    def _join(self, joiners: list[Request]) -> tuple[list[int], torch.Tensor]:
        """Prefill `joiners` into free slots (new ones past the end), their keys right-aligned at
        the cache's end. Returns their slots and first tokens. Prompts of very different lengths
        (a follow-up carries the answer before it) are prefilled apart: padding is not free."""
        slots, first = [], []
        for chunk in _by_length(joiners):
            fresh, fresh_mask, logits = self._prefill(chunk)
            placed = self._place(chunk, fresh, fresh_mask)
            slots += placed
            first.append(self._pick([self.slots[i] for i in placed], logits, list(range(len(placed))), None))
        return slots, torch.cat(first)

    def _place(self, joiners: list[Request], fresh: DynamicCache, fresh_mask: torch.Tensor) -> list[int]:
        width, length = fresh_mask.shape[1], self.mask.shape[1]
        if width > length:  # make room in front for the longer prompt
            for layer in self.cache.layers:
                layer.keys, layer.values = _left_pad(layer.keys, width - length), _left_pad(layer.values, width - length)
            self.mask = torch.cat([self.mask.new_zeros(len(self.slots), width - length), self.mask], dim=1)
            length = width
        free = [i for i, r in enumerate(self.slots) if r is None][:len(joiners)]
        appended = len(joiners) - len(free)
        slots = free + list(range(len(self.slots), len(self.slots) + appended))
        self.slots += [None] * appended
        for i, r in zip(slots, joiners):
            self.slots[i] = _Row(r, position=len(r.ids), generator=self._generator(r))
        self.mask = torch.cat([self.mask, self.mask.new_zeros(appended, length)])
        self.mask[slots] = 0
        self.mask[slots, length - width:] = fresh_mask
        if not self.cache.layers:
            self.cache = fresh
        else:
            for layer, new in zip(self.cache.layers, fresh.layers):
                for name in ("keys", "values"):
                    x = getattr(layer, name)
                    if appended:
                        x = torch.cat([x, x.new_zeros(appended, *x.shape[1:])])
                    x[slots, :, length - width:] = getattr(new, name)
                    setattr(layer, name, x)
        return slots

    def _trim(self) -> None:
        """Drop the cache's leading columns that no live row attends to any more. Every step
        appends a column for all rows and joiners are placed at the end, so without this the
        cache spans every step since the start: each step would copy it whole (DynamicLayer's
        torch.cat) and attend over it. A view, no copy: the next step's cat makes it contiguous."""
        live = [i for i, r in enumerate(self.slots) if r is not None]
        if not live:
            return
        trim = int(self.mask[live].any(0).long().argmax())  # the first column a live row attends to
        if trim == 0:
            return
        self.mask = self.mask[:, trim:]  # a finished row keeps at least the columns of its last steps
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, trim:], layer.values[:, :, trim:]

    def _compact(self, last: torch.Tensor) -> torch.Tensor:
        """Drop the free rows (the next step's `_trim` drops the columns none of the rest attends to)."""
        keep = [i for i, r in enumerate(self.slots) if r is not None]
        self.slots = [self.slots[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask = self.mask[index]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        return last[index]

    def _generator(self, request: Request) -> torch.Generator | None:
        if self.temperature <= 0:
            return None
        return torch.Generator(device=self.device).manual_seed(request.seed)

    def _pick(self, rows, logits: torch.Tensor, which: list[int], last) -> torch.Tensor:
        """Next tokens [len(rows), 1] for the rows at `which` (argmax, or a sample from the row's
        own generator); other rows keep `last`."""
        logits = logits.float()
        if not self.processors and self.temperature <= 0:
            return logits.argmax(-1, keepdim=True)
        picked = last.clone() if last is not None else torch.zeros((len(rows), 1), dtype=torch.long, device=self.device)
        for i in which:
            row = rows[i]
            seen = torch.tensor([row.request.ids + row.tokens], device=self.device)
            scores = self.processors(seen, logits[i][None])
            if self.temperature <= 0:
                picked[i, 0] = scores.argmax(-1)[0]
            else:
                picked[i, 0] = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=row.generator)[0, 0]
        return picked


def _by_length(requests: list[Request]) -> list[list[Request]]:
    """`requests` in chunks of similar prompt length (shortest first), each padded to at most
    1.25x the tokens it holds."""
    chunks: list[list[Request]] = []
    for r in sorted(requests, key=lambda r: len(r.ids)):
        chunk = chunks[-1] if chunks else None
        if chunk and (len(chunk) + 1) * len(r.ids) <= 1.25 * (sum(len(q.ids) for q in chunk) + len(r.ids)):
            chunk.append(r)
        else:
            chunks.append([r])
    return chunks


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` [batch, heads, columns, dim] with `n` zero columns in front."""
    if n == 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:2], n, x.shape[3]), x], dim=2)
