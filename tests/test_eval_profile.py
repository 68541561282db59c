"""Where the time goes: per-phase figures of the evaluation (aggregate, round cost), the report's
breakdown table, the CSV columns, and benchmarks/engine_profile.py end to end on a tiny run."""
from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from specforge.engine.speculative import GenerationStats
from specforge.eval.report import markdown, write_results
from specforge.eval.engine_eval import _against, aggregate, round_cost

ROOT = Path(__file__).resolve().parents[1]


def stats(completion, rounds, n_draft, e2e, **phases):
    s = GenerationStats(prompt_tokens=10, num_draft_tokens=n_draft, completion_tokens=completion,
                        spec_verify_ct=rounds, accepted_drafts=[1] * rounds, e2e_s=e2e, ttft_s=phases["prefill"])
    s.phase_s.update(phases)
    s.phase_s["other"] = e2e - sum(v for k, v in s.phase_s.items() if k != "other")
    return s


def base_stats():
    # 2 requests x 11 tokens: 20 decode steps, 0.2 s of one-token forwards, 0.04 s other
    return [stats(11, 0, 0, 0.37, prefill=0.05, decode=0.1), stats(11, 0, 0, 0.37, prefill=0.05, decode=0.1)]


def spec_stats():
    # 2 requests x 11 tokens in 5 rounds each: 10 rounds
    return [stats(11, 5, 6, 0.30, prefill=0.05, draft=0.05, verify=0.12, accept=0.01, cache=0.01)
            for _ in range(2)]


def test_aggregate_phase_figures_per_step_and_per_round():
    base = aggregate(base_stats())
    assert base["ms_per_step"] == pytest.approx(1000 * 0.64 / 20)
    assert base["decode_ms_per_step"] == pytest.approx(10.0)
    assert base["other_ms_per_step"] == pytest.approx(1000 * 0.44 / 20)
    assert base["share_prefill"] + base["share_decode"] + base["share_other"] == pytest.approx(1.0)
    assert "ms_per_round" not in base and "share_verify" not in base

    spec = aggregate(spec_stats(), steps=5)
    assert spec["ms_per_round"] == pytest.approx(1000 * 0.5 / 10)
    expected = {"draft": 10.0, "verify": 24.0, "accept": 2.0, "cache": 2.0, "other": 12.0}
    for phase, ms in expected.items():
        assert spec[f"{phase}_ms_per_round"] == pytest.approx(ms), phase
    shares = [spec[f"share_{p}"] for p in ("prefill", "draft", "verify", "accept", "cache", "other")]
    assert sum(shares) == pytest.approx(1.0) and spec["share_verify"] == pytest.approx(0.4)
    assert "ms_per_step" not in spec

    cost = round_cost(spec, base)
    assert cost["round_cost_steps"] == pytest.approx(50.0 / 32.0)
    assert cost["verify_cost_steps"] == pytest.approx(2.4) and cost["draft_cost_steps"] == pytest.approx(1.0)
    # no decode step at all (every prompt ends at its first token: an end-of-sequence there): nan, not a
    # ZeroDivisionError, in the figures and in the speed-ups against such a base
    only_first = aggregate([stats(1, 0, 0, 0.1, prefill=0.05)])
    assert math.isnan(only_first["ms_per_step"]) and math.isnan(only_first["decode_tok_s"])
    against = _against(aggregate([stats(1, 0, 6, 0.1, prefill=0.05)], steps=5), only_first)
    assert math.isnan(against["decode_speedup"]) and against["speedup"] == pytest.approx(1.0)


def results_of(epochs_trees):
    base = aggregate(base_stats())
    base.update(tok_s_first_pass=base["tok_s"], tok_s_second_pass=base["tok_s"])
    configs = []
    for i, (epoch, tree) in enumerate(epochs_trees):
        row = {"checkpoint": f"run/epoch_{epoch}", "epoch": epoch, "tree": tree, "lossless": 1.0,
               **aggregate(spec_stats(), steps=5)}
        row["speedup"] = row["tok_s"] / base["tok_s"] + 0.01 * i  # the last one is best
        row["decode_speedup"] = row["decode_tok_s"] / base["decode_tok_s"]
        row.update(round_cost(row, base))
        configs.append(row)
    meta = {"prompts": 2, "max_new_tokens": 11, "temperature": 0.0, "dtype": "float32", "device": "cpu",
            "threads": 1, "exact_ancestor_attention": False}
    return {"base": base, "configs": configs, "meta": meta}


