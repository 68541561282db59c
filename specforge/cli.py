"""`specforge` command line: `specforge serve ...` (the embedded engine as an SGLang-compatible
HTTP server) and `specforge bench ...` (the streaming serving benchmark against any server).
Training and evaluation stay in train.py / evaluate.py (Hydra)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> None:
    from specforge.eval import bench_client
    from specforge.serving import app

    parser = argparse.ArgumentParser(prog="specforge", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="serve a target (+ EAGLE3 draft) on 127.0.0.1 with SGLang's protocol")
    app.add_serve_args(p_serve)
    p_bench = sub.add_parser("bench", help="streaming serving benchmark (sglang.bench_serving figures)")
    bench_client.add_bench_args(p_bench)
    args = parser.parse_args(argv)
    if args.command == "serve":
        app.serve(args)
    else:
        bench_client.bench(args)


if __name__ == "__main__":
    main(sys.argv[1:])
