"""Data stage: raw files -> clean conversations -> input_ids + loss_mask -> draft vocab map.

Every input row is accounted for: it becomes a sample (kept as is or fixed) or a quarantine
entry with its file, line and reason; the report shows that the counts reconcile. Outputs live
in `run_dir/data/` (see docs/design.md).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from collections import Counter
from pathlib import Path

from specforge.config import FixConfig, check_ranges
from specforge.data.fix import MEANING, fix_dataset, quarantine_entry, ranked_reasons, reason_code, top_reasons
from specforge.data.fix.conversations import ImageChecker, ImageLoading, Quarantine, dedupe_key, prompt_key
from specforge.data.formats import RawRow, read_raw_rows, turns_entry, uses_tools
from specforge.data.rows import normalise_row, prompt_overlength, render_conversation
from specforge.data.sources import check_source, hub_name_split, is_hub, source_fingerprint
from specforge.data.template import TemplateError, assistant_markers, text_prompt
from specforge.data.vocab import cached_vocab_mapping, save_vocab, vocab_cache_key
from specforge.errors import InvalidInput, MissingInput
from specforge.run_layout import RunLayout
from specforge.utils.io import file_fingerprint, fingerprint, write_json, write_jsonl, write_text
from specforge.utils.progress import progress_bar

def generate_hint(path: str) -> str:
    """How to make a missing file of the synthetic weather sets (conf/data/weather*.yaml); nothing
    for anyone else's data, which no command here makes."""
    folder = Path(path).parent
    if folder.name not in ("weather", "weather_vl"):
        return ""
    images = " --images 0.5" if folder.name == "weather_vl" else ""
    return f"; it can be generated with `python data_prep/weather.py --out {folder}{images}`"
