"""What a speculative round costs on this machine: it turns the planner's accept lengths
(specforge/eval/planner.py) into predicted speed-ups.

A round of `SpeculativeEngine.generate` (engine/speculative.py, PHASES) spends, in order:
draft (level 1 top-K, T-1 draft steps over K lanes in `draft_levels`, `build_tree`), verify (the
target's tree forward over N nodes), accept (the greedy walk over N x V logits), cache (KV
compaction, `runner.keep`) and, back in draft, the catch-up `draft_extend` over the a = accepted + 1
emitted tokens. So

    t_round(T, K, N) = t_extend + (T-1) * t_step(K) + t_verify(N) + t_overhead(T, K, N)
    t_overhead       = t_level1(K) + t_build(T_K_N) + t_accept(N) + copied * t_keep(N)

averaged over the tree's rounds by its accepted-drafts histogram: t_extend over a = accepted + 1
tokens, and `copied` = the share of rounds whose path is not 0..a (such a path compacts in place
at no cost): those of a K > 1 tree that accept 2+ drafts (node 2 is then another level-1
candidate). The base model's step t_base is one decode forward + argmax. The predicted speed-up
is a decode speed-up (prefill left out), as engine_eval's `decode_speedup` measures it: tokens
emitted by rounds (the completion less the prefill's first token of each request) per round x
t_base / t_round. The loop's own Python (`other`, ~0.05% of a round) is left out.

Each figure is the median of `repeats` timings of the engine's own functions after a prefix of
realistic length (mean prompt + max_new_tokens / 2), all items interleaved in every repeat so that
a machine that drifts moves them alike (the base step is timed over a few steps back to back, as
the base model runs them). Every N and K of the grid is measured, nothing is interpolated: on CPU
each row count up to 8 takes the kernel that was fastest for it on this machine (engine/few_rows.py),
so t_verify(N) is not monotone in N.
"""
from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specforge.engine.few_rows import kernels_of, remember_kernels
from specforge.engine.speculative import DraftState, SpeculativeEngine, sample_token
from specforge.engine.tree import build_tree
from specforge.engine.tree_spec import TreeSpec
from specforge.engine.verify import greedy_verify
from specforge.utils.io import read_json, write_json

REPEATS = 7
BASE_RUN = 4  # decode steps per timing of t_base


@dataclass
class CostModel:
    """Seconds per operation, measured under `key` (target, draft, dtype, device, threads, prefix)."""

    key: dict
    t_base: float  # one base decode step: target forward over 1 token + argmax
    t_verify: dict  # N -> the target's tree forward over N nodes
    t_accept: dict  # N -> the greedy walk (argmax over N x V logits)
    t_keep: dict  # N -> KV compaction to an accepted path that is not 0..a (a copy)
    t_level1: dict  # K -> draft_levels with T = 1 (level 1 from the catch-up's top-K)
    t_step: dict  # K -> one further draft level over K lanes
    t_build: dict  # tree name -> build_tree
    t_extend: list  # [a - 1]: the draft's catch-up forward over a tokens
    measure_s: float = 0.0  # wall time of the measurement
    kernel_timing_s: float = 0.0  # of which choosing the few-row kernels (0: chosen earlier in the process)
    # the engine's few-row kernels these figures were measured with ({geometry: {rows: kernel}},
    # engine/few_rows.py): a stored model brings them back, so its engines run what it priced
    kernels: dict = field(default_factory=dict)

    @staticmethod
    def needs(specs) -> dict:
        """What a grid needs measured: its N, its K (with their largest T), its trees, and the
        longest catch-up (a round emits at most min(T + 1, N) tokens)."""
        return {"ns": sorted({s.num_draft_tokens for s in specs}),
                "steps": {k: max(s.steps for s in specs if s.topk == k) for k in sorted({s.topk for s in specs})},
                "trees": [s.name for s in specs],
                "extend": max(min(s.steps + 1, s.num_draft_tokens) for s in specs)}

    def covers(self, specs) -> bool:
        need = self.needs(specs)
        return (set(need["ns"]) <= set(self.t_verify) and set(need["steps"]) <= set(self.t_step)
                and set(need["trees"]) <= set(self.t_build) and len(self.t_extend) >= need["extend"])

    def t_overhead(self, spec: TreeSpec, accept_histogram: list[int]) -> float:
        """Level 1, build_tree, the walk and the compaction (module docstring) per round."""
        n = spec.num_draft_tokens
        copied = sum(accept_histogram[2:]) / sum(accept_histogram) if spec.topk > 1 else 0.0
        return self.t_level1[spec.topk] + self.t_build[spec.name] + self.t_accept[n] + copied * self.t_keep[n]

    def t_round(self, spec: TreeSpec, accept_histogram: list[int]) -> float:
        """Seconds per round of `spec`; `accept_histogram[a]` = rounds that accepted a drafts."""
        extend = sum(c * self.t_extend[a] for a, c in enumerate(accept_histogram)) / sum(accept_histogram)
        return (extend + (spec.steps - 1) * self.t_step[spec.topk] + self.t_verify[spec.num_draft_tokens]
                + self.t_overhead(spec, accept_histogram))

    def speedup(self, spec: TreeSpec, tokens_per_round: float, accept_histogram: list[int]) -> float:
        """`tokens_per_round`: decode tokens (not the prefill's first) per round, see `decode_tokens_per_round`."""
        return tokens_per_round * self.t_base / self.t_round(spec, accept_histogram)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        ints = {name: {int(k): v for k, v in d[name].items()}
                for name in ("t_verify", "t_accept", "t_keep", "t_level1", "t_step")}
        return cls(**{**d, **ints})


