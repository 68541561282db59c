"""The accept length of every tree T_K_N from one greedy pass per prompt, temperature 0.

Why one pass suffices: at temperature 0 the engine's output is the target's greedy output, and the
draft's state at the start of a round depends only on the committed prefix: its KV of positions
< S-1 (a causal forward pairing token p+1 with the target's feature of p) and its output row at
S-2 (level 1 and the first lane feature; docs/contract.md §3, §5). So per prompt:

1. `batched_trajectories` (text targets: several prompts decoded at once) or `greedy_trajectory`
   (one prompt: by decoding, or by the engine with one tree, the same tokens in fewer forwards):
   the target's greedy tokens and aux features, plus `extra` tokens past the point where the
   engine stops (a last round's walk may run past max_new_tokens or EOS; what it accepts there is
   cut, as the engine and SGLang cut it);
2. per topk K, one draft pass over that sequence (the engine's `draft_extend`, prompt first as
   its prefill does, then the rest in one call): the state of every round start, and a KV cache
   whose prefix of length S-1 is the one a round starting there reads (attention is causal);
3. per round start S and K, the draft's levels at the largest T of that K (the engine's
   `draft_levels`, or `batched_levels`: all round starts at once): level d depends on levels < d
   only, so a shorter T takes a prefix, and N only picks the N-1 best (`build_tree`, the one
   tree builder);
4. per tree, the engine's rounds replayed: build the tree, walk it against the greedy tokens
   (`greedy_walk`, the engine's walk), emit through the engine's `_Request` (the same stop and
   truncation rules, the same GenerationStats and accept-length definitions).

Exactness: same maths as the engine, but the engine computes the draft KV in per-round chunks and
reads target features off tree-verify forwards, so float rounding can differ (~1e-7 in fp32); a
round can only change at a near-tie of draft scores. tests/test_planner.py checks every round of
every tree against `SpeculativeEngine.generate` (benchmarks/planner_bench.py: the share at scale).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specforge.engine.few_rows import few_rows_linears
from specforge.engine.speculative import DraftState, GenerationStats, SpeculativeEngine, _Request, sample_token
from specforge.engine.target import TargetRunner
from specforge.engine.tree import build_tree, first_level, lane_attention_mask, next_level
from specforge.engine.tree_spec import TreeSpec
from specforge.engine.verify import greedy_walk
from specforge.eval.engine_eval import aggregate
from specforge.targets.loader import last_position


@dataclass
class Trajectory:
    """One prompt's greedy continuation: `tokens` [stop + extra] (the first `stop` are what the
    engine emits), `aux` [P + stop - 1, 3H] the target features of positions 0..P+stop-2."""

    prompt: torch.Tensor
    tokens: torch.Tensor
    aux: torch.Tensor
    stop: int


@dataclass
class RequestPlan:
    """A request as the engine would run it with one tree: its output, its GenerationStats
    (accepted_drafts per round, spec_verify_ct, ...; no timings), and per round how many of the
    N nodes sat at each depth 0..T."""

    tokens: list[int]
    stats: GenerationStats
    nodes_per_depth: list[list[int]] = field(default_factory=list)


class _Enough(Exception):
    """Ends the engine's generation of a trajectory once it is long enough."""


