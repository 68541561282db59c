"""The embedded engine on the tiny target (fp32): target forwards, KV compaction, lossless
speculative decoding, SGLang's draft lanes, stop conditions and statistics."""
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge.engine.speculative import SpeculativeEngine
from specforge.engine.target import TargetRunner
from specforge.engine.tree import build_tree, first_level, next_level
from specforge.engine.tree_spec import TreeSpec
from specforge.models.draft import Eagle3Config, Eagle3Draft

AUX = [0, 1, 2]



def load_target(path, std, seed=0):
    """The tiny Llama with weights redrawn at `std`: 0.2 gives varied greedy text, 0.1 long runs
    of repeated tokens (which a small-vocab random draft partly predicts)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def random_draft(target, vocab_ids=None, seed=0, std=0.3, draft_cfg=None):
    """A random Eagle3Draft; `vocab_ids` (sorted target ids) makes a reduced draft vocab;
    `draft_cfg` (e.g. EAGLE 3.1 options) as `Eagle3Config.from_target` takes it."""
    n = len(vocab_ids) if vocab_ids is not None else None
    draft = Eagle3Draft(Eagle3Config.from_target(target.config, AUX, draft_cfg, draft_vocab_size=n))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if vocab_ids is not None:
            ids = torch.tensor(vocab_ids)
            t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            draft.set_vocab_mapping(ids - torch.arange(n), t2d)
    return draft.eval()


@torch.no_grad()
def greedy_reference(model, prompt, n):
    """Plain greedy decoding by full forwards, no cache: the ground truth."""
    ids = prompt.clone()
    for _ in range(n):
        ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax().reshape(1)])
    return ids[prompt.shape[0]:]


def make_prompt(vocab, n=12, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def varied(tiny_target_dir):
    model = load_target(tiny_target_dir, 0.2)
    prompt = make_prompt(model.config.vocab_size)
    return model, prompt, greedy_reference(model, prompt, 60)


@pytest.fixture(scope="module")
def runs(tiny_target_dir):
    model = load_target(tiny_target_dir, 0.1)
    prompt = make_prompt(model.config.vocab_size)
    return model, prompt, greedy_reference(model, prompt, 80)


# ---- target forwards ---------------------------------------------------------------------------


def random_tree(spec, root, vocab, seed):
    """A tree from random draft distributions (what the engine would build from a draft)."""
    g = torch.Generator().manual_seed(seed)
    k = spec.topk

    def topk(rows):
        p = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, -1)
        return torch.topk(p, k, dim=-1)

    v, i = topk(1)
    scores, s0, t0, p0 = first_level(v[0], i[0])
    lists = [[s0], [t0], [p0]]
    for step in range(1, spec.steps):
        v, i = topk(k)
        flat, flat_tok, scores, _, parents = next_level(scores, v, i, step)
        for acc, x in zip(lists, (flat, flat_tok, parents)):
            acc.append(x)
    return build_tree(root, *lists, spec)


@torch.no_grad()
def test_tree_forward_matches_path_forwards(varied):
    """Each node's logits and aux features equal a plain forward over prompt + root..node."""
    model, prompt, _ = varied
    runner = TargetRunner(model, AUX)
    runner.reset(8)  # small on purpose: the cache grows
    logits, aux = runner.prefill(prompt)
    full = model(prompt[None], output_hidden_states=True)
    torch.testing.assert_close(logits, full.logits[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, torch.cat([full.hidden_states[i + 1][0] for i in AUX], -1))

    root = int(logits.argmax())
    tree = random_tree(TreeSpec.parse("4_3_12"), root, model.config.vocab_size, seed=0)
    assert int(tree.depth.max()) >= 3
    logits, aux = runner.tree(tree.tokens, tree.depth, tree.mask)
    for j in range(len(tree)):
        path = tree.mask[j].nonzero().flatten()
        ref = model(torch.cat([prompt, tree.tokens[path]])[None], output_hidden_states=True)
        torch.testing.assert_close(logits[j], ref.logits[0, -1], atol=1e-5, rtol=1e-5)
        ref_aux = torch.cat([ref.hidden_states[i + 1][0, -1] for i in AUX])
        torch.testing.assert_close(aux[j], ref_aux, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_aux_of_the_last_layer_is_its_raw_output(varied):
    """Aux id N-1 is the output of the last decoder layer, not the post-norm state transformers
    puts at hidden_states[N] by default."""
    model, prompt, _ = varied
    captured = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        runner = TargetRunner(model, [0, 1, 3])
        runner.reset(32)
        _, aux = runner.prefill(prompt)
    finally:
        hook.remove()
    raw = captured[0][0] if isinstance(captured[0], tuple) else captured[0]
    torch.testing.assert_close(aux[:, -64:], raw[0])
    with pytest.raises(ValueError, match="aux_layer_ids"):
        TargetRunner(model, [0, 1, 4])


@torch.no_grad()
def test_compaction_keeps_the_accepted_path(varied):
    """After keep(path) the cache is the cache of prompt + path: the next forwards (a decode
    and another tree) equal fresh forwards over that sequence."""
    model, prompt, _ = varied
    runner = TargetRunner(model, AUX)
    runner.reset(64)
    runner.prefill(prompt)
    seq = prompt
    for round_ in range(3):
        root = int(seq[-1] * 7 % 400)
        tree = random_tree(TreeSpec.parse("4_3_12"), root, model.config.vocab_size, seed=round_)
        start = runner.length
        runner.tree(tree.tokens, tree.depth, tree.mask)
        deepest = int(torch.argmax(tree.depth))
        path = tree.mask[deepest].nonzero().flatten()  # not contiguous in node order
        assert path.tolist() != list(range(path.shape[0]))
        runner.keep(start, path)
        seq = torch.cat([seq, tree.tokens[path]])
        assert runner.length == seq.shape[0]
    nxt = torch.tensor([11])
    logits, _ = runner.decode(nxt)
    torch.testing.assert_close(logits, model(torch.cat([seq, nxt])[None]).logits[0, -1], atol=1e-5, rtol=1e-5)


# ---- lossless speculative decoding -------------------------------------------------------------

TREES = ["1_1_2", "4_1_5", "1_3_4", "3_2_6", "4_4_16", "6_3_12", "5_8_40"]


@pytest.mark.parametrize("exact", [False, True], ids=["sglang-lanes", "exact-ancestors"])
def test_lossless_greedy_random_draft(varied, exact):
    model, prompt, ref = varied
    draft = random_draft(model)
    for tree in TREES:
        engine = SpeculativeEngine(model, draft, tree, exact_ancestor_attention=exact)
        out, stats = engine.generate(prompt, 60)
        assert out.tolist() == ref.tolist(), tree
        assert stats.completion_tokens == 60
    base, _ = engine.generate_base(prompt, 60)
    assert base.tolist() == ref.tolist()


@pytest.mark.parametrize("exact", [False, True], ids=["sglang-lanes", "exact-ancestors"])
def test_lossless_greedy_with_deep_acceptance(runs, exact):
    """A random draft over the 8 tokens the target actually uses accepts several drafts in many
    rounds, so compaction of non-contiguous paths and the draft catch-up are exercised."""
    model, prompt, ref = runs
    vocab = sorted(set(ref.tolist()))
    vocab = sorted(vocab + [t for t in range(model.config.vocab_size) if t not in vocab][: 8 - len(vocab)])
    draft = random_draft(model, vocab_ids=vocab)
    deepest = 0
    for tree in TREES:
        engine = SpeculativeEngine(model, draft, tree, exact_ancestor_attention=exact)
        out, stats = engine.generate(prompt, 80)
        assert out.tolist() == ref.tolist(), tree
        deepest = max(deepest, max(stats.accepted_drafts))
        if tree == "5_8_40":
            assert stats.accept_length > 2.0
    assert deepest >= 3


# ---- a draft that is always right: accept length T+1 ------------------------------------------


def constant_draft(target, probs):
    """A real Eagle3Draft whose logits are log(probs) at every position and step.

    All embeddings equal, values read only the embedding half, MLP and fc off: every attention
    output is the same vector a, so the draft's output is m*a (m = 1, 2, ... along the steps),
    which the RMSNorm maps to one vector u; lm_head = log(probs) u^T / |u|^2.
    """
    n = probs.shape[0]
    draft = Eagle3Draft(Eagle3Config.from_target(target.config, AUX, draft_vocab_size=n))
    cfg = draft.config
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.zero_()
        for norm in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm,
                     draft.midlayer.post_attention_layernorm, draft.norm):
            norm.weight.fill_(1.0)
        draft.embed_tokens.weight.fill_(1.0)
        attn = draft.midlayer.self_attn
        emb_half = attn.v_proj.weight[:, : cfg.hidden_size]
        emb_half.copy_(torch.randn(emb_half.shape, generator=g))
        attn.o_proj.weight.copy_(torch.randn(attn.o_proj.weight.shape, generator=g))
        ones = torch.ones(1, 1, cfg.hidden_size)
        x = torch.cat([draft.midlayer.input_layernorm(ones), torch.zeros_like(ones)], -1)
        v = attn.v_proj(x).view(1, 1, cfg.num_key_value_heads, cfg.head_dim)
        v = v.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=2)
        u = draft.norm(attn.o_proj(v.reshape(1, 1, -1)))[0, 0]
        draft.lm_head.weight.copy_(probs.log()[:, None] * u[None, :] / u.dot(u))
        draft.set_vocab_mapping(torch.zeros(n, dtype=torch.long), torch.arange(target.config.vocab_size) < n)
    return draft.eval()


