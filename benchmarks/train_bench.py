"""Training throughput of the EAGLE3 head: TTT tokens/s for attention kernels, precisions, unroll
lengths and draft vocab sizes, on the target geometry of SmolLM2-135M (or any target config).

    python benchmarks/train_bench.py [--target .cache/models/SmolLM2-135M-Instruct] [--out FILE]

Features are random (the speed of a step does not depend on their values); every configuration is
timed in the same process so the ratios are comparable. Prints a Markdown table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.targets.loader import default_aux_layer_ids
from specforge.train.loop import autocast_for
from specforge.train.ttt import Teacher, ttt_forward


def time_config(target_config, attention, precision, ttt_length, draft_vocab, batch, seq, repeats):
    torch.manual_seed(0)
    n_layers = target_config.num_hidden_layers
    cfg = Eagle3Config.from_target(target_config, default_aux_layer_ids(n_layers), draft_vocab_size=draft_vocab)
    draft = Eagle3Draft(cfg, attention=attention)
    vocab, hidden = cfg.vocab_size, cfg.target_hidden_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[: cfg.draft_vocab_size] = True
    draft.set_vocab_mapping(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), t2d)
    teacher = Teacher(torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.05, t2d)
    data = {
        "input_ids": torch.randint(0, cfg.draft_vocab_size, (batch, seq)),
        "loss_mask": torch.ones(batch, seq, dtype=torch.bool),
        "aux": torch.randn(batch, seq, 3 * hidden),
        "last": torch.randn(batch, seq, hidden),
        "position_ids": torch.arange(seq).expand(batch, seq),
    }
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-4)
    times = []
    for i in range(repeats + 1):  # the first step warms up allocators and kernels
        t0 = time.perf_counter()
        with autocast_for(precision, torch.device("cpu")):
            loss, _ = ttt_forward(draft, data, teacher, ttt_length, 0.8)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {"attention": attention, "precision": precision, "ttt_length": ttt_length,
            "draft_vocab": draft_vocab, "batch": batch, "seq": seq,
            "step_s": round(step, 3), "tokens_per_s": round(batch * seq / step, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=".cache/models/SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/train.json")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    if args.target.endswith("SmolLM2-135M-Instruct"):
        from specforge.targets.smollm2 import ensure_smollm2

        ensure_smollm2(args.target)
    target_config = AutoConfig.from_pretrained(args.target)
    grid = [("sdpa", "bf16", 7, 2048), ("sdpa", "fp32", 7, 2048), ("eager", "bf16", 7, 2048),
            ("sdpa", "bf16", 3, 2048), ("sdpa", "bf16", 7, 8192), ("sdpa", "bf16", 7, 32000)]
    rows = []
    print("| attention | precision | ttt | draft vocab | step s | tokens/s |\n|---|---|---|---|---|---|")
    for attention, precision, ttt, dv in grid:
        r = time_config(target_config, attention, precision, ttt, dv, args.batch, args.seq, args.repeats)
        rows.append(r)
        print(f"| {attention} | {precision} | {ttt} | {dv} | {r['step_s']} | {r['tokens_per_s']} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"target": args.target, "threads": torch.get_num_threads(),
                                          "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
