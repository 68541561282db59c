"""Training throughput of the EAGLE3 head: TTT tokens/s for attention kernels, precisions, unroll
lengths, draft vocab sizes, sequence lengths and packing, on the target geometry of SmolLM2-135M
(or any target config); and side by side with the peer trainer, vLLM's `speculators`.

    python benchmarks/train_bench.py [--target .cache/models/SmolLM2-135M-Instruct]   # kernel grid
    make peer-venv && python benchmarks/train_bench.py --vs-peer                       # train_vs_peer.json
    python benchmarks/train_bench.py --vs-peer --device cuda --target DIR --peer-python python3  # *_gpu.json
    python benchmarks/train_bench.py --allocator-ab                                    # allocator.json
    python benchmarks/train_bench.py --slots-ab --batch 4 --seq 512                    # scored_slots.json
    python benchmarks/train_bench.py --length-scaling --device cuda --target DIR       # train_length_gpu.json
    python benchmarks/train_bench.py --length-scaling --device cuda --target DIR --profile  # + each step's top ops

Features are random, except that the target's final state points at the next token (as on
regenerated data), so that every position is scored as on a real store. Each configuration runs
in a fresh process, one after the other (its peak RSS is its own), so ratios within one run compare.
A step is one optimizer step on `rows x seq` tokens: TTT unroll, loss, backward, AdamW.
--vs-peer runs, for every sequence length and dtype, our step and the peer's step
(benchmarks/peer_train_worker.py in .venv-peer, speculators' own model, loss and batch
collation; its AdamW so that both take the same optimizer) on the same shapes: at 512 tokens four
documents per step (ours: a batch of 4 sequences; the peer: 4 documents packed in a row, as its
trainer batches), from 2,048 on one sequence per step.
Both run with the allocator train.py runs with (mimalloc, specforge/utils/allocator.py; the peer's
process gets the same library preloaded); `SPECFORGE_ALLOCATOR=system` times both on glibc's.
--allocator-ab times our step on glibc's malloc and on mimalloc, each shape twice, alternating.
--slots-ab times our step with the TTT steps on every position and where a loss needs them
(scored slots), on documents that open with an unscored prompt, each shape twice, alternating.
--length-scaling times our step at each sequence length with the same tokens per step, for each
attention kernel and dtype, on the CPU or a GPU (there in one process, with the allocator's peak).
--vs-peer --device cuda: both sides on the GPU, each at its defaults there (the peer: flex
attention and its fused loss; speculators installed beside CUDA torch, `--peer-python python3`),
on a target that may be a config alone (the peer worker gives it random head weights).
"""
from __future__ import annotations

if __name__ == "__main__":  # the allocator train.py runs with, in this process and each --one
    from specforge.utils.allocator import preload_mimalloc

    preload_mimalloc()

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.targets.loader import compute_dtype, default_aux_layer_ids
from specforge.train.batches import collate
from specforge.train.loop import autocast_for
from specforge.train.ttt import Teacher, ttt_forward
from specforge.utils.allocator import allocator_choice, mimalloc_env, mimalloc_path, running_allocator
from specforge.utils.io import write_json

PEER_PYTHON = ".venv-peer/bin/python"
PEER_WORKER = "benchmarks/peer_train_worker.py"
# what torch 2.11 said on an H200 where flex's default tiles needed more shared memory than it has:
# "No valid triton configs. OutOfMemoryError: out of resource: ... Required: 262144 Hardware limit:232448"
FLEX_TILE_ERRORS = ("No valid triton configs", "out of resource", "OutOfResources")


