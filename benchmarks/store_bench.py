"""A bf16 and an fp8 hidden-state store of the same samples: bytes per token, teacher agreement,
loader throughput, and (from two evaluations) the accept lengths of the drafts trained on each.

- bytes/token: on disk with headers (`bytes_per_token`) and of the hidden states alone (aux + last
  + fp8 scales; `ratio_vs_8h` = that / 8H, the bf16 store's aux [3H] + last [H]);
- argmax agreement: the target's lm_head over the fp8 store's dequantised `last` vs the bf16
  store's, at the positions training reads (store.scored_rows), fp32 logits, full vocabulary and
  (with the run's data/vocab.safetensors) within the draft vocabulary (the teacher's top choice);
- loader tok/s: every sample read and collated into micro-batches as training does (the same
  shuffled batches for both), a warm-up pass each, then --repeats passes alternating bf16/fp8;
- accept lengths: from the two runs' `eval/results.json` (evaluate.py), the configuration the bf16
  evaluation recommends (or --epoch/--tree) read from both, or given as numbers; null otherwise.

    .venv/bin/python benchmarks/store_bench.py --bf16 outputs/RUN/extract/train --fp8 outputs/RUN_FP8/extract/train \\
        [--eval-bf16 outputs/RUN/eval/results.json --eval-fp8 outputs/RUN_FP8/eval/results.json]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specforge.extract.store import HiddenStateStore, scored_rows  # noqa: E402
from specforge.train.batches import collate, global_batches  # noqa: E402
from specforge.utils.io import read_json, write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bf16", required=True, help="store directory written with extract.dtype=bfloat16")
    p.add_argument("--fp8", required=True, help="store directory of the same samples, extract.dtype=fp8")
    p.add_argument("--target", help="target directory (default: target.path of the bf16 store's run config.yaml)")
    p.add_argument("--eval-bf16", help="results.json of evaluate.py on the run trained on the bf16 store (or its dir)")
    p.add_argument("--eval-fp8", help="results.json of evaluate.py on the run trained on the fp8 store (or its dir)")
    p.add_argument("--epoch", type=int, help="evaluation row to compare (default: the bf16 evaluation's recommended)")
    p.add_argument("--tree", help="evaluation row to compare (default: the bf16 evaluation's recommended)")
    p.add_argument("--accept-bf16", type=float, help="accept length of the bf16 draft (instead of --eval-bf16)")
    p.add_argument("--accept-fp8", type=float, help="accept length of the fp8 draft (instead of --eval-fp8)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per collated micro-batch (train.batch_size)")
    p.add_argument("--repeats", type=int, default=3, help="timed loader passes per store")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "store.json"))
    return p.parse_args(argv)


def run_dir_of(store_dir: Path) -> Path:
    return store_dir.resolve().parents[1]  # <run>/extract/<split> (specforge/run_layout.py)


def lm_head(store: HiddenStateStore, target: str | None) -> tuple[torch.Tensor, str]:
    """The target's output head (fp32) and its path, refused when it is not the store's target."""
    from omegaconf import OmegaConf

    from specforge.targets.loader import load_target, target_fingerprint

    tcfg = OmegaConf.load(run_dir_of(store.dir) / "config.yaml").target
    tcfg.path = target or tcfg.path
    tcfg.fetch = None  # read what is there; never build or download here
    if target_fingerprint(Path(tcfg.path)) != store.meta["target_fingerprint"]:
        raise SystemExit(f"{tcfg.path}: not the target the stores were extracted from (fingerprint "
                         f"{target_fingerprint(Path(tcfg.path))} != {store.meta['target_fingerprint']}); give --target")
    model = load_target(tcfg)
    return model.get_output_embeddings().weight.detach().float(), str(tcfg.path)


@torch.no_grad()
def argmax_agreement(ref: HiddenStateStore, fp8: HiddenStateStore, weight: torch.Tensor,
                     draft_ids: torch.Tensor | None) -> dict:
    """Share of the read positions where argmax(lm_head(last)) is the same from both stores."""
    where = {sid: i for i, sid in enumerate(fp8.ids)}
    same = same_draft = n = 0
    for i, sid in enumerate(ref.ids):
        a, b = ref[i], fp8[where[sid]]
        if not torch.equal(a["input_ids"], b["input_ids"]) or not torch.equal(a["loss_mask"], b["loss_mask"]):
            raise SystemExit(f"sample {sid!r}: different tokens or loss mask in the two stores; not the same samples")
        at = scored_rows(a["loss_mask"])
        la, lb = a["last"][at].float() @ weight.T, b["last"][at].float() @ weight.T
        same += int((la.argmax(-1) == lb.argmax(-1)).sum())
        if draft_ids is not None:
            same_draft += int((la[:, draft_ids].argmax(-1) == lb[:, draft_ids].argmax(-1)).sum())
        n += len(at)
    out = {"positions": n, "argmax_agreement": same / max(n, 1)}
    if draft_ids is not None:
        out["argmax_agreement_draft_vocab"] = same_draft / max(n, 1)
    return out


def loader_pass(store: HiddenStateStore, batches: list[list[int]]) -> float:
    """Tokens/s of reading and collating every micro-batch (what each training step does first)."""
    t0 = time.perf_counter()
    for idx in batches:
        collate([store[i] for i in idx])
    return store.num_tokens / (time.perf_counter() - t0)


def accept_length(path: str | None, epoch: int | None, tree: str | None) -> tuple[float | None, dict | None]:
    """(accept length, the row's epoch and tree) of an evaluation's results.json, or (None, None)."""
    from specforge.eval.report import best_config

    if path is None:
        return None, None
    p = Path(path)
    results = read_json(p / "results.json" if p.is_dir() else p)
    if epoch is None and tree is None:
        best = best_config(results)
        if best is None:
            raise SystemExit(f"{path}: no evaluated configuration")
        epoch, tree = best.get("epoch"), best["tree"]
    rows = [r for r in results["configs"] if (epoch is None or r.get("epoch") == epoch) and (tree is None or r["tree"] == tree)]
    if len(rows) != 1:
        raise SystemExit(f"{path}: {len(rows)} rows for epoch {epoch} tree {tree}; give --epoch and --tree")
    return rows[0]["accept_length"], {"epoch": rows[0].get("epoch"), "tree": rows[0]["tree"]}


def per_tree(eval_bf16: str | None, eval_fp8: str | None, epoch: int | None) -> dict:
    """{tree: {"bf16", "fp8"}} accept lengths of every tree both evaluations ran (at `epoch`)."""
    if eval_bf16 is None or eval_fp8 is None:
        return {}
    rows = {}
    for name, path in (("bf16", eval_bf16), ("fp8", eval_fp8)):
        p = Path(path)
        for r in read_json(p / "results.json" if p.is_dir() else p)["configs"]:
            if epoch is None or r.get("epoch") == epoch:
                rows.setdefault(r["tree"], {})[name] = r["accept_length"]
    return {tree: pair for tree, pair in rows.items() if len(pair) == 2}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ref, fp8 = HiddenStateStore(args.bf16), HiddenStateStore(args.fp8)
    for name, store, dtype in (("--bf16", ref, "bfloat16"), ("--fp8", fp8, "fp8")):
        if store.meta["storage_dtype"] != dtype:
            raise SystemExit(f"{name} {store.dir}: a {store.meta['storage_dtype']} store, expected {dtype}")
    if sorted(ref.ids) != sorted(fp8.ids):
        raise SystemExit("the two stores hold different samples")
    hidden = int(ref.meta["hidden_size"])

    # the comparison row of both evaluations: the bf16 one's recommendation, unless given
    acc_bf16, row = (args.accept_bf16, None) if args.accept_bf16 is not None else accept_length(
        args.eval_bf16, args.epoch, args.tree)
    acc_fp8, row_fp8 = (args.accept_fp8, None) if args.accept_fp8 is not None else accept_length(
        args.eval_fp8, (row or {}).get("epoch", args.epoch), (row or {}).get("tree", args.tree))

    weight, target = lm_head(ref, args.target)
    vocab = run_dir_of(ref.dir) / "data" / "vocab.safetensors"
    draft_ids = None
    if vocab.is_file():
        from safetensors.torch import load_file

        draft_ids = torch.nonzero(load_file(vocab)["t2d"]).reshape(-1)
    t0 = time.perf_counter()
    agreement = argmax_agreement(ref, fp8, weight, draft_ids)
    agreement_s = time.perf_counter() - t0
    del weight

    # same micro-batches for both: the store order may differ, so batch by sample id
    batches = global_batches(ref.lengths, args.batch_size, seed=0, epoch=1)
    where = {sid: i for i, sid in enumerate(fp8.ids)}
    fp8_batches = [[where[ref.ids[i]] for i in b] for b in batches]
    rates = {"bf16": [], "fp8": []}
    loader_pass(ref, batches), loader_pass(fp8, fp8_batches)  # warm-up: page cache, open handles
    for _ in range(args.repeats):
        rates["bf16"].append(loader_pass(ref, batches))
        rates["fp8"].append(loader_pass(fp8, fp8_batches))

    stores = {"bf16": ref, "fp8": fp8}
    total = {k: round(s.bytes_per_token, 1) for k, s in stores.items()}
    hid = {k: round(s.hidden_bytes_per_token, 1) for k, s in stores.items()}
    command = "python benchmarks/store_bench.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    report = {
        "bytes_per_token": hid["fp8"],  # the fp8 store's hidden states (aux + last + scales) per token
        "hidden_size": hidden,
        "ratio_vs_8h": round(fp8.hidden_bytes_per_token / (8 * hidden), 4),
        "accept_length_bf16": acc_bf16,
        "accept_length_fp8": acc_fp8,
        "accept_config": {"bf16": row, "fp8": row_fp8},
        "accept_length_per_tree": per_tree(args.eval_bf16, args.eval_fp8, (row or {}).get("epoch", args.epoch)),
        "total_bytes_per_token": total,  # on disk, headers and ids/masks/offsets included
        "hidden_bytes_per_token": hid,  # aux + last + fp8 scales
        "ratio_vs_8h_per_store": {k: round(s.hidden_bytes_per_token / (8 * hidden), 4) for k, s in stores.items()},
        **agreement,
        "loader_tok_s_bf16": round(statistics.median(rates["bf16"]), 1),
        "loader_tok_s_fp8": round(statistics.median(rates["fp8"]), 1),
        "loader_tok_s_runs": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        "loader_batch_size": args.batch_size,
        "samples": len(ref),
        "tokens": ref.num_tokens,
        "scored_share": round(agreement["positions"] / max(ref.num_tokens, 1), 4),
        "stores": {"bf16": str(ref.dir), "fp8": str(fp8.dir)},
        "target": target,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "command": command,
    }
    write_json(args.out, report)

    print(f"{len(ref)} samples, {ref.num_tokens} tokens (H = {hidden}; training reads `last` at "
          f"{agreement['positions']} of them), {torch.get_num_threads()} threads\n")
    print("| store | bytes/token | hidden bytes/token | ratio vs 8H | loader tok/s (median) | accept length |")
    print("|---|---|---|---|---|---|")
    for k, acc in (("bf16", acc_bf16), ("fp8", acc_fp8)):
        print(f"| {k} | {total[k]:,.1f} | {hid[k]:,.1f} | {report['ratio_vs_8h_per_store'][k]:.3f} | "
              f"{report[f'loader_tok_s_{k}']:,.0f} | {'-' if acc is None else f'{acc:.3f}'} |")
    for tree, pair in report["accept_length_per_tree"].items():
        print(f"accept length at {tree}: bf16 {pair['bf16']:.3f}, fp8 {pair['fp8']:.3f} "
              f"({100 * (pair['fp8'] / pair['bf16'] - 1):+.2f}%)")
    extra = (f", {100 * agreement['argmax_agreement_draft_vocab']:.2f}% within the draft vocab"
             if "argmax_agreement_draft_vocab" in agreement else "")
    print(f"\nteacher argmax, fp8 vs bf16 `last`: {100 * agreement['argmax_agreement']:.2f}% of "
          f"{agreement['positions']} positions agree{extra} ({agreement_s:.1f} s)")
    print(f"loader passes, tok/s: bf16 {report['loader_tok_s_runs']['bf16']}, fp8 {report['loader_tok_s_runs']['fp8']}")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
