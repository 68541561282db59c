"""Training throughput of the peer trainer, speculators 0.9.0's EAGLE-3 draft, on our shapes.

Why: the side-by-side training benchmark compares our EAGLE-3 trainer with vLLM's
`speculators` on the same geometry (SmolLM2-135M target), packed batch, TTT length and
draft vocabulary. This script times the peer through its own API, built and fed the way
its own trainer does it (benchmarks/peer_common.py), so that the comparison is not against a
re-implementation:

- config, model, optimizers and the step: see benchmarks/peer_common.py (its TrainConfig
  defaults overridden only by this script's flags; the body of its `Trainer.train_epoch`).
  Master weights stay fp32 (its trainer never casts the model); `--dtype bf16` means bf16
  hidden states + CPU autocast, `--dtype fp32` means fp32 hidden states and no autocast;
- batch: documents of `--seq-len + 1` raw tokens through its `CollateFn` with its eagle3
  `shift_batch`, i.e. one packed row of exactly `--docs x --seq-len` tokens with per-
  document `document_ids` and position ids, as its dataloader produces.

On a GPU (`--device cuda`) it runs its defaults: `simple_flex_attention` (its forward compiled)
and the `fused` loss (Triton), its model and batch on the GPU, autocast there, as its Trainer
does on one accelerator. A target directory that holds only a config (benchmarks/targets/*) gets
random weights for the three tensors its draft reads from the verifier (`verifier_dir`), and the
config's end-of-sequence id as its mask token (its own fallback where a tokenizer has none).
`--flex-tiles 64` gives its flex attention tiles of 64, as ours takes on packed rows of 16-bit heads
wider than 64 (an H200 with torch 2.11 had too little shared memory for torch's default tiles).

Deviations forced by CPU (the first two are options its trainer documents):
- attention: its default `simple_flex_attention` cannot train on CPU (torch 2.13 raises
  "FlexAttention does not support backward on CPU"; its forward is only torch.compile'd
  when CUDA is present). The default here is its `--draft-attn-impl sdpa` path (dense
  boolean mask, extended per TTT step by `extend_dense_mask_for_draft_tokens`).
  With sdpa the mask is dense, so attention costs the same whether a row holds 1 or 4
  documents (block sparsity is only skipped by flex); it is ~40% of a CPU step. Its
  default draft layer is sliding-window (2048) attention: no difference up to 2048 tokens
  per document, and none in cost with a dense mask.
- loss: its default `--loss-implementation fused` needs Triton (absent from the CPU
  wheel); its `eager` implementation is used.
- its Trainer itself is not instantiated: it moves the model to accelerator 0 and wants a
  DataLoader and checkpoint directory; the step above is its loop body, with autocast on
  "cpu" (it would pick "cuda" when no accelerator exists).

Optimizer: its trainer default, Muon on 2D matrices + AdamW on the rest; `--optimizer adamw`
gives its single-AdamW option (what benchmarks/train_bench.py --vs-peer passes).

Run by the peer's own virtualenv (`make peer-venv`), never by ours; it imports only torch,
transformers and speculators:

    .venv-peer/bin/python benchmarks/peer_train_worker.py --seq-len 512 --docs 4 --dtype bf16
    python3 benchmarks/peer_train_worker.py --device cuda --target benchmarks/targets/llama-3.1-8b \
        --seq-len 4096 --docs 4 --draft-vocab 32000     # where speculators is installed beside CUDA torch

One JSON line on stdout at the end (peer, seq_len, docs, tokens, dtype, ttt, draft_vocab,
step_s = median of the timed steps, tokens_per_s, peak_rss_mb, attn_impl, loss_impl, optimizer,
device; peak_gpu_mb on a GPU);
everything else goes to stderr. On a 2-core machine, time it with nothing else running:
OpenMP threads sharing a core with another process slow a step two- to three-fold.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=".cache/models/SmolLM2-135M-Instruct",
                   help="local HF dir of the target (config + weights: the draft's "
                        "embeddings, lm_head and verifier norm are loaded from it)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per document")
    p.add_argument("--docs", type=int, default=4, help="documents packed into one row")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--ttt", type=int, default=7, help="TTT unroll length")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3, help="timed steps (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--attn-impl", default=None,
                   choices=("sdpa", "eager", "simple_flex_attention"),
                   help="its --draft-attn-impl (default: sdpa on CPU, where flex cannot train; its "
                        "default simple_flex_attention on a GPU)")
    p.add_argument("--optimizer", default=None, choices=("adamw", "muon"),
                   help="its --optimizer (default: its default, muon)")
    p.add_argument("--loss-impl", default=None, choices=("eager", "fused"),
                   help="its --loss-implementation (default: eager on CPU, where Triton is not; "
                        "its default fused on a GPU)")
    p.add_argument("--flex-tiles", type=int, default=None,
                   help="its flex attention with tiles of this size (torch's kernel_options), where "
                        "torch's default tiles ask more shared memory than the GPU has")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.attn_impl = args.attn_impl or ("simple_flex_attention" if gpu else "sdpa")
    args.loss_impl = args.loss_impl or ("fused" if gpu else "eager")
    return args


def verifier_dir(target: str, seed: int = 0) -> str:
    """`target` itself where it holds weights; for a config alone (a geometry), a folder beside the
    system's temporary files with that config and random `model.embed_tokens`, `lm_head` and
    `model.norm` weights (bf16), the tensors its draft reads from the verifier: their values do not
    change a step's cost. Made once per config (the next configuration's process reuses it: an
    8B target's two matrices are 2 GB to draw and write) and renamed into place when complete."""
    import hashlib
    import tempfile
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    folder = Path(target)
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")):
        return target
    key = hashlib.sha256((folder / "config.json").read_bytes() + str(seed).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"peer_verifier_{key}"
    if (out / "model.safetensors").exists():
        return str(out)
    config = AutoConfig.from_pretrained(target)
    text = getattr(config, "text_config", config)
    partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.", dir=out.parent))
    config.save_pretrained(partial)
    g = torch.Generator().manual_seed(seed)
    shape = (text.vocab_size, text.hidden_size)
    save_file({"model.embed_tokens.weight": (0.02 * torch.randn(shape, generator=g)).bfloat16(),
               "lm_head.weight": (0.02 * torch.randn(shape, generator=g)).bfloat16(),
               "model.norm.weight": torch.ones(text.hidden_size, dtype=torch.bfloat16)},
              str(partial / "model.safetensors"))
    try:
        partial.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(partial)
    return str(out)


def verifier_eos(target: str) -> int:
    """The config's end-of-sequence id (its first, where it lists several), else its last token."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    text = getattr(config, "text_config", config)
    eos = getattr(text, "eos_token_id", None) or getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return int(eos) if eos is not None else text.vocab_size - 1


def main(argv=None) -> None:
    args = parse_args(argv)
    # stdout carries the one JSON line; route every log and warning to stderr.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peer_common import build_peer, collate_documents
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    if args.flex_tiles:  # its attention calls the module's flex_attention: that one, with the tiles
        import functools

        import speculators.models.attention as its_attention
        from torch.nn.attention.flex_attention import flex_attention

        tiles = dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"), args.flex_tiles)
        its_attention.flex_attention = functools.partial(flex_attention, kernel_options=tiles)

    hs_dtype_name = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    total_seq_len = args.docs * args.seq_len
    n_steps = args.repeats + 1

    # Its typed config with its defaults, overridden only where this benchmark decides.
    verifier = verifier_dir(args.target, args.seed)
    flat = {
        "verifier_name_or_path": verifier,
        "draft_vocab_size": args.draft_vocab,
        "ttt_steps": args.ttt,
        "total_seq_len": total_seq_len,
        "hidden_states_dtype": hs_dtype_name,
        "draft_attn_impl": args.attn_impl,
        "loss_implementation": args.loss_impl,
        "seed": args.seed,
    }
    if args.optimizer is not None:
        flat["optimizer"] = args.optimizer
    if verifier != args.target:  # no tokenizer to take its mask token from: its fallback's kind
        flat["mask_token_id"] = verifier_eos(args.target)

    tcfg = AutoConfig.from_pretrained(args.target)
    tcfg = getattr(tcfg, "text_config", tcfg)
    hidden, vocab = tcfg.hidden_size, tcfg.vocab_size

    # Random packed documents, each seq_len + 1 raw tokens: shift_batch drops one per doc.
    g = torch.Generator().manual_seed(args.seed)
    samples = []
    for _ in range(args.docs):
        n = args.seq_len + 1
        samples.append({
            "hidden_states": torch.randn(n, 3 * hidden, generator=g),
            "input_ids": torch.randint(0, vocab, (n,), generator=g),
            "verifier_last_hidden_states": torch.randn(n, hidden, generator=g),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "lengths": torch.tensor([n], dtype=torch.long),  # as BaseDataset.__getitem__
            "position_ids": torch.arange(n, dtype=torch.long),
        })

    # Vocab mapping the way its cli derives one from token_freq.pt: here, the batch's counts.
    counts = torch.bincount(torch.cat([s["input_ids"] for s in samples]), minlength=vocab)
    token_freq = {i: int(c) for i, c in enumerate(counts.tolist()) if c}
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq, args.draft_vocab, vocab)

    t0 = time.perf_counter()
    peer = build_peer(flat, t2d, d2t, n_steps)
    model, targs = peer.model, peer.args
    device = torch.device(args.device)
    model.to(device)
    batch = collate_documents(samples, hidden, peer.hs_dtype)
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    n_tokens = int((batch["document_ids"] != -1).sum())
    if n_tokens != total_seq_len:
        raise SystemExit(f"packed row holds {n_tokens} tokens, expected {total_seq_len}")

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lengths = batch["document_ids"].flatten().bincount().tolist()
    print(f"[peer] built in {time.perf_counter() - t0:.1f}s: {n_params / 1e6:.1f}M trainable, "
          f"layers={model.config.transformer_layer_config.num_hidden_layers} "
          f"attn={model._attn_impl} optimizers={[type(o).__name__ for o in peer.optimizers]} "
          f"loss={targs.loss_fn}/{targs.loss_implementation} "
          f"lengths={lengths} threads={torch.get_num_threads()}",
          file=sys.stderr)

    def step():
        result = peer.step(batch, device.type)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result

    times = []
    for i in range(n_steps):
        if i == 1 and device.type == "cuda":  # the peak of the timed steps, after the warm-up's compile
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        draft_tokens, loss, metrics = step()
        dt = time.perf_counter() - t
        ttt_seen = sum(1 for k in metrics if k.startswith("loss_") and k.endswith("_sum")
                       and k[5:-4].isdigit())
        acc0 = metrics["full_acc_0_sum"].item() / max(metrics["full_acc_0_total"].item(), 1)
        print(f"[peer] step {i}{' (warm-up)' if i == 0 else ''}: {dt:.2f}s "
              f"loss={loss.item():.4f} ttt_steps={len(draft_tokens)}/{ttt_seen} acc0={acc0:.3f}",
              file=sys.stderr)
        if len(draft_tokens) != args.ttt or ttt_seen != args.ttt:
            raise SystemExit(f"expected a TTT unroll of {args.ttt}, got {len(draft_tokens)}")
        if i:
            times.append(dt)

    step_s = statistics.median(times)
    gpu = {"peak_gpu_mb": round(torch.cuda.max_memory_allocated(device) / 2**20)} if device.type == "cuda" else {}
    print(json.dumps({
        "peer": "speculators 0.9.0",
        "seq_len": args.seq_len,
        "docs": args.docs,
        "tokens": total_seq_len,
        "dtype": args.dtype,
        "ttt": args.ttt,
        "draft_vocab": args.draft_vocab,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(total_seq_len / step_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "attn_impl": args.attn_impl,
        "loss_impl": args.loss_impl,
        "flex_tiles": args.flex_tiles,
        "optimizer": targs.optimizer,
        "device": args.device,
        **gpu,
    }), flush=True)


if __name__ == "__main__":
    main()
