"""eval.shared_prefix: the system prompt the prompts of a suite share is cached once and only the
rest of each prompt is prefilled, base and speculative alike (SGLang's radix cache); the tokens and
accept figures are those of whole prefills."""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from specforge.eval.engine_eval import MIN_SHARED_PREFIX, eval_with_engine, load_run_config, shared_prefixes
from specforge.eval.report import markdown
from tests.test_eval_profile import tiny_run  # noqa: F401 - the fixture: a run dir with one random draft

SYSTEM = "You are a weather assistant. Reply with the city, the date and a one-line summary of the sky."


def prompt(ids, images=None):
    return {"input_ids": ids, **({"images": images} if images else {})}


def test_shared_prefixes_are_the_common_tokens_of_a_suite():
    head = list(range(100, 100 + MIN_SHARED_PREFIX))
    suites = {"chat": [prompt(head + [1, 2]), prompt(head + [1, 3]), prompt(head + [5])],
              "short": [prompt(head[:-1] + [1]), prompt(head[:-1] + [2])],  # one token too few
              "alone": [prompt(head + [1])],  # nothing to share with
              "images": [prompt(head + [1], {"pixel_values": 1}), prompt(head + [2])]}
    assert shared_prefixes(suites) == {"chat": head}


def test_the_evaluation_gives_the_same_figures_with_and_without_it(tiny_run, tmp_path):
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Weather in city {i}?"},
        {"role": "assistant", "content": "sunny"}]}) + "\n" for i in range(3)))
    run_cfg = load_run_config(tiny_run)
    results = {}
    for shared in (True, False):
        ev = OmegaConf.merge(run_cfg.eval, {"num_prompts": 3, "max_new_tokens": 12, "trees": ["2_1_3"],
                                            "dtype": "float32", "suites": [str(rows)], "shared_prefix": shared})
        results[shared] = eval_with_engine(run_cfg, [tiny_run / "epoch_1"], ev)
    (suite,) = results[True]["meta"]["shared_prefix_tokens"]
    assert results[True]["meta"]["shared_prefix_tokens"][suite] >= MIN_SHARED_PREFIX - 1
    assert results[False]["meta"]["shared_prefix_tokens"][suite] == 0
    with_prefix, without = results[True]["configs"][0], results[False]["configs"][0]
    assert with_prefix["lossless"] == without["lossless"] == 1.0
    for key in ("completion_tokens", "verify_rounds", "accept_length", "accept_histogram"):
        assert with_prefix[key] == without[key]
    assert "eval.shared_prefix" in markdown(results[True]) and "eval.shared_prefix" not in markdown(results[False])