def _document(seq: int, draft_vocab: int, hidden: int, lm_head: torch.Tensor, scored: float = 1.0) -> dict:
    """Random features, but the target's final state at t points at token t+1, as on regenerated
    data: the teacher's argmax lies in the draft vocab and every position is scored, as on real
    stores (the demo's covers 98-100% of its loss tokens). With a random final state the teacher
    would pick a token outside the draft vocab at 5 of 6 positions and skip their loss: a step
    would cost what no real one does. `scored` < 1: the document opens with an unscored prompt of
    (1 - scored) x seq tokens, as a conversation does."""
    ids = torch.randint(0, draft_vocab, (seq,))
    last = 8.0 * lm_head[ids.roll(-1).to(lm_head.device)].float().cpu() + torch.randn(seq, hidden)
    loss_mask = torch.ones(seq, dtype=torch.bool)
    loss_mask[: round((1.0 - scored) * seq)] = False
    return {"input_ids": ids, "loss_mask": loss_mask, "aux": torch.randn(seq, 3 * hidden), "last": last}


def top_ops(step, device: torch.device, n: int = 12) -> list[dict]:
    """One more `step` under torch's profiler: its ops by their own time on the device (the CUDA
    kernels' on a GPU, the CPU's otherwise), the first `n`, each with its share of the step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1
    return [{"op": e.key, "ms": round(getattr(e, key) / 1e3, 2), "share": round(getattr(e, key) / total, 3),
             "calls": e.count} for e in events[:n]]


def time_config(target_config, attention, precision, ttt_length, draft_vocab, batch, seq, repeats,
                packed=False, scored=1.0, skip_unscored=True, device="cpu", profile=False):
    """`batch` sequences of `seq` tokens per step; packed: the same documents in one row; scored:
    the fraction of each document with a loss; skip_unscored: ttt_forward's; profile: the step's
    top ops (`top_ops`) after the timed steps."""
    torch.manual_seed(0)
    device = torch.device(device)
    cuda = device.type == "cuda"
    n_layers = target_config.num_hidden_layers
    cfg = Eagle3Config.from_target(target_config, default_aux_layer_ids(n_layers), draft_vocab_size=draft_vocab)
    with device:  # built where it trains: an 8B target's draft takes seconds to initialise on a CPU
        draft = Eagle3Draft(cfg, attention=attention)
    vocab, hidden = cfg.vocab_size, cfg.target_hidden_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[: cfg.draft_vocab_size] = True
    draft.set_vocab_mapping(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), t2d)
    draft.embed_tokens.requires_grad_(False)  # frozen to the target's, as in training (loop.build_draft)
    # the target's head in the dtype training computes it in (float32 on a CPU without native bf16)
    lm_head = torch.randn(vocab, hidden, dtype=compute_dtype(torch.bfloat16, device), device=device) * 0.05
    teacher = Teacher(lm_head, draft.t2d)
    docs = [_document(seq, cfg.draft_vocab_size, hidden, lm_head, scored) for _ in range(batch)]
    data = {k: v.to(device) for k, v in collate(docs, pack_tokens=batch * seq if packed else 0).items()}
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-4)
    def one_step():
        with autocast_for(precision, device):
            loss, _ = ttt_forward(draft, data, teacher, ttt_length, 0.8, skip_unscored=skip_unscored)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)

    times = []
    for i in range(repeats + 1):  # the first step warms up allocators and kernels (flex compiles)
        if cuda and i == 1:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        one_step()
        if i:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    result = {"attention": attention, "precision": precision, "ttt_length": ttt_length,
              "draft_vocab": draft_vocab, "batch": batch, "seq": seq, "packed": packed, "scored": scored,
              "skip_unscored": skip_unscored,
              "step_s": round(step, 4), "tokens_per_s": round(batch * seq / step, 1),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    if cuda:
        result["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    if profile:
        try:
            result["top_ops"] = top_ops(one_step, device)
        except Exception as e:  # noqa: BLE001 - the timing stands without the profile
            result["top_ops_error"] = f"{type(e).__name__}: {e}"[:300]
    return result


def allocator() -> str:
    """What both sides run on: mimalloc where train.py would preload it, else glibc's malloc."""
    return "mimalloc" if allocator_choice() == "mimalloc" and mimalloc_path() else "glibc"