def decode_tokens_per_round(row: dict) -> float:
    """What a round emits after the prefill's first token, over a planned tree's requests (the
    accept length counts that first token: with 64-token completions it is ~1.6% larger)."""
    return (row["completion_tokens"] - row["requests"]) / row["verify_rounds"]


def describe_device(device) -> str:
    """The machine a figure holds for: the GPU's name, or the CPU's model."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu ({model})"


def prefix_length(prompts, max_new_tokens: int) -> int:
    """Where a round sits on average: the prompts' mean length + half of the completion."""
    lengths = [len(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
    return round(statistics.mean(lengths) + max_new_tokens / 2)


def cost_key(target_fingerprint: str, draft, prefix_len: int, exact_ancestor_attention: bool = False) -> dict:
    """What the figures depend on; a stored model is reused only under an equal key."""
    param, cfg = next(draft.parameters()), draft.config
    return {"target": target_fingerprint, "dtype": str(param.dtype).removeprefix("torch."),
            "device": describe_device(param.device), "threads": torch.get_num_threads(),
            "draft": f"hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
                     f"draft vocab {cfg.draft_vocab_size}",
            "prefix_len": prefix_len, "exact_ancestor_attention": bool(exact_ancestor_attention)}


def load_or_measure(path: str | Path, key: dict, target, draft, prompt, trees,
                    repeats: int = REPEATS) -> tuple[CostModel, bool]:
    """(model, measured now): the model stored in `path` under `key` when it covers `trees`, else
    a new measurement, stored under `key` (models of other keys stay in the file; one of the same
    key is measured again with its trees and the new ones together). A stored
    model's few-row kernels become this process's choice for its target and draft geometries
    (engines built afterwards run them, untimed)."""
    path = Path(path)
    specs = [TreeSpec.parse(t) if isinstance(t, str) else t for t in trees]
    stored = read_json(path)["models"] if path.exists() else []
    for d in stored:
        if d["key"] == key:
            model = CostModel.from_json(d)
            if model.covers(specs):
                remember_kernels(model.kernels)
                return model, False
            # measured again for the union: the stored entry's trees stay covered
            specs += [TreeSpec.parse(t) for t in model.t_build if t not in {s.name for s in specs}]
    model = measure(target, draft, prompt, key, specs, repeats)
    write_json(path, {"models": [d for d in stored if d["key"] != key] + [model.to_json()]})
    return model, True


@torch.inference_mode()
def measure(target, draft, prompt, key: dict, trees, repeats: int = REPEATS) -> CostModel:
    """Time every operation of a round for the trees of the grid (module docstring), after a
    prefix of `key["prefix_len"]` tokens (`prompt`'s ids, repeated)."""
    t_start = time.perf_counter()
    specs = [TreeSpec.parse(t) if isinstance(t, str) else t for t in trees]
    need = CostModel.needs(specs)
    kmax = max(need["steps"])
    t_kernels = time.perf_counter()  # building the engine chooses its few-row kernels, once per process
    engine = SpeculativeEngine(target, draft, TreeSpec(1, kmax, 2), key.get("exact_ancestor_attention", False))
    t_kernels = time.perf_counter() - t_kernels
    runner, kv = engine.runner, engine.draft_kv
    ids = torch.as_tensor(prompt["input_ids"] if isinstance(prompt, dict) else prompt, dtype=torch.long)
    if runner.vl is not None:  # a text prefix: image placeholders need their images (the cost is per token)
        ids = ids[ids != runner.vl.image_token_id]
    length = key["prefix_len"]
    prefix = ids.repeat(math.ceil(length / ids.numel()))[:length].to(engine.device)
    widest = max(s.steps * s.topk for s in specs)
    engine.reset(length + max(need["ns"]) + widest + need["extend"])
    root, state = engine.prefill(prefix)  # both caches hold the prefix; top-kmax of the next level 1
    sync = ((lambda: torch.cuda.synchronize(engine.device)) if engine.device.type == "cuda" else (lambda: None))

    def clock(fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - t0, out

    def rewind():  # back to the prefix: both caches' entries past it are scratch
        for layer in runner.cache.layers:
            layer.length = length
        kv.length = length

    def levels(spec):
        engine.spec = spec  # draft_levels reads T and K from the engine's tree
        k = spec.topk  # the top-k of a top-kmax is its first k entries
        return engine.draft_levels(DraftState(state.probs[:k], state.ids[:k], state.feat))

    # Every K's levels at its largest T (a shorter T takes a prefix, see draft_levels); per N, one
    # real tree of the grid; the largest one's verify gives the catch-up its tokens and features.
    deepest = {k: levels(TreeSpec(t, k, t + 1)) for k, t in need["steps"].items()}
    built = {s.name: (s, [x[: s.steps] for x in deepest[s.topk]]) for s in specs}
    tree_of = {}
    for s in specs:
        tree_of.setdefault(s.num_draft_tokens, build_tree(root, *built[s.name][1], s))
    big = max(need["ns"])
    emitted, aux = tree_of[big].tokens, runner.tree(tree_of[big].tokens, tree_of[big].depth, tree_of[big].mask)[1]
    rewind()

    def base():  # back to back, as generate_base runs its steps (a round's operations alternate)
        t, _ = clock(lambda: [sample_token(runner.decode(root)[0], 0.0, None) for _ in range(BASE_RUN)])
        rewind()
        return {("t_base",): t / BASE_RUN}

    def round_of(n):
        tree = tree_of[n]
        t_verify, (logits, _) = clock(lambda: runner.tree(tree.tokens, tree.depth, tree.mask))
        t_accept, _ = clock(lambda: greedy_verify(tree, logits))
        t_keep, _ = clock(lambda: runner.keep(length, torch.tensor([0, n - 1], device=engine.device)))
        rewind()
        return {("t_verify", n): t_verify, ("t_accept", n): t_accept, ("t_keep", n): t_keep}

    def draft_steps(k):
        longest = max(2, need["steps"][k])  # T = 2 at least, to time one step
        one, _ = clock(lambda: levels(TreeSpec(1, k, 2)))
        many, _ = clock(lambda: levels(TreeSpec(longest, k, longest + 1)))
        return {("t_level1", k): one, ("t_step", k): (many - one) / (longest - 1)}

    def builds():
        return {("t_build", name): clock(lambda: build_tree(root, *lv, s))[0] for name, (s, lv) in built.items()}

    def extend(a):
        t, _ = clock(lambda: engine.draft_extend(emitted[:a], aux[:a]))
        rewind()
        return {("t_extend", a): t}

    items = ([base] + [lambda n=n: round_of(n) for n in need["ns"]]
             + [lambda k=k: draft_steps(k) for k in need["steps"]] + [builds]
             + [lambda a=a: extend(a) for a in range(1, need["extend"] + 1)])
    samples = {}
    for r in range(repeats + 1):  # the first pass warms up and is dropped
        for item in items:
            for name, t in item().items():
                if r:
                    samples.setdefault(name, []).append(t)
    med = {name: statistics.median(ts) for name, ts in samples.items()}
    per = {what: {name[1]: v for name, v in med.items() if name[0] == what}
           for what in ("t_verify", "t_accept", "t_keep", "t_level1", "t_step", "t_build", "t_extend")}
    return CostModel(key=key, t_base=med[("t_base",)], **{f: v for f, v in per.items() if f != "t_extend"},
                     t_extend=[per["t_extend"][a] for a in range(1, need["extend"] + 1)],
                     measure_s=time.perf_counter() - t_start, kernel_timing_s=t_kernels,
                     kernels={**kernels_of(runner.kernel_modules), **kernels_of(engine.draft_linears)})
