"""`eval.planner=true`: every epoch x tree of `eval.planner_trees` from one greedy pass
per prompt (planner.py), priced by the round costs measured on this machine (cost_model.py), and
the epoch x tree to ship: the highest predicted speed-up, among the grid and every chain vLLM could
serve (`eval.planner_chains`; SGLang serves them too). `eval.planner_confirm=k` then measures
the k best trees of that epoch with the engine's own evaluation (`eval_with_engine`: base model
before and after, same prompts) and records how far the prediction was off.

Greedy (temperature 0) only: the planner replays the engine's rounds against the greedy tokens.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from specforge.checkpoint import load_draft
from specforge.engine.tree_spec import TreeSpec
from specforge.errors import InvalidInput
from specforge.eval import resume
from specforge.eval.cost_model import cost_key, decode_tokens_per_round, load_or_measure, prefix_length
from specforge.eval.engine_eval import eval_with_engine, load_engine_inputs
from specforge.eval.planner import TRAJECTORY_BATCH, plan, summarize
from specforge.eval.resume import KEY as RESUME_KEY
from specforge.run_layout import epoch_of
from specforge.targets.loader import resolve_target_path, stop_token_ids, target_fingerprint, torch_dtype
from specforge.targets.vl import is_vl_config
from specforge.utils.io import file_fingerprint
from specforge.utils.progress import progress_bar


def check_planner(eval_cfg) -> list[TreeSpec]:
    """The grid, refused before anything loads when the planner cannot run it."""
    if str(eval_cfg.engine) != "embedded":
        raise InvalidInput(f"eval.planner=true runs the embedded engine's planner, not eval.engine={eval_cfg.engine}")
    if eval_cfg.temperature > 0:
        raise InvalidInput(f"eval.planner=true is greedy only (it replays rounds against the greedy tokens); "
                           f"eval.temperature={eval_cfg.temperature}: set it to 0")
    specs = TreeSpec.parse_list(eval_cfg.planner_trees, "eval.planner_trees")
    if not specs:
        raise InvalidInput("eval.planner_trees is empty: give the trees T_K_N to plan, e.g. [5_1_6,8_2_16]")
    return specs


def vllm_chains(eval_cfg, specs: list[TreeSpec]) -> list[TreeSpec]:
    """The chains T_1_(T+1), T = 1..eval.planner_chains, that the grid lacks. vLLM drafts chains only
    (num_speculative_tokens = T), so its chain is chosen among every length, not among the grid's
    (the default grid's two chains draft 8 and 16 tokens). They reuse the grid's draft levels of
    topk 1 (a shorter T takes a prefix) and cost a replay each."""
    grid = {s.name for s in specs}
    chains = [TreeSpec(t, 1, t + 1) for t in range(1, int(getattr(eval_cfg, "planner_chains", 0)) + 1)]
    return [c for c in chains if c.name not in grid]


def _nan_max(rows, key):
    return max(rows, key=lambda r: -math.inf if math.isnan(r[key]) else r[key])


def fastest_tree(cost, specs: list[TreeSpec]):
    """Where the planner's next greedy trajectory comes from (one prompt at a time: vision-language
    targets; text prompts are decoded in batches): the tree predicted fastest on the
    prompts planned so far (the same tokens at temperature 0, in the fewest target forwards), or
    plain decoding (None) for the first prompt and while no tree is predicted to beat it."""

    def pick(plans: dict) -> TreeSpec | None:
        best, best_speedup = None, 1.0
        for spec in specs:
            if not plans[spec.name]:
                return None
            row = summarize(spec.name, plans[spec.name])
            if row["verify_rounds"]:
                predicted = cost.speedup(spec, decode_tokens_per_round(row), row["accept_histogram"])
                if predicted > best_speedup:
                    best, best_speedup = spec, predicted
        return best

    return pick


# what a checkpoint's plans depend on, besides the machine, the target, prompts, checkpoint and cost model
KEYED_SETTINGS = ("max_new_tokens", "exact_ancestor_attention")


def plan_epochs(run_cfg, ckpts: list[Path], eval_cfg, cost_path: Path, on_progress=None,
                earlier: dict | None = None) -> dict:
    """The planner over every checkpoint x tree of the grid and of `vllm_chains` (rows marked
    `grid` or not): accept figures, the accepted shape (tree_depth: mean deepest node of the built
    trees; tree_width = (N-1) / tree_depth), the round's cost and the predicted speed-up; the
    recommended epoch x tree (the highest predicted speed-up of them all: SGLang serves chains
    too); the cost model; wall times. `on_progress({"rows", "plan_s"})` after each checkpoint; a
    checkpoint whose rows `earlier` (such a record of a run that stopped) holds under the same key
    (resume.py: with the cost model's figures, which pick the trajectories) is not planned again."""
    specs = check_planner(eval_cfg)
    chains = vllm_chains(eval_cfg, specs)
    device, dtype_name, tokenizer, suites, target = load_engine_inputs(run_cfg, eval_cfg)
    prompts = [p for suite in suites.values() for p in suite]
    eos, exact = stop_token_ids(target, tokenizer), eval_cfg.exact_ancestor_attention
    prefix = prefix_length(prompts, eval_cfg.max_new_tokens)
    fingerprint = target_fingerprint(resolve_target_path(run_cfg.target))
    common = resume.settings(fingerprint, eval_cfg, prompts, dtype_name, device, KEYED_SETTINGS)
    earlier = earlier or {}
    earlier_s = earlier.get("plan_s") if isinstance(earlier.get("plan_s"), dict) else {}
    rows, cost, measured, plan_s, resumed = [], None, False, {}, 0
    with progress_bar() as bar:
        task = bar.add_task("plan", total=len(ckpts) * len(prompts), info="")
        for ckpt in ckpts:
            draft = load_draft(ckpt, device=device, dtype=torch_dtype(dtype_name))
            if cost is None:  # every epoch of a run has the same geometry, so the same costs
                bar.update(task, info="round costs")
                key = cost_key(fingerprint, draft, prefix, exact)
                cost, measured = load_or_measure(cost_path, key, target, draft, prompts[0], specs + chains)
            bar.update(task, info=ckpt.name)
            ckpt_key = resume.config_key(common, file_fingerprint(ckpt), [s.name for s in specs + chains],
                                         cost.to_json())
            config = {"epoch": epoch_of(ckpt), "checkpoint": str(ckpt), RESUME_KEY: ckpt_key}
            kept = [r for r in resume.rows(earlier, "rows") if r.get(RESUME_KEY) == ckpt_key]
            if kept:
                print(f"[eval] {ckpt.name}: planned by an earlier run of this planner that stopped, kept", flush=True)
                rows += [{**r, **config, "resumed": True} for r in kept]
                plan_s[str(ckpt)] = float(earlier_s.get(ckpt_key, 0.0))
                resumed += 1
                bar.advance(task, len(prompts))
                continue
            t0 = time.perf_counter()
            plans = plan(target, draft, prompts, specs + chains, eval_cfg.max_new_tokens, eos, exact,
                         trajectory_tree=fastest_tree(cost, specs), on_planned=lambda: bar.advance(task))
            plan_s[str(ckpt)] = time.perf_counter() - t0
            rows += _rows(config, specs, chains, plans, cost)
            if on_progress:
                on_progress({"rows": rows, "plan_s": {r[RESUME_KEY]: plan_s[r["checkpoint"]] for r in rows}})
    return {"meta": {"prompts": len(prompts), "max_new_tokens": eval_cfg.max_new_tokens, "dtype": dtype_name,
                     "device": device, "threads": torch.get_num_threads(), "trees": [s.name for s in specs],
                     "chains": [s.name for s in chains], "resumed_checkpoints": resumed,
                     "prefix_len": prefix,
                     "trajectory": "decoding, then the tree predicted fastest so far" if is_vl_config(target.config)
                     else f"batched decoding ({TRAJECTORY_BATCH} prompts at a time)",
                     "exact_ancestor_attention": exact},
            "rows": rows, "recommended": _nan_max(rows, "predicted_speedup"),
            "cost_model": {**cost.to_json(), "measured_now": measured, "path": str(cost_path)},
            "seconds": {"cost_model": cost.measure_s if measured else 0.0, "plan": plan_s,
                        "planner": sum(plan_s.values()) + (cost.measure_s if measured else 0.0)}}


def confirm(run_cfg, ckpt: str | Path, eval_cfg, trees: list[str], partial=None) -> dict:
    """The engine's evaluation of `trees` on one checkpoint (eval_with_engine, eval_cfg's prompts);
    `partial` (resume.Partial): its configurations kept as they finish, and taken from a run that stopped."""
    from omegaconf import OmegaConf

    return eval_with_engine(run_cfg, [Path(ckpt)], OmegaConf.merge(eval_cfg, {"trees": list(trees)}),
                            on_progress=partial.save if partial else None, earlier=partial.earlier if partial else None)


def compare(rows: list[dict], results: dict) -> list[dict]:
    """Planner vs engine per confirmed configuration. The prediction is a decode speed-up, so
    `error` is against the engine's decode_speedup (`error_e2e` against its e2e speed-up)."""
    planned = {(r["checkpoint"], r["tree"]): r for r in rows}
    out = []
    for c in results["configs"]:
        p = planned[(c["checkpoint"], c["tree"])]
        out.append({"epoch": c["epoch"], "tree": c["tree"], "accept_length": p["accept_length"],
                    "measured_accept_length": c["accept_length"], "predicted_speedup": p["predicted_speedup"],
                    "measured_speedup": c["decode_speedup"], "measured_e2e_speedup": c["speedup"],
                    "error": p["predicted_speedup"] / c["decode_speedup"] - 1,
                    "error_e2e": p["predicted_speedup"] / c["speedup"] - 1,
                    "t_round_ms": p["t_round_ms"], "measured_ms_per_round": c["ms_per_round"],
                    "lossless": c["lossless"]})
    return out


def _rows(config: dict, specs: list[TreeSpec], chains: list[TreeSpec], plans: dict, cost) -> list[dict]:
    """A checkpoint's row per tree of the grid (`grid`) and per chain: its plans' figures and the
    cost model's round cost and predicted speed-up."""
    rows = []
    for spec in specs + chains:
        row = {**config, "grid": spec in specs, **summarize(spec.name, plans[spec.name])}
        rounds = row["verify_rounds"]
        t_round = cost.t_round(spec, row["accept_histogram"]) if rounds else math.nan
        row.update(tree_width=(spec.num_draft_tokens - 1) / row["tree_depth"] if rounds else math.nan,
                   t_round_ms=1000 * t_round,
                   predicted_speedup=cost.speedup(spec, decode_tokens_per_round(row), row["accept_histogram"])
                   if rounds else math.nan)
        rows.append(row)
    return rows


def eval_with_planner(run_cfg, ckpts: list[Path], eval_cfg, cost_path: Path, planner_partial=None,
                      confirm_partial=None) -> tuple[dict, dict | None]:
    """(planner results, the confirmation's engine results or None). The partials (resume.Partial),
    where given, keep the planned checkpoints and the confirmed configurations as they finish, and
    bring back those of a run that stopped."""
    planner = plan_epochs(run_cfg, ckpts, eval_cfg, cost_path, planner_partial.save if planner_partial else None,
                          planner_partial.earlier if planner_partial else None)
    k = int(eval_cfg.planner_confirm)
    if k <= 0:
        return planner, None
    best = planner["recommended"]
    top = sorted((r for r in planner["rows"] if r["checkpoint"] == best["checkpoint"]),
                 key=lambda r: -r["predicted_speedup"] if not math.isnan(r["predicted_speedup"]) else math.inf)[:k]
    t0 = time.perf_counter()
    results = confirm(run_cfg, best["checkpoint"], eval_cfg, [r["tree"] for r in top], confirm_partial)
    planner["seconds"]["confirm"] = time.perf_counter() - t0
    planner["confirmed"] = compare(planner["rows"], results)
    return planner, results
