"""Fix a raw conversation dataset on its own, as the data stage does: every row kept, fixed (with its
fixes) or quarantined (with reason, file and line), and a report.

    python data_prep/fix.py data/weather/train.jsonl --out data/clean [--toon] [--format auto]

Writes <out>/<name>.jsonl (clean `{"id", "messages"(, "tools"), "fixes", "kept_as_written"}` rows, "text" for
"messages" with --format text: as the data stage keeps them), <out>/<name>.quarantine.jsonl and
<out>/<name>.report.{json,md}. The same code runs in `python train.py stages=[data]`.
A file that cannot be read (missing, empty, not UTF-8 text, unsupported type) or holds no row exits 1
naming it and writes nothing. More than --max-quarantined-share of the rows quarantined (usually a wrong
--format or the wrong file) exits 1 too, after writing every output: as data.max_quarantined_share does.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specforge.config import DataConfig, FixConfig
from specforge.data.fix import MEANING, fix_dataset
from specforge.data.fix.conversations import ImageLoading
from specforge.data.formats import FORMATS, read_raw_rows, turns_entry
from specforge.data.sources import check_source
from specforge.utils.io import write_json, write_jsonl, write_text


def report_markdown(name: str, counts: dict) -> str:
    lines = [f"# Fix report: {name}", "",
             "input_rows = kept + fixed + quarantined", "", "| | rows |", "|---|---|"]
    lines += [f"| {k} | {counts[k]} |" for k in ("input_rows", "kept", "fixed", "quarantined")]
    for title, key in (("Fixes applied (rows)", "by_fix"), ("Quarantined by reason", "by_reason"),
                       ("Kept as written (rows, among kept and fixed)", "by_kept_as_written")):
        if counts.get(key):
            lines += ["", f"## {title}", "", "| | rows |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in counts[key].items()]
            if meant := [f"- `{k}`: {MEANING[k]}" for k in counts[key] if k in MEANING]:
                lines += ["", *meant]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="raw dataset (.jsonl or .json, maybe compressed: .gz .bz2 .xz .zst; .parquet, .arrow)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=sorted(FORMATS), default="auto")
    p.add_argument("--toon", action="store_true", help="decode and repair TOON answers")
    p.add_argument("--toon-where", choices=["message", "fenced"], default="message")
    p.add_argument("--toon-prose", choices=["quarantine", "keep"], default="quarantine",
                   help="an answer that is prose, not a TOON document (data.fix.toon_prose)")
    p.add_argument("--toon-unrepairable", choices=["quarantine", "keep"], default="quarantine",
                   help="an answer no repair makes valid TOON (data.fix.toon_unrepairable): keep = as written")
    p.add_argument("--image-root", default=None)
    p.add_argument("--image-orientation", choices=["stored", "upright"], default="stored",
                   help="an image whose EXIF orientation turns it: read as stored (as SGLang does) or replaced by an "
                        "upright copy, inline as a data URI (as vLLM shows it; data.image_orientation)")
    p.add_argument("--image-alpha", choices=["drop", "white"], default="drop",
                   help="an RGBA image with transparent pixels: its alpha dropped (as SGLang does) or replaced by a "
                        "copy composited onto white, inline as a data URI (as vLLM shows it; data.image_alpha)")
    p.add_argument("--max-quarantined-share", type=float, default=DataConfig.max_quarantined_share,
                   help="exit 1 (after writing everything) when more of the rows are quarantined; 1: never")
    args = p.parse_args(argv)
    if not 0 <= args.max_quarantined_share <= 1:
        p.error(f"--max-quarantined-share must lie in [0, 1], got {args.max_quarantined_share:g}")
    src, out = Path(args.input), Path(args.out)
    fix = FixConfig(toon=args.toon, toon_where=args.toon_where, toon_prose=args.toon_prose,
                    toon_unrepairable=args.toon_unrepairable)
    try:
        check_source(str(src))
        loading = ImageLoading(upright=args.image_orientation == "upright", on_white=args.image_alpha == "white")
        result = fix_dataset(read_raw_rows(src), fix, args.format, args.image_root, loading=loading)
    except (OSError, ValueError) as e:  # DataFileError is a ValueError
        print(f"fix.py: error: {e}", file=sys.stderr)
        return 1
    if not result.counts["input_rows"]:
        print(f"fix.py: error: {src} holds no rows: nothing to fix", file=sys.stderr)
        return 1
    name = src.name.split(".")[0]
    write_jsonl(out / f"{name}.jsonl", ({**turns_entry(r), "fixes": r["fixes"], "kept_as_written": r["kept_as_written"]}
                                        for r in result.kept))
    write_jsonl(out / f"{name}.quarantine.jsonl", result.quarantined)
    write_json(out / f"{name}.report.json", result.counts)
    write_text(out / f"{name}.report.md", report_markdown(name, result.counts))
    c = result.counts
    print(f"{src}: {c['input_rows']} rows -> kept {c['kept']}, fixed {c['fixed']}, "
          f"quarantined {c['quarantined']} (report: {out / f'{name}.report.md'})")
    problem = result.too_many_quarantined(args.max_quarantined_share)
    if problem:
        print(f"fix.py: error: {src}: {problem}. Every row is accounted for in {out}; to accept this, "
              "raise --max-quarantined-share", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
