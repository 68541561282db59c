"""Pipeline stage `eval` (and the body of evaluate.py): every epoch checkpoint x every tree."""
from __future__ import annotations

from pathlib import Path


def run_evaluation(run_cfg, ckpt: str | Path, eval_cfg, out_dir: str | Path | None = None) -> dict:
    from specforge.config import check_eval_trees
    from specforge.eval.report import best_config, write_results
    from specforge.eval.engine_eval import eval_with_engine, find_checkpoints
    from specforge.run_layout import RunLayout
    from specforge.run_report import write_run_report

    check_eval_trees(eval_cfg)  # before anything loads
    run_dir, ckpts = find_checkpoints(ckpt, getattr(eval_cfg, "epochs", None))
    if eval_cfg.engine in ("server", "sglang"):  # a serving benchmark over HTTP (server_eval.py)
        from specforge.eval.server_eval import eval_with_servers

        summary = eval_with_servers(run_cfg, ckpts, eval_cfg, run_dir,
                                    Path(out_dir) / "serving" if out_dir else None)
        print(Path(summary["report"]).read_text(), flush=True)
        return {"report": summary["report"], "engine": eval_cfg.engine}
    results = eval_with_engine(run_cfg, ckpts, eval_cfg)
    eval_dir = RunLayout(run_dir).eval_dir
    out_dir = Path(out_dir) if out_dir else eval_dir
    report = write_results(results, out_dir)
    if out_dir == eval_dir:
        write_run_report(run_dir)
    print(report.read_text(), flush=True)
    best = best_config(results)
    return {"report": str(report), "configs": len(results["configs"]),
            **({"best_epoch": best["epoch"], "best_tree": best["tree"], "best_speedup": best["speedup"],
                "best_accept_length": best["accept_length"]} if best else {})}


def run(cfg, run_dir: Path, fingerprint: str | None = None) -> dict:
    return run_evaluation(cfg, run_dir, cfg.eval)