def in_subprocess(argv: list[str], env: dict | None = None) -> dict:
    """Run one configuration in a fresh process; its last stdout line is the JSON result."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ours(args, attention, precision, ttt, vocab, batch, seq, packed=False, alloc=None, **more) -> dict:
    one = {"attention": attention, "precision": precision, "ttt_length": ttt, "draft_vocab": vocab,
           "batch": batch, "seq": seq, "packed": packed, **more}
    env = None if alloc is None else {**os.environ, "SPECFORGE_ALLOCATOR": alloc}
    return in_subprocess([sys.executable, __file__, "--target", args.target, "--repeats", str(args.repeats),
                          "--one", json.dumps(one)], env)


def peer(args, precision, ttt, vocab, docs, seq) -> dict:
    """The peer's step in its own process. On a GPU, where its flex attention does not compile with
    torch's default tiles (too little shared memory, as ours did on an H200), once more with tiles
    of 64 (the row says so: `flex_tiles`)."""
    env = mimalloc_env()  # the peer's process on the same allocator as ours
    argv = [args.peer_python, PEER_WORKER, "--target", args.target, "--seq-len", str(seq),
            "--docs", str(docs), "--dtype", precision, "--ttt", str(ttt), "--draft-vocab", str(vocab),
            "--repeats", str(args.repeats), "--optimizer", "adamw",
            "--device", "cuda" if args.device.startswith("cuda") else "cpu"]
    try:
        return in_subprocess(argv, env)
    except RuntimeError as e:
        if not args.device.startswith("cuda") or not any(s in str(e) for s in FLEX_TILE_ERRORS):
            raise
        return in_subprocess(argv + ["--flex-tiles", "64"], env)


def _measured(side, *a, **kw) -> dict:
    """One side's result, or its error (the table goes on: a run on a lent GPU gets no second try)."""
    try:
        return side(*a, **kw)
    except (RuntimeError, ValueError) as e:  # a failed process, or no JSON line from it
        return {"tokens_per_s": None, "peak_rss_mb": None, "error": str(e)[-1500:]}


def kernel_grid(args):
    grid = [("sdpa", "bf16", 7, 2048), ("sdpa", "fp32", 7, 2048), ("eager", "bf16", 7, 2048),
            ("dense", "bf16", 7, 2048), ("sdpa", "bf16", 3, 2048), ("sdpa", "bf16", 7, 8192),
            ("sdpa", "bf16", 7, 32000)]
    rows = []
    print("| attention | precision | ttt | draft vocab | step s | tokens/s | peak RSS MB |\n|---|---|---|---|---|---|---|")
    for attention, precision, ttt, dv in grid:
        r = ours(args, attention, precision, ttt, dv, args.batch, args.seq)
        rows.append(r)
        print(f"| {attention} | {precision} | {ttt} | {dv} | {r['step_s']} | {r['tokens_per_s']} | "
              f"{r['peak_rss_mb']} |", flush=True)
    return {"target": args.target, "threads": os.cpu_count(), "allocator": allocator(), "results": rows}


