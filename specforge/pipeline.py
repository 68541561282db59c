"""Runs the stages in order; each is skipped when the fingerprint of its inputs is unchanged and
its outputs are still there (a stage's `damaged`, where it has one, says what of them is gone or
broken; then it runs again: the extract stage's stores, which it rebuilds the same from the same
samples, so the stages after it need not run again).

A stage's fingerprint covers its config sections, its own extra inputs (e.g. raw data files) and
the fingerprints of the stages it reads from, so a change anywhere upstream re-runs everything
downstream and nothing else. Keys that only say how a stage runs, not what it computes (train.resume,
train.strategy, ...), are left out: resuming or changing the number of processes is the same run.
So are unset (None) keys: a new setting that is None by default keeps earlier runs up to date; one
with another default either goes into its stage's `ignore` (a check, not a computation) or re-runs.

Under torchrun / Slurm (more than one process): rank 0 decides what runs and writes the markers;
a stage runs on rank 0 alone (data, eval; the others wait) or on every rank (extract shards its
inputs, train is data-parallel). A failure on rank 0 is reported on every rank instead of leaving
them waiting.
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from specforge import distributed as dist
from specforge.config import check_config
from specforge.errors import InvalidInput
from specforge.run_layout import RunLayout
from specforge.run_report import write_run_report
from specforge.utils.io import fingerprint, read_json, write_json, write_text
from specforge.utils.run_lock import RunDirLock


@dataclass(frozen=True)
class Stage:
    name: str
    # exposes run(cfg, run_dir, fingerprint) -> dict (train keeps its fingerprint in its training states,
    # so that only the same run resumes them) and optionally extra_inputs(cfg) -> dict, check(cfg)
    # (refusals before the first stage), damaged(cfg, run_dir, summary) -> str | None (what of a
    # finished stage's outputs is gone or broken: cheap checks, no model) and preflight(cfg, run_dir)
    # -> str | None (its checks of the outputs of `preflight_reads`, asked as soon as those are final:
    # in a run before the next stage spends anything, e.g. training's batch against the data stage's
    # samples before extraction; with check_only, also a stage's own disk check)
    module: str
    config_keys: tuple[str, ...]
    depends: tuple[str, ...]
    ranks: str = "main"  # main: rank 0 runs it, the others wait | all: every rank runs it
    ignore: tuple[str, ...] = ()  # keys under config_keys that do not change what the stage computes
    # keys that only split the work among processes: a run that changes them alone (train.grad_accum with the
    # number of GPUs, the global batch unchanged) resumes the work of the one before; run() then also gets
    # the fingerprint without them
    split_only: tuple[str, ...] = ()
    preflight_reads: tuple[str, ...] = ()  # the stages whose outputs its preflight reads

    def entry(self, attr: str) -> Callable | None:
        return getattr(importlib.import_module(self.module), attr, None)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage("data", "specforge.data.stage", ("target", "data", "draft.draft_vocab_size"), (),
              ignore=("data.regenerate.check_template",)),
        Stage("extract", "specforge.extract.stage", ("target", "extract"), ("data",), ranks="all",
              ignore=("extract.disk_check",), preflight_reads=("data",)),
        Stage("train", "specforge.train.stage", ("target", "draft", "train", "seed"), ("data", "extract"),
              ranks="all", ignore=("train.resume", "train.save_state_every", "train.num_threads",
                                   "train.strategy", "train.zero_stage", "train.memory_probe",
                                   "train.keep_epoch_states", "draft.min_vocab_coverage"),
              split_only=("train.grad_accum",), preflight_reads=("data",)),
        Stage("eval", "specforge.eval.stage", ("eval",), ("train",)),
    ]
}


def run_dir_of(cfg) -> Path:
    return Path(cfg.output_dir) / cfg.run_name


def stage_fingerprint(cfg, stage: Stage, run_dir: Path, planned: dict | None = None,
                      leave_out: tuple[str, ...] = ()) -> str:
    """`planned`: the fingerprints upstream stages will have once they ran (check_only), in place
    of their markers'. Settings that are None (not set) are left out: a setting added in a later
    version, unset by default, leaves the runs made before it up to date. So are `leave_out`'s."""
    sections = {k: _set_only(OmegaConf.to_container(OmegaConf.select(cfg, k), resolve=True))
                if OmegaConf.is_config(OmegaConf.select(cfg, k)) else OmegaConf.select(cfg, k)
                for k in stage.config_keys}
    for key in stage.ignore + leave_out:
        section, _, rest = key.partition(".")
        node = sections.get(section)
        *path, leaf = rest.split(".")
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    extra = stage.entry("extra_inputs")
    upstream = {}
    for dep in stage.depends:
        marker = RunLayout(run_dir).marker(dep)
        if planned and dep in planned:
            upstream[dep] = planned[dep]
        else:
            upstream[dep] = read_json(marker)["fingerprint"] if marker.exists() else None
    return fingerprint(stage.name, sections, extra(cfg) if extra else None, upstream)


