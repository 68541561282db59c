"""Evaluate checkpoints x trees against the base model on the same prompts, with the embedded
engine: accept length, accept rate, throughput, latency, and whether the output is lossless.

The base model runs before AND after the speculative configurations; its throughput is the mean
of both passes, so a machine that slows down mid-run does not flatter or punish the draft.

Every configuration also says where its time went (`phase_figures`, from the engine's per-request
phase timers): ms per verify round of each phase (draft, verify, accept, cache, other) or, for the
base model, per decode step (decode, other); each phase's share of e2e time; and the cost of a
round in base decode steps (`round_cost`), which explains the speed-up:
decode speed-up ~= accept length / round_cost_steps.

The prompts of a suite usually share a system prompt; with eval.shared_prefix (default, as
SGLang's radix cache serves them) both engines keep its cache entries and prefill the rest of
each prompt only (`shared_prefixes`, `SpeculativeEngine.share_prefix`).
"""
from __future__ import annotations

import math
import os
import statistics
import warnings
from pathlib import Path

import torch

from specforge.checkpoint import load_draft
from specforge.data.template import THINKING_SWITCH
from specforge.engine.speculative import PHASES, GenerationStats, SpeculativeEngine
from specforge.engine.tree_spec import TreeSpec
from specforge.errors import InvalidInput, MissingInput, SpecForgeWarning
from specforge.eval import resume
from specforge.eval.prompts import load_suites
from specforge.eval.resume import KEY as RESUME_KEY
from specforge.run_layout import RunLayout, epoch_of
from specforge.targets.loader import (compute_dtype, dtype_name as dtype_name_of, load_target, load_tokenizer,
                                      local_target_config, resolve_target_path, stop_token_ids, target_context,
                                      target_fingerprint, torch_dtype)
from specforge.targets.vl import is_vl, load_image_processor, vl_info
from specforge.utils.io import file_fingerprint
from specforge.utils.progress import progress_bar


def find_checkpoints(path: str | Path, epochs=None) -> tuple[Path, list[Path]]:
    """(run directory, checkpoints): a checkpoint directory itself, or every epoch_* of a run
    (only those in `epochs` when given, eval.epochs)."""
    path = Path(path)
    if (path / "config.json").exists():
        if epochs and epoch_of(path) not in set(epochs):  # a filter that this one checkpoint does not pass
            raise InvalidInput(f"eval.epochs={list(epochs)}: ckpt={path} is one checkpoint ({path.name}); "
                               f"name the run directory ({path.parent}) to pick epochs, or drop eval.epochs")
        return path.parent, [path]
    ckpts = RunLayout(path).checkpoints()
    if not ckpts:
        raise MissingInput(f"ckpt={path}: neither a checkpoint (config.json) nor a run with epoch_* dirs")
    if epochs:
        missing = sorted(set(epochs) - {epoch_of(p) for p in ckpts})
        if missing:
            raise MissingInput(f"eval.epochs: {path} has no epoch_{missing[0]} "
                               f"(it has {[epoch_of(p) for p in ckpts]})")
        ckpts = [p for p in ckpts if epoch_of(p) in set(epochs)]
    return path, ckpts


def load_run_config(run_dir: str | Path):
    """The run's resolved config (`config.yaml`), with output_dir/run_name pointing at `run_dir`."""
    from omegaconf import OmegaConf

    from specforge.config import Config

    run_dir = Path(run_dir)
    saved = RunLayout(run_dir).config
    if not saved.exists():
        raise MissingInput(f"{saved}: the run's resolved config is needed to know its target and data")
    run_cfg = OmegaConf.structured(Config)
    passed_over = merge_known(run_cfg, OmegaConf.to_container(OmegaConf.load(saved)))
    if passed_over:  # a run of an earlier version: what this one no longer has, or types otherwise
        warnings.warn(f"{saved}: written by another version of SpecForge; these settings are not this version's "
                      f"and were passed over: {'; '.join(passed_over)}", category=SpecForgeWarning, stacklevel=2)
    run_cfg.output_dir, run_cfg.run_name = str(run_dir.parent), run_dir.name
    return run_cfg


