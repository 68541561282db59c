"""What training's start costs to get the target's embedding and head: the whole target loaded
(`load_target`, as before) against the two matrices read alone (`load_embedding_and_head`).

A random Llama of the given geometry is written once in bf16 shards (as hub checkpoints are) to
--work; each way runs in its own process (peak RSS is per process), alternating, after the shards
were read once into the page cache (so both measure CPU and memory, not the disk: from a cold disk
the whole load also reads every shard). Best of --repeats per way.

    .venv/bin/python benchmarks/target_head_bench.py            # -> benchmarks/results/target_head.json
"""
from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge.utils.io import write_json  # noqa: E402

WAYS = ("whole", "alone")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", default="/tmp/target_head_bench", help="where the random target is written (kept)")
    p.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "target_head.json"))
    return p.parse_args(argv)


def write_target(args) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(args.work) / f"llama_{args.hidden}x{args.layers}_{args.vocab}"
    if (path / "model.safetensors.index.json").is_file():
        return path
    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
                         vocab_size=args.vocab, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size="1GB")
    return path


def worker(way: str, path: Path) -> dict:
    from specforge.config import TargetConfig
    from specforge.targets.loader import load_embedding_and_head, load_target

    from transformers import AutoConfig, AutoModelForCausalLM  # imported before the clock starts
    from transformers.models.llama import modeling_llama  # noqa: F401

    cfg = TargetConfig(name="bench", path=str(path), dtype="bfloat16")
    before_mb = peak_rss_mb()
    start = time.perf_counter()
    if way == "whole":
        target = load_target(cfg)
        embed = target.get_input_embeddings().weight.detach().float()
        head = target.get_output_embeddings().weight.detach()
        del target
    else:
        embed, head, _ = load_embedding_and_head(cfg)
    seconds = time.perf_counter() - start
    return {"way": way, "seconds": round(seconds, 2), "embed": list(embed.shape), "head_dtype": str(head.dtype),
            "rss_before_mb": round(before_mb), "peak_rss_mb": round(peak_rss_mb())}


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would carry the parent's over fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.work))))
        return
    path = write_target(args)
    shards = sorted(path.glob("*.safetensors"))
    checkpoint_gb = sum(f.stat().st_size for f in shards) / 1e9
    for f in shards:  # into the page cache: both ways read from memory
        with open(f, "rb") as stream:
            while stream.read(1 << 24):
                pass
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, "--worker", way, "--work", str(path)], check=True,
                                 capture_output=True, text=True, cwd=ROOT).stdout
            runs[way].append(json.loads(out.strip().splitlines()[-1]))
    rows = [min(runs[way], key=lambda r: r["seconds"]) | {"peak_rss_mb": min(r["peak_rss_mb"] for r in runs[way])}
            for way in WAYS]
    whole, alone = rows
    print(f"random Llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {checkpoint_gb:.2f} GB in bf16")
    print("| way | seconds | peak RSS MB |\n|---|---|---|")
    for row in rows:
        print(f"| {row['way']} | {row['seconds']} | {row['peak_rss_mb']} |")
    print(f"alone / whole: {alone['seconds'] / whole['seconds']:.3f} of the time, "
          f"{alone['peak_rss_mb'] / whole['peak_rss_mb']:.3f} of the memory")
    result = {"geometry": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate,
                           "vocab": args.vocab, "checkpoint_gb": round(checkpoint_gb, 2)},
              "rows": rows, "runs": runs,
              "command": shlex.join(["python", "benchmarks/target_head_bench.py", *(argv or sys.argv[1:])])}
    write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
