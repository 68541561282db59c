"""EAGLE3 speculative decoding with SGLang's semantics (docs/contract.md §3, §5, §6), batch size 1.

Per round: T draft forwards (the first is the catch-up over the tokens accepted last round, whose
last row gives the level-1 top-K; then T-1 decode steps over K lanes), one tree-masked target
forward over the N nodes, a greedy or sampling walk, and compaction of both KV caches to the
accepted path. The draft at position p consumes (token p+1, target feature of position p), so
the draft's cache always covers exactly the target's committed prefix.

`generate_base` runs the plain target on the same cache machinery, so the two are comparable.

`share_prefix` keeps both caches of a prompt prefix that many requests share (a system prompt),
as SGLang's radix cache does; a request starting with it copies those entries instead of
prefilling them, base and speculative alike.

Every request records where its wall-clock time went (`GenerationStats.phase_s`, see PHASES).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from specforge.engine.few_rows import choose_kernels, few_rows_linears, plain_linears
from specforge.engine.target import TargetRunner
from specforge.engine.tree import Tree, build_tree, first_level, lane_attention_mask, next_level
from specforge.engine.tree_spec import TreeSpec
from specforge.engine.verify import greedy_verify, sampling_verify, target_probs


PHASES = ("prefill", "draft", "verify", "accept", "cache", "decode", "other")
"""Phases of `GenerationStats.phase_s`, in seconds per request:

- prefill: request setup (cache allocation), target prefill + first token, draft prefill
- draft: draft forwards, top-K and tree building (`draft_tree`) and the catch-up forward over the
  accepted tokens (`draft_extend`, whose KV writes are part of the draft forward as the target's
  are part of its verify forward)
- verify: the target's tree-masked forward over the N nodes
- accept: the greedy / sampling walk over the verified tree
- cache: KV compaction of the target to the accepted path (`runner.keep`); the draft needs none:
  its scratch entries past the committed length are overwritten by the next round
- decode: the base model's one-token target forwards
- other: e2e minus all of the above (Python overhead, emitting/streaming tokens, sampling ...)
"""


class PhaseTimer:
    """Charges wall-clock time to phases: `lap(phase)` charges the time since the previous lap (or
    `skip`) to `phase`, `skip()` to nobody (it ends up in `other`). On CUDA a lap synchronizes
    first, so a phase is charged for the kernels it launched; on CPU it is two perf_counter reads."""

    __slots__ = ("phase_s", "t", "sync")

    def __init__(self, phase_s: dict, t0: float, device):
        self.phase_s, self.t = phase_s, t0
        device = torch.device(device)
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None

    def lap(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.phase_s[phase] += now - self.t
        self.t = now

    def skip(self) -> None:
        if self.sync is not None:
            self.sync()
        self.t = time.perf_counter()


@dataclass
class GenerationStats:
    """Per-request figures, named as SGLang names them (docs/contract.md §6). Times in seconds."""

    prompt_tokens: int
    num_draft_tokens: int = 0  # N of the tree (0 for the base model)
    completion_tokens: int = 0
    spec_verify_ct: int = 0  # verify rounds
    accepted_drafts: list = field(default_factory=list)  # per round, drafts committed (bonus excluded)
    prefill_s: float = 0.0  # target prefill + draft prefill
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    token_times_s: list = field(default_factory=list)  # since start, one per completion token
    phase_s: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # see PHASES; sums to e2e_s

    @property
    def accept_length(self) -> float:
        """completion_tokens / spec_verify_ct: counts the bonus and the prefill's first token."""
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else math.nan

    @property
    def round_accept_length(self) -> float:
        """Mean over rounds of accepted drafts + 1 (the server-wide figure of SGLang)."""
        n = len(self.accepted_drafts)
        return (sum(self.accepted_drafts) + n) / n if n else math.nan

    @property
    def accept_rate(self) -> float:
        """Correct drafts / (rounds * (N-1))."""
        slots = self.spec_verify_ct * (self.num_draft_tokens - 1)
        return sum(self.accepted_drafts) / slots if slots > 0 else math.nan

    def accept_histogram(self, steps: int) -> list[int]:
        """How many rounds accepted 0, 1, ..., T drafts."""
        counts = [0] * (steps + 1)
        for a in self.accepted_drafts:
            counts[a] += 1
        return counts

    @property
    def tpot_s(self) -> float:
        """(e2e - ttft) / (completion_tokens - 1), as bench_serving computes it."""
        n = self.completion_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else math.nan

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(accept_length=self.accept_length, round_accept_length=self.round_accept_length,
                 accept_rate=self.accept_rate, tpot_s=self.tpot_s)
        return d