def vs_peer(args):
    """Ours and the peer on the same shapes, each configuration in a fresh process; the JSON is
    rewritten after every row (a run cut short keeps what it measured). On a GPU both sides run
    their defaults there (ours: --attentions' first kernel; the peer: flex and its fused loss) and
    the rows carry each side's peak GPU memory; on a CPU a last row of ours with a 32K draft vocab
    records the peak RSS of the longest length."""
    gpu = args.device.startswith("cuda")
    attention = args.attentions[0]
    peer_kernels = "flex attention, fused loss" if gpu else "sdpa attention, eager loss"
    rows = []
    result = {"rows": rows, "device": torch.cuda.get_device_name(0) if gpu else f"cpu ({os.cpu_count()} threads)",
              "ttt": args.ttt, "draft_vocab": args.draft_vocab, "threads": os.cpu_count(), "allocator": allocator(),
              "ours": f"train.attention={attention}",
              "peer": f"speculators 0.9.0 ({peer_kernels}, AdamW; benchmarks/peer_train_worker.py)",
              "command": "python " + " ".join(sys.argv)}
    memory = "GPU" if gpu else "RSS"
    print(f"| tokens/sequence | layout | dtype | ours tok/s | peer tok/s | ours / peer | ours peak {memory} MB | "
          f"peer peak {memory} MB |\n|---|---|---|---|---|---|---|---|")
    for seq in args.seq_lens:
        docs = max(1, args.tokens_per_step // seq)
        for precision in args.dtypes:
            mine = _measured(ours, args, attention, precision, args.ttt, args.draft_vocab, docs, seq,
                             device=args.device)
            theirs = (_measured(peer, args, precision, args.ttt, args.draft_vocab, docs, seq)
                      if args.peer_seq_lens is None or seq in args.peer_seq_lens
                      else {"tokens_per_s": None, "peak_rss_mb": None})  # ours alone at this length
            layout = f"{docs} x {seq}"
            row = {"seq_len": seq, "layout": layout, "dtype": precision,
                   "ours_tok_s": mine["tokens_per_s"], "peer_tok_s": theirs["tokens_per_s"],
                   "ours_peak_rss_mb": mine["peak_rss_mb"], "peer_peak_rss_mb": theirs["peak_rss_mb"]}
            if gpu:
                row.update(ours_peak_gpu_mb=mine.get("peak_gpu_mb"), peer_peak_gpu_mb=theirs.get("peak_gpu_mb"),
                           peer_flex_tiles=theirs.get("flex_tiles"))
            row.update({f"{side}_error": r["error"] for side, r in (("ours", mine), ("peer", theirs)) if "error" in r})
            rows.append(row)
            ratio = f"{mine['tokens_per_s'] / theirs['tokens_per_s']:.2f}" if mine["tokens_per_s"] and theirs["tokens_per_s"] else "-"
            key = "peak_gpu_mb" if gpu else "peak_rss_mb"
            print(f"| {seq} | {layout} | {precision} | {mine['tokens_per_s']} | {theirs['tokens_per_s']} | {ratio} | "
                  f"{mine.get(key)} | {theirs.get(key)} |", flush=True)
            for side, r in (("ours", mine), ("peer", theirs)):
                if "error" in r:
                    print(f"|   {side} failed: {r['error'].strip().splitlines()[-1][:200]} |", flush=True)
            write_json(Path(args.out), result)
    if not gpu:
        big = _measured(ours, args, attention, "bf16", args.ttt, 32000, 1, max(args.seq_lens))
        print(f"\nours, 1 x {max(args.seq_lens)} tokens, TTT {args.ttt}, draft vocab 32000, bf16: "
              f"{big['tokens_per_s']} tok/s, peak RSS {big['peak_rss_mb']} MB")
        result["memory"] = {"seq_len": max(args.seq_lens), "ttt": args.ttt, "draft_vocab": 32000, "dtype": "bf16",
                            "peak_rss_mb": big["peak_rss_mb"], "tokens_per_s": big["tokens_per_s"]}
    return result


def length_scaling(args):
    """Our step at each sequence length with the same tokens per step (--tokens-per-step / seq
    sequences), per attention kernel and dtype, on --device: tokens/s and its ratio to the first
    length. On a GPU every configuration runs in this process (flex compiles once), with the
    allocator's peak per configuration. The JSON is rewritten after every row: a run cut short
    keeps what it measured."""
    rows = []
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu ({os.cpu_count()} threads)"
    result = {"rows": rows, "device": device, "torch": torch.__version__, "target": args.target, "ttt": args.ttt,
              "draft_vocab": args.draft_vocab, "tokens_per_step": args.tokens_per_step,
              "command": "python " + " ".join(sys.argv)}
    print(f"| attention | dtype | layout | step s | tokens/s | vs {args.seq_lens[0]} | peak GPU MB |\n"
          "|---|---|---|---|---|---|---|")
    target_config = AutoConfig.from_pretrained(args.target)
    for attention in args.attentions:
        for precision in args.dtypes:
            first = None
            for seq in args.seq_lens:
                batch = max(1, args.tokens_per_step // seq)
                one = {"attention": attention, "precision": precision, "ttt_length": args.ttt,
                       "draft_vocab": args.draft_vocab, "batch": batch, "seq": seq}
                try:
                    if args.device == "cpu":
                        r = ours(args, attention, precision, args.ttt, args.draft_vocab, batch, seq)
                    else:
                        r = time_config(target_config, repeats=args.repeats, device=args.device,
                                        profile=args.profile, **one)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    r = {**one, "step_s": None, "tokens_per_s": None, "error": "out of memory"}
                first = first or r["tokens_per_s"]
                r["vs_first"] = round(r["tokens_per_s"] / first, 3) if r["tokens_per_s"] and first else None
                rows.append(r)
                print(f"| {attention} | {precision} | {batch} x {seq} | {r['step_s']} | {r['tokens_per_s']} | "
                      f"{r['vs_first']} | {r.get('peak_gpu_mb', '-')} |", flush=True)
                for op in r.get("top_ops", [])[:6]:
                    print(f"|   {op['op'][:60]} | {op['ms']} ms | {op['share']:.0%} of the step | {op['calls']} calls |")
                write_json(Path(args.out), result)
    return result


def allocator_ab(args):
    """Our step on glibc's malloc and on mimalloc, same shapes; two rounds, alternating, so that a
    slow stretch of a shared machine hits both sides; the better round of each counts."""
    if mimalloc_path() is None:
        sys.exit("cmeel-mimalloc is not installed: nothing to compare")
    shapes = [("bf16", 8192, 4, 512), ("bf16", 8192, 1, 4096), ("fp32", 8192, 4, 512), ("fp32", 8192, 1, 4096),
              ("bf16", 32000, 1, 4096)]
    rows = []
    print("| dtype | draft vocab | layout | glibc tok/s | mimalloc tok/s | mimalloc / glibc | glibc peak RSS MB | "
          "mimalloc peak RSS MB |\n|---|---|---|---|---|---|---|---|")
    for precision, vocab, batch, seq in shapes:
        runs = {"system": [], "mimalloc": []}
        for _ in range(2):
            for choice in runs:
                runs[choice].append(ours(args, "sdpa", precision, args.ttt, vocab, batch, seq, alloc=choice))
        glibc, mim = (max(runs[c], key=lambda r: r["tokens_per_s"]) for c in ("system", "mimalloc"))
        assert glibc["allocator"] == "glibc" and mim["allocator"] == "mimalloc", (glibc, mim)
        row = {"dtype": precision, "draft_vocab": vocab, "layout": f"{batch} x {seq}",
               "glibc_tok_s": glibc["tokens_per_s"], "mimalloc_tok_s": mim["tokens_per_s"],
               "glibc_peak_rss_mb": glibc["peak_rss_mb"], "mimalloc_peak_rss_mb": mim["peak_rss_mb"],
               "all_tok_s": {c: [r["tokens_per_s"] for r in runs[c]] for c in runs}}
        rows.append(row)
        print(f"| {precision} | {vocab} | {row['layout']} | {row['glibc_tok_s']} | {row['mimalloc_tok_s']} | "
              f"{row['mimalloc_tok_s'] / row['glibc_tok_s']:.2f} | {row['glibc_peak_rss_mb']} | "
              f"{row['mimalloc_peak_rss_mb']} |", flush=True)
    return {"rows": rows, "ttt": args.ttt, "threads": os.cpu_count(), "repeats": args.repeats,
            "command": "python " + " ".join(sys.argv)}


def slots_ab(args):
    """TTT steps on every position vs where a loss needs them (ttt_forward's skip_unscored),
    documents with an unscored prompt; two rounds, alternating, the better of each."""
    shapes = [(7, 1.0, args.draft_vocab), (7, 0.6, args.draft_vocab), (7, 0.3, args.draft_vocab),
              (3, 0.5, 2048)]  # the last: the demo's TTT and draft vocab, about its store's scored share
    rows = []
    print("| TTT | draft vocab | scored | every position tok/s | scored slots tok/s | speed-up | "
          "every position peak RSS MB | scored slots peak RSS MB |\n|---|---|---|---|---|---|---|---|")
    for ttt, scored, vocab in shapes:
        runs = {False: [], True: []}
        for _ in range(2):
            for skip in runs:
                runs[skip].append(ours(args, "sdpa", "bf16", ttt, vocab, args.batch, args.seq,
                                       scored=scored, skip_unscored=skip))
        every, slots = (max(runs[s], key=lambda r: r["tokens_per_s"]) for s in (False, True))
        row = {"ttt": ttt, "draft_vocab": vocab, "scored": scored, "layout": f"{args.batch} x {args.seq}",
               "every_position_tok_s": every["tokens_per_s"], "scored_slots_tok_s": slots["tokens_per_s"],
               "every_position_peak_rss_mb": every["peak_rss_mb"], "scored_slots_peak_rss_mb": slots["peak_rss_mb"],
               "all_tok_s": {("scored_slots" if s else "every_position"): [r["tokens_per_s"] for r in runs[s]]
                             for s in runs}}
        rows.append(row)
        print(f"| {ttt} | {vocab} | {scored} | {row['every_position_tok_s']} | {row['scored_slots_tok_s']} | "
              f"{row['scored_slots_tok_s'] / row['every_position_tok_s']:.2f} | {row['every_position_peak_rss_mb']} | "
              f"{row['scored_slots_peak_rss_mb']} |", flush=True)
    return {"rows": rows, "dtype": "bf16", "threads": os.cpu_count(),
            "allocator": allocator(), "repeats": args.repeats, "command": "python " + " ".join(sys.argv)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=".cache/models/SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vs-peer", action="store_true", help="ours vs speculators (needs make peer-venv)")
    ap.add_argument("--allocator-ab", action="store_true", help="our step on glibc's malloc vs mimalloc")
    ap.add_argument("--slots-ab", action="store_true",
                    help="TTT steps on every position vs where a loss needs them (--batch x --seq)")
    ap.add_argument("--length-scaling", action="store_true",
                    help="our step at each --seq-lens with --tokens-per-step, per --attentions and --dtypes")
    ap.add_argument("--attentions", type=lambda s: s.split(","), default=["sdpa"])
    ap.add_argument("--device", default="cpu", help="--length-scaling, --vs-peer: cpu or cuda")
    ap.add_argument("--profile", action="store_true",
                    help="--length-scaling off the CPU: each step's top ops on the device (one more step, profiled)")
    ap.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 4096])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp32"])
    ap.add_argument("--tokens-per-step", type=int, default=2048, help="--vs-peer: documents of a step below it")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--peer-python", default=PEER_PYTHON)
    ap.add_argument("--peer-seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="--vs-peer: the lengths the peer runs at too (default: every --seq-lens)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration, JSON in and out
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.target.endswith("SmolLM2-135M-Instruct"):
        from specforge.targets.smollm2 import ensure_smollm2

        ensure_smollm2(args.target)
    if args.one:
        torch.set_num_threads(os.cpu_count())
        one = json.loads(args.one)
        result = time_config(AutoConfig.from_pretrained(args.target), repeats=args.repeats, **one)
        result["allocator"] = running_allocator()  # what this process runs on
        print(json.dumps(result))
        return
    if args.vs_peer and not (Path(args.peer_python).exists() or shutil.which(args.peer_python)):
        sys.exit(f"{args.peer_python} not found: run `make peer-venv` first (speculators in its own virtualenv)")
    if args.allocator_ab:
        result, default_out = allocator_ab(args), "benchmarks/results/allocator.json"
    elif args.slots_ab:
        result, default_out = slots_ab(args), "benchmarks/results/scored_slots.json"
    elif args.length_scaling:
        args.out = args.out or f"benchmarks/results/train_length_{'cpu' if args.device == 'cpu' else 'gpu'}.json"
        result, default_out = length_scaling(args), args.out
    elif args.vs_peer:
        args.out = args.out or f"benchmarks/results/train_vs_peer{'_gpu' if args.device.startswith('cuda') else ''}.json"
        result, default_out = vs_peer(args), args.out
    else:
        result, default_out = kernel_grid(args), "benchmarks/results/train.json"
    out = Path(args.out or default_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
