"""`eval.planner=true` (specforge/eval/planner_eval.py) and its cost model (specforge/eval/cost_model.py):
the stored cost model is reused under the same key and measured again under another, a round's cost
composes as documented, and the eval stage writes planner.json, heatmaps and the report section,
recommending the highest predicted speed-up; a confirmed tree's engine accept length is the
planner's (fp32 greedy: exact). Correctness only, never timing."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from specforge.engine.speculative import GenerationStats
from specforge.engine.tree_spec import TreeSpec
from specforge.eval.cost_model import CostModel, cost_key, decode_tokens_per_round, load_or_measure
from specforge.eval.engine_eval import load_run_config
from specforge.eval.planner import RequestPlan
from specforge.eval.planner_eval import fastest_tree
from specforge.eval.stage import run_evaluation
from specforge.run_layout import RunLayout
from specforge.utils.io import read_json

GRID = ["1_1_2", "3_1_4", "2_2_3", "3_2_6", "4_3_8"]


@pytest.fixture(scope="module")
def tiny_models(tiny_target_dir):
    from tests.test_engine import random_draft
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()
    return target, random_draft(target)


def test_cost_model_is_stored_reused_and_measured_again_when_the_key_differs(tiny_models, tmp_path):
    target, draft = tiny_models
    path, prompt = tmp_path / "cost_model.json", list(range(3, 15))
    key = cost_key("fp-a", draft, prefix_len=20)
    first, measured = load_or_measure(path, key, target, draft, prompt, GRID, repeats=2)
    assert measured and len(read_json(path)["models"]) == 1
    specs = [TreeSpec.parse(t) for t in GRID]
    assert set(first.t_verify) == set(first.t_accept) == set(first.t_keep) == {2, 3, 4, 6, 8}
    assert set(first.t_step) == set(first.t_level1) == {1, 2, 3} and set(first.t_build) == set(GRID)
    assert len(first.t_extend) == 5  # 4_3_8 emits up to T + 1 = 5 tokens a round
    figures = [first.t_base, *first.t_verify.values(), *first.t_step.values(), *first.t_build.values(), *first.t_extend]
    assert all(t > 0 for t in figures)

    again, measured = load_or_measure(path, key, target, draft, prompt, GRID[:3], repeats=2)
    assert not measured and again == first  # same key, a sub-grid: read back, not measured

    for other in ({**key, "threads": key["threads"] + 1}, {**key, "target": "fp-b"}, {**key, "prefix_len": 30}):
        _, measured = load_or_measure(path, other, target, draft, prompt, GRID[:2], repeats=2)
        assert measured
    stored = read_json(path)["models"]
    assert len(stored) == 4 and [m["key"] for m in stored][0] == key

    # same key, a grid with an N and a K it never measured: measured again (with the stored trees),
    # replacing its entry
    wider, measured = load_or_measure(path, key, target, draft, prompt, ["2_4_9"], repeats=2)
    assert measured and 9 in wider.t_verify and 4 in wider.t_step
    assert wider.covers(specs)  # with the trees it held before: a sub-grid never narrows the stored entry
    assert len(read_json(path)["models"]) == 4


def test_a_stored_cost_model_brings_back_its_kernels(tiny_models, tmp_path, monkeypatch):
    """The figures hold for the few-row kernels they were measured with: a process that reads the
    stored model runs its engines with those, untimed (a new timing could choose others)."""
    from specforge.engine import few_rows
    from specforge.engine.speculative import SpeculativeEngine

    monkeypatch.setattr(few_rows, "_CHOSEN", {})
    target, draft = tiny_models
    path, key = tmp_path / "cost_model.json", cost_key("fp-a", draft, prefix_len=20)
    model, _ = load_or_measure(path, key, target, draft, list(range(3, 15)), GRID[:2], repeats=1)
    engine = SpeculativeEngine(target, draft, "3_1_4")
    assert model.kernels == {**few_rows.kernels_of(engine.runner.kernel_modules),
                             **few_rows.kernels_of(engine.draft_linears)} and len(model.kernels) == 2

    stored = read_json(path)
    other = {geometry: {"2": "column"} for geometry in model.kernels}  # as if another machine state chose so
    stored["models"][0]["kernels"] = other
    path.write_text(json.dumps(stored))
    monkeypatch.setattr(few_rows, "_CHOSEN", {})  # a new process
    monkeypatch.setattr(few_rows, "_time_kernels", lambda *a: pytest.fail("kernels timed despite a stored model"))
    again, measured = load_or_measure(path, key, target, draft, list(range(3, 15)), GRID[:2])
    assert not measured and again.kernels == other
    engine = SpeculativeEngine(target, draft, "3_1_4")
    assert engine.runner.kernels == engine.draft_kernels == {2: "column"}


def test_round_cost_composes_as_documented():
    ms = 1e-3
    cost = CostModel(key={}, t_base=30 * ms, t_verify={6: 50 * ms, 8: 60 * ms}, t_accept={6: 0.5 * ms, 8: 0.7 * ms},
                     t_keep={6: 0.2 * ms, 8: 0.3 * ms}, t_level1={1: 0.1 * ms, 2: 0.15 * ms},
                     t_step={1: 1.5 * ms, 2: 2 * ms}, t_build={"5_1_6": 0.4 * ms, "4_2_8": 0.6 * ms},
                     t_extend=[1 * ms, 1.1 * ms, 1.2 * ms, 1.3 * ms, 1.4 * ms, 1.5 * ms])
    tree = TreeSpec.parse("4_2_8")
    hist = [2, 1, 0, 1, 0]  # rounds that accepted 0, 1, 2, 3, 4 drafts; catch-up over accepted + 1 tokens
    extend = (2 * 1 + 1 * 1.1 + 1 * 1.3) / 4 * ms
    overhead = (0.15 + 0.6 + 0.7 + 0.3 / 4) * ms  # 1 round in 4 accepts 2+ drafts: its path is copied
    assert cost.t_overhead(tree, hist) == pytest.approx(overhead)
    assert cost.t_round(tree, hist) == pytest.approx(extend + 3 * 2 * ms + 60 * ms + overhead)
    assert cost.speedup(tree, 2.5, hist) == pytest.approx(2.5 * 30 * ms / cost.t_round(tree, hist))
    # a decode speed-up: 2 requests of 65 tokens in 50 rounds emit 128 tokens by rounds, not 130
    assert decode_tokens_per_round({"completion_tokens": 130, "requests": 2, "verify_rounds": 50}) == 2.56
    chain = TreeSpec.parse("5_1_6")  # its path is always 0..a: compacted in place, no keep cost
    assert cost.t_overhead(chain, [0, 0, 0, 0, 0, 3]) == pytest.approx((0.1 + 0.4 + 0.5) * ms)
    assert cost.t_round(chain, [0, 0, 0, 0, 0, 3]) == pytest.approx(1.5 * ms + 4 * 1.5 * ms + 50 * ms + 1.0 * ms)
    assert CostModel.from_json(json.loads(json.dumps(cost.to_json()))) == cost


# ---- the eval stage ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planner_run(tmp_path_factory, tiny_target_dir, tiny_models):
    """A run as the pipeline leaves it: config.yaml, held-out conversations, epoch_1 = a draft
    fitted (TTT) to the target's greedy continuations of those prompts, epoch_2 = a random draft."""
    from transformers import AutoTokenizer

    from specforge.checkpoint import save_checkpoint
    from specforge.eval.prompts import heldout_prompts
    from specforge.eval.tiny_run import build_tiny_run
    from tests.test_engine import greedy_reference
    from tests.test_planner import trained_draft

    target, random = tiny_models
    run = build_tiny_run(tmp_path_factory.mktemp("planner") / "outputs" / "tiny", tiny_target_dir, random_draft=False)
    prompts = heldout_prompts(run / "data" / "eval.conversations.jsonl", AutoTokenizer.from_pretrained(str(tiny_target_dir)), 3)
    seqs = [torch.tensor(p["input_ids"]) for p in prompts]
    seqs = [torch.cat([s, greedy_reference(target, s, 40)]) for s in seqs]
    width = min(s.shape[0] for s in seqs)
    save_checkpoint(trained_draft(target, torch.stack([s[:width] for s in seqs])), run / "epoch_1", dtype=torch.float32)
    save_checkpoint(random, run / "epoch_2", dtype=torch.float32)
    return run