@pytest.fixture(scope="module")
def always_zero(tiny_target_dir):
    """Target with a zero final norm: all logits 0, so the argmax is always token 0."""
    target = load_target(tiny_target_dir, 0.2)
    with torch.no_grad():
        target.model.norm.weight.zero_()
    return target, constant_draft(target, torch.tensor([0.9, 0.05, 0.03, 0.02]))


@pytest.mark.parametrize("tree, rounds", [("4_1_5", 4), ("3_2_6", 4), ("6_4_20", 3)])
def test_perfect_draft_reaches_max_accept_length(always_zero, tree, rounds):
    """The constant draft puts 0.9 on token 0, so its best path (0, 0, ...) is in every tree and
    every round accepts T drafts: accept length T+1 per round (plus the prefill token over the
    request), accept rate T/(N-1)."""
    target, draft = always_zero
    engine = SpeculativeEngine(target, draft, tree)
    t, n = engine.spec.steps, engine.spec.num_draft_tokens
    max_new = 1 + rounds * (t + 1)
    out, stats = engine.generate(make_prompt(target.config.vocab_size), max_new)
    assert out.tolist() == [0] * max_new
    assert stats.accepted_drafts == [t] * rounds
    assert stats.accept_histogram(t) == [0] * t + [rounds]
    assert stats.accept_length == pytest.approx(max_new / rounds)
    assert stats.round_accept_length == t + 1
    assert stats.accept_rate == pytest.approx(t / (n - 1))


