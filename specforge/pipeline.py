"""Runs the stages in order; each is skipped when the fingerprint of its inputs is unchanged.

A stage's fingerprint covers its config sections, its own extra inputs (e.g. raw data files) and
the fingerprints of the stages it reads from, so a change anywhere upstream re-runs everything
downstream and nothing else.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from specforge.utils.io import fingerprint, read_json, write_json, write_text


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # exposes run(cfg, run_dir) -> dict and optionally extra_inputs(cfg) -> dict
    config_keys: tuple[str, ...]
    depends: tuple[str, ...]

    def entry(self, attr: str) -> Callable | None:
        return getattr(importlib.import_module(self.module), attr, None)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in [
        Stage("data", "specforge.data.stage", ("target", "data", "draft.draft_vocab_size"), ()),
        Stage("extract", "specforge.extract.stage", ("target", "extract"), ("data",)),
        Stage("train", "specforge.train.stage", ("target", "draft", "train", "seed"), ("data", "extract")),
        Stage("eval", "specforge.eval.stage", ("eval",), ("train",)),
    ]
}


def run_dir_of(cfg) -> Path:
    return Path(cfg.output_dir) / cfg.run_name


def marker_path(run_dir: Path, stage: str) -> Path:
    return run_dir / f".stage_{stage}.json"


def stage_fingerprint(cfg, stage: Stage, run_dir: Path) -> str:
    sections = {k: OmegaConf.to_container(OmegaConf.select(cfg, k), resolve=True)
                if OmegaConf.is_config(OmegaConf.select(cfg, k)) else OmegaConf.select(cfg, k)
                for k in stage.config_keys}
    extra = stage.entry("extra_inputs")
    upstream = {}
    for dep in stage.depends:
        marker = marker_path(run_dir, dep)
        upstream[dep] = read_json(marker)["fingerprint"] if marker.exists() else None
    return fingerprint(stage.name, sections, extra(cfg) if extra else None, upstream)


def run_pipeline(cfg) -> dict[str, dict]:
    """Run `cfg.stages` in the canonical order; returns each stage's summary."""
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise ValueError(f"stages: unknown stage(s) {unknown}; known: {list(STAGES)}")
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    summaries = {}
    for name in [s for s in STAGES if s in cfg.stages]:
        stage = STAGES[name]
        missing = [d for d in stage.depends if not marker_path(run_dir, d).exists()]
        if missing:
            raise RuntimeError(
                f"stage '{name}' needs the output of {missing} in {run_dir}; add them to stages=[...]"
            )
        fp = stage_fingerprint(cfg, stage, run_dir)
        marker = marker_path(run_dir, name)
        if marker.exists() and read_json(marker).get("fingerprint") == fp:
            print(f"[pipeline] {name}: up to date (fingerprint {fp}), skipped", flush=True)
            summaries[name] = read_json(marker).get("summary", {})
            continue
        print(f"[pipeline] {name}: running", flush=True)
        t0 = time.time()
        summary = stage.entry("run")(cfg, run_dir) or {}
        summary["seconds"] = round(time.time() - t0, 2)
        write_json(marker, {"fingerprint": fp, "summary": summary})
        summaries[name] = summary
        print(f"[pipeline] {name}: done in {summary['seconds']} s", flush=True)
    return summaries