def planner_cfg(run, *overrides):
    from omegaconf import OmegaConf

    cfg = load_run_config(run).eval
    for item in ("planner=true", "num_prompts=3", "max_new_tokens=24", "dtype=float32", f"planner_trees={GRID}",
                 *overrides):
        key, value = item.split("=", 1)
        OmegaConf.update(cfg, key, OmegaConf.create(f"v: {value}").v)
    return cfg


def test_trajectories_come_from_the_tree_predicted_fastest_so_far():
    ms = 1e-3
    cost = CostModel(key={}, t_base=30 * ms, t_verify={3: 31 * ms, 6: 60 * ms}, t_accept={3: 0.0, 6: 0.0},
                     t_keep={3: 0.0, 6: 0.0}, t_level1={1: 0.0}, t_step={1: 1 * ms},
                     t_build={"2_1_3": 0.0, "5_1_6": 0.0}, t_extend=[1 * ms] * 6)
    chain, long_chain = TreeSpec.parse("2_1_3"), TreeSpec.parse("5_1_6")
    pick = fastest_tree(cost, [chain, long_chain])

    def request(spec, accepted):  # one prompt's plan: its first token, then a round per entry
        stats = GenerationStats(prompt_tokens=10, num_draft_tokens=spec.num_draft_tokens,
                                completion_tokens=1 + sum(a + 1 for a in accepted),
                                spec_verify_ct=len(accepted), accepted_drafts=list(accepted), e2e_s=1.0)
        return RequestPlan([], stats, [[1] * (spec.steps + 1)] * len(accepted))  # chains: a node per depth

    assert pick({"2_1_3": [], "5_1_6": []}) is None  # nothing planned yet: the first prompt decodes
    # 2_1_3 accepts 2 per round: 3 tokens in 33 ms (2.7x); 5_1_6 accepts 4: 5 tokens in 65 ms (2.3x)
    plans = {"2_1_3": [request(chain, [2, 2])], "5_1_6": [request(long_chain, [4, 4])]}
    assert pick(plans) == chain
    plans = {"2_1_3": [request(chain, [0, 0])], "5_1_6": [request(long_chain, [0, 0])]}
    assert pick(plans) is None  # no tree beats decoding (1 token per 33 ms or 65 ms): decode


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the evaluation uses every core