@torch.inference_mode()
def greedy_trajectory(runner: TargetRunner, prompt: torch.Tensor, max_new_tokens: int, eos_token_id,
                      extra: int, engine: SpeculativeEngine | None = None, images=None) -> Trajectory:
    """Greedy tokens until the engine would stop (its `_Request` decides), then `extra` more,
    ignoring EOS. Without `engine`: decoding on the runner, aux read at each step. With `engine`
    (speculative, same target): its output, the same tokens at temperature 0 in fewer target
    forwards, then the completion's aux in one forward after the prompt's prefill. `images`: a
    vision-language prompt's; the runner keeps the prompt's positions for the draft after."""
    p = prompt.shape[0]
    runner.reset(p + max_new_tokens + extra + 1)
    req = _Request(p, max_new_tokens, eos_token_id, 0, runner.device)
    if engine is None:
        logits, aux = runner.prefill(prompt, images=images)
        tokens, feats = [sample_token(logits, 0.0, None).reshape(1)], [aux]
        req.emit(tokens[0].tolist())
        while not req.done or len(tokens) < len(req.tokens) + extra:
            logits, aux = runner.decode(tokens[-1], need_aux=True)
            feats.append(aux)
            tokens.append(sample_token(logits, 0.0, None).reshape(1))
            if not req.done:
                req.emit(tokens[-1].tolist())
        tokens = torch.cat(tokens)
    else:
        out = []

        def collect(new):
            for t in new:
                out.append(t)
                if not req.done:
                    req.emit([t])
            if req.done and len(out) >= len(req.tokens) + extra:
                raise _Enough

        try:
            engine.generate(prompt, max_new_tokens + extra, on_tokens=collect, images=images)
        except _Enough:
            pass
        tokens = torch.tensor(out, dtype=torch.long, device=runner.device)
        feats = [runner.prefill(prompt, images=images)[1]]
        if len(req.tokens) > 1:
            feats.append(runner.extend(tokens[: len(req.tokens) - 1])[1])
    stop = len(req.tokens)
    return Trajectory(prompt, tokens, torch.cat(feats)[: p + stop - 1], stop)


# prompts decoded at once for a text target's greedy trajectories: 16 demo prompts x 128 tokens in
# 10.7 s against 14.0 s in batches of 8 (2-core AVX-512 EPYC, the engine's few-row kernels)
TRAJECTORY_BATCH = 16