def test_drafts_accepted_past_max_new_tokens_are_not_counted(always_zero):
    """SGLang cuts a round's accept length where its request finishes (eagle_info.verify), and the
    server-wide figure sums the cut lengths. The engine counted the whole walk: with T=4 and 18 tokens, the
    last round's 4 drafts although only 1 was committed, a round accept length of 5.0 instead of 4.25."""
    target, draft = always_zero
    out, stats = SpeculativeEngine(target, draft, "4_1_5").generate(make_prompt(target.config.vocab_size), 18)
    assert out.tolist() == [0] * 18
    assert stats.accepted_drafts == [4, 4, 4, 1] and stats.spec_verify_ct == 4
    assert stats.round_accept_length == (18 - 1) / 4 == 4.25
    assert stats.accept_rate == pytest.approx(13 / (4 * 4))


# ---- SGLang's draft lanes against a per-lane reference -----------------------------------------


@torch.no_grad()
def reference_scores(draft, state, past, spec, exact):
    """SGLang's draft loop written plainly: every lane runs alone with an explicit list of its
    own earlier keys (exact=False) or of its beam's ancestors' keys (exact=True)."""
    k = spec.topk
    scores, ids = state.probs, state.ids
    score_list = [scores]
    lane_tok, lane_feat = ids, [state.feat] * k
    lane_kv = [[] for _ in range(k)]
    length = past[0].shape[2]
    for i in range(1, spec.steps):
        outs, kvs, probs, toks = [], [], [], []
        for j in range(k):
            pk = torch.cat([past[0]] + [kv[0] for kv in lane_kv[j]], dim=2)
            pv = torch.cat([past[1]] + [kv[1] for kv in lane_kv[j]], dim=2)
            out, logits, kv = draft.step(lane_tok[j].view(1, 1), lane_feat[j].view(1, 1, -1),
                                         torch.tensor([[length + i - 1]]), (pk, pv))
            p, c = torch.topk(torch.softmax(logits[0, 0].float(), -1), k)
            outs.append(out[0, 0]), kvs.append(kv), probs.append(p), toks.append(draft.to_target_ids(c))
        flat = (scores[:, None] * torch.stack(probs)).reshape(-1)
        score_list.append(flat)
        scores, sel = torch.topk(flat, k)
        parent = (sel // k).tolist()
        if exact:
            lane_kv = [lane_kv[parent[j]] + [kvs[parent[j]]] for j in range(k)]
        else:
            lane_kv = [lane_kv[j] + [kvs[j]] for j in range(k)]
        lane_tok = torch.stack(toks).reshape(-1)[sel]
        lane_feat = [outs[p] for p in parent]
    return torch.cat(score_list)


def test_draft_lanes_match_the_per_lane_reference(varied):
    model, prompt, _ = varied
    draft = random_draft(model, seed=3, std=0.5)
    spec = TreeSpec.parse("5_3_12")
    refs = {}
    for exact in (False, True):
        engine = SpeculativeEngine(model, draft, spec, exact_ancestor_attention=exact)
        with torch.inference_mode():
            engine.reset(64)
            token, state = engine.prefill(prompt)
            tree = engine.draft_tree(token, state)
            past = tuple(x.clone() for x in engine.draft_kv.past())
        refs[exact] = reference_scores(draft, state, past, spec, exact)
        torch.testing.assert_close(tree.scores, refs[exact][tree.candidates], atol=1e-6, rtol=1e-5)
    # The two attention rules really differ on this draft (beams were reordered).
    assert not torch.allclose(refs[False], refs[True], atol=1e-6)


@torch.no_grad()
def test_draft_catch_up_equals_one_shot_prefill(runs):
    """After rounds of prefill + per-round catch-up over accepted tokens, the draft's cache is
    what one causal draft forward over the committed sequence gives with the contract's pairing
    (token p+1, target feature p, position p)."""
    model, prompt, ref = runs
    draft = random_draft(model, vocab_ids=sorted(set(ref.tolist()))[:8])
    engine = SpeculativeEngine(model, draft, "4_4_16")
    out, stats = engine.generate(prompt, 40)
    assert max(stats.accepted_drafts) >= 2
    length = engine.draft_kv.length  # committed before the last round (it ended the request)
    assert length + engine.spec.num_draft_tokens == engine.runner.length
    seq = torch.cat([prompt, out])
    hidden = model(seq[None, :length], output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i + 1][0] for i in AUX], -1)
    _, _, (k, v) = draft.step(seq[None, 1 : length + 1], draft.project(aux)[None], torch.arange(length)[None])
    keys, values = engine.draft_kv.past()
    torch.testing.assert_close(keys, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, v, atol=1e-5, rtol=1e-5)