def test_eval_stage_plans_every_epoch_and_tree_and_recommends_the_best(planner_run, threads, capsys):
    summary = run_evaluation(load_run_config(planner_run), planner_run,
                             planner_cfg(planner_run, "planner_confirm=1", "planner_chains=5"))
    eval_dir = planner_run / "eval"
    planner = read_json(eval_dir / "planner.json")
    rows = planner["rows"]  # the grid, then the chains of up to 5 drafts it lacks (vLLM's), per epoch
    assert [(r["epoch"], r["tree"]) for r in rows if r["grid"]] == [(e, t) for e in (1, 2) for t in GRID]
    assert [(r["epoch"], r["tree"]) for r in rows if not r["grid"]] == [
        (e, t) for e in (1, 2) for t in ("2_1_3", "4_1_5", "5_1_6")]
    assert planner["meta"]["chains"] == ["2_1_3", "4_1_5", "5_1_6"]
    for r in rows:
        assert {"accept_length", "accept_rate", "tree_depth", "tree_width", "t_round_ms", "predicted_speedup"} <= set(r)
        assert r["predicted_speedup"] > 0
    best = max(rows, key=lambda r: r["predicted_speedup"])  # of them all: SGLang serves chains too
    assert (planner["recommended"]["epoch"], planner["recommended"]["tree"]) == (best["epoch"], best["tree"])
    assert (summary["best_epoch"], summary["best_tree"]) == (best["epoch"], best["tree"])
    fitted = {r["tree"]: r["accept_length"] for r in rows if r["epoch"] == 1}
    random = {r["tree"]: r["accept_length"] for r in rows if r["epoch"] == 2}
    assert max(fitted.values()) > max(random.values()) + 0.5  # the planner tells a trained draft apart
    assert best["epoch"] == 1

    assert planner["cost_model"]["measured_now"] and planner["seconds"]["planner"] > 0
    assert set(planner["cost_model"]["t_verify"]) == {"2", "3", "4", "5", "6", "8"}
    assert len(read_json(eval_dir / "cost_model.json")["models"]) == 1

    (confirmed,) = planner["confirmed"]
    assert confirmed["tree"] == best["tree"] and confirmed["epoch"] == 1
    assert confirmed["measured_accept_length"] == confirmed["accept_length"]  # fp32 greedy: exact
    assert confirmed["lossless"] == 1.0 and confirmed["measured_speedup"] > 0
    engine = read_json(eval_dir / "results.json")
    assert [(c["epoch"], c["tree"]) for c in engine["configs"]] == [(1, best["tree"])]

    for k in (1, 2, 3):
        assert (eval_dir / "plots" / f"planner_topk{k}.png").stat().st_size > 1000
    report = (eval_dir / "report.md").read_text()
    assert "## Evaluation: speculative decoding vs the base model" in report  # the confirmation's own section
    assert "## Tree planner" in report and f"**{best['tree']}** (recommended" in report
    assert "Confirmed by the engine" in report and "![planner_topk2](plots/planner_topk2.png)" in report
    assert "## Tree planner" in (planner_run / "report.md").read_text()  # the run's report includes it
    steps, topk, tokens = best["tree"].split("_")  # and serves the planner's choice
    assert (f"epoch_1 --speculative-num-steps {steps} --speculative-eagle-topk {topk} "
            f"--speculative-num-draft-tokens {tokens}") in (planner_run / "report.md").read_text().split("## Serve it")[1]
    out = capsys.readouterr()
    assert f"**{best['tree']}** (recommended" in out.out
    assert re.search(r"plan: 6/6 \(100%\), .*epoch_2", out.out + out.err)  # the progress of 2 epochs x 3 prompts
    chain = max((r for r in rows if r["epoch"] == best["epoch"] and r["tree"].split("_")[1] == "1"),
                key=lambda r: r["predicted_speedup"])  # vLLM drafts chains: the fastest one is served there
    assert read_json(RunLayout(planner_run).eval_choice)["chain"]["tree"] == chain["tree"]
    marks = "recommended, vLLM" if chain["tree"] == best["tree"] else "vLLM"
    assert f"| {chain['tree'].split('_')[0]} | **{chain['tree']}** ({marks}) |" in report
    assert "| num_speculative_tokens | chain |" in report and "and 3 more chains x 2 checkpoint(s)" in report
    assert f'"num_speculative_tokens": {chain["tree"].split("_")[0]}' in (planner_run / "report.md").read_text()

    # the same key again (one epoch, no confirmation): the stored cost model is reused
    run_evaluation(load_run_config(planner_run), planner_run, planner_cfg(planner_run, "epochs=[2]", "planner_chains=5"))
    planner = read_json(eval_dir / "planner.json")
    assert not planner["cost_model"]["measured_now"] and planner["seconds"]["cost_model"] == 0
    assert {r["epoch"] for r in planner["rows"]} == {2} and "confirmed" not in planner
    assert [r["tree"] for r in planner["rows"] if not r["grid"]] == ["2_1_3", "4_1_5", "5_1_6"]
    assert "Confirmed by the engine" not in (eval_dir / "report.md").read_text()