@torch.inference_mode()
def batched_trajectories(runner: TargetRunner, prompts: list[torch.Tensor], max_new_tokens: int, eos_token_id,
                         extra: int) -> list[Trajectory]:
    """`greedy_trajectory` without an engine for several text prompts at once: one left-padded row
    per prompt, greedy decoding of all rows together (each step reads the weights once for every
    row: 8 demo prompts in 2.4x less time than one at a time on a 2-core CPU). Padding keys are
    masked from every real query; a padding query sees only itself (a fully masked row would give
    NaN, and 0 x NaN reaches the real rows). Positions restart at 0 after each row's padding."""
    b, device = len(prompts), runner.device
    lens = torch.tensor([p.shape[0] for p in prompts], device=device)
    width = int(lens.max())
    pad = width - lens
    ids = torch.zeros((b, width), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        ids[i, int(pad[i]):] = prompt
    capacity = width + max_new_tokens + extra + 1
    runner.reset(capacity)
    keys = torch.arange(capacity, device=device)[None] >= pad[:, None]  # [B, capacity]: not padding
    square = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    mask = (keys[:, None, None, :width] & square) | torch.eye(width, dtype=torch.bool, device=device)
    pos = (torch.arange(width, device=device)[None] - pad[:, None]).clamp(min=0)
    logits, aux = runner.rows(ids, pos, mask, logits_to_keep=last_position(ids))
    feats = [[aux[i, int(pad[i]):]] for i in range(b)]
    tokens = [logits[:, -1].argmax(-1)]
    reqs = [_Request(int(n), max_new_tokens, eos_token_id, 0, device) for n in lens]
    for req, t in zip(reqs, tokens[0].tolist()):
        req.emit([t])
    step = 0
    while any(not r.done or len(tokens) < len(r.tokens) + extra for r in reqs):
        length = width + step
        logits, aux = runner.rows(tokens[-1][:, None], (lens + step)[:, None],
                                  keys[:, None, None, :length + 1], need_aux=True)
        for i in range(b):
            feats[i].append(aux[i])
        tokens.append(logits[:, -1].argmax(-1))
        for req, t in zip(reqs, tokens[-1].tolist()):
            if not req.done:
                req.emit([t])
        step += 1
    tokens = torch.stack(tokens, dim=1)
    out = []
    for i, (prompt, req) in enumerate(zip(prompts, reqs)):
        stop = len(req.tokens)
        out.append(Trajectory(prompt, tokens[i, :stop + extra], torch.cat(feats[i])[: prompt.shape[0] + stop - 1],
                              stop))
    return out


class DraftLevels:
    """The draft's levels at every round start of one trajectory for one K: `levels(c)`, c the
    committed completion tokens, is what `draft_tree` expands at that round, on the CPU (where
    `replay` builds the trees: many tiny ops).

    `batch` = 0: the engine's own `draft_levels` per round start, on demand (memoised).
    `batch` > 0: every round start at once, `batch` lanes per draft forward (`batched_levels`).
    """

    @torch.inference_mode()
    def __init__(self, engine: SpeculativeEngine, traj: Trajectory, batch: int = 0):
        self.engine, self.memo = engine, {}
        p, g = traj.prompt.shape[0], traj.tokens
        engine.reset(p + traj.stop)
        first = engine.draft_prefill(traj.prompt, g[:1], traj.aux[:p])  # after the trajectory's prefill
        states = [DraftState(*(x[None] for x in first))]
        if traj.stop > 1:  # round c (c >= 2 committed tokens) starts from row c-2 of this call
            states.append(engine.draft_extend(g[1:traj.stop], traj.aux[p:], every_row=True))
        self.state = DraftState(*(torch.cat(x) for x in zip(*states)))  # row c-1: round c
        self.prompt_len = p
        kv = engine.draft_kv
        self.k, self.v, self.length = kv.k.clone(), kv.v.clone(), kv.length
        if batch > 0:
            rounds = traj.stop - 1
            per = max(1, batch // engine.spec.topk)
            chunks = [batched_levels(engine, list(range(p + i, p + min(i + per, rounds))),
                                     DraftState(*(x[i: min(i + per, rounds)] for x in self.state)))
                      for i in range(0, rounds, per)]
            merged = [[torch.cat(parts).cpu() for parts in zip(*level)] for level in zip(*chunks)]
            self.memo = {c: tuple([x[c - 1] for x in lst] for lst in merged) for c in range(1, rounds + 1)}

    @torch.inference_mode()
    def levels(self, c: int):
        if c not in self.memo:
            kv = self.engine.draft_kv
            kv.length = self.prompt_len + c - 1  # the committed prefix minus the root
            state = DraftState(*(x[c - 1] for x in self.state))
            self.memo[c] = tuple([x.cpu() for x in lst] for lst in self.engine.draft_levels(state))
            # draft_levels wrote its scratch keys over the sequence's: put those back
            end = min(kv.length + self.engine.spec.steps * self.engine.spec.topk, self.length)
            kv.k[:, :, kv.length:end] = self.k[:, :, kv.length:end]
            kv.v[:, :, kv.length:end] = self.v[:, :, kv.length:end]
            kv.length = self.length
        return self.memo[c]


def _block_diagonal(blocks: torch.Tensor) -> torch.Tensor:
    """[B, K, W] -> [B*K, B*W]: row (b, j) sees column (b', w) iff b == b' and blocks[b, j, w]."""
    b, k, w = blocks.shape
    eye = torch.eye(b, dtype=torch.bool, device=blocks.device)
    return (eye[:, None, :, None] & blocks[:, :, None, :]).reshape(b * k, b * w)


@torch.inference_mode()
def batched_levels(engine: SpeculativeEngine, starts: list[int], state: DraftState):
    """`engine.draft_levels` for B round starts at once, each reading the draft KV prefix of
    length `starts[b]` (engine.draft_kv holds the whole sequence): the B*K lanes run as one
    sequence; lane (b, j) sees keys < starts[b] and, of the scratch keys each step appends after
    the sequence, those that `lane_attention_mask` gives it within its own round start; the
    levels come from `next_level` per start. Same maths as the engine's loop, other float
    summation order. Returns (score_list, token_list, parents_list) with a leading B dim."""
    draft, k, steps = engine.draft, engine.spec.topk, engine.spec.steps
    b, device = len(starts), state.ids.device
    lengths = torch.tensor(starts, device=device)
    seq_k, seq_v = engine.draft_kv.k[:, :, :max(starts)], engine.draft_kv.v[:, :, :max(starts)]
    prefix = (torch.arange(seq_k.shape[2], device=device) < lengths[:, None]).repeat_interleave(k, 0)
    scores, s0, t0, p0 = (torch.stack(x) for x in zip(*map(first_level, state.probs, state.ids)))
    score_list, token_list, parents_list = [s0], [t0], [p0]
    lane_tok, lane_feat = state.ids.reshape(-1), state.feat.repeat_interleave(k, 0)
    lane_mask = torch.stack([lane_attention_mask(None, None, k, engine.exact)] * b).to(device)
    scratch_k, scratch_v = [], []
    next_levels = torch.vmap(next_level, in_dims=(0, 0, 0, None))
    for i in range(1, steps):
        seen = [_block_diagonal(lane_mask[:, :, (s - 1) * k: s * k]) for s in range(1, i)]
        mask = torch.cat([prefix, *seen, torch.eye(b * k, dtype=torch.bool, device=device)], dim=1)[None]
        pos = (lengths + i - 1 + engine.runner.rope_delta).repeat_interleave(k)[None]
        past = (torch.cat([seq_k, *scratch_k], dim=2), torch.cat([seq_v, *scratch_v], dim=2))
        with few_rows_linears(engine.draft_linears, engine.draft_kernels):  # as the engine's own draft steps
            out, logits, (kk, vv) = draft.step(lane_tok[None], lane_feat[None], pos, past, mask)
        probs, child = engine._draft_topk(logits[0])
        flat, flat_tok, scores, sel, parents = next_levels(scores, probs.view(b, k, k), child.view(b, k, k), i)
        score_list.append(flat)
        token_list.append(flat_tok)
        parents_list.append(parents)
        if i < steps - 1:
            scratch_k.append(kk)
            scratch_v.append(vv)
            parent_lane = sel // k
            lane_tok = torch.gather(flat_tok, 1, sel).reshape(-1)
            lane_feat = torch.gather(out[0].view(b, k, -1), 1, parent_lane[..., None].expand(-1, -1, out.shape[-1]))
            lane_feat = lane_feat.reshape(b * k, -1)
            lane_mask = torch.stack([lane_attention_mask(m, p, k, engine.exact) for m, p in zip(lane_mask, parent_lane)])
    return score_list, token_list, parents_list


@torch.inference_mode()
def replay(spec: TreeSpec, traj: Trajectory, levels: DraftLevels, max_new_tokens: int,
           eos_token_id) -> RequestPlan:
    """The engine's `generate` loop for one tree, with the verify forward replaced by the greedy
    tokens: node j's target argmax is the greedy token after its depth (only read on the walk)."""
    t, g = spec.steps, traj.tokens.cpu()
    req = _Request(traj.prompt.shape[0], max_new_tokens, eos_token_id, spec.num_draft_tokens, g.device)
    req.emit(g[:1].tolist())
    c, widths = 1, []
    while not req.done:
        scores, tokens, parents = levels.levels(c)
        tree = build_tree(g[c - 1], scores[:t], tokens[:t], parents[:t], spec)
        _, emitted = greedy_walk(tree, g[c + tree.depth])
        widths.append(torch.bincount(tree.depth, minlength=t + 1).tolist())
        req.commit_round(emitted.tolist())
        c += emitted.shape[0]
    out, stats = req.finish(g.device)
    return RequestPlan(out.tolist(), stats, widths)


def _prompt_ids(prompt, device) -> torch.Tensor:
    ids = prompt["input_ids"] if isinstance(prompt, dict) else prompt
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)


@torch.inference_mode()
def plan(target, draft, prompts, trees, max_new_tokens: int, eos_token_id=None,
         exact_ancestor_attention: bool = False, batch: int = 256,
         trajectory_tree=None, trajectory_batch: int = TRAJECTORY_BATCH,
         on_planned=None) -> dict[str, list[RequestPlan]]:
    """{tree name: [RequestPlan per prompt]} for every tree of `trees` (T_K_N strings or TreeSpecs),
    as `SpeculativeEngine(target, draft, tree).generate(prompt, max_new_tokens, eos_token_id=...)`
    would run them at temperature 0. `prompts`: token id sequences or heldout_prompts rows.
    `batch`: draft lanes per forward when expanding all round starts at once; 0 runs the engine's
    own `draft_levels` at each round start that some tree reaches (the reference, slower).
    `trajectory_batch` > 1 (text targets): the greedy tokens of that many prompts at once, by
    batched decoding (`batched_trajectories`). Otherwise, and for vision-language targets, one
    prompt at a time: `trajectory_tree` names the tree whose engine gives them (the same tokens in
    fewer target forwards than decoding), or is a function of the plans so far that names the tree
    for the next prompt (None: decoding), e.g. the one predicted fastest (planner_eval).
    `on_planned()` after each prompt's trees are planned (a progress bar)."""
    specs = [TreeSpec.parse(t) if isinstance(t, str) else t for t in trees]
    steps = {}  # per topk, the largest T of the grid
    for s in specs:
        steps[s.topk] = max(steps.get(s.topk, 0), s.steps)
    engines = {k: SpeculativeEngine(target, draft, TreeSpec(t, k, t + 1), exact_ancestor_attention)
               for k, t in steps.items()}
    runner = next(iter(engines.values())).runner
    for engine in engines.values():  # one runner: a vision-language prompt's positions, read by every K
        engine.runner = runner
    sources = {}  # the trajectories' engines, by tree
    out = {s.name: [] for s in specs}
    extra = max(steps.values())
    batched = trajectory_batch > 1 and runner.vl is None
    for first in range(0, len(prompts), trajectory_batch if batched else 1):
        chunk = prompts[first: first + trajectory_batch] if batched else [prompts[first]]
        if batched:
            trajs = batched_trajectories(runner, [_prompt_ids(p, runner.device) for p in chunk], max_new_tokens,
                                         eos_token_id, extra)
        else:
            tree = trajectory_tree(out) if callable(trajectory_tree) else trajectory_tree
            if tree and str(tree) not in sources:
                sources[str(tree)] = SpeculativeEngine(target, draft, tree, exact_ancestor_attention)
            trajs = [greedy_trajectory(runner, _prompt_ids(chunk[0], runner.device), max_new_tokens, eos_token_id,
                                       extra, sources[str(tree)] if tree else None,
                                       chunk[0].get("images") if isinstance(chunk[0], dict) else None)]
        for traj in trajs:
            plan_trajectory(traj, engines, specs, batch, max_new_tokens, eos_token_id, out)
            if on_planned is not None:
                on_planned()
    return out


def plan_trajectory(traj: Trajectory, engines: dict, specs: list[TreeSpec], batch: int, max_new_tokens: int,
                    eos_token_id, out: dict) -> None:
    """Every tree's RequestPlan for one trajectory, appended to out[tree name]."""
    for k, engine in engines.items():
        levels = DraftLevels(engine, traj, batch)
        for s in specs:
            if s.topk == k:
                out[s.name].append(replay(s, traj, levels, max_new_tokens, eos_token_id))


ACCEPT_KEYS = ("requests", "completion_tokens", "verify_rounds", "accept_length", "round_accept_length",
               "accept_rate", "accept_histogram")


def summarize(name: str, requests: list[RequestPlan]) -> dict:
    """A tree's accept figures (engine_eval's `aggregate`, timings left out) and its accepted shape:
    mean nodes at each depth (the tree's real width per level; root = 1), mean deepest node, and
    the share of rounds whose accepted path reached depth d = 1..T (`reach`)."""
    spec = TreeSpec.parse(name)
    row = {"tree": name, **{k: v for k, v in aggregate([r.stats for r in requests], spec.steps).items()
                            if k in ACCEPT_KEYS}}
    widths = torch.tensor([w for r in requests for w in r.nodes_per_depth], dtype=torch.float64)
    accepted = torch.tensor([a for r in requests for a in r.stats.accepted_drafts])
    if len(accepted):
        depth = torch.arange(spec.steps + 1)
        row["nodes_per_depth"] = widths.mean(0).tolist()
        row["tree_depth"] = float(((widths > 0) * depth).amax(1).double().mean())
        row["reach"] = [float((accepted >= d).double().mean()) for d in range(1, spec.steps + 1)]
    return row
