"""What extraction through servers costs against the embedded backend, measured in one run.

Both backends extract the same synthetic samples (extract_bench.make_samples) with the same batch
plan. `embedded` runs the target in this process (all threads). `server` starts the aux and the
final server as processes (`specforge serve` with SGLang's hidden-state flags, one thread each, as
`extract.backend=sglang` starts SGLang's) and reads the rows out of SGLang's JSON answers. The
table gives tokens/s, the ratio to embedded, the JSON bytes per token the client parses, and
whether the stored tensors are identical.

    .venv/bin/python benchmarks/extract_backends.py            # SmolLM2-135M, ~2 min on 2 cores
    .venv/bin/python benchmarks/extract_backends.py --tiny     # tiny random Llama, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_bench import DEFAULT_MODEL, make_samples  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="target directory (HF format)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random Llama instead")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "extract_backends.json"))
    return p.parse_args(argv)


def timed(extractor, rows) -> tuple[dict, float]:
    t0 = time.perf_counter()
    states = {sample["id"]: s for sample, s in extractor.run(rows)}
    return states, time.perf_counter() - t0


def answer_cost(url: str, rows) -> tuple[float, float]:
    """(JSON bytes, client seconds to decode them into tensors) per prompt token, for one answer
    of `url` to the longest row: the part of the server backend no GPU makes faster."""
    import urllib.request

    from specforge.extract.server import prompt_rows

    ids = max(rows, key=lambda r: len(r["input_ids"]))["input_ids"].tolist()
    body = {"input_ids": [ids], "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_hidden_states": True}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=600) as r:
        raw = r.read()
    t0 = time.perf_counter()
    for _ in range(3):
        meta = json.loads(raw)[0]["meta_info"]
        prompt_rows(meta, len(ids), len(meta["hidden_states"][0][0]), url).to(torch.bfloat16)
    return len(raw) / len(ids), (time.perf_counter() - t0) / 3 / len(ids)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    from specforge.extract.embedded import EmbeddedExtractor
    from specforge.extract.server import ServerExtractor, extraction_servers
    from specforge.serving.server import extraction_serve_command
    from specforge.targets.loader import aux_layer_ids, torch_dtype

    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(args.model)
    if args.tiny:
        from specforge.targets.tiny import build_tiny_llama

        model_dir = build_tiny_llama(Path(tmp.name) / "tiny")
    config = AutoConfig.from_pretrained(model_dir)
    aux = aux_layer_ids(argparse.Namespace(aux_layer_ids=[0, 1, 2] if args.tiny else None, kind="causal_lm"), config)
    rows = [dict(r, input_ids=torch.tensor(r["input_ids"], dtype=torch.int32))
            for r in make_samples(args.samples, args.min_len, args.max_len, config.vocab_size, args.seed)]
    tokens = sum(len(r["input_ids"]) for r in rows)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(args.dtype)).eval()
    ref, t_embedded = timed(EmbeddedExtractor(model, aux, args.batch_tokens), rows)
    del model

    build = partial(extraction_serve_command, dtype=args.dtype, threads=1)
    with extraction_servers(build, model_dir, aux, Path(tmp.name) / "logs") as urls:
        ex = ServerExtractor(*urls, aux, config.hidden_size, args.batch_tokens)
        ex.check_servers()
        got, t_server = timed(ex, rows)
        ex.close()
        costs = [answer_cost(url, rows) for url in urls]
    identical = all(torch.equal(got[k]["aux"], v["aux"]) and torch.equal(got[k]["last"], v["last"])
                    for k, v in ref.items())

    decode_s = sum(c[1] for c in costs)  # per token, aux + final answers
    results = [
        {"backend": "embedded", "tok_s": tokens / t_embedded, "ratio": 1.0, "json_bytes_per_token": None,
         "client_decode_ceiling_tok_s": None},
        {"backend": "server (2 x specforge serve)", "tok_s": tokens / t_server, "ratio": t_embedded / t_server,
         "json_bytes_per_token": sum(c[0] for c in costs), "client_decode_ceiling_tok_s": 1 / decode_s},
    ]
    print(f"{model_dir.name}, {args.dtype}, {args.samples} samples, {tokens} tokens, aux {aux}, "
          f"batch_tokens {args.batch_tokens}, {os.cpu_count()} cores; stored tensors identical: {identical}")
    print("| backend | tok/s | vs embedded | JSON bytes/token | client decode ceiling tok/s |")
    print("|---|---|---|---|---|")
    for r in results:
        b = "-" if r["json_bytes_per_token"] is None else f"{r['json_bytes_per_token']:,.0f}"
        c = "-" if r["client_decode_ceiling_tok_s"] is None else f"{r['client_decode_ceiling_tok_s']:,.0f}"
        print(f"| {r['backend']} | {r['tok_s']:,.0f} | {r['ratio']:.2f}x | {b} | {c} |")
    out = {"model": str(model_dir), "dtype": args.dtype, "samples": args.samples, "tokens": tokens, "aux": aux,
           "batch_tokens": args.batch_tokens, "identical": identical, "results": results,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    tmp.cleanup()
    return out


if __name__ == "__main__":
    main()