@pytest.mark.parametrize("override, message", [
    ("temperature=0.7", "greedy only"), ("planner_trees=['3_1_5']", "chain"), ("planner_trees=[]", "empty"),
    ("planner_trees=['3_0_4']", "eval.planner_trees: tree 3_0_4: topk must be a positive integer"),
    ("planner_trees=['5_1_6','2_1_3','5_1_6']", "eval.planner_trees: 5_1_6 listed more than once"),
    ("planner_chains=17", r"eval.planner_chains.*\[0, 16\]"),
    ("engine=server", "embedded")])
def test_planner_refuses_what_it_cannot_run_before_loading(planner_run, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        run_evaluation(load_run_config(planner_run), planner_run, planner_cfg(planner_run, override), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cost_model_bench_on_a_tiny_run(tmp_path, threads, capsys):
    """benchmarks/cost_model_bench.py end to end; what benchmarks/planner_bench.py wrote stays."""
    from specforge.utils.io import write_json
    from tests.test_eval_profile import benchmark

    module = benchmark("cost_model_bench")
    out = tmp_path / "planner.json"
    write_json(out, {"engine_s": 1.0, "trees": []})  # planner_bench's keys
    argv = ["--tiny", "--grid", "1_1_2", "2_2_3", "--trees", "2_1_3", "5_1_6", "--num-prompts", "2",
            "--max-new-tokens", "8", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    assert module.main(argv) == 0
    report = read_json(out)
    assert report["engine_s"] == 1.0 and report["trees"] == []
    assert [r["tree"] for r in report["rows"]] == ["2_1_3", "5_1_6"]
    for r in report["rows"]:
        assert r["measured_accept_length"] == r["accept_length"] and r["lossless"] == 1.0
        assert r["error"] == pytest.approx(r["predicted_speedup"] / r["measured_speedup"] - 1)
    assert report["grid_over_one_tree"] == pytest.approx(report["grid_seconds"] / report["one_tree_seconds"])
    assert report["cost_model_bench"]["timing_repeats"] == 3  # each request's fastest of 3 engine runs
    assert report["command"].endswith("--work-dir " + str(tmp_path / "work"))
    assert "written: " + str(out) in capsys.readouterr().out


def test_an_interrupted_planner_keeps_the_checkpoints_it_planned(planner_run, tiny_models, threads, tmp_path, capsys):
    """A Ctrl-C after epoch_1 is planned (on_progress is where the stage writes its partial file):
    the next run keeps epoch_1's rows and plans epoch_2 only; a checkpoint retrained since is
    planned again."""
    from specforge.checkpoint import save_checkpoint
    from specforge.eval.planner_eval import plan_epochs
    from specforge.eval.stage import PLANNER_PARTIAL_NAME
    from specforge.utils.io import write_json

    run_cfg, cfg = load_run_config(planner_run), planner_cfg(planner_run, "planner_chains=0")
    out = tmp_path / "out"
    ckpts = [planner_run / "epoch_1", planner_run / "epoch_2"]

    def ctrl_c(record):
        write_json(out / PLANNER_PARTIAL_NAME, record)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plan_epochs(run_cfg, ckpts, cfg, out / "cost_model.json", on_progress=ctrl_c)
    planned = read_json(out / PLANNER_PARTIAL_NAME)["rows"]
    assert {r["epoch"] for r in planned} == {1} and len(planned) == len(GRID)

    run_evaluation(run_cfg, planner_run, cfg, out)
    assert "[eval] epoch_1: planned by an earlier run of this planner that stopped, kept" in capsys.readouterr().out
    planner = read_json(out / "planner.json")
    assert [(r["epoch"], bool(r.get("resumed"))) for r in planner["rows"]] == [(1, True)] * 5 + [(2, False)] * 5
    for kept, row in zip(planned, planner["rows"]):
        assert {k: row[k] for k in kept if k != "resumed"} == kept
    assert planner["meta"]["resumed_checkpoints"] == 1
    assert "Planned by an earlier run that stopped, and kept: epoch_1." in (out / "report.md").read_text()
    assert not (out / PLANNER_PARTIAL_NAME).exists()

    write_json(out / PLANNER_PARTIAL_NAME, {"rows": planner["rows"], "plan_s": {}})
    retrained = copy.deepcopy(tiny_models[1])
    with torch.no_grad():
        next(retrained.parameters()).add_(0.01)
    save_checkpoint(retrained, tmp_path / "epoch_1", dtype=torch.float32)  # epoch_1 retrained: other bytes
    save_checkpoint(tiny_models[1], tmp_path / "epoch_2", dtype=torch.float32)  # the same bytes as before
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("epoch_1", "epoch_2"):
        (tmp_path / name).rename(moved / name)
    (moved / "config.yaml").write_bytes((planner_run / "config.yaml").read_bytes())
    (moved / "data").symlink_to(planner_run / "data")
    run_evaluation(load_run_config(moved), moved, cfg, out)
    again = read_json(out / "planner.json")["rows"]
    assert [(r["epoch"], bool(r.get("resumed"))) for r in again] == [(1, False)] * 5 + [(2, True)] * 5
    assert [r["checkpoint"] for r in again] == [str(moved / "epoch_1")] * 5 + [str(moved / "epoch_2")] * 5


def test_an_interrupted_confirmation_keeps_the_trees_it_measured(planner_run, threads, tmp_path, capsys):
    """eval.planner_confirm=2, a Ctrl-C once the first confirmed tree is kept: the next run keeps
    the planned checkpoint and that tree, and measures the second only."""
    from specforge.eval.planner_eval import eval_with_planner
    from specforge.eval.resume import Partial
    from specforge.eval.stage import PARTIAL_NAME, PLANNER_PARTIAL_NAME

    run_cfg = load_run_config(planner_run)
    cfg = planner_cfg(planner_run, "planner_chains=0", "planner_confirm=2", "epochs=[1]")
    out = tmp_path / "out"

    class CtrlCAfterOne(Partial):
        def save(self, record):
            super().save(record)
            if record["configs"]:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eval_with_planner(run_cfg, [planner_run / "epoch_1"], cfg, out / "cost_model.json",
                          Partial(out / PLANNER_PARTIAL_NAME, "planned"), CtrlCAfterOne(out / PARTIAL_NAME, "confirmed"))
    (first,) = read_json(out / PARTIAL_NAME)["configs"]

    run_evaluation(run_cfg, planner_run, cfg, out)
    said = capsys.readouterr().out
    assert "[eval] epoch_1: planned by an earlier run of this planner that stopped, kept" in said
    assert f"[eval] 1 of 2 configurations measured by an earlier run of this evaluation that stopped, kept: " \
           f"epoch_1 {first['tree']}" in said
    confirmed = read_json(out / "results.json")["configs"]
    assert [(c["tree"], c.get("resumed")) for c in confirmed][0] == (first["tree"], True)
    assert confirmed[1].get("resumed") is None and confirmed[0]["accept_length"] == first["accept_length"]
    assert [c["tree"] for c in read_json(out / "planner.json")["confirmed"]] == [c["tree"] for c in confirmed]
    assert not (out / PARTIAL_NAME).exists() and not (out / PLANNER_PARTIAL_NAME).exists()