def merge_known(schema, saved: dict, prefix: str = "") -> list[str]:
    """Set every key of `saved` that `schema` (a structured config) has and whose value it takes,
    recursively; -> what was passed over, each key with why."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    passed_over = []
    for key, value in saved.items():
        where = f"{prefix}{key}"
        if key not in schema.keys():  # `in schema` is False for a key whose value is missing
            passed_over.append(f"{where} (not a setting any more)")
        elif isinstance(value, dict) and OmegaConf.is_dict(schema[key]) and OmegaConf.get_type(schema, key) is not dict:
            passed_over += merge_known(schema[key], value, f"{where}.")
        else:
            try:
                schema[key] = value
            except OmegaConfBaseException as e:
                passed_over.append(f"{where}={value!r} ({str(e).splitlines()[0]})")
    return passed_over


def _p99(values: list[float]) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


ROUND_PHASES = ("draft", "verify", "accept", "cache", "other")  # the phases of a verify round
STEP_PHASES = ("decode", "other")  # the phases of a base decode step


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def phase_figures(stats: list[GenerationStats]) -> dict:
    """Where the time went, over all requests of one configuration.

    Speculative: `ms_per_round` and `<phase>_ms_per_round` for ROUND_PHASES (per verify round);
    base: `ms_per_step` and `<phase>_ms_per_step` for STEP_PHASES (per decode step, the first token
    coming from prefill). Both: `share_<phase>` = the phase's share of the e2e time (prefill too).
    """
    total = {p: sum(s.phase_s.get(p, 0.0) for s in stats) for p in PHASES}
    e2e = sum(s.e2e_s for s in stats)
    if any(s.num_draft_tokens for s in stats):
        unit, phases, n = "round", ROUND_PHASES, sum(s.spec_verify_ct for s in stats)
    else:
        unit, phases, n = "step", STEP_PHASES, sum(max(s.completion_tokens - 1, 0) for s in stats)
    out = {f"ms_per_{unit}": _div(1000 * sum(total[p] for p in phases), n)}
    out.update({f"{p}_ms_per_{unit}": _div(1000 * total[p], n) for p in phases})
    out.update({f"share_{p}": _div(total[p], e2e) for p in ("prefill", *phases)})
    return out


def round_cost(row: dict, base: dict) -> dict:
    """A verify round in base decode steps: the whole round against the base model's whole step
    (`round_cost_steps`; decode speed-up ~= accept length / it), and its verify forward and its
    drafting against the base model's one-token forward (`verify_cost_steps`, `draft_cost_steps`)."""
    return {"round_cost_steps": _div(row["ms_per_round"], base["ms_per_step"]),
            "verify_cost_steps": _div(row["verify_ms_per_round"], base["decode_ms_per_step"]),
            "draft_cost_steps": _div(row["draft_ms_per_round"], base["decode_ms_per_step"])}


def aggregate(stats: list[GenerationStats], steps: int = 0) -> dict:
    """Figures of one configuration over all its requests (docs/contract.md §6 definitions)."""
    completion = sum(s.completion_tokens for s in stats)
    rounds = sum(s.spec_verify_ct for s in stats)
    accepted = [a for s in stats for a in s.accepted_drafts]
    slots = sum(s.spec_verify_ct * max(s.num_draft_tokens - 1, 0) for s in stats)
    decode_tokens = sum(max(s.completion_tokens - 1, 0) for s in stats)
    decode_s = sum(s.e2e_s - s.ttft_s for s in stats)
    hist = [0] * (steps + 1)
    for a in accepted:
        hist[a] += 1
    tpots = [s.tpot_s * 1000 for s in stats if not math.isnan(s.tpot_s)]
    return {
        "requests": len(stats),
        "completion_tokens": completion,
        "verify_rounds": rounds,
        "accept_length": completion / rounds if rounds else math.nan,
        "round_accept_length": (sum(accepted) + len(accepted)) / len(accepted) if accepted else math.nan,
        "accept_rate": sum(accepted) / slots if slots else math.nan,
        "accept_histogram": hist if accepted else [],
        "prefill_s": statistics.mean(s.prefill_s for s in stats),
        "ttft_s": statistics.mean(s.ttft_s for s in stats),
        "tpot_ms_mean": statistics.mean(tpots) if tpots else math.nan,
        "tpot_ms_p99": _p99(tpots),
        "e2e_s": statistics.mean(s.e2e_s for s in stats),
        "tok_s": completion / sum(s.e2e_s for s in stats),
        "decode_tok_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else math.nan,
        **phase_figures(stats),
    }