class DraftState(NamedTuple):
    """What the next round's draft starts from: level-1 top-K (probs, target ids) and the
    feature `draft.step` returned at the last committed position (the input feature of the first
    decode step: the pre-norm output, or the post-norm one with EAGLE 3.1's norm_output)."""

    probs: torch.Tensor
    ids: torch.Tensor
    feat: torch.Tensor


class DraftKV:
    """The draft's keys/values [1, kv_heads, capacity, head_dim]; entries past `length` are scratch
    for the current round's draft steps."""

    def __init__(self, kv_heads: int, head_dim: int, dtype, device):
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.length = 0

    def reset(self, capacity: int):
        shape = (1, self.kv_heads, capacity, self.head_dim)
        self.k = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.length = 0

    def past(self, extra: int = 0):
        end = self.length + extra
        return self.k[:, :, :end], self.v[:, :, :end]

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor):
        end = at + k.shape[2]
        if end > self.k.shape[2]:
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty((*old.shape[:2], max(end, 2 * old.shape[2]), old.shape[3]))
                new[:, :, :at] = old[:, :, :at]
                setattr(self, name, new)
        self.k[:, :, at:end] = k
        self.v[:, :, at:end] = v


def _as_prompt(input_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"generate: batch size 1 only, got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("generate: input_ids must be a non-empty sequence of token ids")
    return ids.to(device)


GREEDY_BELOW = 1e-6  # SGLang's sampling epsilon: a temperature under it decodes greedily (1e-39 overflows)


def sample_token(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """Greedy at temperature 0, else a draw from target_probs: the one sampling rule of the engine."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, temperature)
    return torch.multinomial(probs, 1, generator=generator)[0]


class SharedPrefix(NamedTuple):
    """Cache entries of `tokens[:-1]` (the last token is prefilled again by each request: the
    draft's catch-up over the prefix's last position needs its target feature): per target layer
    (keys, values), and the draft's (keys, values) pairing token p+1 with feature p, or None."""

    tokens: torch.Tensor
    target: list
    draft: tuple | None


class _Request:
    """Output tokens, stop conditions and timing of one generate call."""

    def __init__(self, prompt_len, max_new_tokens, eos_token_id, num_draft_tokens, device, on_tokens=None):
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.t0 = time.perf_counter()
        self.max_new = max_new_tokens
        self.eos = set() if eos_token_id is None else set(
            [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        )
        self.tokens: list[int] = []
        self.on_tokens = on_tokens  # streaming: called with each batch of committed tokens
        self.done = False
        self.stats = GenerationStats(prompt_tokens=prompt_len, num_draft_tokens=num_draft_tokens)
        self.timer = PhaseTimer(self.stats.phase_s, self.t0, device)

    def emit(self, tokens: list[int]) -> None:
        """Append tokens up to eos / max_new_tokens (never past them); an exception raised by
        `on_tokens` aborts the request (a client that went away)."""
        before = len(self.tokens)
        for t in tokens[: self.max_new - len(self.tokens)]:
            self.tokens.append(t)
            if t in self.eos:
                break
        self.done = len(self.tokens) >= self.max_new or self.tokens[-1] in self.eos
        now = time.perf_counter() - self.t0
        self.stats.token_times_s += [now] * (len(self.tokens) - len(self.stats.token_times_s))
        if self.on_tokens is not None:
            self.on_tokens(self.tokens[before:])

    def commit_round(self, tokens: list[int]) -> None:
        """One verify round's accepted drafts and bonus, emitted up to eos / max_new_tokens, its drafts
        counted as committed: SGLang cuts a round's accept length where its request finishes, so drafts
        accepted past the end count neither in a request's figures nor in the server's."""
        self.stats.spec_verify_ct += 1
        before = len(self.tokens)
        self.emit(tokens)
        self.stats.accepted_drafts.append(len(self.tokens) - before - 1)

    def first_token_done(self):
        """TTFT covers the whole prefill stage (target and draft), as the server streams it."""
        now = time.perf_counter() - self.t0
        self.stats.prefill_s = self.stats.ttft_s = self.stats.token_times_s[0] = now

    def finish(self, device):
        self.stats.completion_tokens = len(self.tokens)
        self.stats.e2e_s = time.perf_counter() - self.t0
        phases = self.stats.phase_s
        phases["other"] = self.stats.e2e_s - sum(v for k, v in phases.items() if k != "other")
        return torch.tensor(self.tokens, dtype=torch.long, device=device), self.stats


class SpeculativeEngine:
    """Speculative decoding of `target` (a transformers causal LM) with an `Eagle3Draft`.

    `exact_ancestor_attention=False` reproduces SGLang's draft lanes (a lane keeps its own keys of
    the earlier draft steps even after beams are reordered); True makes each beam attend to its
    real ancestors. With `draft=None` only `generate_base` is available.
    """

    def __init__(self, target, draft, tree: TreeSpec | str = "1_1_2",
                 exact_ancestor_attention: bool = False, aux_layer_ids=None):
        self.spec = TreeSpec.parse(tree) if isinstance(tree, str) else tree
        self.exact = exact_ancestor_attention
        self.draft = draft.eval() if draft is not None else None
        if aux_layer_ids is None:
            aux_layer_ids = draft.config.aux_layer_ids if draft is not None else []
        self.runner = TargetRunner(target, list(aux_layer_ids))
        self.prefix: SharedPrefix | None = None  # share_prefix
        if draft is not None:
            if self.spec.topk > draft.config.draft_vocab_size:
                raise ValueError(
                    f"tree {self.spec}: topk exceeds the draft vocab ({draft.config.draft_vocab_size})"
                )
            param = next(draft.parameters())
            self.draft_dtype = param.dtype
            self.draft_linears = plain_linears(draft, subclasses=True)  # few_rows_linears in its forwards
            self.draft_kernels = choose_kernels(self.draft_linears)
            cfg = draft.config
            self.draft_kv = DraftKV(cfg.num_key_value_heads, cfg.head_dim, param.dtype, param.device)
            if self.runner.vl is not None and not draft.uses_mrope:
                raise ValueError("draft: the target uses M-RoPE but the draft config has no rope_scaling.mrope_section")
            # image positions: the target's merged input embeddings (default, as SGLang feeds them)
            # or the draft's own embedding of the placeholder token (config.json "image_embeddings")
            self.merged_image_embeds = cfg.extra.get("image_embeddings", "merged") == "merged"

    @property
    def device(self):
        return self.runner.device

    # ---- draft side -------------------------------------------------------------------------

    def _draft_topk(self, logits: torch.Tensor):
        """Top-K of the draft distribution (plain softmax, as SGLang), as target ids."""
        probs, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.spec.topk, dim=-1)
        return probs, self.draft.to_target_ids(ids)

    @torch.inference_mode()
    def draft_extend(self, tokens: torch.Tensor, aux: torch.Tensor, position_ids=None,
                     input_embeds=None, every_row: bool = False) -> DraftState:
        """Catch up over newly committed positions, pairing (token p+1, target feature p), causal.

        The last row is the draft's first step of the next round: its top-K is level 1
        (`every_row`: the state of every row, [n, K] and [n, H], for the planner). The
        prompt of a vision-language target brings its own M-RoPE `position_ids` [3, n] and
        `input_embeds` [n, H]; later tokens sit at their index + the target's rope delta.
        """
        start, n = self.draft_kv.length, tokens.shape[0]
        if position_ids is None:
            pos = torch.arange(start, start + n, device=tokens.device)[None] + self.runner.rope_delta
        else:
            pos = position_ids[None]
        with few_rows_linears(self.draft_linears, self.draft_kernels):
            feat = self.draft.project(aux.to(self.draft_dtype))[None]
            out, logits, (k, v) = self.draft.step(
                tokens[None], feat, pos, self.draft_kv.past(),
                input_embeds=None if input_embeds is None else input_embeds[None].to(self.draft_dtype))
        self.draft_kv.write(start, k, v)
        self.draft_kv.length = start + n
        rows = slice(None) if every_row else -1
        probs, ids = self._draft_topk(logits[0, rows])
        return DraftState(probs, ids, out[0, rows])

    @torch.inference_mode()
    def draft_tree(self, root: torch.Tensor, state: DraftState) -> Tree:
        """T-1 decode steps over K lanes from the level-1 top-K, then the global top-(N-1)."""
        return build_tree(root, *self.draft_levels(state), self.spec)

    @torch.inference_mode()
    def draft_levels(self, state: DraftState):
        """The T levels of candidates, (score_list, token_list, parents_list) as build_tree takes them.

        All lanes run as one sequence of K tokens at the same position; the mask gives each lane
        the committed prefix, the earlier-step keys it may see (lane_attention_mask) and itself.
        Level d depends on levels < d only, never on T or N: the levels of a shorter T are a
        prefix of these (the planner, specforge/eval/planner.py, relies on it).
        """
        k, steps = self.spec.topk, self.spec.steps
        scores, s0, t0, p0 = first_level(state.probs, state.ids)
        score_list, token_list, parents_list = [s0], [t0], [p0]
        lane_tok, lane_feat = state.ids, state.feat.expand(k, -1)
        lane_mask = lane_attention_mask(None, None, k, self.exact)
        length, device = self.draft_kv.length, state.ids.device
        prefix = torch.ones((k, length), dtype=torch.bool, device=device)
        self_mask = torch.eye(k, dtype=torch.bool, device=device)
        for i in range(1, steps):
            written = (i - 1) * k
            mask = torch.cat([prefix, lane_mask.to(device), self_mask], dim=1)[None]
            pos = torch.full((1, k), length + i - 1 + self.runner.rope_delta, device=device)
            with few_rows_linears(self.draft_linears, self.draft_kernels):
                out, logits, (kk, vv) = self.draft.step(
                    lane_tok[None], lane_feat[None], pos, self.draft_kv.past(written), mask)
            probs, child = self._draft_topk(logits[0])
            flat, flat_tok, scores, sel, parents = next_level(scores, probs, child, i)
            score_list.append(flat)
            token_list.append(flat_tok)
            parents_list.append(parents)
            if i < steps - 1:  # the next step reads this step's keys and beams
                self.draft_kv.write(length + written, kk, vv)
                parent_lane = sel // k
                lane_tok, lane_feat = flat_tok[sel], out[0][parent_lane]
                lane_mask = lane_attention_mask(lane_mask, parent_lane, k, self.exact)
        return score_list, token_list, parents_list

    # ---- generation ---------------------------------------------------------------------------

    def _start(self, input_ids, max_new_tokens, eos_token_id, num_draft_tokens, on_tokens=None):
        """(prompt, request, cached): `cached` leading prompt tokens are in the caches already (the
        shared prefix, restored here, inside the request's time), the rest needs a prefill."""
        prompt = _as_prompt(input_ids, self.device)
        req = _Request(prompt.shape[0], max_new_tokens, eos_token_id, num_draft_tokens, self.device, on_tokens)
        self.reset(prompt.shape[0] + max_new_tokens)
        return prompt, req, self._restore_prefix(prompt, draft=num_draft_tokens > 0)

    @torch.inference_mode()
    def share_prefix(self, input_ids) -> int:
        """Keep the caches of `input_ids` (>= 2 tokens, text only) for every later request whose
        prompt starts with them; returns the tokens a request then skips (len - 1). Computed by
        the same prefill as a request's, so the restored entries are what that request would
        have written. `share_prefix(None)` forgets it."""
        if input_ids is None:
            self.prefix = None
            return 0
        ids = _as_prompt(input_ids, self.device)
        if ids.shape[0] < 2:
            raise ValueError(f"share_prefix: at least 2 tokens, got {ids.shape[0]}")
        if self.runner.vl is not None:
            raise ValueError("share_prefix: a vision-language prompt must start an empty cache (M-RoPE positions)")
        self.prefix = None
        self.reset(ids.shape[0])
        _, aux = self.runner.prefill(ids[:-1], need_aux=self.draft is not None)
        target = [(layer.keys[:, :, : layer.length].clone(), layer.values[:, :, : layer.length].clone())
                  for layer in self.runner.cache.layers]
        draft = None
        if self.draft is not None:
            self.draft_extend(ids[1:], aux)
            draft = tuple(t.clone() for t in self.draft_kv.past())
        self.prefix = SharedPrefix(ids, target, draft)
        return ids.shape[0] - 1

    def _restore_prefix(self, prompt: torch.Tensor, draft: bool) -> int:
        p = self.prefix
        n = 0 if p is None else p.tokens.shape[0]
        if not n or prompt.shape[0] < n or not torch.equal(prompt[:n], p.tokens):
            return 0
        for layer, (k, v) in zip(self.runner.cache.layers, p.target):
            layer.update(k, v)
        if draft:
            self.draft_kv.write(0, *p.draft)
            self.draft_kv.length = n - 1
        return n - 1

    def reset(self, max_len: int):
        """Empty both caches, sized for `max_len` committed tokens plus one round's scratch."""
        capacity = max_len + self.spec.num_draft_tokens + self.spec.steps * self.spec.topk
        self.runner.reset(capacity)
        if self.draft is not None:
            self.draft_kv.reset(capacity)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, temperature: float = 0.0, generator=None, images=None,
                cached: int = 0):
        """Target prefill (first token sampled there), then the draft over the prompt pairing
        (token p+1, feature p); the first `cached` prompt tokens are in both caches already.
        Returns the first token [1] and the draft state of round 1."""
        logits, aux = self.runner.prefill(prompt[cached:], images=images)
        token = sample_token(logits, temperature, generator).reshape(1)
        return token, self.draft_prefill(prompt, token, aux, cached)

    @torch.inference_mode()
    def draft_prefill(self, prompt: torch.Tensor, token: torch.Tensor, aux: torch.Tensor,
                      cached: int = 0) -> DraftState:
        """The draft over the prompt, pairing (token p+1, feature p), `token` the first sampled one,
        after the runner's prefill of `prompt` (whose M-RoPE positions and merged image embeddings
        a vision-language prompt's draft reads); positions below `cached` are in its cache."""
        tokens = torch.cat([prompt[1:], token])[cached:]
        if self.runner.vl is None:
            return self.draft_extend(tokens, aux)
        embeds = None
        at = tokens == self.runner.vl.image_token_id
        at[-1] = False  # the sampled token is text
        if self.merged_image_embeds and bool(at.any()):
            # slot p reads token p+1: the merged embedding of p+1 (the sampled token: its own)
            embeds = self.draft.embed_tokens(tokens).to(self.runner.prompt_embeds.dtype)
            embeds[at] = self.runner.prompt_embeds[1:][at[:-1]]
        return self.draft_extend(tokens, aux, self.runner.prompt_positions, embeds)

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0,
                 eos_token_id=None, generator: torch.Generator | None = None, on_tokens=None, images=None):
        """Speculative generation. Returns (completion token ids [n], GenerationStats);
        `on_tokens(ids)` streams the tokens committed by each round; `images` ({"pixel_values",
        "image_grid_thw"}) go with the prompt of a vision-language target."""
        if self.draft is None:
            raise ValueError("generate: this engine has no draft; use generate_base")
        prompt, req, cached = self._start(input_ids, max_new_tokens, eos_token_id, self.spec.num_draft_tokens,
                                          on_tokens)
        timer = req.timer
        token, state = self.prefill(prompt, temperature, generator, images, cached)
        timer.lap("prefill")
        req.emit(token.tolist())
        req.first_token_done()
        timer.skip()
        while not req.done:
            tree = self.draft_tree(token, state)
            timer.lap("draft")
            start = self.runner.length
            logits, aux = self.runner.tree(tree.tokens, tree.depth, tree.mask)
            timer.lap("verify")
            if temperature < GREEDY_BELOW:
                path, emitted = greedy_verify(tree, logits)
            else:
                path, emitted = sampling_verify(tree, target_probs(logits, temperature), generator)
            timer.lap("accept")
            req.commit_round(emitted.tolist())
            if req.done:
                break
            timer.skip()
            self.runner.keep(start, path)
            timer.lap("cache")
            state = self.draft_extend(emitted, aux[path])
            token = emitted[-1:]
            timer.lap("draft")
        return req.finish(self.device)

    @torch.inference_mode()
    def generate_base(self, input_ids, max_new_tokens: int, temperature: float = 0.0,
                      eos_token_id=None, generator: torch.Generator | None = None, on_tokens=None, images=None):
        """Plain autoregressive decoding of the target on the same cache machinery."""
        prompt, req, cached = self._start(input_ids, max_new_tokens, eos_token_id, 0, on_tokens)
        timer = req.timer
        logits, _ = self.runner.prefill(prompt[cached:], need_aux=False, images=images)
        token = sample_token(logits, temperature, generator)
        timer.lap("prefill")
        req.emit([int(token)])
        req.first_token_done()
        while not req.done:
            timer.skip()
            logits, _ = self.runner.decode(token)
            timer.lap("decode")
            token = sample_token(logits, temperature, generator)
            req.emit([int(token)])
        return req.finish(self.device)