# ---- stopping, sampling and statistics ---------------------------------------------------------


def test_max_new_tokens_and_eos(runs):
    model, prompt, ref = runs
    engine = SpeculativeEngine(model, random_draft(model), "5_8_40")
    for max_new in (1, 2, 7):
        out, stats = engine.generate(prompt, max_new)
        assert out.tolist() == ref[:max_new].tolist()
        assert stats.completion_tokens == max_new
    ref_list = ref.tolist()
    eos = ref_list[30]
    cut = ref_list.index(eos) + 1
    for eos_arg in (eos, [eos, 10**6]):
        out, _ = engine.generate(prompt, 80, eos_token_id=eos_arg)
        assert out.tolist() == ref_list[:cut]
        base, _ = engine.generate_base(prompt, 80, eos_token_id=eos_arg)
        assert base.tolist() == ref_list[:cut]
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(prompt, 0)


def test_sampling_runs_and_is_reproducible(varied):
    model, prompt, _ = varied
    engine = SpeculativeEngine(model, random_draft(model), "4_4_16")
    outs = [engine.generate(prompt, 40, temperature=0.8, generator=torch.Generator().manual_seed(s))[0]
            for s in (5, 5, 6)]
    assert outs[0].tolist() == outs[1].tolist() and outs[0].tolist() != outs[2].tolist()
    assert all(o.shape[0] == 40 and int(o.max()) < model.config.vocab_size for o in outs)
    g = torch.Generator().manual_seed(5)
    base, stats = engine.generate_base(prompt, 40, temperature=0.8, generator=g)
    assert base.shape[0] == 40 and stats.spec_verify_ct == 0


