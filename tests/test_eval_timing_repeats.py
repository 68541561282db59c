"""eval.timing_repeats: each request runs R times back to back and keeps its fastest run's figures
(tokens and accept figures are those of every run); runs that disagree are refused, and R < 1
before anything loads."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import specforge.eval.engine_eval as engine_eval
from specforge.checkpoint import load_draft
from specforge.engine.speculative import SpeculativeEngine
from specforge.engine.tree_spec import TreeSpec
from specforge.eval.engine_eval import _run_pass, eval_with_engine, load_engine_inputs, load_run_config
from specforge.utils.progress import progress_bar
from tests.test_eval_profile import tiny_run  # noqa: F401 - the fixture: a run dir with one random draft


def eval_config(run_dir, **overrides):
    run_cfg = load_run_config(run_dir)
    ev = OmegaConf.merge(run_cfg.eval, {"num_prompts": 2, "max_new_tokens": 8, "trees": ["2_1_3"],
                                        "dtype": "float32", **overrides})
    return run_cfg, ev


class Spy:
    """The engine's own generate, with every run's result kept (the real function runs)."""

    def __init__(self, run, perturb_call: int | None = None):
        self.run, self.runs, self.perturb_call = run, [], perturb_call

    def __call__(self, *args, **kwargs):
        ids, stats = self.run(*args, **kwargs)
        if len(self.runs) == self.perturb_call:  # what a non-deterministic kernel would do
            ids = ids.clone()
            ids[-1] += 1
        self.runs.append((ids.tolist(), stats))
        return ids, stats


def engine_and_prompts(run_dir, ev):
    run_cfg = load_run_config(run_dir)
    device, dtype_name, tokenizer, suites, target = load_engine_inputs(run_cfg, ev)
    draft = load_draft(run_dir / "epoch_1", device=device, dtype=torch.float32)
    return SpeculativeEngine(target, draft, TreeSpec.parse("2_1_3")), suites["heldout"], tokenizer.eos_token_id


def test_each_request_keeps_its_fastest_run(tiny_run):
    _, ev = eval_config(tiny_run, timing_repeats=3)
    engine, prompts, eos = engine_and_prompts(tiny_run, ev)
    for speculative in (True, False):
        spy = Spy(engine.generate if speculative else engine.generate_base)
        setattr(engine, "generate" if speculative else "generate_base", spy)
        with progress_bar(disable=True) as bar:
            outputs, stats = _run_pass(engine, prompts, ev, eos, speculative, bar, bar.add_task("t", total=2, info=""))
        assert len(spy.runs) == 3 * len(prompts)
        for i, (out, kept) in enumerate(zip(outputs, stats)):
            runs = spy.runs[3 * i: 3 * i + 3]
            assert all(ids == out for ids, _ in runs)  # every run gave the same tokens
            assert kept is min((s for _, s in runs), key=lambda s: s.e2e_s)
            assert kept.accepted_drafts == runs[0][1].accepted_drafts


def test_runs_that_disagree_are_refused_naming_the_prompt(tiny_run):
    _, ev = eval_config(tiny_run, timing_repeats=2)
    engine, prompts, eos = engine_and_prompts(tiny_run, ev)
    engine.generate = Spy(engine.generate, perturb_call=1)  # the first prompt's second run
    with progress_bar(disable=True) as bar, pytest.raises(RuntimeError, match=rf"prompt '{prompts[0]['id']}' gave "
                                                                              r"other tokens.*timing_repeats=1"):
        _run_pass(engine, prompts, ev, eos, True, bar, bar.add_task("t", total=2, info=""))


def test_the_evaluation_records_it_and_gives_the_same_figures(tiny_run):
    run_cfg, once = eval_config(tiny_run)
    _, thrice = eval_config(tiny_run, timing_repeats=3)
    a, b = eval_with_engine(run_cfg, [tiny_run / "epoch_1"], once), eval_with_engine(run_cfg, [tiny_run / "epoch_1"], thrice)
    assert (a["meta"]["timing_repeats"], b["meta"]["timing_repeats"]) == (1, 3)
    for key in ("completion_tokens", "verify_rounds", "accept_length", "accept_histogram", "lossless"):
        assert a["configs"][0][key] == b["configs"][0][key]


def test_fewer_than_one_run_is_refused_before_the_target_loads(tiny_run, monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("the target loaded before eval.timing_repeats was checked")

    monkeypatch.setattr(engine_eval, "load_target", tripwire)
    run_cfg, ev = eval_config(tiny_run, timing_repeats=0)
    with pytest.raises(ValueError, match="eval.timing_repeats=0"):
        eval_with_engine(run_cfg, [tiny_run / "epoch_1"], ev)