def run_pipeline(cfg) -> dict[str, dict]:
    """Run `cfg.stages` in the canonical order; returns each stage's summary.

    Joins the process group when launched as several processes (and leaves it at the end)."""
    if not cfg.stages:
        raise InvalidInput(f"stages is empty: nothing to run; name some of {list(STAGES)}, e.g. stages=[data,extract]")
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise InvalidInput(f"stages: unknown stage(s) {unknown}; known: {list(STAGES)}")
    check_config(cfg)
    for name in cfg.stages:  # each stage's own refusals, before the first one spends anything
        check = STAGES[name].entry("check")
        if check is not None:
            check(cfg)
    if cfg.check_only:
        return {"check_only": plan_stages(cfg)}
    joined_here = not dist.current().distributed
    env = dist.init_distributed(OmegaConf.select(cfg, "launch.dist_timeout_minutes", default=120.0))
    try:
        with dist.rank_errors("pipeline"):
            return _run_stages(cfg, env)
    finally:
        if joined_here and env.distributed:
            dist.shutdown()


def _set_only(section):
    if isinstance(section, dict):
        return {k: _set_only(v) for k, v in section.items() if v is not None}
    return section


def plan_stages(cfg) -> dict[str, str]:
    """`check_only=true`, every check passed: what each stage of `cfg.stages` would do now
    ("up to date" or why it would run), printed; nothing is written or run."""
    run_dir, planned, plan = run_dir_of(cfg), {}, {}
    for name in [s for s in STAGES if s in cfg.stages]:
        stage = STAGES[name]
        decision, planned[name], _, why = _decide(cfg, stage, run_dir, planned)
        inputs_final = all(plan.get(dep, "up to date") == "up to date" for dep in stage.preflight_reads)
        if decision == "run" and inputs_final and (preflight := stage.entry("preflight")) is not None:
            line = preflight(cfg, run_dir)  # what the stage checks on its inputs, e.g. the disk
            why += f"; {line}" if line else ""
        plan[name] = why if decision == "skip" else f"would run: {why}"
    if os.environ.get("RANK", "0") == "0":
        for name, what in plan.items():
            print(f"[pipeline] check_only: {name}: {what}", flush=True)
        print(f"[pipeline] check_only: every setting and input of stages {list(plan)} checked that can be "
              "before a model runs; nothing was run or written", flush=True)
    return plan


def _decide(cfg, stage: Stage, run_dir: Path, planned: dict | None = None) -> tuple[str, str, dict, str]:
    """("skip" | "run", fingerprint, summary of the finished stage, why). `planned`: see
    stage_fingerprint (its stages count as done)."""
    missing = [d for d in stage.depends if d not in (planned or {}) and not RunLayout(run_dir).marker(d).exists()]
    if missing:
        raise InvalidInput(
            f"stage '{stage.name}' needs the output of {missing} in {run_dir}; add them to stages=[...]"
        )
    fp = stage_fingerprint(cfg, stage, run_dir, planned)
    marker = RunLayout(run_dir).marker(stage.name)
    if not marker.exists():
        return "run", fp, {}, "not run yet"
    if read_json(marker).get("fingerprint") != fp:
        return "run", fp, {}, "its settings or inputs (or an earlier stage's) changed since it ran"
    summary = read_json(marker).get("summary", {})
    damaged = stage.entry("damaged")
    problem = damaged(cfg, run_dir, summary) if damaged else None
    if problem is None:
        return "skip", fp, summary, "up to date"
    return "run", fp, {}, f"up to date, but {problem}: running it again"