def test_statistics(runs):
    model, prompt, _ = runs
    vocab = list(range(8))
    engine = SpeculativeEngine(model, random_draft(model, vocab_ids=vocab), "6_3_12")
    out, stats = engine.generate(prompt, 50)
    t = engine.spec.steps
    assert stats.prompt_tokens == prompt.shape[0] and stats.completion_tokens == out.shape[0] == 50
    assert stats.accept_length == pytest.approx(50 / stats.spec_verify_ct)
    assert len(stats.accepted_drafts) == stats.spec_verify_ct == sum(stats.accept_histogram(t))
    assert stats.accept_rate == pytest.approx(sum(stats.accepted_drafts) / (stats.spec_verify_ct * 11))
    # Tokens come from prefill (1) and from each round (accepted + bonus), the last one cut.
    produced = [1 + sum(a + 1 for a in stats.accepted_drafts[:r]) for r in (-1, None)]
    assert produced[0] < 50 <= produced[1]
    times = stats.token_times_s
    assert len(times) == 50 and times == sorted(times)
    assert 0 < stats.ttft_s == times[0] <= times[-1] <= stats.e2e_s and stats.tpot_s > 0
    assert set(stats.to_dict()) >= {"accept_length", "accept_rate", "spec_verify_ct", "tpot_s"}


# ---- where the time goes: per-phase timers ---------------------------------------------------

SPEC_PHASES = ("prefill", "draft", "verify", "accept", "cache")


def test_phase_times_sum_to_e2e(runs):
    """Speculative: prefill, draft, verify, accept and cache are all charged, decode is not; base:
    prefill and decode, nothing speculative. `other` is the rest, so the phases sum to e2e."""
    from specforge.engine.speculative import PHASES, PhaseTimer

    assert PhaseTimer({}, 0.0, "cpu").sync is None  # no synchronize on the CPU path
    model, prompt, _ = runs
    engine = SpeculativeEngine(model, random_draft(model, vocab_ids=list(range(8))), "4_2_8")
    _, spec = engine.generate(prompt, 40)
    _, base = engine.generate_base(prompt, 40)
    for stats in (spec, base):
        assert set(stats.phase_s) == set(PHASES)
        assert sum(stats.phase_s.values()) == pytest.approx(stats.e2e_s, rel=1e-9, abs=1e-12)
        assert stats.phase_s["other"] > 0
        assert stats.phase_s["prefill"] <= stats.ttft_s
        assert stats.to_dict()["phase_s"] == stats.phase_s
    assert spec.spec_verify_ct >= 2
    assert all(spec.phase_s[p] > 0 for p in SPEC_PHASES) and spec.phase_s["decode"] == 0
    assert base.phase_s["prefill"] > 0 and base.phase_s["decode"] > 0
    assert all(base.phase_s[p] == 0 for p in ("draft", "verify", "accept", "cache"))