def table(md: str, header: str) -> list[str]:
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_report_has_the_breakdown_table():
    results = results_of([(1, "5_1_6"), (1, "8_2_16"), (2, "5_1_6")])
    md = markdown(results)
    # the existing table and the ship recommendation are still there
    assert len(table(md, "| epoch | tree | prefill s |")) == 3 and "**Ship `epoch_2` with tree `5_1_6`**" in md
    assert "### Where the time goes" in md
    header = ("| epoch | tree | ms/round | draft | verify | accept | cache | other | "
              "round cost (decode steps) | accept length |")
    rows = table(md, header)
    assert len(rows) == 3
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cells[:4] == ["1", "8_2_16", "50.00", "10.00 (17%)"] and cells[4] == "24.00 (40%)"
    assert float(cells[-2]) == pytest.approx(50 / 32, abs=1e-3) and cells[-1] == "2.200"
    assert "Base model: 32.00 ms per decode step (one-token forward 10.00 (27%)" in md
    assert ("For `epoch_2` / `5_1_6` (the fastest configuration) a round costs 1.56 decode steps "
            "(verify 2.40, draft 1.00 one-token forwards; verify is 48% of the round) and commits 2.20 tokens: "
            "2.20 / 1.56 = 1.41x expected") in md


def test_the_ship_line_of_a_sampled_evaluation_does_not_claim_lossless():
    """At temperature > 0 outputs are not compared with the base model's (lossless is None): the
    headline says so, not "among lossless configurations"."""
    results = results_of([(1, "5_1_6"), (2, "5_1_6")])
    results["meta"]["temperature"] = 0.7
    for row in results["configs"]:
        row["lossless"] = None
    md = markdown(results)
    assert ("lossless -; best speed-up (sampled at temperature 0.7: outputs not compared with the base model's)"
            in md) and "among lossless" not in md


def test_report_without_phase_figures_keeps_the_old_tables():
    results = results_of([(1, "5_1_6")])
    for row in [results["base"], *results["configs"]]:
        for k in [k for k in row if "_ms_per_" in k or k.startswith(("ms_per", "share_"))]:
            del row[k]
    md = markdown(results)
    assert "Where the time goes" not in md and "**Ship `epoch_1`" in md


def test_no_ship_headline_when_every_configuration_is_slower_than_the_base():
    results = results_of([(1, "5_1_6"), (2, "12_8_64")])
    for i, row in enumerate(results["configs"]):
        row["speedup"] = 0.8 + 0.09 * i
    md = markdown(results)
    assert "**Ship" not in md
    assert ("**No configuration was faster than the base model here**: the fastest, `epoch_2` with tree "
            "`12_8_64`, reached a speed-up of 0.89x (accept length 2.20, lossless 1.000;") in md


def test_results_csv_and_json_carry_the_phase_figures(tmp_path):
    results = results_of([(1, "5_1_6"), (2, "8_2_16")])
    write_results(results, tmp_path)
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["tree"] for r in rows] == ["base", "5_1_6", "8_2_16"]
    assert float(rows[0]["ms_per_step"]) == pytest.approx(32.0) and rows[0]["ms_per_round"] == ""
    for r in rows[1:]:
        assert float(r["verify_ms_per_round"]) == pytest.approx(24.0)
        assert float(r["round_cost_steps"]) == pytest.approx(50 / 32)
        assert float(r["share_verify"]) == pytest.approx(0.4)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["configs"][0]["draft_cost_steps"] == pytest.approx(1.0)
    assert "Where the time goes" in (tmp_path / "report.md").read_text()


# ---- benchmarks/ scripts on a tiny run ------------------------------------------------------------


def benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_run(tmp_path, tiny_target_dir):
    """A run directory as the pipeline leaves it, without training: config.yaml, held-out
    conversations and one random draft checkpoint for the tiny target."""
    from specforge.eval.tiny_run import build_tiny_run

    return build_tiny_run(tmp_path / "outputs" / "tiny", tiny_target_dir)