MIN_SHARED_PREFIX = 16  # tokens; a shorter common prefix (a chat template's header) is not worth a cache


def shared_prefixes(suites: dict[str, list[dict]]) -> dict[str, list[int]]:
    """{suite: the tokens every one of its prompts starts with}, for suites of >= 2 text prompts
    whose common prefix has >= MIN_SHARED_PREFIX tokens (a system prompt)."""
    out = {}
    for name, prompts in suites.items():
        if len(prompts) < 2 or any(p.get("images") for p in prompts):
            continue
        common = os.path.commonprefix([[int(t) for t in p["input_ids"]] for p in prompts])
        if len(common) >= MIN_SHARED_PREFIX:
            out[name] = common
    return out


def _share(engine, tokens: list[int] | None) -> None:
    held = None if engine.prefix is None else engine.prefix.tokens.tolist()
    if held != tokens:
        engine.share_prefix(tokens)


def _run_pass(engine, prompts, eval_cfg, eos, speculative: bool, bar, task, prefixes=None):
    """Every prompt through `engine`; with eval.timing_repeats = R > 1 each request runs R times
    back to back and keeps its fastest run's figures: on a shared machine contention only ever
    adds time, so the fastest of a few runs is the steadiest estimate of the request's cost. The
    R runs (same seed) must give the same tokens. `prefixes` {suite: tokens}: the shared prefix
    each suite's requests find cached (none for a suite not in it)."""
    outputs, stats = [], []
    generator = torch.Generator(device=engine.device)
    run = engine.generate if speculative else engine.generate_base
    for i, p in enumerate(prompts):
        _share(engine, (prefixes or {}).get(p["suite"]))
        best = None
        for _ in range(eval_cfg.timing_repeats):
            generator.manual_seed(eval_cfg.seed + i)
            ids, st = run(p["input_ids"], eval_cfg.max_new_tokens, temperature=eval_cfg.temperature,
                          eos_token_id=eos, generator=generator, images=p.get("images"))
            ids = [int(t) for t in ids]
            if best is not None and ids != best[0]:
                raise RuntimeError(f"prompt {p['id']!r} gave other tokens on a repeated run (eval.timing_repeats="
                                   f"{eval_cfg.timing_repeats}): the engine is not deterministic here, so its "
                                   "timings cannot be taken as the fastest of several runs; set eval.timing_repeats=1")
            if best is None or st.e2e_s < best[1].e2e_s:
                best = (ids, st)
        outputs.append(best[0])
        stats.append(best[1])
        bar.advance(task)
    return outputs, stats


def _base_of(first: dict, second: dict) -> dict:
    """The base model's figures: the mean of its pass before and after the speculative ones."""
    base = {k: (first[k] + second[k]) / 2 if isinstance(first[k], float) else first[k] for k in first}
    base["tok_s_first_pass"], base["tok_s_second_pass"] = first["tok_s"], second["tok_s"]
    return base


def _against(row: dict, base: dict) -> dict:
    """`row` with its speed-ups over `base` and its round cost in base decode steps."""
    row["speedup"] = _div(row["tok_s"], base["tok_s"])
    row["decode_speedup"] = _div(row["decode_tok_s"], base["decode_tok_s"])  # nan: nothing decoded after the prefill
    row.update(round_cost(row, base))
    return row


def _lossless(outputs, base_outputs, eval_cfg) -> float | None:
    # Identical output is only expected at temperature 0 (greedy).
    if eval_cfg.temperature > 0:
        return None
    return sum(o == b for o, b in zip(outputs, base_outputs)) / len(outputs)


