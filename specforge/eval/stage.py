"""Pipeline stage `eval` (and the body of evaluate.py): every epoch checkpoint x every tree."""
from __future__ import annotations

from pathlib import Path

from specforge.errors import InvalidInput
from specforge.utils.io import write_json

PARTIAL_NAME = "results.partial.json"  # the configurations finished so far, while an evaluation runs (resume.py)
PLANNER_PARTIAL_NAME = "planner.partial.json"  # the checkpoints planned so far, while the planner runs


def check(cfg) -> None:
    """The pipeline's check before its first stage, so that training hours are not spent on an
    evaluation that cannot run."""
    check_eval(cfg.eval)
    never = [e for e in cfg.eval.epochs or () if not 1 <= e <= cfg.train.epochs]
    if "train" in cfg.stages and never:
        raise InvalidInput(f"eval.epochs: {never} will not be trained (train.epochs={cfg.train.epochs}: epoch_1 .. "
                           f"epoch_{cfg.train.epochs})")
    if not cfg.data.eval_files and _uses_heldout(cfg.eval):
        raise InvalidInput("eval: the evaluation prompts are the held-out split's (eval.suites: heldout; a server "
                           "engine's eval.prompts=conversations), but data.eval_files is empty; name held-out files, "
                           "or other prompts (eval.suites=[humaneval] or a file; eval.prompts=random)")


def _uses_heldout(eval_cfg) -> bool:
    from specforge.eval.prompts import HELDOUT, suite_entries

    if str(eval_cfg.engine) == "embedded":  # the planner too
        return HELDOUT in suite_entries(eval_cfg)
    return str(getattr(eval_cfg, "prompts", "conversations")) == "conversations"


def check_eval(eval_cfg) -> None:
    """Everything about `eval` that can be refused before anything loads: evaluate.py and this
    stage call it first."""
    from specforge.config import check_eval_trees, check_ranges
    from specforge.engine.tree_spec import TreeSpec
    from specforge.eval.prompts import check_suites

    check_eval_trees(eval_cfg)
    if str(eval_cfg.engine) != "server":  # a server serves its own tree
        TreeSpec.parse_list(eval_cfg.trees, "eval.trees", " (eval.timing_repeats times a configuration again)")
    check_ranges({"eval": eval_cfg}, ["eval"])
    if getattr(eval_cfg, "planner", False):
        from specforge.eval.planner_eval import check_planner

        check_planner(eval_cfg)  # its grid, its engine, temperature 0
    check_suites(eval_cfg)  # an unknown suite, a missing file, suites for a server engine
    if getattr(eval_cfg, "scenario", None) is not None:
        from specforge.eval.scenarios import get_scenario

        try:
            get_scenario(eval_cfg.scenario)
        except ValueError as e:
            raise InvalidInput(f"eval.scenario: {e}") from None
    if str(eval_cfg.engine) == "server" and not eval_cfg.url:
        raise InvalidInput("eval.engine=server needs eval.url (the base URL of a running server)")
    if str(eval_cfg.engine) == "server":
        from specforge.launch.process import check_urls

        check_urls({f"eval.{name}": getattr(eval_cfg, name, None) for name in ("url", "baseline_url")})
    if str(eval_cfg.engine) == "sglang":
        from specforge.launch.sglang_commands import flag_table

        flag_table(getattr(eval_cfg, "sglang_version", None))  # installed (or named) and supported


def run_evaluation(run_cfg, ckpt: str | Path, eval_cfg, out_dir: str | Path | None = None) -> dict:
    """Every selected checkpoint x tree measured (or the planner's, or a serving benchmark's),
    written to `out_dir` (default: the run's eval/, then its report.md)."""
    from specforge.eval.engine_eval import find_checkpoints
    from specforge.run_layout import RunLayout

    check_eval(eval_cfg)  # before anything loads
    run_dir, ckpts = find_checkpoints(ckpt, getattr(eval_cfg, "epochs", None))
    check_checkpoints(ckpts, run_cfg.target, bool(getattr(eval_cfg, "allow_other_target", False)))
    with output_lock(Path(out_dir) if out_dir else RunLayout(run_dir).eval_dir):
        return _evaluate(run_cfg, run_dir, ckpts, eval_cfg, out_dir)


def output_lock(out_dir: Path):
    """One evaluation writes `out_dir` at a time (a second evaluate.py of the same run, or one
    beside the pipeline's eval stage, would interleave partial and final results). The lock file
    lies beside it, so that a refusal before any model runs leaves `out_dir` unwritten."""
    from specforge.utils.run_lock import RunDirLock

    return RunDirLock(out_dir.parent / f".{out_dir.name}.lock", what=f"{out_dir} (an evaluation's output)",
                      advice="give this evaluation another out_dir=")


