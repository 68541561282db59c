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
    p.add_argument("--decode-workers", type=int, nargs="+", default=[1, 2],
                   help="extract.decode_workers settings of the server backend to compare")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "extract_backends.json"))
    return p.parse_args(argv)


def timed(extractor, rows) -> tuple[dict, float]:
    t0 = time.perf_counter()
    states = {sample["id"]: s for sample, s in extractor.run(rows)}
    return states, time.perf_counter() - t0


def record_answers(ex, rows) -> list[tuple]:
    """The raw JSON answers of both servers for every batch of the plan, as decode_answer's args."""
    from specforge.launch.process import http_json

    answers = []
    for batch in ex.batches(rows):
        body = ex.request_body(batch)
        for kind, url in ex.urls.items():
            answers.append((http_json(url + "/generate", body, raw=True), [r["id"] for r in batch],
                            [len(r["input_ids"]) for r in batch], ex.widths[kind], url))
    return answers


def decode_seconds(answers, workers: int) -> float:
    """Wall time to decode every recorded answer into bf16 tensors with `workers` processes (1: in
    this process, as decode_workers=1 does): the client's share when the servers are instant."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from specforge.extract.server_backend import decode_answer

    def finish(arrays):
        return [torch.from_numpy(a).to(torch.bfloat16) for a in arrays]

    if workers == 1:
        t0 = time.perf_counter()
        for args in answers:
            finish(decode_answer(*args))
        return time.perf_counter() - t0
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(decode_answer, *zip(*answers[:workers])))  # workers started and warm
        t0 = time.perf_counter()
        for arrays in pool.map(decode_answer, *zip(*answers)):
            finish(arrays)
        return time.perf_counter() - t0


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    from specforge.extract.embedded import EmbeddedExtractor
    from specforge.extract.server_backend import ServerExtractor, extraction_servers
    from specforge.launch.embedded_commands import embedded_extraction_command
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

    build = partial(embedded_extraction_command, dtype=args.dtype, threads=1)
    server_runs, identical = [], True
    with extraction_servers(build, model_dir, aux, Path(tmp.name) / "logs") as urls:
        for workers in args.decode_workers:
            ex = ServerExtractor(*urls, aux, config.hidden_size, args.batch_tokens, decode_workers=workers)
            ex.check_servers()
            got, t_server = timed(ex, rows)
            ex.close()
            server_runs.append((workers, t_server))
            identical &= all(torch.equal(got[k]["aux"], v["aux"]) and torch.equal(got[k]["last"], v["last"])
                             for k, v in ref.items())
        answers = record_answers(ex, rows)
    json_bytes = sum(len(a[0]) for a in answers) / tokens
    ceilings = {w: tokens / decode_seconds(answers, w) for w in args.decode_workers}

    results = [
        {"backend": "embedded", "tok_s": tokens / t_embedded, "ratio": 1.0, "json_bytes_per_token": None,
         "client_decode_ceiling_tok_s": None},
    ] + [{"backend": f"server (2 x specforge serve), decode_workers {w}", "tok_s": tokens / t, "ratio": t_embedded / t,
          "json_bytes_per_token": json_bytes, "client_decode_ceiling_tok_s": ceilings[w]}
         for w, t in server_runs]
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
