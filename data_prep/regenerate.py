"""Regenerate the assistant turns of a JSONL/JSON dataset with the target model.

The draft learns best from what the target actually says, so every assistant turn is answered
again by the target (in-process through transformers, or by OpenAI-compatible servers such as
SGLang or vLLM), replaying the user turns in order. Rows are parsed and fixed like the data stage
does, before and after regeneration; the output is an OpenAI-`messages` JSONL file that the data
stage reads like any other. Interrupted runs resume: run the same command again.

    python data_prep/regenerate.py data/weather/train.jsonl --out data/weather_regen/train.jsonl \\
        --target .cache/models/SmolLM2-135M-Instruct
    python data_prep/regenerate.py data/weather/train.jsonl --out data/weather_regen/train.jsonl \\
        --backend openai --url http://127.0.0.1:30000 --url http://127.0.0.1:30001 --concurrency 64
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from specforge.config import TARGET_DTYPES, DataConfig, FixConfig, RegenerateConfig, TargetConfig
from specforge.data.fix import fix_dataset
from specforge.data.formats import FORMATS, read_raw_rows, turns_entry
from specforge.data.regen import regenerate_conversations
from specforge.data.regen.run import check_config
from specforge.data.sources import check_source
from specforge.errors import InvalidInput
from specforge.utils.io import write_jsonl


# RegenerateConfig's fields -> the flags that set them here, for its refusals
FLAGS = {"backend": "--backend", "urls": "--url", "concurrency": "--concurrency", "batch_size": "--batch-size",
         "temperature": "--temperature", "max_new_tokens": "--max-new-tokens"}


def main(argv: list[str] | None = None) -> int:
    d = RegenerateConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="dataset file (.jsonl or .json, maybe compressed: .gz .bz2 .xz .zst; .parquet, "
                                 ".arrow; ShareGPT, messages or conversations rows)")
    p.add_argument("--out", required=True, help="regenerated JSONL to write ({'id', 'messages'} rows; 'tools' too "
                                                 "where a row has them)")
    p.add_argument("--work-dir", help="resume log, failures, skipped rows and report (default: --out's folder)")
    p.add_argument("--target", help="target model directory (required for --backend embedded)")
    p.add_argument("--dtype", default=TargetConfig.dtype, choices=TARGET_DTYPES, help="dtype of the embedded target")
    p.add_argument("--chat-template", help="a Jinja chat template file used instead of the target's (embedded backend; "
                                           "a server renders with its own --chat-template)")
    p.add_argument("--backend", choices=["embedded", "openai"], default=d.backend)
    p.add_argument("--url", action="append", default=[], help="server URL (repeat for several; openai backend)")
    p.add_argument("--model", help="model name sent to the server (default: the first it serves)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight (openai backend)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences decoded at once (embedded)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0: greedy")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--thinking", action="store_true", help="enable_thinking=True in the chat template")
    p.add_argument("--keep-truncated", action="store_true",
                   help="keep answers cut off at --max-new-tokens as the last turn instead of skipping")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (--temperature > 0; greedy answers "
                                                      "do not depend on it)")
    p.add_argument("--format", choices=[f for f in FORMATS if f != "text"], default="auto",
                   help="input row format (not preformatted text: it has no turns to ask the target)")
    p.add_argument("--toon", action="store_true", help="repair/quarantine TOON answers (data.fix.toon)")
    p.add_argument("--no-fix", action="store_true", help="only parse rows, no repairs (data.fix.enabled=false)")
    p.add_argument("--max-quarantined-share", type=float, default=DataConfig.max_quarantined_share,
                   help="refuse, before the target answers anything, when more of the input rows are "
                        "quarantined (usually a wrong --format); 1: never")
    args = p.parse_args(argv)
    if not 0 <= args.max_quarantined_share <= 1:
        p.error(f"--max-quarantined-share must lie in [0, 1], got {args.max_quarantined_share:g}")

    if args.backend == "embedded" and not args.target:
        p.error("--target is required with --backend embedded")
    out = Path(args.out)
    work_dir = Path(args.work_dir) if args.work_dir else out.parent
    split = out.stem
    cfg = RegenerateConfig(enabled=True, backend=args.backend, urls=args.url, model=args.model,
                           concurrency=args.concurrency, batch_size=args.batch_size, temperature=args.temperature,
                           max_new_tokens=args.max_new_tokens, thinking=args.thinking,
                           keep_truncated=args.keep_truncated)
    target = TargetConfig(name=Path(args.target).name, path=args.target, dtype=args.dtype,
                          chat_template=args.chat_template) if args.target else None
    fix = FixConfig(enabled=not args.no_fix, toon=args.toon)
    try:  # the settings first, said as the flags that gave them
        check_config(cfg)
    except InvalidInput as e:
        p.error(re.sub(r"data\.regenerate\.(\w+)(\[\d+\])?", lambda m: FLAGS.get(m[1], m[0]), str(e)))

    try:
        check_source(args.input)
        parsed = fix_dataset(read_raw_rows(args.input), fix, args.format)
        if not parsed.counts["input_rows"]:
            raise InvalidInput(f"{args.input} holds no rows: nothing to regenerate")
        if parsed.quarantined:
            write_jsonl(work_dir / f"regen_{split}.input_quarantine.jsonl", parsed.quarantined)
            print(f"{len(parsed.quarantined)} input rows quarantined before regeneration: "
                  f"{work_dir / f'regen_{split}.input_quarantine.jsonl'}")
        problem = parsed.too_many_quarantined(args.max_quarantined_share)
        if problem:
            raise InvalidInput(f"{args.input}: {problem}. Nothing was regenerated; to accept this, raise "
                               "--max-quarantined-share")
        rows, report = regenerate_conversations(parsed.kept, cfg, target, work_dir, split, fix=fix, seed=args.seed)
    except (ConnectionError, FileNotFoundError, ValueError) as e:  # configuration problems: no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    report.pop("quarantine")
    n = write_jsonl(out, (turns_entry(r) for r in rows))
    print(json.dumps({k: v for k, v in report.items() if k != "files"}, indent=2))
    print(f"wrote {n} conversations to {out}; failures and skipped rows in {work_dir}/regen_{split}.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