def _check_shared_run_dir(run_dir: Path) -> None:
    """Every rank must see rank 0's files (multi-node runs need a shared file system)."""
    token = dist.broadcast_object(f"{time.time_ns()}" if dist.current().is_main else None)
    probe = RunLayout(run_dir).rank_probe
    if dist.current().is_main:
        write_text(probe, token)
    dist.barrier()
    sees = probe.exists() and probe.read_text() == token
    blind = [r for r, ok in enumerate(dist.gather_objects(sees)) if not ok]
    dist.barrier()
    if dist.current().is_main:
        probe.unlink(missing_ok=True)
    if blind:
        raise RuntimeError(f"{run_dir}: ranks {blind} do not see rank 0's files; output_dir must be on a "
                           "file system shared by every node")


def _run_stages(cfg, env) -> dict[str, dict]:
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(RunLayout(run_dir).lock)
    dist.run_on_main(lock.acquire, what="locking the run directory")  # before anything is written
    try:
        return _stages_in(cfg, env, run_dir)
    finally:
        lock.release()


def _stages_in(cfg, env, run_dir: Path) -> dict[str, dict]:
    if env.is_main:
        write_text(RunLayout(run_dir).config, OmegaConf.to_yaml(cfg, resolve=True))
    if env.distributed:
        _check_shared_run_dir(run_dir)
    summaries, preflighted = {}, set()
    for name in [s for s in STAGES if s in cfg.stages]:
        stage = STAGES[name]
        decision, fp, summary, why = dist.run_on_main(_decide, cfg, stage, run_dir, what=f"stage '{name}'")
        if why.startswith("up to date, but") and env.is_main:
            print(f"[pipeline] {name}: {why}", flush=True)
        if decision == "skip":
            if env.is_main:
                print(f"[pipeline] {name}: up to date (fingerprint {fp}), skipped", flush=True)
            summaries[name] = summary
            continue
        _preflight_later(cfg, run_dir, name, final=lambda s: s in summaries or s not in cfg.stages, done=preflighted)
        if env.is_main:
            # The stage rewrites its outputs from here on: a refusal or crash part way must not leave them
            # under the marker of the run before, which a rerun of that run's settings would take as done.
            RunLayout(run_dir).marker(name).unlink(missing_ok=True)
            print(f"[pipeline] {name}: running" + (f" on {env.world_size} processes" if env.distributed
                                                  and stage.ranks == "all" else ""), flush=True)
        t0 = time.time()
        args = (cfg, run_dir, fp) + ((stage_fingerprint(cfg, stage, run_dir, leave_out=stage.split_only),)
                                     if stage.split_only else ())
        if stage.ranks == "all":
            summary = stage.entry("run")(*args) or {}
            dist.barrier()
        else:
            summary = dist.run_on_main(lambda: stage.entry("run")(*args) or {}, what=f"stage '{name}'")
        wall = round(time.time() - t0, 2)
        summary.setdefault("seconds", wall)  # training says its own, summed over the runs a resume continues
        if env.is_main:
            write_json(RunLayout(run_dir).marker(name), {"fingerprint": fp, "summary": summary})
            write_run_report(run_dir)  # with this stage's summary (time, throughput, rows)
            print(f"[pipeline] {name}: done in {wall} s", flush=True)
        dist.barrier()
        summaries[name] = summary
    return summaries


def _preflight_later(cfg, run_dir: Path, name: str, final: Callable[[str], bool], done: set[str]) -> None:
    """Before stage `name` runs: the preflight of each later stage whose inputs are `final` now,
    once per run (training's refusal of a batch the samples cannot give comes before extraction)."""
    order = [s for s in STAGES if s in cfg.stages]
    for later in order[order.index(name) + 1:]:
        stage = STAGES[later]
        if later in done or not all(final(dep) for dep in stage.preflight_reads):
            continue
        done.add(later)
        if (preflight := stage.entry("preflight")) is not None:
            line = dist.run_on_main(preflight, cfg, run_dir, what=f"the {later} stage's checks")
            if line and dist.current().is_main:
                print(f"[pipeline] {later}: {line}", flush=True)
