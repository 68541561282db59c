"""The planner (specforge/eval/planner.py) against the engine: for every prompt and tree, the same
output and the same accepted drafts in every round, on the tiny fp32 target with a draft trained
(the real TTT loss) to accept 0..T drafts per round."""
import pytest
import torch

from specforge.engine.speculative import SpeculativeEngine
from specforge.engine.tree_spec import TreeSpec
from specforge.eval.engine_eval import aggregate
from specforge.eval.planner import DraftLevels, batched_trajectories, greedy_trajectory, plan, summarize
from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.train.ttt import Teacher, ttt_forward
from tests.test_engine import AUX, greedy_reference, load_target, make_prompt

# chains (K=1, N=T+1) and K>1 trees whose N-1 is below the K+(T-1)K^2 candidates
TREES = ["1_1_2", "3_1_4", "5_1_6", "2_2_3", "3_2_6", "4_3_8", "5_3_12", "4_4_16", "6_3_10"]
MAX_NEW = 40


def trained_draft(model, seqs: torch.Tensor, steps: int = 100) -> Eagle3Draft:
    """A draft fitted by TTT (3 steps) to the target's greedy continuations `seqs` [B, S]."""
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.from_target(model.config, AUX))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        hidden = model(seqs, output_hidden_states=True).hidden_states
    batch = {"input_ids": seqs, "loss_mask": torch.ones_like(seqs, dtype=torch.bool),
             "aux": torch.cat([hidden[i + 1] for i in AUX], -1), "last": hidden[-1],
             "position_ids": torch.arange(seqs.shape[1]).expand_as(seqs)}
    teacher = Teacher(model.lm_head.weight.detach(), draft.t2d)
    opt = torch.optim.Adam(draft.trainable_parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = ttt_forward(draft, batch, teacher, 3, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def setup(tiny_target_dir):
    model = load_target(tiny_target_dir, 0.2)
    prompts = [make_prompt(model.config.vocab_size, n=10, seed=s) for s in range(1, 7)]
    refs = [greedy_reference(model, p, 48) for p in prompts]
    draft = trained_draft(model, torch.stack([torch.cat([p, r]) for p, r in zip(prompts, refs)]))
    eos = refs[0].tolist()[10]  # stops request 0 mid-way (and any other that emits it)
    return model, draft, prompts, refs, eos


def engine_runs(model, draft, prompts, trees, max_new, eos, exact=False):
    runs = {}
    for tree in trees:
        engine = SpeculativeEngine(model, draft, tree, exact_ancestor_attention=exact)
        runs[tree] = [engine.generate(p, max_new, eos_token_id=eos) for p in prompts]
    return runs


_ENGINE_RUNS = {}


@pytest.mark.parametrize("batch, source, rows", [(0, None, 1), (7, None, 1), (256, None, 1), (256, "3_2_6", 1),
                                                 (256, None, 4)],
                         ids=["per-round", "batched-7", "batched-256", "speculative-trajectory",
                              "batched-trajectories"])
@pytest.mark.parametrize("max_new, use_eos", [(MAX_NEW, False), (17, True)])
def test_every_round_of_every_tree_matches_the_engine(setup, max_new, use_eos, batch, source, rows):
    """batch=0: the engine's draft_levels at each round start; 7: chunks of a few round starts
    (K does not divide 7); 256: all of a request's round starts in one forward per level;
    source: the greedy tokens from the engine with that tree rather than from decoding one prompt
    at a time; rows=4: from decoding 4 prompts at once (6 prompts: a chunk of 4, one of 2)."""
    model, draft, prompts, refs, eos = setup
    eos = eos if use_eos else None
    plans = plan(model, draft, prompts, TREES, max_new, eos_token_id=eos, batch=batch, trajectory_tree=source,
                 trajectory_batch=rows)
    key = (max_new, eos)
    if key not in _ENGINE_RUNS:
        _ENGINE_RUNS[key] = engine_runs(model, draft, prompts, TREES, max_new, eos)
    runs = _ENGINE_RUNS[key]
    for tree in TREES:
        for i, ((out, stats), got) in enumerate(zip(runs[tree], plans[tree])):
            assert got.tokens == out.tolist(), (tree, i)
            assert got.stats.accepted_drafts == stats.accepted_drafts, (tree, i)
            assert (got.stats.completion_tokens, got.stats.spec_verify_ct) == (
                stats.completion_tokens, stats.spec_verify_ct)
            assert [sum(w) for w in got.nodes_per_depth] == [TreeSpec.parse(tree).num_draft_tokens] * stats.spec_verify_ct
            # a last round whose walk went past the stop counts what it committed, as SGLang does
            assert 1 + sum(a + 1 for a in stats.accepted_drafts) == stats.completion_tokens, (tree, i)
        accept = aggregate([s for _, s in runs[tree]], TreeSpec.parse(tree).steps)
        row = summarize(tree, plans[tree])
        for key in ("accept_length", "round_accept_length", "accept_rate", "accept_histogram", "verify_rounds"):
            assert row[key] == accept[key], (tree, key)
    lengths = {tree: summarize(tree, plans[tree])["accept_length"] for tree in TREES}
    assert max(lengths.values()) > 2.5 and len(set(lengths.values())) >= 5  # a discriminating grid
    if use_eos:
        ref = refs[0].tolist()
        assert plans["1_1_2"][0].tokens == ref[: ref.index(eos) + 1]


def test_batched_trajectories_equal_one_prompt_at_a_time(setup):
    """Prompts of different lengths (left padding of 0-6 tokens), one stopped early by EOS: the
    same tokens, stop and features as decoding each prompt alone."""
    model, draft, *_ = setup
    prompts = [make_prompt(model.config.vocab_size, n=n, seed=10 + n) for n in (7, 13, 10)]
    engine = SpeculativeEngine(model, draft, "3_1_4")
    alone = [greedy_trajectory(engine.runner, p, 20, None, extra=4) for p in prompts]
    eos = int(alone[1].tokens[5])  # prompt 1 stops at its 6th token (and any other that emits it)
    alone = [greedy_trajectory(engine.runner, p, 20, eos, extra=4) for p in prompts]
    together = batched_trajectories(engine.runner, prompts, 20, eos, extra=4)
    assert alone[1].stop <= 6 and len({t.stop for t in alone}) > 1
    for a, b in zip(alone, together):
        assert b.stop == a.stop and torch.equal(b.tokens, a.tokens)
        assert b.aux.shape == a.aux.shape and torch.allclose(b.aux, a.aux, atol=1e-4, rtol=1e-4)
        assert torch.isfinite(b.aux).all()


def test_exact_ancestor_attention(setup):
    """The planner runs the engine's lanes, so the exact-ancestor option carries over."""
    model, draft, prompts, _, _ = setup
    trees = ["3_2_6", "5_3_12", "4_4_16"]
    runs = engine_runs(model, draft, prompts[:3], trees, MAX_NEW, None, exact=True)
    for batch in (0, 256):
        plans = plan(model, draft, prompts[:3], trees, MAX_NEW, exact_ancestor_attention=True, batch=batch)
        for tree in trees:
            assert [p.stats.accepted_drafts for p in plans[tree]] == [s.accepted_drafts for _, s in runs[tree]]


@pytest.mark.parametrize("exact", [False, True])
def test_batched_levels_equal_the_engines_at_every_round_start(setup, exact):
    model, draft, prompts, _, _ = setup
    engine = SpeculativeEngine(model, draft, "5_3_12", exact_ancestor_attention=exact)
    traj = greedy_trajectory(engine.runner, prompts[1], MAX_NEW, None, extra=5)
    batched = DraftLevels(engine, traj, batch=10)
    reference = DraftLevels(engine, traj, batch=0)  # the engine's draft_levels, on demand
    for c in range(1, traj.stop):
        for got, ref in zip(batched.levels(c), reference.levels(c)):
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_levels_do_not_depend_on_t_or_n(setup):
    """What the planner's memo relies on: a shorter tree's levels are a prefix of a longer one's."""
    model, draft, prompts, _, _ = setup
    levels = []
    for tree in ("6_3_10", "4_3_8"):
        engine = SpeculativeEngine(model, draft, tree)
        with torch.inference_mode():
            engine.reset(64)
            _, state = engine.prefill(prompts[0])
            levels.append(engine.draft_levels(state))
    assert len(levels[0][0]) == 6 and len(levels[1][0]) == 4
    for long, short in zip(*levels):
        for a, b in zip(long, short):
            assert torch.equal(a, b)


def test_summary_shape(setup):
    model, draft, prompts, _, _ = setup
    row = summarize("4_4_16", plan(model, draft, prompts[:2], ["4_4_16"], MAX_NEW)["4_4_16"])
    assert row["nodes_per_depth"][0] == 1 and sum(row["nodes_per_depth"]) == pytest.approx(16)
    assert 1 <= row["tree_depth"] <= 4
    hist = row["accept_histogram"]
    assert row["reach"] == pytest.approx([sum(hist[d:]) / sum(hist) for d in range(1, 5)])