# What most rows of a split quarantined for one reason usually mean: a hint for the error message.
SHARE_HINTS = {
    "invalid_row": "the rows do not have the shape data.format={format} expects; check data.format "
                   "('auto' detects messages, sharegpt and conversations rows one by one)",
    "no_messages": "the rows hold no conversation where data.format={format} looks; check data.format",
    "invalid_json": "is the file JSON Lines (.jsonl, one object per line) or one JSON list (.json)?",
    "duplicate": "the rows repeat one another (the first of each is kept): is a file exported with repeats, "
                 "or are the same conversations in two files?",
    "no_assistant_turn": "the conversations have no answer to train on: are these prompts only? (data.format=text: "
                         "rendered with another chat template than the target's? see target.chat_template)",
    "empty_turn": "turns with empty content: check the field the texts are in (data.format={format})",
    "row_too_long": "raise data.max_chars_per_row (now {max_chars})",
    "overlength": "raise data.max_length or set data.overlength=truncate",
    "no_loss_tokens_after_truncation": "the answers start after data.max_length (now {max_length}): raise it",
    "prompt_overlength": "the prompts alone fill data.max_length (now {max_length}): raise it",
    "toon_unrepairable": "are the answers TOON at all? set data.fix.toon=false if not",
    "toon_not_a_document": "the answers are prose: set data.fix.toon=false, or data.fix.toon_prose=keep",
    "image_missing": "check data.image_root (now {image_root}; default: the data file's folder)",
    "image_outside_root": "check data.image_root (now {image_root})",
    "image_too_large": "the images have more pixels than PIL decodes without calling them a decompression bomb; "
                       "downscale them (the target's processor resizes them to data.image_max_pixels anyway)",
    "image_format": "the images are in a format not read here (HEIC photos from an iPhone, which the servers "
                    "cannot read either?): convert them to JPEG or PNG",
    "image_refused": "the target's image processor (and so a server) refuses these images, e.g. strips "
                     "thinner than 1:200: crop or pad them",
    "image_remote": "the images are URLs, and nothing here fetches them: download them and name the files "
                    "(or embed them: base64 data: URIs, or a Parquet / datasets Image column)",
    "special_token_text": "the texts spell the tokenizer's special tokens (a chat log saved with its template "
                          "applied?); data.special_token_text=keep tokenizes them as control tokens, and "
                          "{{\"id\", \"text\"}} rows of whole rendered conversations are read with data.format=text",
    "in_train": "the eval files repeat the training prompts: hold out other conversations, or set "
                "data.eval_in_train=keep to evaluate on training prompts",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def split_files(cfg) -> dict[str, list[str]]:
    """{"train": [...], "eval": [...]}, glob patterns expanded; eval only when eval files are configured."""
    splits = {"train": expand_patterns(cfg.data.train_files, "data.train_files")}
    if cfg.data.eval_files:
        splits["eval"] = expand_patterns(cfg.data.eval_files, "data.eval_files")
    return splits


def expand_patterns(entries, key: str) -> list[str]:
    """Each entry with a glob pattern (`shards/*.jsonl.gz`, `**` for subfolders) -> the paths it
    matches, sorted; one that matches nothing is an error naming `key`. A file whose name only looks
    like a pattern (`rows[1].jsonl`, a `ds[1]` folder) is that file: as a pattern it matches `rows1.jsonl`,
    not itself."""
    out = []
    for entry in entries:
        if is_hub(entry) or not glob.has_magic(entry) or Path(entry).exists():
            out.append(entry)
            continue
        matches = sorted(glob.glob(entry, recursive=True))
        if not matches:
            raise MissingInput(f"{key}: {entry} matches no file{generate_hint(entry)}")
        out += matches
    return out


def _check_exists(path: str) -> None:
    """A data file, a save_to_disk folder or a hub name (specforge/data/sources.py)."""
    try:
        check_source(path)
    except FileNotFoundError:
        raise MissingInput(f"data file {path} not found{generate_hint(path)}") from None


def extra_inputs(cfg) -> dict:
    """Content fingerprints of the raw files (folders: of all their files; hub datasets: their
    name only): editing a file re-runs the stage. The seed where regeneration samples."""
    out = {}
    for split, files in split_files(cfg).items():
        for f in files:
            _check_exists(f)
        out[split] = {f: source_fingerprint(f) for f in files}
    if cfg.target.chat_template and Path(cfg.target.chat_template).is_file():  # editing it renders rows anew
        out["chat_template"] = file_fingerprint(cfg.target.chat_template)
    regen = cfg.data.regenerate
    if regen.enabled and regen.temperature > 0:  # sampled answers follow the seed (greedy ones do not)
        out["regenerate_seed"] = cfg.seed
    return out


def target_vocab_size(target_path: Path, tokenizer) -> int:
    """The model's vocab size (config.json, text_config for vision-language targets), never
    smaller than the tokenizer: the draft's t2d must cover every id the tokenizer can emit."""
    config_vocab = 0
    config_file = Path(target_path) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config_vocab = (config.get("text_config") or {}).get("vocab_size") or config.get("vocab_size") or 0
    return max(int(config_vocab), len(tokenizer))


def tokenizer_fingerprint(target_path: Path) -> str:
    files = [Path(target_path) / n for n in TOKENIZER_FILES if (Path(target_path) / n).is_file()]
    return fingerprint({f.name: file_fingerprint(f) for f in files})


def _read_split(files: list[str]) -> list[RawRow]:
    rows: list[RawRow] = []
    for f in files:
        rows.extend(read_raw_rows(f))
    return rows


def max_chars_per_row(data_cfg) -> int:
    """data.max_chars_per_row, or by default 16 characters per token of max_length (at least 65536):
    far more than truncation keeps, small enough that one row cannot blow up the tokenizer."""
    limit = data_cfg.max_chars_per_row
    return max(16 * data_cfg.max_length, 1 << 16) if limit is None else limit


def check(cfg) -> None:
    """Fail on a setting that cannot work before any file is read, not after minutes of work."""
    from specforge.data.fix import check_config as check_fix
    from specforge.data.regen.run import check_config as check_regen
    from specforge.targets.loader import local_target_config, read_chat_template

    check_ranges(cfg, ["data"])
    if cfg.target.chat_template:
        read_chat_template(cfg.target.chat_template, "target.chat_template")
    check_fix(cfg.data.fix)
    if cfg.data.format == "text":
        check_preformatted(cfg)
    if cfg.data.regenerate.enabled:
        check_regen(cfg.data.regenerate)
    if (target_config := local_target_config(cfg.target)) is not None:  # else once it is fetched (run)
        check_max_length(cfg, target_config, cfg.target.path)
    splits = split_files(cfg)
    ids = _identities([f for files in splits.values() for f in files])
    for split, files in splits.items():  # the second copy's rows would all be quarantined as duplicates
        first: dict[tuple, str] = {}
        for f in (f for f in files if f in ids):
            if ids[f] in first:
                raise InvalidInput(f"data.{split}_files: {first[ids[f]]} is listed twice ({f} is the same input); "
                                   "name it once")
            first[ids[f]] = f
    if cfg.data.eval_in_train == "quarantine":
        train: dict[tuple, str] = {}
        for t in (t for t in splits["train"] if t in ids):
            train.setdefault(ids[t], t)
        for e in (e for e in splits.get("eval", []) if e in ids):
            if ids[e] in train:
                raise InvalidInput(f"data.eval_files: {e} is also a training file ({train[ids[e]]}): no held-out row "
                                   "would be left; name another file, or set data.eval_in_train=keep to evaluate on "
                                   "training prompts")


def check_preformatted(cfg) -> None:
    """data.format=text trains the text as written: what needs turns cannot apply to it."""
    from specforge.targets.vl import is_vl

    needs_turns = [name for name, on in (("data.regenerate.enabled", cfg.data.regenerate.enabled),
                                         ("data.fix.toon", cfg.data.fix.enabled and cfg.data.fix.toon),
                                         (f"target.kind={cfg.target.kind}", is_vl(cfg.target.kind))) if on]
    if needs_turns:
        raise InvalidInput(f"data.format=text: preformatted text is trained as written: it has no turns to "
                           f"regenerate, repair or attach images to, so {', '.join(needs_turns)} cannot apply; turn "
                           "that off, or give the conversations as turns (messages, conversations, ...)")


def check_max_length(cfg, target_config, where) -> None:
    """data.max_length within the target's positions: past them its hidden states are not what it
    serves (RoPE beyond its training), and training would learn from them without a sign. And
    room for a prompt beside data.regenerate.max_new_tokens: else every conversation is refused
    (regen_prompt_too_long) and kept with its original answer."""
    from specforge.targets.loader import target_context

    positions = target_context(target_config)
    if positions and cfg.data.max_length > positions:
        raise InvalidInput(f"data.max_length={cfg.data.max_length} is past the target's context: {positions} "
                           f"positions (max_position_embeddings and RoPE scaling in {where}/config.json); "
                           f"set data.max_length <= {positions}")
    regen = cfg.data.regenerate
    if positions and regen.enabled and regen.max_new_tokens >= positions:
        raise InvalidInput(f"data.regenerate.max_new_tokens={regen.max_new_tokens} leaves no room for a prompt in the "
                           f"target's {positions} positions ({where}/config.json): every conversation would be kept "
                           f"with its original answer; set it well below {positions}")


def _identities(entries: list[str]) -> dict[str, tuple]:
    """What makes two inputs one: the hub split (hub:a/b is hub:a/b:train), else the resolved path,
    or for a file whose size another file shares, its bytes (hashed: each read at most once, and
    only then, so many shards cost a stat each). Missing files have none: the stage says they are."""
    paths = {e: Path(e) for e in entries if not is_hub(e)}
    size = {e: p.stat().st_size for e, p in paths.items() if p.is_file()}
    shared = Counter(size[e] for e in entries if e in size)  # a name listed twice: twice
    ids: dict[str, tuple] = {}
    for e in dict.fromkeys(entries):  # each name once
        if is_hub(e):
            ids[e] = ("hub", *hub_name_split(e))
        elif e in size and shared[size[e]] > 1:
            ids[e] = ("bytes", _bytes_hash(paths[e]))
        elif paths[e].exists():
            ids[e] = ("path", str(paths[e].resolve()))
    return ids


def _bytes_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _parse_only(rows: list[RawRow], fmt: str, image_root: str | None = None, max_chars: int | None = None,
                embedded_dir: Path | None = None,
                loading: ImageLoading = ImageLoading()) -> tuple[list[dict], list[dict]]:
    """Without the fix step: parse each row, quarantine what does not parse, is too long or names
    a bad image (same reason codes); image paths are resolved as the fix step resolves them."""
    images, off = ImageChecker(image_root, embedded_dir, loading), FixConfig(enabled=False)
    kept, quarantined = [], []
    for raw in rows:
        try:
            conv, fixes = normalise_row(raw, off, fmt, images, max_chars)
        except Quarantine as q:
            quarantined.append(quarantine_entry(raw, q.reason))
            continue
        kept.append({**conv, "fixes": fixes, "file": raw.file, "line": raw.line})
    return kept, quarantined


def _normalise(cfg, rows: list[RawRow], embedded_dir: Path | None) -> tuple[list[dict], list[dict]]:
    """(conversations {"id", "messages", "fixes", "file", "line"}, quarantine entries)."""
    max_chars, loading = max_chars_per_row(cfg.data), ImageLoading.of(cfg.data)
    if not cfg.data.fix.enabled:
        return _parse_only(rows, cfg.data.format, cfg.data.image_root, max_chars, embedded_dir, loading)
    result = fix_dataset(rows, cfg.data.fix, cfg.data.format, cfg.data.image_root, max_chars,
                         embedded_dir=embedded_dir, loading=loading)
    if len(result.kept) + len(result.quarantined) != len(rows):
        raise RuntimeError(
            f"data.fix: {len(rows)} input rows but {len(result.kept)} kept + {len(result.quarantined)} "
            "quarantined; every row must be accounted for exactly once"
        )
    return result.kept, result.quarantined


def process_split(cfg, split: str, files: list[str], tokenizer, progress=None, run_dir=None, vl=None,
                  train_prompts: dict[str, str] | None = None) -> dict:
    """Read, normalise, limit, (regenerate) and render one split. `vl`: (image processor, VLInfo)
    of a vision-language target; its rows also carry `images` and `image_grid_thw`.
    `train_prompts` (an eval split's): the train split's "prompts"; rows opening with one of them
    are quarantined as in_train (data.eval_in_train=keep: counted only).

    data.num_proc >= 1 runs the per-row steps in `datasets.map` workers (specforge/data/parallel.py)
    with the same functions and the same result. Returns {"samples", "conversations",
    "quarantine", "counts", "prompts"} ("prompts": prompt_key -> where, of the samples); samples
    that cannot be used after rendering (over-length, template errors) move from kept/fixed to
    quarantined."""
    for f in files:
        _check_exists(f)
    mapped = cfg.data.num_proc > 0
    renders = None  # one RowRender per conversation once rendered
    embedded = RunLayout(run_dir).embedded_images if run_dir is not None else None  # else data URIs stay URIs
    if mapped:
        from specforge.data import parallel

        # Rendered in the same pass as the fix unless regeneration or max_samples come between.
        fused = not cfg.data.regenerate.enabled and cfg.data.max_samples is None
        n_rows, convs, quarantine, renders = parallel.normalise_split(
            cfg, files, max_chars_per_row(cfg.data), tokenizer if fused else None, vl, embedded)
    else:
        rows = _read_split(files)
        n_rows = len(rows)
        convs, quarantine = _normalise(cfg, rows, embedded)
        del rows
    quarantine = [{"split": split, **q} for q in quarantine]
    in_train = None
    if train_prompts is not None:
        seen = {i: where for i, c in enumerate(convs)
                if (key := conversation_prompt_key(tokenizer, c)) and (where := train_prompts.get(key))}
        in_train = len(seen)
        if cfg.data.eval_in_train == "quarantine" and seen:
            quarantine += [_quarantined(split, convs[i], f"in_train: opens with the prompt of the train sample "
                                                         f"from {where}; the draft is trained on it, so it would "
                                                         "not measure held-out accept length")
                           for i, where in seen.items()]
            convs = [c for i, c in enumerate(convs) if i not in seen]
            if renders is not None:  # rendered in the workers already, one per conversation
                renders = [r for i, r in enumerate(renders) if i not in seen]

    skipped = 0
    if cfg.data.max_samples is not None and len(convs) > cfg.data.max_samples:
        skipped = len(convs) - cfg.data.max_samples
        convs = convs[: cfg.data.max_samples]

    regenerated = None
    if cfg.data.regenerate.enabled:
        # The draft must learn what the target says: its own answers replace the dataset's.
        from specforge.data.regen import regenerate_conversations

        if run_dir is None:
            raise ValueError("data.regenerate: needs the run directory for its resume journal")
        convs, too_long = _prompt_overlength(split, convs, tokenizer, cfg.data.max_length)
        quarantine += too_long
        refuse_before_regeneration(cfg, split, n_rows, quarantine, RunLayout(run_dir))
        convs, regenerated = regenerate_conversations(
            convs, cfg.data.regenerate, cfg.target, RunLayout(run_dir).data_dir, split,
            fix=cfg.data.fix, image_root=cfg.data.image_root, seed=cfg.seed, progress=progress)
        quarantine += [{"split": split, **q} for q in regenerated.pop("quarantine")]

    task = progress.add_task(f"data {split}", total=len(convs), info="") if progress else None
    if renders is None and mapped:
        renders = parallel.render_split(cfg, convs, tokenizer, vl)
    if renders is None:
        renders = []
        for conv in convs:
            renders.append(render_conversation(tokenizer, conv, cfg.data.max_length, cfg.data.overlength, vl,
                                               cfg.data.special_token_text))
            if task is not None:
                progress.advance(task)
    elif task is not None:
        progress.update(task, completed=len(convs))
    result = _collect(split, convs, renders, quarantine, n_rows, skipped, tokenizer)
    if in_train is not None:
        result["counts"]["in_train"] = in_train
    if regenerated is not None:
        result["counts"]["regenerate"] = regenerated
    return result


def conversation_prompt_key(tokenizer, conv: dict) -> str | None:
    """`prompt_key` of a conversation; of preformatted text (data.format=text), its text up to the first
    assistant turn (eval rows are held out against train samples by it)."""
    if "text" not in conv:
        return prompt_key(conv["messages"])
    prompt = text_prompt(tokenizer, conv["text"])
    return dedupe_key(prompt) if prompt else None


def _quarantined(split: str, conv: dict, reason: str) -> dict:
    """The quarantine entry of a parsed conversation (data/quarantine.jsonl)."""
    return {"split": split, "file": conv.get("file"), "line": conv.get("line"), "reason": reason,
            "row": turns_entry(conv)}


def _prompt_overlength(split: str, convs: list[dict], tokenizer, max_length: int) -> tuple[list[dict], list[dict]]:
    """(the conversations an answer can fit, quarantine entries of those whose prompt alone fills
    max_length): the target is not asked for answers that would be cut away."""
    keep, out = [], []
    for conv in convs:
        if reason := prompt_overlength(tokenizer, conv["messages"], max_length, conv.get("tools")):
            out.append(_quarantined(split, conv, reason))
        else:
            keep.append(conv)
    return keep, out


def _collect(split: str, convs: list[dict], renders: list, quarantine: list[dict], n_rows: int, skipped: int,
             tokenizer) -> dict:
    """The split's result from its rendered conversations (one RowRender each, in order): samples,
    clean conversations, the quarantine (rows that rendered to a reason join it, in order) and
    the counts, which must reconcile with the `n_rows` input rows."""
    samples, conversations = [], []
    prompts: dict[str, str] = {}  # prompt_key -> "file line N" of the first sample opening with it
    fixes: Counter = Counter()
    as_written: Counter = Counter()  # rows that went through although flagged (no valid TOON, an EXIF-turned image)
    kept = fixed = truncated = tool_rows = tool_calls = 0
    ids: set[str] = set()
    for conv, r in zip(convs, renders, strict=True):
        if r.reason is not None:
            quarantine.append(_quarantined(split, conv, r.reason))
            continue
        if conv["id"] in ids:  # files merged with ids counted from 0 each: the store keys samples by id
            conv = {**conv, "id": _unused_id(conv, ids), "fixes": [*conv.get("fixes", ()), "renamed_duplicate_id"]}
        ids.add(conv["id"])
        truncated += r.truncated
        tool_rows += uses_tools(conv.get("messages", []), conv.get("tools"))
        tool_calls += sum(len(m.get("tool_calls") or ()) for m in conv.get("messages", ()))
        as_written.update(conv.get("kept_as_written") or ())
        if conv.get("fixes"):
            fixed += 1
            fixes.update(conv["fixes"])
        else:
            kept += 1
        samples.append({"id": conv["id"], "input_ids": r.input_ids, "loss_mask": r.loss_mask, **r.images})
        conversations.append(turns_entry(conv))
        if key := conversation_prompt_key(tokenizer, conv):
            prompts.setdefault(key, f"{conv.get('file')} line {conv.get('line')}")
    lengths = [len(s["input_ids"]) for s in samples]
    counts = {
        "input_rows": n_rows,
        "kept": kept,
        "fixed": fixed,
        "quarantined": len(quarantine),
        "skipped_max_samples": skipped,
        "by_reason": dict(sorted(Counter(reason_code(q["reason"]) for q in quarantine).items())),
        "by_fix": dict(sorted(fixes.items())),
        "by_kept_as_written": dict(sorted(as_written.items())),
        "truncated": truncated,
        "samples": len(samples),
        "tokens": sum(lengths),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "images": sum(len(s.get("images", ())) for s in samples),
        "tool_rows": tool_rows,  # samples with tools, calls or results (agentic traces)
        "tool_calls": tool_calls,
        "max_tokens": max(lengths, default=0),
    }
    accounted = kept + fixed + len(quarantine) + skipped
    if accounted != n_rows:
        raise RuntimeError(
            f"data {split}: {n_rows} input rows but {accounted} accounted for "
            f"(kept {kept} + fixed {fixed} + quarantined {len(quarantine)} + skipped {skipped})"
        )
    return {"samples": samples, "conversations": conversations, "quarantine": quarantine, "counts": counts,
            "prompts": prompts}


def _unused_id(conv: dict, ids: set[str]) -> str:
    """A new id for a sample whose id an earlier one has: "<id>@<file name>:<line>" (its provenance),
    with "~k" added should even that be taken."""
    base = f"{conv['id']}@{Path(str(conv.get('file'))).name}:{conv.get('line')}"
    new, k = base, 1
    while new in ids:
        new, k = f"{base}~{k}", k + 1
    return new


def _coverage(samples: list[dict], t2d) -> float:
    """Fraction of loss tokens the draft vocab can predict (1.0 = nothing lost to the reduced vocab)."""
    allowed = t2d.tolist()
    total = covered = 0
    for s in samples:
        for t, m in zip(s["input_ids"], s["loss_mask"]):
            if m:
                total += 1
                covered += allowed[t]
    return round(covered / total, 6) if total else 0.0


def run(cfg, run_dir, fingerprint: str | None = None) -> dict:
    """Write run_dir/data/*; returns the per-split counts and vocab facts for the pipeline marker."""
    from specforge.targets.loader import load_tokenizer, resolve_target_path
    from specforge.targets.vl import is_vl, load_image_processor, vl_info
    from transformers import AutoConfig

    check(cfg)
    layout = RunLayout(run_dir)
    splits = split_files(cfg)
    for files in splits.values():
        for f in files:
            _check_exists(f)
    target_path = resolve_target_path(cfg.target)
    target_config = AutoConfig.from_pretrained(target_path, trust_remote_code=cfg.target.trust_remote_code)
    check_max_length(cfg, target_config, target_path)  # check() could not where the target was still to fetch
    tokenizer = load_tokenizer(cfg.target)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInput(f"target tokenizer at {target_path} has no chat template; the data stage needs one: give "
                           "it with target.chat_template=FILE (a Jinja template, as the servers' --chat-template)")
    if cfg.data.format == "text":  # before any row: every one would be a template_error
        try:
            assistant_markers(tokenizer)
        except TemplateError as e:
            raise InvalidInput(f"data.format=text with the chat template of {target_path}: {e}") from None

    vl = None
    if is_vl(cfg.target.kind):
        vl = (load_image_processor(target_path, cfg.data.image_min_pixels, cfg.data.image_max_pixels),
              vl_info(target_config))
    results = {}
    with progress_bar() as progress:
        for split, files in splits.items():  # train first: eval rows are checked against its prompts
            train_prompts = results["train"]["prompts"] if split == "eval" else None
            results[split] = process_split(cfg, split, files, tokenizer, progress, run_dir, vl, train_prompts)

    for split in ("train", "eval"):
        if split not in results:  # no eval files configured: leave no stale eval data behind
            for stale in (layout.samples(split), layout.conversations(split)):
                stale.unlink(missing_ok=True)
            continue
        write_jsonl(layout.samples(split), results[split]["samples"])
        write_jsonl(layout.conversations(split), results[split]["conversations"])
    write_jsonl(layout.quarantine, [q for r in results.values() for q in r["quarantine"]])
    embedded = _keep_named_images(layout, results)

    summary = {split: r["counts"] for split, r in results.items()}
    train = results["train"]
    if not train["samples"]:
        _write_report(layout, summary, None)
        raise InvalidInput(
            f"data: no training samples left out of {train['counts']['input_rows']} rows "
            f"(top reasons: {top_reasons(train['counts'])}); see {layout.quarantine} and {layout.data_report_md}"
        )
    too_many = [p for split, r in results.items() if (p := quarantined_share_problem(cfg, split, r))]
    if too_many:
        _write_report(layout, summary, None)
        raise InvalidInput("; ".join(too_many) + f". Every row is accounted for in {layout.quarantine} and "
                           f"{layout.data_report_md}; to accept this, raise data.max_quarantined_share (1.0: never fail)")
    held_out = results.get("eval")
    if held_out is not None and not held_out["samples"]:  # every held-out metric would be of nothing
        _write_report(layout, summary, None)
        raise InvalidInput(
            f"data: no held-out samples left out of {held_out['counts']['input_rows']} rows of data.eval_files "
            f"(top reasons: {top_reasons(held_out['counts'])}); see {layout.quarantine} and {layout.data_report_md}; "
            "name files with held-out conversations, or data.eval_files=[] to train without a held-out split"
        )

    vocab_size = target_vocab_size(target_path, tokenizer)
    requested = cfg.draft.draft_vocab_size
    key = vocab_cache_key(
        file_fingerprint(layout.samples("train")), tokenizer_fingerprint(target_path),
        vocab_size, requested,
    )
    d2t, t2d, hit = cached_vocab_mapping(  # says so when it clamps the requested size
        cfg.cache_dir, key, ((s["input_ids"], s["loss_mask"]) for s in train["samples"]),
        vocab_size, requested,
    )
    save_vocab(layout.vocab, d2t, t2d)
    vocab = {
        "vocab_size": vocab_size,
        "requested_draft_vocab_size": requested,
        "draft_vocab_size": int(len(d2t)),
        "cache_key": key,
        "cache_hit": hit,
        "coverage": {split: _coverage(r["samples"], t2d) for split, r in results.items()},
    }
    _write_report(layout, summary, vocab, embedded)
    refuse_low_coverage(cfg, vocab, train["samples"], layout)
    return {**summary, "vocab": vocab}


def _keep_named_images(layout: RunLayout, results: dict) -> dict | None:
    """{"files", "bytes"} of the images written from the data (ImageChecker) that the samples name;
    the folder's others (of rows quarantined since, or of an earlier version of the data) are
    removed, so it holds the run's images and no more. None where the data embedded none."""
    folder = layout.embedded_images
    if not folder.is_dir():
        return None
    named = {Path(p) for r in results.values() for s in r["samples"] for p in s.get("images", ())
             if Path(p).parent == folder.resolve()}
    for path in folder.resolve().iterdir():
        if path not in named and not path.name.startswith("."):  # "."-files: another writer's temp files
            path.unlink()
    return {"files": len(named), "bytes": sum(p.stat().st_size for p in named)}


def damaged(cfg, run_dir, summary: dict) -> str | None:
    """A finished data stage's files that are gone (deleted by hand, or the images it wrote from the
    data's embedded ones): the pipeline prepares the data again, the same as before, instead of
    handing the extraction names of nothing."""
    layout = RunLayout(run_dir)
    splits = [split for split in ("train", "eval") if split in summary]
    for path in [*map(layout.samples, splits), *map(layout.conversations, splits), layout.vocab]:
        if not path.is_file():
            return f"{path} is gone"
    root = f"{layout.embedded_images.resolve()}{os.sep}"
    for split in (s for s in splits if summary[s].get("images")):
        with open(layout.samples(split), encoding="utf-8") as f:
            for line in (line for line in f if root in line):
                ours = (p for p in json.loads(line)["images"] if p.startswith(root))
                if gone := next((p for p in ours if not Path(p).is_file()), None):
                    return f"the image {gone} it wrote from the data is gone"
    return None


def refuse_low_coverage(cfg, vocab: dict, samples: list[dict], layout: RunLayout) -> None:
    """A draft vocab that covers too few of the training loss tokens (the most frequent ones are
    kept, so no draft vocab of that size covers more): the draft never proposes the rest, and the
    held-out simulated accept length, counted where the target's token is in the draft vocab
    (docs/contract.md §4), would not show it."""
    covered, floor = vocab["coverage"]["train"], cfg.draft.min_vocab_coverage
    if covered >= floor or cfg.draft.init_from:  # a draft trained on keeps its own vocab map
        return
    distinct = len({t for s in samples for t, m in zip(s["input_ids"], s["loss_mask"]) if m})
    raise InvalidInput(
        f"draft.draft_vocab_size={vocab['draft_vocab_size']} covers {covered:.1%} of the training loss tokens, "
        f"below draft.min_vocab_coverage={floor:g}: the draft never proposes the other {1 - covered:.1%}, and the "
        f"held-out simulated accept length (counted where the target's token is in the draft vocab) would hide it. "
        f"The data has {distinct} distinct loss tokens: raise draft.draft_vocab_size, or lower "
        f"draft.min_vocab_coverage (0: never refuse). See {layout.data_report_md}")


def refuse_before_regeneration(cfg, split: str, rows: int, quarantine: list[dict], layout: RunLayout) -> None:
    """The quarantined-share check on the parsed rows, before the target answers any of them: a
    wrong data.format must not cost a regeneration first. The quarantine is written before failing."""
    counts = {"input_rows": rows, "quarantined": len(quarantine),
              "by_reason": dict(Counter(reason_code(q["reason"]) for q in quarantine))}
    problem = quarantined_share_problem(cfg, split, {"counts": counts, "quarantine": quarantine})
    if problem:
        write_jsonl(layout.quarantine, quarantine)
        raise InvalidInput(f"{problem}. Nothing was regenerated; every quarantined row is in {layout.quarantine}; "
                           "to accept this, raise data.max_quarantined_share (1.0: never fail)")


def quarantined_share_problem(cfg, split: str, result: dict) -> str | None:
    """Why this split lost too many rows (share, top reasons, one example, a hint), or None.

    A stage that quarantines most of its input almost always read it wrongly (data.format, the
    wrong file); finishing with "done" would hide that behind a tiny training set."""
    counts = result["counts"]
    rows, quarantined = counts["input_rows"], counts["quarantined"]
    limit = cfg.data.max_quarantined_share
    if not rows or quarantined / rows <= limit:
        return None
    top = ranked_reasons(counts)[0][0]
    example = next(q for q in result["quarantine"] if reason_code(q["reason"]) == top)
    reason = example["reason"] if len(example["reason"]) <= 200 else example["reason"][:197] + "..."
    hint = SHARE_HINTS.get(top, "").format(  # none for a reason without one (the data.format hint misled)
        format=cfg.data.format, max_chars=max_chars_per_row(cfg.data), image_root=cfg.data.image_root,
        max_length=cfg.data.max_length)
    return (f"data {split}: {quarantined} of {rows} rows quarantined ({quarantined / rows:.1%}), more than "
            f"data.max_quarantined_share={limit}; top reasons: {top_reasons(counts)}; e.g. {example['file']} "
            f"line {example['line']}: {reason}" + (f"; hint: {hint}" if hint else ""))


def _write_report(layout: RunLayout, summary: dict, vocab: dict | None, embedded: dict | None = None) -> None:
    write_json(layout.data_report_json, {"splits": summary, "vocab": vocab, "embedded_images": embedded})
    write_text(layout.data_report_md, report_markdown(summary, vocab, embedded))


def report_markdown(summary: dict, vocab: dict | None, embedded: dict | None = None) -> str:
    rows = ["input_rows", "kept", "fixed", "quarantined", "skipped_max_samples", "truncated",
            "samples", "tokens", "loss_tokens", "max_tokens"]
    if any(summary[s].get("images") for s in summary):
        rows.append("images")
    if any(summary[s].get("tool_rows") for s in summary):
        rows += ["tool_rows", "tool_calls"]  # agentic traces read as such, not flattened
    if any("in_train" in summary[s] for s in summary):
        rows.append("in_train")  # eval rows opening with a train sample's prompt (data.eval_in_train)
    splits = list(summary)
    lines = ["# Data report", "", "Every input row is kept, fixed or quarantined "
             "(input_rows = kept + fixed + quarantined + skipped_max_samples).", "",
             "| | " + " | ".join(splits) + " |", "|---|" + "---|" * len(splits)]
    lines += [f"| {k} | " + " | ".join(str(summary[s].get(k, "-")) for s in splits) + " |" for k in rows]
    for title, key in (("Quarantined by reason", "by_reason"), ("Fixes applied", "by_fix"),
                       ("Kept as written", "by_kept_as_written")):
        names = sorted({n for s in splits for n in summary[s].get(key, {})})
        if names:
            lines += ["", f"## {title}", "", "| | " + " | ".join(splits) + " |", "|---|" + "---|" * len(splits)]
            lines += [f"| {n} | " + " | ".join(str(summary[s].get(key, {}).get(n, 0)) for s in splits) + " |"
                      for n in names]
            if meant := [f"- `{n}`: {MEANING[n]}" for n in names if n in MEANING]:
                lines += ["", *meant]
            if key == "by_kept_as_written":
                lines += ["", "Rows, counted among kept and fixed."]
    if vocab:
        requested = vocab.get("requested_draft_vocab_size", vocab["draft_vocab_size"])
        clamped = (f"; draft.draft_vocab_size={requested} clamped to the target vocab"
                   if requested != vocab["draft_vocab_size"] else "")
        lines += ["", "## Draft vocabulary", "",
                  f"- {vocab['draft_vocab_size']} of {vocab['vocab_size']} target tokens "
                  f"(cache {'hit' if vocab['cache_hit'] else 'miss'}, key {vocab['cache_key']}{clamped})"]
        lines += [f"- loss tokens covered by the draft vocab, {s}: {c:.2%}" for s, c in vocab["coverage"].items()]
    if embedded:
        lines += ["", f"Images written to `images/`, once each (those that came inside the data as data: URIs or "
                      f"table image columns, and copies as the server loads them): {embedded['files']} distinct, "
                      f"{embedded['bytes'] / 1e6:.1f} MB."]
    lines += ["", "Quarantined rows with file, line and reason: `quarantine.jsonl`.", ""]
    return "\n".join(lines)