def _evaluate(run_cfg, run_dir: Path, ckpts: list[Path], eval_cfg, out_dir: str | Path | None) -> dict:
    from specforge.eval.report import best_config, write_results
    from specforge.eval.engine_eval import eval_with_engine
    from specforge.eval.resume import Partial
    from specforge.run_layout import RunLayout
    from specforge.run_report import write_run_report

    if eval_cfg.engine in ("server", "sglang"):  # a serving benchmark over HTTP (server_eval.py)
        from specforge.eval.server_eval import eval_with_servers

        summary = eval_with_servers(run_cfg, ckpts, eval_cfg, run_dir,
                                    Path(out_dir) / "serving" if out_dir else None)
        print(Path(summary["report"]).read_text(), flush=True)
        return {"report": summary["report"], "engine": eval_cfg.engine}
    layout = RunLayout(run_dir)
    eval_dir = layout.eval_dir
    out_dir = Path(out_dir) if out_dir else eval_dir
    if out_dir == eval_dir:
        layout.eval_choice.unlink(missing_ok=True)  # an older evaluation's, engine or planner
    if getattr(eval_cfg, "planner", False):
        return run_planner(run_cfg, run_dir, ckpts, eval_cfg, out_dir)
    partial = Partial(out_dir / PARTIAL_NAME, "the configurations")
    try:
        results = eval_with_engine(run_cfg, ckpts, eval_cfg, on_progress=partial.save, earlier=partial.earlier)
    except BaseException:
        partial.say_kept()
        raise
    report = write_results(results, out_dir)
    partial.remove()
    best = best_config(results)
    if out_dir == eval_dir:
        if best:
            record_choice(layout, best, results["configs"], "speedup")
        write_run_report(run_dir)
    print(report.read_text(), flush=True)
    return {"report": str(report), "configs": len(results["configs"]),
            **({"best_epoch": best["epoch"], "best_tree": best["tree"], "best_speedup": best["speedup"],
                "best_accept_length": best["accept_length"]} if best else {})}


def run_planner(run_cfg, run_dir: Path, ckpts: list[Path], eval_cfg, out_dir: Path) -> dict:
    """eval.planner=true: planner.json, heatmaps and report.md in `out_dir`; the cost model is
    kept with the run (reused while target, dtype, device and threads stay the same)."""
    from specforge.eval.planner_eval import eval_with_planner
    from specforge.eval.report import write_planner
    from specforge.eval.resume import Partial
    from specforge.run_layout import RunLayout
    from specforge.run_report import write_run_report

    layout = RunLayout(run_dir)
    cost_path = layout.cost_model if out_dir == layout.eval_dir else out_dir / layout.cost_model.name
    partials = (Partial(out_dir / PLANNER_PARTIAL_NAME, "the checkpoints planned"),
                Partial(out_dir / PARTIAL_NAME, "the confirmed configurations"))
    try:
        planner, results = eval_with_planner(run_cfg, ckpts, eval_cfg, cost_path, *partials)
    except BaseException:
        for partial in partials:
            partial.say_kept()
        raise
    report = write_planner(planner, out_dir, results)
    for partial in partials:
        partial.remove()
    best = planner["recommended"]
    if out_dir == layout.eval_dir:
        record_choice(layout, best, planner["rows"], "predicted_speedup")
        write_run_report(run_dir)
    print(report.read_text(), flush=True)
    return {"report": str(report), "planner": str(out_dir / layout.planner.name), "best_epoch": best["epoch"],
            "best_tree": best["tree"], "predicted_speedup": best["predicted_speedup"],
            "best_accept_length": best["accept_length"]}


def check_checkpoints(ckpts: list[Path], target_cfg, allow_other_target: bool) -> None:
    """Every selected checkpoint read and checked against the target before any model runs: a
    broken epoch_7 fails the evaluation at once, not after the base model's benchmark."""
    from transformers import AutoConfig

    from specforge.checkpoint import check_fits_target, read_checkpoint
    from specforge.targets.loader import resolve_target_path, target_fingerprint

    path = resolve_target_path(target_cfg)
    target_config = AutoConfig.from_pretrained(path, trust_remote_code=target_cfg.trust_remote_code)
    for ckpt in ckpts:
        cfg, _ = read_checkpoint(ckpt, weights=False)  # the evaluation loads the weights later
        check_fits_target(cfg, target_config, ckpt, target_fingerprint(path), allow_other_target)


def run(cfg, run_dir: Path, fingerprint: str | None = None) -> dict:
    return run_evaluation(cfg, run_dir, cfg.eval)


def record_choice(layout, best: dict, rows: list[dict], key: str) -> None:
    """eval/ship.json (RunLayout.eval_choice): the epoch and tree to ship, their speed-up by `key`
    (the engine's `speedup` or the planner's `predicted_speedup`), and that epoch's fastest chain by
    it for vLLM."""
    from specforge.eval.report import best_chain

    write_json(layout.eval_choice, {"epoch": best["epoch"], "tree": best["tree"], "speedup": best[key],
                                    "chain": best_chain(rows, best["epoch"], key)})