def load_engine_inputs(run_cfg, eval_cfg):
    """(device, dtype name, tokenizer, {suite: prompts}, target) as every engine evaluation loads
    them: every core, eval.dtype or the run's, the prompts of eval.suites read (and refused) before
    the target loads."""
    torch.set_num_threads(os.cpu_count())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # what target and draft compute in here: bf16 on a CPU without native bf16 runs in float32
    dtype_name = dtype_name_of(compute_dtype(torch_dtype(eval_cfg.dtype or run_cfg.target.dtype), device))
    target_cfg = run_cfg.target.copy() if hasattr(run_cfg.target, "copy") else run_cfg.target
    target_cfg.dtype = dtype_name
    tokenizer = load_tokenizer(run_cfg.target)
    vl = None
    if is_vl(run_cfg.target.kind):  # prompts keep their images (expanded as the data stage did)
        target_path = resolve_target_path(run_cfg.target)
        vl = (load_image_processor(target_path, run_cfg.data.image_min_pixels, run_cfg.data.image_max_pixels),
              vl_info(target_path))
    config = local_target_config(run_cfg.target)
    positions = target_context(config) if config is not None else None
    suites = load_suites(run_cfg, eval_cfg, tokenizer, vl, positions)  # a bad suite fails before the target loads
    return device, dtype_name, tokenizer, suites, load_target(target_cfg, device)


# what a configuration's figures depend on, besides the machine, the target, prompts and checkpoint
KEYED_SETTINGS = ("max_new_tokens", "temperature", "seed", "exact_ancestor_attention", "timing_repeats", "shared_prefix")


def _earlier_configs(run_cfg, eval_cfg, prompts, dtype_name, device, ckpts, trees, earlier):
    """({(checkpoint, tree): key}, {key: (row, suite rows)} of `earlier` measured under a key of
    this run)."""
    target = target_fingerprint(resolve_target_path(run_cfg.target))
    common = resume.settings(target, eval_cfg, prompts, dtype_name, device, KEYED_SETTINGS)
    keys = {}
    for ckpt in ckpts:
        ckpt_id = file_fingerprint(ckpt)
        keys.update({(ckpt, str(t)): resume.config_key(common, ckpt_id, str(t)) for t in trees})
    wanted = set(keys.values())
    configs, suite_configs = resume.rows(earlier, "configs"), resume.rows(earlier, "suite_configs")
    kept = {r[RESUME_KEY]: (r, [s for s in suite_configs if s.get(RESUME_KEY) == r[RESUME_KEY]])
            for r in configs if r.get(RESUME_KEY) in wanted}
    if kept:
        names = ", ".join(f"{Path(r['checkpoint']).name} {r['tree']}" for r, _ in kept.values())
        print(f"[eval] {len(kept)} of {len(keys)} configurations measured by an earlier run of this evaluation that "
              f"stopped, kept: {names}", flush=True)
    return keys, kept


