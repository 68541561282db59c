"""Why greedy speculative output can differ from plain decoding at low precision: the target's
logits for the same tokens from one-token decode steps vs from chunked verify forwards.

For each held-out prompt it decodes `--tokens` greedy tokens one at a time (the base model), then
feeds the same tokens again as causal chains of `--chunk` (what a verify forward of a chain tree
computes) and compares, position by position, the largest absolute logit difference and whether
the argmax differs. A flipped argmax is where a speculative run and the base run part ways.
`--decode-mask` passes an explicit mask to the one-token decode too (same attention path as verify).

    .venv/bin/python benchmarks/verify_consistency.py --run outputs/smollm2_weather --dtypes bfloat16 float32
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge.engine.target import TargetRunner  # noqa: E402
from specforge.eval.prompts import heldout_prompts  # noqa: E402
from specforge.eval.engine_eval import load_run_config  # noqa: E402
from specforge.run_layout import RunLayout  # noqa: E402
from specforge.targets.loader import aux_layer_ids, load_target, load_tokenizer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", default=str(ROOT / "outputs" / "smollm2_weather"), help="a run directory (its target and held-out prompts)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--chunk", type=int, default=6, help="tokens per verify forward (a chain tree of N nodes)")
    p.add_argument("--decode-mask", action="store_true", help="give the one-token decode an explicit mask as well")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "verify_consistency.json"))
    return p.parse_args(argv)


def compare(runner: TargetRunner, prompt: list[int], tokens: int, chunk: int, decode_mask: bool) -> list[tuple[float, bool]]:
    """(max |logit difference|, argmax differs) per position of the greedy continuation."""
    ids = torch.tensor(prompt)
    runner.reset(len(prompt) + tokens + chunk)
    logits, _ = runner.prefill(ids, need_aux=False)
    seq, decoded = [], []
    token = logits.argmax()
    for _ in range(tokens):
        seq.append(int(token))
        if decode_mask:
            out, _ = runner.tree(token.reshape(1), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
            out = out[0]
        else:
            out, _ = runner.decode(token)
        decoded.append(out)
        token = out.argmax()
    runner.reset(len(prompt) + tokens + chunk)
    runner.prefill(ids, need_aux=False)
    verified = []
    for c in range(0, tokens, chunk):
        part = torch.tensor(seq[c : c + chunk])
        n = len(part)
        out, _ = runner.tree(part, torch.arange(n), torch.tril(torch.ones(n, n, dtype=torch.bool)))
        verified += list(out)
    return [(float((a - b).abs().max()), bool(a.argmax() != b.argmax())) for a, b in zip(decoded, verified)]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_run_config(Path(args.run))
    rows = []
    for dtype in args.dtypes:
        target_cfg = cfg.target.copy()
        target_cfg.dtype = dtype
        model, tok = load_target(target_cfg), load_tokenizer(target_cfg)
        runner = TargetRunner(model, aux_layer_ids(target_cfg, model.config))
        prompts = heldout_prompts(RunLayout(args.run).conversations("eval"), tok, args.prompts)
        with torch.inference_mode():
            pairs = [pair for p in prompts for pair in compare(runner, p["input_ids"], args.tokens, args.chunk,
                                                                  args.decode_mask)]
        diffs = sorted(d for d, _ in pairs)
        rows.append({"dtype": dtype, "positions": len(pairs), "argmax_flips": sum(f for _, f in pairs),
                     "max_abs_logit_diff": diffs[-1], "median_abs_logit_diff": diffs[len(diffs) // 2]})
        del model, runner
    print(f"{args.run}: {args.prompts} prompts x {args.tokens} greedy tokens, verify chunks of {args.chunk}"
          f"{', explicit mask on decode' if args.decode_mask else ''}, {args.threads} threads")
    print("| dtype | positions | argmax flips | max abs logit diff | median abs logit diff |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['positions']} | {r['argmax_flips']} | {r['max_abs_logit_diff']:.3g} | "
              f"{r['median_abs_logit_diff']:.3g} |")
    out = {"args": vars(args), "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
