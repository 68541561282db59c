"""Regenerate the assistant turns of a split with the target, resumably, then re-validate them.

The draft must learn what the target actually says, not what a dataset author wrote (EAGLE-3
and every major trainer do this). Files in `out_dir` (split = "train", "eval", ...):

    regen_<split>.partial.jsonl   resume log: fingerprint header + one line per finished conversation
    regen_<split>.jsonl           the output rows {"id", "messages", "fixes", "file", "line", ...}
    regen_<split>.failures.jsonl  every conversation that could not be regenerated: id, reason, action
    regen_<split>.skipped.jsonl   every input conversation NOT in the output, with its reason
                                  (unusable answer, or quarantined by the fix step afterwards)
    regen_<split>.report.json     the counts returned as `report` (without the quarantine list)

What happens on each kind of failure is decided in specforge/data/regen/replay.py.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from specforge.config import FixConfig
from specforge.data.fix import fix_dataset, reason_code
from specforge.data.formats import RawRow, tools_entry
from specforge.data.regen.journal import Journal
from specforge.data.regen.replay import Replay, conversation_key, turns_to_answer
from specforge.errors import InvalidInput
from specforge.utils.io import file_fingerprint, fingerprint, write_json, write_jsonl
from specforge.utils.progress import progress_bar

BACKENDS = ("embedded", "openai")
FORMAT_VERSION = 1  # bump when a code change alters the answers, to invalidate old resume logs


def regenerate_conversations(
    conversations: list[dict],
    cfg,
    target_cfg,
    out_dir: str | Path,
    split: str,
    *,
    fix: FixConfig | None = None,
    image_root: str | None = None,
    seed: int = 0,
    progress=None,
) -> tuple[list[dict], dict]:
    """(rows, report): every assistant turn answered again by the target, then repaired or
    quarantined by `fix_dataset` with `fix` (default: FixConfig()) like the input was.

    `conversations` are {"id", "messages", ...} (the data stage's rows, with "fixes", "file",
    "line"); other keys are kept. `cfg` is a RegenerateConfig, `target_cfg` a TargetConfig (may be
    None with the openai backend; it then only fingerprints by model name). Every input row ends
    in `rows` or in `report["quarantine"]` ({"file", "line", "reason", "row"}, the stage's
    quarantine shape): pop that list before serialising the report. `progress`: a rich Progress
    to add the task to (else one is shown)."""
    check_config(cfg)
    out_dir = Path(out_dir)
    fix = fix if fix is not None else FixConfig()
    files = {name: out_dir / f"regen_{split}.{name}.jsonl" for name in ("partial", "failures", "skipped")}
    keys = [conversation_key(c) for c in conversations]

    backend, model = None, cfg.model
    if cfg.backend == "openai" and not model:  # the server's first model answers: its name keys the resume log
        backend = make_backend(cfg, target_cfg, seed)
        model = backend.model
    journal = Journal(files["partial"], regen_fingerprint(cfg, target_cfg, seed, model),
                      {"split": split, "backend": cfg.backend, "model": model})
    started = time.monotonic()
    tokens = asked = 0
    generating = 0.0  # seconds spent asking the target (model loading and probing excluded)
    try:
        done = journal.open()
        todo = _todo(conversations, keys, done, cfg.max_new_tokens, cfg.keep_truncated)
        unique = len(set(keys))
        if todo:
            backend = backend or make_backend(cfg, target_cfg, seed)  # loaded only when there is work
            # The bar counts turns as they are answered: the embedded backend journals a group of
            # conversations at a time (minutes apart on a CPU), the turns come steadily.
            per_key = {k: turns_to_answer(c["messages"], c.get("tools"))  # once each
                       for c, k in zip(conversations, keys)}
            total = sum(per_key.values())
            with nullcontext(progress) if progress is not None else progress_bar() as bar:
                task = bar.add_task(f"regenerate {split} (turns)", total=total,
                                    completed=total - sum(r.asked for r in todo), info="")
                t0 = time.monotonic()
                live_tokens, lock = [0], threading.Lock()

                def on_answer(n_tokens: int) -> None:  # from the openai backend's threads too
                    with lock:
                        live_tokens[0] += n_tokens
                        speed = live_tokens[0] / max(time.monotonic() - t0, 1e-9)
                        bar.update(task, advance=1, info=f"{speed:.0f} tok/s")

                for replay in backend.run(todo, on_answer):
                    record = replay.record()
                    journal.append(record)
                    done[record["key"]] = record
                    tokens += record["tokens"]
                    asked += 1
                    generating = time.monotonic() - t0
                    with lock:  # the turns a failure or a kept truncated answer left unasked
                        bar.update(task, advance=replay.asked - replay.answers)
    finally:
        journal.close()
    seconds = time.monotonic() - started

    out = _assemble(conversations, keys, done, fix, image_root)
    report = {
        "split": split,
        "backend": cfg.backend,
        "requested": len(conversations),
        "resumed": unique - len(todo),  # distinct conversations reused from the resume log
        "asked": asked,  # distinct conversations sent to the target by this run
        **{s: out.statuses.get(s, 0) for s in ("regenerated", "unchanged", "kept_original", "skipped")},
        "failed": len(out.failures),
        "failures_by_reason": dict(sorted(Counter(reason_code(f["reason"]) for f in out.failures).items())),
        "turns_regenerated": out.turns,
        "fix": out.fix_counts,  # the fix step on the regenerated rows (input_rows = rows not skipped)
        "quarantined": out.fix_counts["quarantined"],
        "output_rows": len(out.rows),
        "seconds": round(seconds, 3),  # this call, model loading included; the rest: this run's generation
        "generate_seconds": round(generating, 3),
        "tokens_generated": tokens,
        "tokens_per_s": round(tokens / generating, 1) if generating > 0 else 0.0,
        "files": {"output": str(out_dir / f"regen_{split}.jsonl"), **{k: str(v) for k, v in files.items()},
                  "report": str(out_dir / f"regen_{split}.report.json")},
    }
    if len(out.rows) + len(out.quarantine) != len(conversations):
        raise RuntimeError(f"regenerate {split}: {len(conversations)} conversations but {len(out.rows)} kept + "
                           f"{len(out.quarantine)} dropped; each must be accounted for exactly once")
    write_jsonl(out_dir / f"regen_{split}.jsonl", out.rows)
    write_jsonl(files["failures"], out.failures)
    write_jsonl(files["skipped"], out.quarantine)
    write_json(out_dir / f"regen_{split}.report.json", report)
    return out.rows, {**report, "quarantine": out.quarantine}


def check_config(cfg) -> None:
    """Fail before loading anything when a setting cannot work."""
    if cfg.backend not in BACKENDS:
        raise InvalidInput(f"data.regenerate.backend: {cfg.backend!r} is not one of {list(BACKENDS)}")
    if cfg.backend == "openai" and not cfg.urls:
        raise InvalidInput("data.regenerate.urls: empty; the openai backend needs at least one server URL "
                           "(e.g. http://127.0.0.1:30000)")
    if cfg.backend == "openai":
        from specforge.launch.process import check_urls

        check_urls({f"data.regenerate.urls[{i}]": url for i, url in enumerate(cfg.urls)})
    for name in ("batch_size", "concurrency", "max_new_tokens"):
        if int(getattr(cfg, name)) < 1:
            raise InvalidInput(f"data.regenerate.{name}: must be >= 1, got {getattr(cfg, name)}")
    if cfg.temperature < 0:
        raise InvalidInput(f"data.regenerate.temperature: must be >= 0, got {cfg.temperature}")


def regen_fingerprint(cfg, target_cfg, seed: int, model: str | None = None) -> str:
    """Everything that decides the answers; URLs, concurrency and batch size do not (they decide
    how fast we get them), so changing them keeps the resume log. `model`: the one answering where
    data.regenerate.model names none (a server's). Greedy answers do not depend on the seed: it is
    fingerprinted as 0 then, so a greedy log stays valid under another seed (and as before at 0)."""
    target = None
    if target_cfg is not None:
        from specforge.targets.loader import resolve_target_path, target_fingerprint

        template = getattr(target_cfg, "chat_template", None)  # the prompts the target answers
        target = {"files": target_fingerprint(resolve_target_path(target_cfg)),
                  "dtype": target_cfg.dtype if cfg.backend == "embedded" else None,
                  **({"chat_template": file_fingerprint(template)} if template else {})}
    return fingerprint(FORMAT_VERSION, cfg.backend, cfg.model or model, float(cfg.temperature),
                       int(cfg.max_new_tokens), bool(cfg.thinking), seed if cfg.temperature > 0 else 0, target,
                       bool(cfg.keep_truncated))


def make_backend(cfg, target_cfg, seed: int):
    if cfg.backend == "embedded":
        from specforge.data.regen.embedded import EmbeddedBackend

        return EmbeddedBackend(cfg, target_cfg, seed)
    from specforge.data.regen.openai_api import OpenAIBackend

    prompts = None  # without a target (data_prep/regenerate.py without --target), or its template, nothing to check
    if target_cfg is not None and getattr(cfg, "check_template", True):
        from specforge.data.regen.prompt import target_renderer

        prompts = target_renderer(cfg, target_cfg, required=False)
    return OpenAIBackend(cfg, seed, prompts=prompts)


def _todo(conversations: list[dict], keys: list[str], done: dict, max_new_tokens: int,
          keep_truncated: bool = False) -> list[Replay]:
    """Conversations to ask, once each, in input order: not in the log, or failed transiently
    (the server may be back)."""
    todo, seen = [], set()
    for i, (conv, key) in enumerate(zip(conversations, keys)):
        rec = done.get(key)
        retry = rec is not None and (rec.get("failure") or {}).get("transient", False)
        if key not in seen and (rec is None or retry):
            todo.append(Replay(key, i, conv, max_new_tokens, keep_truncated))
        seen.add(key)
    return todo


@dataclass
class _Assembled:
    rows: list[dict] = field(default_factory=list)
    quarantine: list[dict] = field(default_factory=list)  # {"file", "line", "reason", "row"}
    failures: list[dict] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    turns: int = 0
    fix_counts: dict = field(default_factory=dict)


def _assemble(conversations, keys, done, fix, image_root) -> _Assembled:
    """Input order, original keys kept; unusable answers are dropped, the rest go through the fix
    step again so a regenerated answer that is broken is repaired or quarantined."""
    out = _Assembled()
    raws: list[RawRow] = []
    # the fix step runs on rows numbered by their position here, in their own file (relative image
    # paths resolve as before): rows of a JSON list written on one line share a line. What it keeps
    # and quarantines gets the real line back; a duplicate names the first by its real line.
    by_place: dict[int, tuple[dict, int]] = {}  # position -> (conversation, its line)
    for i, (conv, key) in enumerate(zip(conversations, keys)):
        rec = done[key]
        file, line = conv.get("file") or "<conversations>", conv.get("line") or i + 1
        out.statuses[rec["status"]] += 1
        if rec["status"] == "regenerated":
            out.turns += rec["turns"]
        if rec["failure"] is not None:
            out.failures.append({"id": conv["id"], "file": file, "line": line, "reason": rec["failure"]["reason"],
                                 "action": rec["status"], "transient": rec["failure"]["transient"],
                                 "answer": rec["failure"].get("answer")})  # the unusable answer, if any
        if rec["status"] == "skipped":
            out.quarantine.append({"file": file, "line": line, "reason": rec["failure"]["reason"],
                                   "row": {"id": conv["id"], "messages": conv["messages"], **tools_entry(conv.get("tools"))}})
            continue
        by_place[i] = (conv, line)
        raws.append(RawRow(file, i, {"id": conv["id"], "messages": rec["messages"], **tools_entry(conv.get("tools"))},
                           None))

    result = fix_dataset(raws, fix, "messages", image_root,
                         place=lambda raw: f"{raw.file}:{by_place[raw.line][1]}")
    out.fix_counts = result.counts
    for row in result.kept:
        conv = by_place[row["line"]][0]
        fixes = list(conv.get("fixes") or [])
        fixes += [f for f in row["fixes"] if f not in fixes]
        out.rows.append({**conv, "messages": row["messages"], "fixes": fixes,  # conv keeps its file and line
                         "kept_as_written": row["kept_as_written"]})  # of the answers as regenerated
    for q in result.quarantined:
        out.quarantine.append({**q, "line": by_place[q["line"]][1], "reason": f"{q['reason']} (after regeneration)"})
    return out
