"""Train the peer's EAGLE-3 draft (speculators 0.9.0) on samples exported from one of our stores.

Run by benchmarks/peer_quality.py in the peer's virtualenv (`make peer-venv`), never by ours. The
export directory holds what both trainers see:
- `samples.safetensors`: per sample i, `{i}.input_ids`, `{i}.loss_mask`, `{i}.aux` (the 3 captured
  target states), `{i}.last` (the target's final post-norm state); `d2t`, `t2d` (our draft vocab);
- `plan.json`: the sample indices of every optimizer step (our trainer's micro-batches, in its
  order), the learning rate of every step (our schedule), TTT length, the EAGLE 3.1 options, seed.

The peer is built and stepped by benchmarks/peer_common.py (its config, model, loss, optimizer
builders, collation and loop body). Settings pinned to ours: samples and their order, optimizer
steps, learning rate per step (its AdamW; its default Muon runs its Newton-Schulz iterations in
bf16, which a CPU without native bf16 computes ~60x slower), TTT length, draft vocab, seed, float32,
and the architecture our layout can serve (one layer, `--no-norm-before-residual`, our EAGLE 3.1
options). Everything else is its default: kl_div loss, no TTT step decay, weight decay 0.01, grad
clip 1.0, its lm_head initialised from the target's and frozen.
One deviation forced by the data: our store keeps the target's final state after its norm, so
the peer's `verifier_norm` (which it applies to a pre-norm state) is an identity here; its teacher
is then exactly `lm_head(last)`, the same as ours.

Writes to --out: `weights.safetensors` (its state dict as its save writes it), `config.json` (its
config), `check.safetensors` (its step-0 logits on the first sample, for the conversion check) and
`train.jsonl` (loss and step-0 accuracy every --log-every steps).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", required=True, help="directory with samples.safetensors and plan.json")
    p.add_argument("--out", required=True)
    p.add_argument("--target", required=True, help="local HF dir of the target")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)

    import torch
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peer_common import build_peer, collate_documents

    with open(os.path.join(args.export, "plan.json")) as f:
        plan = json.load(f)
    tensors = load_file(os.path.join(args.export, "samples.safetensors"))
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")

    def document(i: int) -> dict:
        ids = tensors[f"{i}.input_ids"]
        n = ids.shape[0]
        return {"hidden_states": tensors[f"{i}.aux"].float(), "input_ids": ids,
                "verifier_last_hidden_states": tensors[f"{i}.last"].float(),
                "loss_mask": tensors[f"{i}.loss_mask"].long(),
                "lengths": torch.tensor([n], dtype=torch.long),  # as its BaseDataset.__getitem__
                "position_ids": torch.arange(n, dtype=torch.long)}

    steps, lrs = plan["steps"], plan["lr"]
    options = plan["options"]
    flat = {
        "verifier_name_or_path": args.target,
        "draft_vocab_size": int(d2t.shape[0]),
        "ttt_steps": plan["ttt_length"],
        "total_seq_len": max(sum(tensors[f"{i}.input_ids"].shape[0] - 1 for i in s) for s in steps),
        "hidden_states_dtype": "float32",
        "draft_attn_impl": "sdpa",  # its flex attention has no backward on CPU
        "loss_implementation": "eager",  # its fused loss needs Triton
        "seed": plan["seed"],
        "optimizer": "adamw",
        "lr": max(lrs),
        "scheduler_type": "none",  # each step's learning rate is set from the plan below
        "norm_before_residual": False,
        "norm_before_fc": bool(options["norm_before_fc"]),
        "fc_norm": bool(options["fc_norm"]),
        "norm_output": bool(options["norm_output"]),
    }
    peer = build_peer(flat, t2d, d2t, len(steps), schedule=False)
    model = peer.model
    model.verifier_norm = torch.nn.Identity()  # the store's `last` is already post-norm (docstring)
    hidden = model.config.transformer_layer_config.hidden_size
    print(f"[peer] {len(steps)} steps, {len(tensors) // 4} samples, options {options}, "
          f"optimizers {[type(o).__name__ for o in peer.optimizers]}, threads {torch.get_num_threads()}",
          file=sys.stderr, flush=True)

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(args.out, "train.jsonl"), "w") as log:
        for s, (indices, lr) in enumerate(zip(steps, lrs)):
            for opt in peer.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
            batch = collate_documents([document(i) for i in indices], hidden, peer.hs_dtype)
            _, loss, metrics = peer.step(batch)
            if (s + 1) % args.log_every == 0 or s + 1 == len(steps):
                acc0 = metrics["full_acc_0_sum"].item() / max(metrics["full_acc_0_total"].item(), 1)
                row = {"step": s + 1, "lr": lr, "loss": round(loss.item(), 4), "acc_0": round(acc0, 4),
                       "seconds": round(time.perf_counter() - t0, 1)}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"[peer] {row}", file=sys.stderr, flush=True)

    skip = set(type(model)._keys_to_ignore_on_save)  # what its save_pretrained leaves out
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in skip}
    save_file(state, os.path.join(args.out, "weights.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        f.write(model.config.to_json_string())

    # Its step-0 logits on the first sample, for the conversion check on our side.
    model.eval()
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    first = steps[0][0]
    with torch.no_grad():
        model(**collate_documents([document(first)], hidden, peer.hs_dtype), **{**peer.train_kwargs, "ttt_steps": 1})
    hook.remove()
    save_file({"logits": captured[0][0].contiguous(), "sample": torch.tensor(first)},
              os.path.join(args.out, "check.safetensors"))
    print(json.dumps({"steps": len(steps), "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
