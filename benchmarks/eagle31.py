"""EAGLE 3 vs EAGLE 3.1: held-out accept length of two drafts of one target, per tree and context.

Both drafts must be trained on the same run's data with the same budget (the demo and a copy of it
with `draft=eagle31`, see docs/benchmarks.md). Each is run by the embedded engine at temperature 0
over the same held-out prompts, for every tree, in two contexts:

- `usual`: each held-out conversation up to its first answer (what the eval stage uses);
- `long`: the same question after earlier held-out conversations replayed as prior turns (their
  questions and answers), until the prompt is at least `--long-factor` times as long: the
  attention-drift setting EAGLE 3.1 targets.

Accept length = completion tokens / verify rounds over all prompts (docs/contract.md §6). Prints a
table and writes benchmarks/results/eagle31.json: {"rows": [{"tree", "context", "eagle3",
"eagle31"}], "command": ...}.

    .venv/bin/python benchmarks/eagle31.py --eagle3 outputs/smollm2_weather \\
        --eagle31 outputs/smollm2_weather_eagle31 --trees 3_1_4 8_1_9 4_2_8
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eagle3", required=True, help="EAGLE 3 checkpoint, or a run directory (its last epoch)")
    p.add_argument("--eagle31", required=True, help="EAGLE 3.1 checkpoint, or a run directory (its last epoch)")
    p.add_argument("--trees", nargs="+", default=["3_1_4", "8_1_9", "4_2_8"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--long-factor", type=float, default=3.0, help="long prompts: at least this x the usual length")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eagle31.json"))
    return p.parse_args(argv)


def render(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def long_prompts(conversations: list[dict], prompts: list[dict], tokenizer, factor: float) -> list[dict]:
    """Each prompt's question after other held-out conversations replayed as earlier turns."""
    out = []
    for i, prompt in enumerate(prompts):
        history, j = [], i + 1
        system = [m for m in prompt["messages"] if m["role"] == "system"]
        question = [m for m in prompt["messages"] if m["role"] != "system"]
        ids = prompt["input_ids"]
        while len(ids) < factor * len(prompt["input_ids"]):
            other = conversations[j % len(conversations)]
            j += 1
            if other["id"] == prompt["id"]:
                continue
            history += [m for m in other["messages"] if m["role"] != "system"]
            ids = render(tokenizer, system + history + question)
        out.append({"id": prompt["id"], "input_ids": ids})
    return out


def accept_length(engine, prompts, max_new_tokens: int, eos) -> float:
    completion = rounds = 0
    for p in prompts:
        _, stats = engine.generate(p["input_ids"], max_new_tokens, temperature=0.0, eos_token_id=eos)
        completion += stats.completion_tokens
        rounds += stats.spec_verify_ct
    return completion / rounds


def main(argv=None) -> int:
    args = parse_args(argv)
    from specforge.checkpoint import load_draft
    from specforge.engine.speculative import SpeculativeEngine
    from specforge.engine.tree_spec import TreeSpec
    from specforge.eval.engine_eval import find_checkpoints, load_run_config
    from specforge.eval.prompts import heldout_prompts
    from specforge.run_layout import RunLayout
    from specforge.targets.loader import load_target, load_tokenizer, torch_dtype
    from specforge.utils.io import read_jsonl, write_json

    trees = [TreeSpec.parse(t) for t in args.trees]
    ckpts = {}
    for name in ("eagle3", "eagle31"):
        run_dir, found = find_checkpoints(getattr(args, name))
        ckpts[name] = (run_dir, found[-1])
    run_cfg = load_run_config(ckpts["eagle3"][0])
    tokenizer = load_tokenizer(run_cfg.target)
    run_cfg.target.dtype = args.dtype
    target = load_target(run_cfg.target, "cpu")
    conversations_file = RunLayout(ckpts["eagle3"][0]).conversations("eval")
    usual = heldout_prompts(conversations_file, tokenizer, args.num_prompts)
    contexts = {"usual": usual,
                "long": long_prompts(list(read_jsonl(conversations_file)), usual, tokenizer, args.long_factor)}
    mean_len = {c: sum(len(p["input_ids"]) for p in ps) / len(ps) for c, ps in contexts.items()}
    print(f"prompts: {len(usual)}; mean length usual {mean_len['usual']:.0f}, long {mean_len['long']:.0f} tokens")

    eos = tokenizer.eos_token_id
    figures: dict[tuple, float] = {}
    t0 = time.perf_counter()
    for name, (_, ckpt) in ckpts.items():
        draft = load_draft(ckpt, dtype=torch_dtype(args.dtype))
        options = {k: getattr(draft.config, k) for k in ("fc_norm", "norm_output", "norm_before_fc")}
        print(f"{name}: {ckpt} {options}", flush=True)
        for tree in trees:
            engine = SpeculativeEngine(target, draft, tree)
            for context, prompts in contexts.items():
                figures[(str(tree), context, name)] = accept_length(engine, prompts, args.max_new_tokens, eos)
                print(f"  {tree} {context}: accept length {figures[(str(tree), context, name)]:.3f}", flush=True)

    rows = [{"tree": str(t), "context": c, "eagle3": round(figures[(str(t), c, "eagle3")], 4),
             "eagle31": round(figures[(str(t), c, "eagle31")], 4)} for t in trees for c in contexts]
    print("\n| tree | context | EAGLE 3 | EAGLE 3.1 | 3.1 / 3 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['context']} | {r['eagle3']:.3f} | {r['eagle31']:.3f} | "
              f"{r['eagle31'] / r['eagle3']:.3f} |")
    command = "python benchmarks/eagle31.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    write_json(Path(args.out), {
        "rows": rows, "command": command,
        "checkpoints": {k: str(v[1]) for k, v in ckpts.items()}, "prompts": len(usual),
        "mean_prompt_tokens": {c: round(v, 1) for c, v in mean_len.items()},
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "temperature": 0.0,
        "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 1)})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
