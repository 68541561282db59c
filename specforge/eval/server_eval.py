"""Evaluation through servers: bench a running server, or launch base + each checkpoint x tree.

- `run_server_benchmark(server, requests, ...)`: `server` is a base URL (any running server) or a
  `Launch` (a command to start: wait for /health, bench, always stop; log in the run dir).
- `eval_with_servers(run_cfg, checkpoints, eval_cfg, run_dir)`: what `eval.engine=server` and
  `eval.engine=sglang` do. `server`: bench `eval.url` (and `eval.baseline_url` when given), after
  asking each what it serves (`served_by`: eval.url must draft, the baseline must not).
  `sglang`: launch the base target, then every checkpoint x tree, one server at a time (the
  server-wide accept length is cumulative since start, so one server per configuration).
  Writes `<label>.json`, `summary.json`, `report.md` and the server logs `logs/<label>.log` in
  the output dir (default `run_dir/eval/serving`).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from specforge.errors import InvalidInput
from specforge.utils.io import file_fingerprint, fingerprint, write_json, write_text
from specforge.utils.progress import progress_bar
from specforge.eval.bench_client import (
    BenchRequest, BenchResult, comparison, comparison_table, conversation_requests, file_requests,
    random_token_requests, run_benchmark, served_by,
)
from specforge.eval.scenarios import Scenario, get_scenario
from specforge.targets.vl import is_vl
from specforge.launch.process import ServerProcess, free_port
from specforge.run_layout import RunLayout

# (target_path, draft_path | None, tree | None, port) -> command
CommandBuilder = Callable[..., list]


@dataclass
class Launch:
    """A server to start for one benchmark."""

    command: list[str]
    port: int
    log_path: Path
    env: dict | None = None
    startup_timeout_s: float = 900.0
    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def run_server_benchmark(server: str | Launch, requests: Sequence[BenchRequest], *,
                         scenario: Scenario | None = None, label: str = "", **bench_kwargs) -> BenchResult:
    """Bench `server` (a base URL, or a Launch started and always stopped around the benchmark).
    `scenario` sets request_rate and max_concurrency; other keywords go to run_benchmark."""
    if scenario is not None:
        bench_kwargs.setdefault("request_rate", scenario.request_rate)
        bench_kwargs.setdefault("max_concurrency", scenario.max_concurrency)
    if isinstance(server, str):
        result = run_benchmark(server, requests, label=label, **bench_kwargs)
    else:
        with ServerProcess(server.command, server.port, server.log_path, host=server.host, env=server.env,
                           startup_timeout_s=server.startup_timeout_s) as proc:
            result = run_benchmark(proc.base_url, requests, label=label, **bench_kwargs)
        result.config["launch"] = {"command": server.command, "log": str(server.log_path)}
    if scenario is not None:
        result.config["scenario"] = scenario.to_dict()
    return result


# ---- evaluation over checkpoints x trees -----------------------------------------------------------


def eval_scenario(eval_cfg) -> Scenario:
    """The preset `eval.scenario`, or (None) eval.num_prompts x eval.max_new_tokens one request at a
    time; the `eval.bench_*` fields override single values (e.g. to scale a preset down for CPU)."""
    if eval_cfg.scenario:
        base = get_scenario(eval_cfg.scenario)
    else:
        base = Scenario("eval", num_prompts=eval_cfg.num_prompts, input_len=512,
                        output_len=eval_cfg.max_new_tokens, request_rate=math.inf, max_concurrency=1)
    rate = getattr(eval_cfg, "bench_request_rate", None)
    return base.scaled(num_prompts=getattr(eval_cfg, "bench_num_prompts", None),
                       input_len=getattr(eval_cfg, "bench_input_len", None),
                       output_len=getattr(eval_cfg, "bench_output_len", None),
                       request_rate=None if rate is None else float(rate),
                       max_concurrency=getattr(eval_cfg, "bench_max_concurrency", None))


def eval_requests(eval_cfg, scenario: Scenario, tokenizer, run_dir, seed: int = 0,
                  with_images: bool = False) -> list[BenchRequest]:
    prompts = getattr(eval_cfg, "prompts", "conversations")
    if prompts == "conversations":
        return conversation_requests(run_dir, tokenizer, scenario.num_prompts, scenario.output_len, with_images,
                                     thinking=getattr(eval_cfg, "thinking", None))
    if prompts == "random":
        return random_token_requests(scenario.num_prompts, scenario.input_len, scenario.output_len,
                                     len(tokenizer), exclude_ids=tokenizer.all_special_ids, seed=seed)
    return file_requests(prompts, tokenizer, scenario.num_prompts, scenario.output_len, with_images,
                         thinking=getattr(eval_cfg, "thinking", None), setting="eval.prompts",
                         conversations_file=RunLayout(Path(run_dir)).conversations("eval"))


def checkpoint_label(checkpoint: Path, tree: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{Path(checkpoint).name}_{tree}")


def sglang_command_builder(run_cfg, eval_cfg) -> CommandBuilder:
    """sglang_server_command with eval.dtype (else target.dtype), eval.sglang_args, eval.sglang_version."""
    from specforge.launch.sglang_commands import sglang_server_command

    from specforge.targets.vl import image_pixel_bounds

    dtype = getattr(eval_cfg, "dtype", None) or run_cfg.target.dtype
    options = {"dtype": dtype, "trust_remote_code": bool(run_cfg.target.trust_remote_code)}
    if bounds := image_pixel_bounds(run_cfg.data):  # the image tokens the draft was trained on
        options["mm_process_config"] = json.dumps({"image": bounds})
    return partial(sglang_server_command, options=options, version=getattr(eval_cfg, "sglang_version", None),
                   extra_args=list(getattr(eval_cfg, "sglang_args", None) or []))


def resume_key(command: Sequence[str], requests: Sequence[BenchRequest], scenario: Scenario, temperature: float,
               backend: str, seed: int, checkpoint: str | None = None, setup: dict | None = None) -> str:
    """What a launched configuration's measurement depends on: its server command but the free port
    it drew, the requests, the scenario, the sampling, the draft's bytes (`checkpoint`:
    file_fingerprint; a retrained epoch_3 has the same path) and what the command does not say
    (`setup`: launch_setup)."""
    args = list(map(str, command))
    if "--port" in args:
        args[args.index("--port") + 1] = "PORT"
    return fingerprint({"command": args, "requests": [(r.prompt, r.output_len, r.images) for r in requests],
                        "scenario": scenario.to_dict(), "temperature": temperature, "backend": backend, "seed": seed,
                        "checkpoint": checkpoint, "setup": setup})


def launch_setup(target: Path) -> dict:
    """What a launched server's speed depends on beyond its command line: the target's files (a model
    downloaded again to the same path), the installed SGLang (`pip install -U sglang`) and the machine."""
    import torch

    from specforge.eval.cost_model import describe_device
    from specforge.launch.sglang_commands import installed_sglang_version
    from specforge.targets.loader import target_fingerprint

    return {"target": target_fingerprint(target), "sglang": installed_sglang_version(),
            "device": describe_device("cuda" if torch.cuda.is_available() else "cpu")}


def finished_result(path: Path, key: str) -> BenchResult | None:
    """The result an earlier run of the same evaluation saved at `path` (a crash, or a stop, after
    it): the server's startup and the benchmark are not paid again. None when absent, cut short or
    measured otherwise."""
    try:
        saved = json.loads(Path(path).read_text())
        if saved["config"].get("resume_key") == key:
            return BenchResult(saved["metrics"], [], saved["config"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def served_line(label: str, info: dict) -> str:
    """What a server said it serves, for the report."""
    if not info.get("speculative_algorithm"):
        return f"- {label}: `{info.get('model_path')}` alone"
    return (f"- {label}: `{info.get('model_path')}` with {info['speculative_algorithm']} draft "
            f"`{info.get('speculative_draft_model_path')}` (steps {info.get('speculative_num_steps')}, topk "
            f"{info.get('speculative_eagle_topk')}, {info.get('speculative_num_draft_tokens')} draft tokens)")


def eval_with_servers(run_cfg, checkpoints: Sequence[Path], eval_cfg, run_dir, out_dir=None, *,
                     tokenizer=None, command_builder: CommandBuilder | None = None) -> dict:
    """Serving benchmark for eval_cfg.engine = server | sglang (see the module doc). `run_cfg` gives
    the target (and the seed of random prompts / Poisson arrivals), `run_dir` the held-out
    prompts; results go to `out_dir` (default run_dir/eval/serving). Returns the summary (also in
    summary.json): scenario, metrics per label, and every label compared with the baseline."""
    from specforge.targets.loader import load_tokenizer, resolve_target_path

    ev = eval_cfg
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else RunLayout(run_dir).serving_dir
    tokenizer = tokenizer or load_tokenizer(run_cfg.target)
    scenario = eval_scenario(ev)
    seed = int(getattr(run_cfg, "seed", 0) or 0)
    requests = eval_requests(ev, scenario, tokenizer, run_dir, seed=seed,
                             with_images=is_vl(getattr(run_cfg.target, "kind", None)))
    timeout = float(getattr(ev, "server_startup_timeout_s", 900.0))

    runs: list[tuple[str, str | Launch, Path | None]] = []  # (label, URL or launch, checkpoint)
    said: dict[str, dict] = {}  # what running servers say they serve
    if ev.engine == "server":
        if not ev.url:
            raise InvalidInput("eval.engine=server needs eval.url (the base URL of a running server)")
        said = served_by(ev.url, getattr(ev, "baseline_url", None))
        if getattr(ev, "baseline_url", None):
            runs.append(("baseline", ev.baseline_url, None))
        runs.append(("server", ev.url, None))
    elif ev.engine == "sglang":
        build = command_builder or sglang_command_builder(run_cfg, ev)
        target = resolve_target_path(run_cfg.target)
        configs = [("baseline", None, None)] + [
            (checkpoint_label(c, str(t)), Path(c), str(t)) for c in checkpoints for t in ev.trees]
        for label, ckpt, tree in configs:
            port = free_port()
            runs.append((label, Launch(build(target, ckpt, tree, port), port, out_dir / "logs" / f"{label}.log",
                                       startup_timeout_s=timeout), ckpt))
    else:
        raise ValueError(f"eval_with_servers: eval.engine={ev.engine!r} is not a server engine (server | sglang)")

    results: dict[str, BenchResult] = {}
    backend = getattr(ev, "bench_backend", "sglang")
    setup = launch_setup(target) if ev.engine == "sglang" else None
    draft_bytes = {ckpt: file_fingerprint(ckpt) for ckpt in dict.fromkeys(c for _, _, c in runs if c is not None)}
    with progress_bar() as bar:  # requests; a launched server's start-up shows as time on its label
        task = bar.add_task("eval", total=len(runs) * len(requests), info="")
        for label, server, ckpt in runs:
            bar.update(task, info=label)
            path = out_dir / f"{label}.json"
            key = None
            if isinstance(server, Launch):  # launched here: the same command measures the same thing again
                key = resume_key(server.command, requests, scenario, ev.temperature, backend, seed,
                                 draft_bytes.get(ckpt), setup)
                if (earlier := finished_result(path, key)) is not None:
                    print(f"[eval] {label}: measured by an earlier run of this evaluation ({path}), kept", flush=True)
                    results[label] = earlier
                    bar.advance(task, len(requests))
                    continue
            results[label] = run_server_benchmark(
                server, requests, scenario=scenario, label=label, temperature=ev.temperature,
                backend=backend, seed=seed, on_request=lambda: bar.advance(task))  # key: $SPECFORGE_API_KEY
            if key is not None:
                results[label].config["resume_key"] = key
            results[label].save(path)

    summary = {"engine": ev.engine, "scenario": scenario.to_dict(), "prompts": getattr(ev, "prompts", "conversations"),
               "metrics": {k: r.metrics for k, r in results.items()}, "comparisons": {}, "served": said}
    report = [f"# Serving benchmark ({ev.engine}, scenario {scenario.name})", "",
              f"`{json.dumps(scenario.to_dict())}`", ""]
    if said:
        report += ["What the servers said they serve (/server_info):", "",
                   *(served_line(label, info) for label, info in said.items()), ""]
    base = results.get("baseline")
    for label, r in results.items():
        if label == "baseline":
            continue
        if base is not None:
            summary["comparisons"][label] = comparison(base.metrics, r.metrics)
            report += [f"## {label}", "", comparison_table(base.metrics, r.metrics, eagle_label=label)]
        else:
            report += [f"## {label}", "", *(f"- {k}: {v}" for k, v in r.metrics.items() if k != "errors"), ""]
    write_json(out_dir / "summary.json", summary)
    write_text(out_dir / "report.md", "\n".join(report) + "\n")
    summary["report"] = str(out_dir / "report.md")
    return summary
