"""Train SpecForge's own EAGLE-3 draft (sgl-project's `specforge` 0.2.0) on samples exported from one of our stores.

Run by `benchmarks/peer_quality.py --peer specforge` in SpecForge's virtualenv (`make specforge-venv`),
never by ours. The export is the one the speculators worker reads (peer_quality_worker.py's docstring):
`samples.safetensors` (per sample `input_ids`, `loss_mask`, `aux`, `last`; `d2t`, `t2d`) and `plan.json`
(the sample indices of every optimizer step, the learning rate of every step, TTT length, options, seed).

Built and stepped with SpecForge's own parts, as its offline trainer assembles them:
- the draft: `LlamaForCausalLMEagle3` (attention backend `sdpa`) with our draft's geometry
  (`--draft-config`, our checkpoint's config.json), the target's embedding loaded and frozen
  (`load_embedding`, `freeze_embedding`), its lm_head and layer initialised by its `post_init`;
- a sample: its offline normaliser (`normalize_offline_sample`) and collator (`DataCollatorWithPadding`);
- the teacher: its `TargetHead` over the stored final state (the target's lm_head, frozen);
- the step: `Eagle3TrainStrategy.forward_loss` over `OnlineEagle3Model` (its TTT unroll, its soft-label
  loss per step, its 0.8^k step weights), backward, `BF16Optimizer.step` (AdamW over fp32 masters,
  weight decay 0, gradient clipping at 0.5).
Pinned to ours: samples and their order, one optimizer step per micro-batch of ours, the learning rate
of every step (set before each step over its scheduler's), TTT length, draft vocab (d2t/t2d), seed,
float32 (its trainer would compute in bf16). Two deviations the CPU forces: its loss is a Triton kernel
(`LogSoftmaxLoss`), replaced by the reference implementation beside it in the same file (the same sum
of -p log q over the positions, averaged over batch x positions), and its teacher head runs in float32.
SpecForge 0.2.0 has EAGLE 3.1's `fc_norm` but not its `norm_output` (its next step reads the layer's
pre-norm output): the plan must not ask for `norm_output` or `norm_before_fc`.

`--mask-shift N` is an ablation of SpecForge, not SpecForge as released: its loss takes position t where
the answer mask is set at t itself, while the draft there predicts token t+2 (ours takes t where token
t+2 is an answer token); the mask given to it is moved N positions earlier (2: our positions).

Writes to --out the directory its SGLang export writes (`model.safetensors` + `config.json`: `midlayer.*`,
`fc`, `norm`, `lm_head`, `d2t`, `t2d`, no embedding), `check.safetensors`
(its step-0 logits on the first sample, for the conversion check on our side) and `train.jsonl`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# our config.json keys SpecForge's LlamaConfig has no use for (ours, or set from the plan)
OUR_KEYS = ("specforge_target", "eagle_aux_hidden_state_layer_ids", "fc_norm", "norm_output", "norm_before_fc",
            "torch_dtype")


def reference_loss():
    """SpecForge's LogSoftmaxLoss (a Triton kernel) as its eager reference `_compute_loss`: same signature
    through `.apply`, same value (-sum p log softmax(logits) over the masked positions, mean over B x T)."""
    from specforge.core import loss as sf_loss

    compute = getattr(sf_loss._compute_loss, "_torchdynamo_orig_callable", sf_loss._compute_loss)

    class ReferenceLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return compute(logits, target_p, position_mask)

    return ReferenceLoss


def save_for_sglang(draft, out: str) -> None:
    """What its SGLang export (`specforge.export.to_sglang`) writes for a trained draft: save_pretrained
    of the state without the embedding, checked against the keys SGLang's loader needs, then the RoPE
    fields older readers look for."""
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.export.to_sglang import WEIGHT_MAPS, _serving_state

    state = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
    draft.save_pretrained(out, state_dict=_serving_state(state, WEIGHT_MAPS[type(draft).__name__]))
    apply_legacy_rope_scaling(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", required=True, help="directory with samples.safetensors and plan.json")
    p.add_argument("--out", required=True)
    p.add_argument("--target", required=True, help="local HF dir of the target")
    p.add_argument("--draft-config", required=True, help="our checkpoint's config.json: the draft's geometry")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--mask-shift", type=int, default=0,
                   help="ablation: loss at t where the answer mask is set at t+N (0: SpecForge's own; 2: ours)")
    args = p.parse_args(argv)

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    import specforge.algorithms.eagle3.model as sf_model
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    torch.set_num_threads(args.threads)
    with open(os.path.join(args.export, "plan.json")) as f:
        plan = json.load(f)
    options = plan["options"]
    if options.get("norm_output") or options.get("norm_before_fc"):
        sys.exit(f"plan options {options}: SpecForge 0.2.0 trains EAGLE 3 with or without fc_norm only "
                 "(no norm_output, no norm_before_fc)")
    tensors = load_file(os.path.join(args.export, "samples.safetensors"))
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    steps, lrs = plan["steps"], plan["lr"]

    with open(args.draft_config) as f:
        ours = json.load(f)
    # its draft config as a user writes one: the geometry, the vocab, the layers to capture (eagle_config)
    draft_config = LlamaConfig(**{**{k: v for k, v in ours.items() if k not in OUR_KEYS},
                                  "architectures": ["LlamaForCausalLMEagle3"], "fc_norm": bool(options["fc_norm"]),
                                  "draft_vocab_size": int(d2t.shape[0])})
    torch.manual_seed(plan["seed"])
    draft = LlamaForCausalLMEagle3(draft_config, attention_backend="sdpa")
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    draft.load_embedding(args.target, embedding_key="model.embed_tokens.weight")
    draft.freeze_embedding()
    sf_model.LogSoftmaxLoss = reference_loss()  # the CPU has no Triton backend (docstring)
    model = sf_model.OnlineEagle3Model(draft, length=plan["ttt_length"], attention_backend="sdpa").float()
    model.train()

    head = TargetHead(args.target)  # what TargetHead.from_pretrained does, for a single-file target
    with safe_open(os.path.join(args.target, "model.safetensors"), framework="pt") as f:
        key = "lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight"  # tied
        with torch.no_grad():
            head.fc.weight.copy_(f.get_tensor(key))
    head.freeze_weights()
    head = head.eval().float()
    strategy = Eagle3TrainStrategy(model, target_head=head)
    optimizer = BF16Optimizer(draft, lr=max(lrs), total_steps=len(steps))  # its defaults: wd 0, clip 0.5
    collate = DataCollatorWithPadding()

    def shifted(mask):
        n = args.mask_shift
        return torch.cat([mask[n:], mask.new_zeros(n)]) if n else mask

    def batch(indices) -> TrainBatch:
        rows = [normalize_offline_sample({"aux_hidden_state": tensors[f"{i}.aux"].float()[None],
                                          "hidden_state": tensors[f"{i}.last"].float()[None],
                                          "input_ids": tensors[f"{i}.input_ids"].long(),
                                          "loss_mask": shifted(tensors[f"{i}.loss_mask"].long())}, max_len=1 << 30)
                for i in indices]
        return TrainBatch(sample_ids=[str(i) for i in indices], strategy="eagle3", tensors=collate(rows),
                          metadata={"target_repr": "hidden_state"})

    print(f"[specforge] {len(steps)} steps, {len(tensors) // 4} samples, options {options}, "
          f"threads {torch.get_num_threads()}", file=sys.stderr, flush=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(args.out, "train.jsonl"), "w") as log:
        for s, (indices, lr) in enumerate(zip(steps, lrs)):
            for group in optimizer.optimizer.param_groups:
                group["lr"] = lr
            out = strategy.forward_loss(batch(indices))
            out.loss.backward()
            grad_norm = optimizer.step()
            if (s + 1) % args.log_every == 0 or s + 1 == len(steps):
                row = {"step": s + 1, "lr": lr, "loss": round(out.loss.item(), 4),
                       "acc_0": round(out.metrics["acces"][0].item(), 4), "grad_norm": round(grad_norm.item(), 4),
                       "seconds": round(time.perf_counter() - t0, 1)}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"[specforge] {row}", file=sys.stderr, flush=True)

    save_for_sglang(draft, args.out)

    # Its step-0 logits on the first sample: its alignment, feature of t with token t+1, positions from 0.
    first = steps[0][0]
    ids, aux = tensors[f"{first}.input_ids"].long(), tensors[f"{first}.aux"].float()
    with torch.no_grad():
        draft.eval()
        h = draft.project_hidden_states(aux[:-1][None])
        n = h.shape[1]
        mask = draft.prepare_decoder_attention_mask(attention_mask=torch.ones(1, n, dtype=torch.bool),
                                                    hidden_states=h, batch_size=1, seq_length=n,
                                                    past_key_values_length=0)
        y = draft.backbone(draft.embed_input_ids(ids[1:][None]), h, [[], []], mask, torch.arange(n)[None])
        logits = draft.compute_logits(y)
    save_file({"logits": logits[0].contiguous(), "sample": torch.tensor(first)},
              os.path.join(args.out, "check.safetensors"))
    print(json.dumps({"steps": len(steps), "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