def test_engine_profile_script_end_to_end(tiny_run, tmp_path, capsys):
    module = benchmark("engine_profile")
    out = tmp_path / "profile.json"
    threads = torch.get_num_threads()
    try:
        rc = module.main(["--ckpt", str(tiny_run), "--trees", "2_1_3", "3_2_6", "--num-prompts", "2",
                          "--max-new-tokens", "12", "--dtype", "float32", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the evaluation uses every core
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["checkpoints"] == [str(tiny_run / "epoch_1")] and report["prompts"] == 2
    base = report["base"]
    assert {"ms_per_step", "decode_ms_per_step", "other_ms_per_step", "share_prefill", "share_decode"} <= set(base)
    assert base["decode_ms_per_step"] > 0
    assert [r["tree"] for r in report["configs"]] == ["2_1_3", "3_2_6"]
    for r in report["configs"]:
        assert "requests_detail" not in r
        for phase in ("draft", "verify", "accept", "cache"):
            assert r[f"{phase}_ms_per_round"] > 0 and r[f"share_{phase}"] > 0
        assert r["ms_per_round"] == pytest.approx(sum(r[f"{p}_ms_per_round"]
                                                      for p in ("draft", "verify", "accept", "cache", "other")))
        assert r["round_cost_steps"] > 0 and r["verify_cost_steps"] > 0 and r["draft_cost_steps"] > 0
        assert r["lossless"] == 1.0  # fp32 greedy
    printed = capsys.readouterr().out
    assert "### Where the time goes" in printed
    assert len(table(printed, "| epoch | tree | ms/round |")) == 2


def test_demo_speedup_script_records_the_best_lossless_tree(tiny_run, tmp_path, capsys):
    """benchmarks/demo_speedup.py: the issue's keys, the fastest tree among the lossless ones, and
    each tree's bound accept length x t_base / t_round from the same run's timings."""
    module = benchmark("demo_speedup")
    out = tmp_path / "demo_speedup.json"
    threads = torch.get_num_threads()
    try:
        rc = module.main(["--ckpt", str(tiny_run), "--trees", "2_1_3", "3_2_6", "--num-prompts", "2",
                          "--max-new-tokens", "12", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    record = json.loads(out.read_text())
    assert {"tree", "speedup", "accept_length", "lossless_share", "dtype", "command"} <= set(record)
    assert record["dtype"] == "float32" and record["lossless_share"] == 1.0
    assert record["command"].startswith("python benchmarks/demo_speedup.py --ckpt ")
    rows = {r["tree"]: r for r in record["rows"]}
    assert set(rows) == {"2_1_3", "3_2_6"}
    assert record["speedup"] == max(r["speedup"] for r in rows.values())
    top = rows[record["tree"]]
    assert record["accept_length"] == top["accept_length"] and record["bound"] == top["bound"]
    for r in rows.values():
        assert r["bound"] == pytest.approx(r["accept_length"] / r["round_cost_steps"])  # round cost in base steps
        assert r["of_bound"] == pytest.approx(r["speedup"] / r["bound"])
    assert f"| {record['tree']}" in capsys.readouterr().out.replace("**", "")


def test_verify_consistency_script_on_a_tiny_run(tiny_run, tmp_path, capsys):
    """fp32: chunked verify and one-token decode agree to float rounding (no argmax flip); the
    comparison really covers every greedy position of every prompt."""
    module = benchmark("verify_consistency")
    out = tmp_path / "consistency.json"
    assert module.main(["--run", str(tiny_run), "--dtypes", "float32", "--prompts", "2", "--tokens", "9",
                        "--chunk", "4", "--threads", str(torch.get_num_threads()), "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["positions"] == 2 * 9 and row["argmax_flips"] == 0
    assert row["max_abs_logit_diff"] < 1e-3  # different kernels, same maths
    assert "| float32 | 18 | 0 |" in capsys.readouterr().out


def test_find_checkpoints_every_epoch_or_the_chosen_ones(tmp_path):
    from specforge.eval.engine_eval import find_checkpoints

    for k in (1, 2, 10):
        (tmp_path / f"epoch_{k}").mkdir()
        (tmp_path / f"epoch_{k}" / "config.json").write_text("{}")
    (tmp_path / "epoch_x").mkdir()
    assert [p.name for p in find_checkpoints(tmp_path)[1]] == ["epoch_1", "epoch_2", "epoch_10"]
    assert [p.name for p in find_checkpoints(tmp_path, [10, 1])[1]] == ["epoch_1", "epoch_10"]
    with pytest.raises(FileNotFoundError, match=r"eval.epochs: .* has no epoch_3 \(it has \[1, 2, 10\]\)"):
        find_checkpoints(tmp_path, [3])
    assert find_checkpoints(tmp_path / "epoch_2", [2]) == (tmp_path, [tmp_path / "epoch_2"])  # one checkpoint: as given
    with pytest.raises(ValueError, match=r"eval.epochs=\[1\]: ckpt=.*epoch_2 is one checkpoint"):  # not among them
        find_checkpoints(tmp_path / "epoch_2", [1])
