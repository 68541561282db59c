"""`specforge` command line: `specforge serve ...` (the embedded engine as an SGLang-compatible
HTTP server), `specforge bench ...` (the streaming serving benchmark against any server) and
`specforge import-draft SRC DST --target T` (another trainer's draft as our checkpoint).
Training and evaluation stay in train.py / evaluate.py (Hydra)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> None:
    from specforge.config import TARGET_KINDS
    from specforge.errors import plain_warnings
    from specforge.eval import bench_client
    from specforge.serving import app

    plain_warnings("specforge")

    parser = argparse.ArgumentParser(prog="specforge", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="serve a target (+ EAGLE3 draft) on 127.0.0.1 with SGLang's protocol")
    app.add_serve_args(p_serve)
    p_bench = sub.add_parser("bench", help="streaming serving benchmark (sglang.bench_serving figures)")
    bench_client.add_bench_args(p_bench)
    p_import = sub.add_parser("import-draft", help="a SpecForge / EAGLE / speculators EAGLE-3 draft as our checkpoint")
    p_import.add_argument("src", help="the draft's directory (config.json + model.safetensors or pytorch_model.bin)")
    p_import.add_argument("dst", help="a new directory for our checkpoint")
    p_import.add_argument("--target", required=True, help="the target's directory (its layer count, vocab, embedding)")
    p_import.add_argument("--kind", default="causal_lm", choices=TARGET_KINDS, help="target.kind")
    p_import.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "serve":
        app.serve(args)
    elif args.command == "bench":
        bench_client.bench(args)
    else:
        import_draft_command(args)


def import_draft_command(args) -> None:
    from specforge.config import TargetConfig
    from specforge.draft_import import import_draft

    target = TargetConfig(name=Path(args.target).name, path=args.target, kind=args.kind,
                          trust_remote_code=args.trust_remote_code)
    try:
        dst = import_draft(args.src, args.dst, target)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError: the message is the report
        sys.exit(f"import-draft: {e}")
    print(f"import-draft: {args.src} -> {dst} (measure it: python evaluate.py ckpt={dst} out_dir=...)")


if __name__ == "__main__":
    main(sys.argv[1:])