def eval_with_engine(run_cfg, ckpts: list[Path], eval_cfg, on_progress=None, earlier: dict | None = None) -> dict:
    """Run base + every checkpoint x tree over the prompts of every suite (eval.suites); returns
    {"base": ..., "configs": [...], "meta": ...} over all prompts (one suite: that suite's figures)
    plus "suite_base" {suite: base} and "suite_configs" [a row per checkpoint x tree x suite, with
    its speed-up over that suite's base]. `on_progress(results so far)` after the base pass and
    after each configuration: what a later failure must not lose (speed-ups there are against the
    first base pass alone). `earlier`: such results of a run that stopped; a configuration found
    there under the same key (resume.py) is kept (`resumed`), not measured again. Its speed-up is
    against this run's base passes; the base model always runs here."""
    trees = [TreeSpec.parse(t) for t in eval_cfg.trees]  # refuse bad trees before loading anything
    if eval_cfg.timing_repeats < 1:
        raise InvalidInput(f"eval.timing_repeats={eval_cfg.timing_repeats}: each request runs at least once")
    if eval_cfg.engine != "embedded":
        raise ValueError(f"eval.engine={eval_cfg.engine!r}: this function runs the embedded engine")
    device, dtype_name, tokenizer, suites, target = load_engine_inputs(run_cfg, eval_cfg)
    prompts = [p for suite in suites.values() for p in suite]
    eos = stop_token_ids(target, tokenizer)
    keys, kept = _earlier_configs(run_cfg, eval_cfg, prompts, dtype_name, device, ckpts, trees, earlier)

    def per_suite(items: list) -> dict[str, list]:
        return {name: [x for x, p in zip(items, prompts) if p["suite"] == name] for name in suites}

    base_engine = SpeculativeEngine(target, None)
    # a vision-language prompt starts an empty cache (its M-RoPE positions): nothing shared there
    prefixes = shared_prefixes(suites) if eval_cfg.shared_prefix and base_engine.runner.vl is None else {}
    warm = prompts[0]
    base_engine.generate_base(warm["input_ids"], 8, eos_token_id=eos, images=warm.get("images"))
    n_passes = 2 + len(ckpts) * len(trees)
    results = {"configs": [], "suite_configs": [], "meta": {
        "prompts": len(prompts), "suites": {name: len(ps) for name, ps in suites.items()},
        "max_new_tokens": eval_cfg.max_new_tokens,
        "thinking": prompts[0]["template_kwargs"].get(THINKING_SWITCH),  # None: the template has no switch
        "temperature": eval_cfg.temperature, "dtype": dtype_name, "device": device,
        "threads": torch.get_num_threads(), "exact_ancestor_attention": eval_cfg.exact_ancestor_attention,
        "timing_repeats": eval_cfg.timing_repeats, "resumed": len(kept),
        "shared_prefix_tokens": {name: len(prefixes[name]) - 1 if name in prefixes else 0 for name in suites},
        # the target's matmul kernel per row count, timed on this machine (engine/few_rows.py)
        "few_rows_kernels": {str(n): k for n, k in sorted(base_engine.runner.kernels.items())}}}
    with progress_bar() as bar:
        task = bar.add_task("eval", total=n_passes * len(prompts), info="base")
        base_outputs, base_stats = _run_pass(base_engine, prompts, eval_cfg, eos, False, bar, task, prefixes)
        results["base"] = aggregate(base_stats)
        results["suite_base"] = {name: aggregate(s) for name, s in per_suite(base_stats).items()}
        if on_progress:
            on_progress(results)
        for ckpt in ckpts:
            draft = None  # loaded for the first configuration measured here
            for tree in trees:
                bar.update(task, info=f"{ckpt.name} {tree}")
                key = keys[(ckpt, str(tree))]
                config = {"checkpoint": str(ckpt), "epoch": epoch_of(ckpt), "tree": str(tree), RESUME_KEY: key}
                if key in kept:
                    row, suite_rows = kept[key]
                    results["configs"].append({**row, **config, "resumed": True})
                    results["suite_configs"] += [{**r, **config} for r in suite_rows]
                    bar.advance(task, len(prompts))
                else:
                    if draft is None:
                        draft = load_draft(ckpt, device=device, dtype=torch_dtype(dtype_name))
                    engine = SpeculativeEngine(target, draft, tree, eval_cfg.exact_ancestor_attention)
                    engine.generate(warm["input_ids"], 8, eos_token_id=eos, images=warm.get("images"))
                    outputs, stats = _run_pass(engine, prompts, eval_cfg, eos, True, bar, task, prefixes)
                    results["configs"].append(
                        {**config, **aggregate(stats, tree.steps), "lossless": _lossless(outputs, base_outputs, eval_cfg),
                         "requests_detail": [s.to_dict() | {"id": p["id"], "suite": p["suite"]}
                                             for s, p in zip(stats, prompts)]})
                    suite_outputs, suite_base_outputs = per_suite(outputs), per_suite(base_outputs)
                    for name, suite_stats in per_suite(stats).items():
                        results["suite_configs"].append(
                            {**config, "suite": name, **aggregate(suite_stats, tree.steps),
                             "lossless": _lossless(suite_outputs[name], suite_base_outputs[name], eval_cfg)})
                if on_progress:
                    row = results["configs"][-1]
                    row["speedup"] = row["tok_s"] / results["base"]["tok_s"]
                    for r in results["suite_configs"][-len(suites):]:
                        r["speedup"] = r["tok_s"] / results["suite_base"][r["suite"]]["tok_s"]
                    on_progress(results)
        bar.update(task, info="base (again)")
        _, base_again = _run_pass(base_engine, prompts, eval_cfg, eos, False, bar, task, prefixes)

    results["base"] = _base_of(aggregate(base_stats), aggregate(base_again))
    firsts, seconds = per_suite(base_stats), per_suite(base_again)
    results["suite_base"] = {name: _base_of(aggregate(firsts[name]), aggregate(seconds[name])) for name in suites}
    for row in results["configs"]:
        _against(row, results["base"])
    for row in results["suite_configs"]:
        _against(row, results["suite_base"][row["suite"]])
    return results
