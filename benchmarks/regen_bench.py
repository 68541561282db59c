"""Regeneration throughput: the embedded backend's refill decoder vs `generate` in rounds.

The baseline is how the embedded backend asked the target before the refill decoder (and how
`transformers` is usually batched): conversations `--batch-size` at a time, each round one
left-padded greedy `generate` call for every conversation's next assistant turn, so a batch
decodes until its longest answer ends and follow-up turns run as a second, smaller batch.
Both answer the same demo conversations (data_prep/weather.py, seed 0: the first `--conversations`
of `make demo`'s 600) with the demo's target (SmolLM2-135M-Instruct, bfloat16) and settings
(max_new_tokens 128). Prints a table and writes --out.

    .venv/bin/python benchmarks/regen_bench.py                       # 256 conversations, batch 32
    .venv/bin/python benchmarks/regen_bench.py --batch-sizes 32 64   # one refill row per size

tokens counts the generated tokens that end up in answers (end-of-turn included), as the data
stage reports them; tok_s is tokens over the wall time of decoding (the model loaded once,
before). same_answers: the share of conversations whose regenerated messages equal the
baseline's (bfloat16 on a CPU: a different batch composition can flip a near-tie argmax).
"""
from __future__ import annotations

import argparse
import itertools
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_TARGET = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32], help="refill decoder rows in flight")
    p.add_argument("--baseline-batch-size", type=int, default=32, help="conversations per generate call")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="SmolLM2 directory (fetched if missing)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "regen.json"))
    return p.parse_args(argv)


def replays(conversations: list[dict], max_new_tokens: int):
    from specforge.data.regen.replay import Replay, conversation_key

    return [Replay(conversation_key(c), i, c, max_new_tokens, keep_truncated=True) for i, c in enumerate(conversations)]


def generate_in_rounds(backend, todo, batch_size: int) -> None:
    """The baseline: per group of `batch_size`, round k asks every k-th turn in one generate call."""
    from specforge.data.regen.replay import Answer, RegenFailure

    tok, model = backend.tokenizer, backend.model
    for _, group in itertools.groupby(todo, key=lambda r: r.index // batch_size):
        group = list(group)
        while True:
            live, prompts = [], []
            for r in group:
                messages = r.prompt()
                if messages is None:
                    continue
                try:
                    prompts.append(backend._prompt_ids(messages))
                    live.append(r)
                except RegenFailure as e:
                    r.fail(e)
            if not live:
                break
            enc = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
            with torch.inference_mode():
                out = model.generate(**enc, do_sample=False, temperature=None, top_p=None, top_k=None,
                                     max_new_tokens=backend.cfg.max_new_tokens, pad_token_id=tok.pad_token_id,
                                     eos_token_id=sorted(backend.stop_ids))
            for r, row in zip(live, out[:, enc["input_ids"].shape[1]:].tolist()):
                end = next((i for i, t in enumerate(row) if t in backend.stop_ids), None)
                content = row if end is None else row[:end]
                r.answer(Answer(text=tok.decode(content, skip_special_tokens=True),
                                tokens=len(row) if end is None else end + 1, truncated=end is None))


def measure(name: str, batch_size: int, conversations, max_new_tokens: int, run) -> tuple[dict, list]:
    todo = replays(conversations, max_new_tokens)
    t0 = time.perf_counter()
    run(todo)
    seconds = time.perf_counter() - t0
    records = [r.record() for r in todo]
    tokens = sum(rec["tokens"] for rec in records)
    row = {"method": name, "batch_size": batch_size, "conversations": len(todo),
           "turns": sum(rec["turns"] for rec in records), "tokens": tokens,
           "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1)}
    print(f"  {name:<9} batch {batch_size:>3}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s",
          flush=True)
    return row, [rec["messages"] for rec in records]


def main(argv=None) -> int:
    args = parse_args(argv)
    from data_prep.weather import generate
    from specforge.config import RegenerateConfig, TargetConfig
    from specforge.data.regen.embedded import EmbeddedBackend
    from specforge.targets.smollm2 import ensure_smollm2
    from specforge.utils.io import write_json

    torch.manual_seed(0)
    ensure_smollm2(args.target)
    conversations = [{"id": s["id"], "messages": s["messages"]}
                     for s in generate(args.conversations, seed=0, split="train")]
    target = TargetConfig(name="smollm2", path=args.target, dtype="bfloat16")
    cfg = RegenerateConfig(enabled=True, batch_size=args.baseline_batch_size, max_new_tokens=args.max_new_tokens,
                           keep_truncated=True)
    backend = EmbeddedBackend(cfg, target, device="cpu")
    print(f"{len(conversations)} conversations, {torch.get_num_threads()} threads, target {args.target} (bfloat16)")

    row, reference = measure("generate", args.baseline_batch_size, conversations, args.max_new_tokens,
                             lambda todo: generate_in_rounds(backend, todo, args.baseline_batch_size))
    rows = [row]
    for bs in args.batch_sizes:
        backend.cfg = RegenerateConfig(enabled=True, batch_size=bs, max_new_tokens=args.max_new_tokens,
                                       keep_truncated=True)
        row, messages = measure("refill", bs, conversations, args.max_new_tokens,
                                lambda todo: list(backend.run(todo)))
        row["same_answers"] = round(sum(a == b for a, b in zip(messages, reference)) / len(reference), 3)
        row["speedup"] = round(rows[0]["seconds"] / row["seconds"], 2)
        rows.append(row)

    print(f"\n| method | batch | turns | tokens | seconds | tok/s | speed-up | same answers |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['batch_size']} | {r['turns']} | {r['tokens']} | {r['seconds']} | {r['tok_s']} | "
              f"{r.get('speedup', 1.0)}x | {r.get('same_answers', '-')} |")
    command = " ".join(["python", "benchmarks/regen_bench.py", *map(shlex.quote, sys.argv[1:])])
    write_json(args.out, {"rows": rows, "command": command, "threads": torch.get_num_threads(),
                          "cpu": platform.processor() or platform.machine(), "torch": torch.__version__})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