def _slowed(fn, delay, calls):
    def wrapper(*args, **kwargs):
        calls.append(1)
        time.sleep(delay)
        return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("where, phase", [
    ("draft_tree", "draft"), ("draft_extend", "draft"), ("runner.tree", "verify"),
    ("greedy_verify", "accept"), ("runner.keep", "cache"), ("runner.decode", "decode")])
def test_phase_timers_charge_the_right_phase(runs, monkeypatch, where, phase):
    """A sleep injected into one step of the loop lands in that step's phase and in no other."""
    import specforge.engine.speculative as spec_module

    model, prompt, _ = runs
    engine = SpeculativeEngine(model, random_draft(model, vocab_ids=list(range(8))), "4_2_8")
    run = engine.generate_base if phase == "decode" else engine.generate
    owner = spec_module if where == "greedy_verify" else engine.runner if where.startswith("runner.") else engine
    name = where.split(".")[-1]
    original = getattr(owner, name)

    def run_slowed(delay):
        calls = []
        monkeypatch.setattr(owner, name, _slowed(original, delay, calls))
        _, stats = run(prompt, 24)
        return stats.phase_s, len(calls) - (where == "draft_extend")  # its first call: the draft prefill

    # The sleeps must outweigh every phase's own compute, also on a loaded 2-core machine (a fixed
    # 0.05 s each was once outweighed): sized from a run without them, which makes the same calls.
    own, n = run_slowed(0.0)
    assert n >= 3
    delay = max(0.05, 3 * max(own.values()) / n)
    phase_s, n_slowed = run_slowed(delay)
    slept = delay * n_slowed
    assert n_slowed == n
    assert phase_s[phase] >= slept
    assert all(v < slept for p, v in phase_s.items() if p != phase), phase_s


# ---- a shared prompt prefix (a system prompt), cached once ---------------------------------------


def test_shared_prefix_gives_the_same_caches_and_tokens(varied):
    """A request whose prompt starts with the shared prefix restores its entries and prefills the
    rest: the same target and draft caches as a whole prefill, the same tokens, base and
    speculative; a prompt that does not start with it prefills everything."""
    model, prompt, ref = varied
    draft = random_draft(model)
    whole = SpeculativeEngine(model, draft, "3_2_4")
    whole.reset(prompt.shape[0] + 8)
    token, state = whole.prefill(prompt)
    shared = SpeculativeEngine(model, draft, "3_2_4")
    assert shared.share_prefix(prompt[:7]) == 6
    _, _, cached = shared._start(prompt, 8, None, shared.spec.num_draft_tokens)
    assert cached == 6 and shared.runner.length == 6 and shared.draft_kv.length == 6
    token2, state2 = shared.prefill(prompt, cached=cached)
    assert token2.tolist() == token.tolist()
    torch.testing.assert_close(state2.probs, state.probs, atol=1e-5, rtol=1e-5)
    assert state2.ids.tolist() == state.ids.tolist()
    for a, b in zip(shared.runner.cache.layers, whole.runner.cache.layers):
        assert a.length == b.length == prompt.shape[0]
        torch.testing.assert_close(a.keys[:, :, : a.length], b.keys[:, :, : b.length], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.draft_kv.past(), whole.draft_kv.past(), atol=1e-5, rtol=1e-5)

    out, stats = shared.generate(prompt, 60)
    assert out.tolist() == ref.tolist()
    base, _ = shared.generate_base(prompt, 60)
    assert base.tolist() == ref.tolist()
    other = prompt.flip(0)  # does not start with the prefix: no entries restored
    assert shared._start(other, 8, None, 4)[2] == 0 and shared.runner.length == 0
    assert shared.generate(other, 20)[0].tolist() == greedy_reference(model, other, 20).tolist()
    shared.share_prefix(None)
    assert shared._start(prompt, 8, None, 4)[2] == 0


def test_shared_prefix_refuses_a_single_token(varied):
    model, prompt, _ = varied
    with pytest.raises(ValueError, match="at least 2 tokens"):
        SpeculativeEngine(model, None).share_prefix(prompt[:1])
