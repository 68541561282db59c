"""Draft quality side by side: our trainer and another (vLLM's `speculators`, SpecForge) on one store and budget.

One extracted store (a run's `extract/`, the demo's by default) feeds both trainers:
1. ours: the run's own train config (`specforge.train.loop.train`), `--epochs` epochs, float32,
   into `<work>/ours/` (its `data/` and `extract/` link to the run's);
2. the peer: benchmarks/peer_quality_worker.py in `.venv-peer` (`make peer-venv`), fed the same
   samples in the same order, one optimizer step per micro-batch of ours (its packed row of the
   same documents), our learning rate at every step, our TTT length, draft vocab (d2t/t2d), seed
   and EAGLE 3.1 options (the worker's docstring lists what stays its own);
3. the peer's weights are renamed into our layout (specforge/speculators_format.py; checked here:
   the round trip is bit-identical and the converted draft's step-0 logits equal the peer's own
   on a training sample) and saved as a checkpoint like ours (bf16 weights);
4. both checkpoints run in our embedded engine on the run's held-out prompts, T=0, float32, one
   shared base pass before and after (specforge.eval.engine_eval), for every --trees.

Prints a table and writes benchmarks/results/peer_quality.json: {"rows": [{"tree", "ours",
"peer", ...}], "steps", "command", ...}.

--ablate NAME --set KEY=VALUE ...: one row of the recipe's ablation table. Our draft is trained with
the overrides (same samples, order and steps; the peer is not retrained: its plan is the run's)
and only its accept length is measured, by the same engine on the same prompts and trees; at T=0 in
float32 it is deterministic, so it compares with the peer's in peer_quality.json. The row is added
to benchmarks/results/recipe_ablation.json ({"rows": [{"name", "set", "accept_length": {tree: ...},
"vs_peer": {tree: ...}}], "peer", "samples", ...}; --ablation-out for another store's table).

--ttt-length N unrolls both N TTT steps (default: the run's); --seed N trains both with seed N (another --out per seed); --spread FILE ... then tabulates ours / peer
per tree and seed with the mean over seeds (benchmarks/results/peer_quality_seeds.json).
--draft eagle3|eagle31 gives both the EAGLE 3.1 options of conf/draft/<name>.yaml (default: the run's).

--peer specforge: the peer is sgl-project's SpecForge 0.2.0 (`make specforge-venv`; its worker,
benchmarks/specforge_peer_worker.py, says what it runs as SpecForge does and what the CPU forces),
trained into <peer-work>/specforge/ and converted with `specforge import-draft`
(specforge/draft_import.py), checked as above on its step-0 logits. It trains EAGLE 3 with or
without fc_norm only: `--draft eagle3` on a run of EAGLE 3.1.

    make peer-venv
    .venv/bin/python benchmarks/peer_quality.py --run outputs/smollm2_weather --epochs 3
    make specforge-venv
    .venv/bin/python benchmarks/peer_quality.py --peer specforge --draft eagle3 --run outputs/smollm2_code \
        --work outputs/peer_specforge_code --out benchmarks/results/peer_quality_specforge_code.json
    .venv/bin/python benchmarks/peer_quality.py --ablate step_weight_1 --set train.step_weight=1.0 \
        --work outputs/ablation/step_weight_1 --fresh
Both train on the allocator train.py runs with (mimalloc, specforge/utils/allocator.py: ours in this
process, the peer's worker through LD_PRELOAD); the result records it.
"""
from __future__ import annotations

if __name__ == "__main__":  # the allocator train.py runs with: ours trains in this process
    from specforge.utils.allocator import preload_mimalloc

    preload_mimalloc()

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from safetensors.torch import load_file, save_file  # noqa: E402

from specforge.checkpoint import read_checkpoint, save_checkpoint  # noqa: E402
from specforge.config import EAGLE31_OPTIONS  # noqa: E402
from specforge.eval.engine_eval import eval_with_engine, load_run_config  # noqa: E402
from specforge.extract.store import HiddenStateStore  # noqa: E402
from specforge.models.draft import Eagle3Draft  # noqa: E402
from specforge.run_layout import RunLayout  # noqa: E402
from specforge.speculators_format import from_speculators, options_of, to_speculators  # noqa: E402
from specforge.targets.loader import resolve_target_path  # noqa: E402
from specforge.train.batches import global_batches, steps_per_epoch  # noqa: E402
from specforge.train.loop import cosine_with_warmup  # noqa: E402
from specforge.utils.allocator import mimalloc_env, running_allocator  # noqa: E402
from specforge.utils.io import read_json, write_json  # noqa: E402

# each peer: its virtualenv (and the make target that builds it), its worker, its directory under --work
PEERS = {
    "speculators": {"python": ".venv-peer/bin/python", "make": "peer-venv",
                    "worker": "benchmarks/peer_quality_worker.py", "dir": "peer",
                    "label": "speculators 0.9.0 (benchmarks/peer_quality_worker.py: its model, kl_div loss, AdamW; "
                             "sdpa, eager loss on CPU)"},
    "specforge": {"python": ".venv-sf/bin/python", "make": "specforge-venv",
                  "worker": "benchmarks/specforge_peer_worker.py", "dir": "specforge",
                  "label": "SpecForge 0.2.0 (benchmarks/specforge_peer_worker.py: its draft, TTT model, soft-label "
                           "loss with 0.8^k step weights, BF16Optimizer; sdpa, reference loss on CPU)"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="outputs/smollm2_weather", help="run directory with extract/ and data/")
    p.add_argument("--epochs", type=int, default=3, help="training budget of both, in epochs of the run's batches")
    p.add_argument("--work", default="outputs/peer_quality",
                   help="where both drafts are trained; what is there already is reused (--fresh wipes it)")
    p.add_argument("--fresh", action="store_true", help="wipe --work first")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of OUR run config only (an ablation, e.g. train.step_weight=1.0); the "
                        "peer keeps the run's plan: train it once and point --peer-work at it")
    p.add_argument("--seed", type=int, default=None,
                   help="the seed of BOTH trainers (sample order and initialisation; default: the run's), "
                        "for the spread over seeds; --out another file per seed")
    p.add_argument("--ttt-length", type=int, default=None,
                   help="TTT steps of BOTH trainers (default: the run's train.ttt_length); a tree deeper "
                        "than it runs draft steps neither was trained for")
    p.add_argument("--spread", nargs="+", metavar="JSON",
                   help="no training: the spread over seeds of runs of this benchmark (their --out files, "
                        "same store and budget, one seed each) -> --spread-out")
    p.add_argument("--spread-out", default=str(ROOT / "benchmarks" / "results" / "peer_quality_seeds.json"))
    p.add_argument("--peer-work", default=None, help="where the peer is trained (default: --work)")
    p.add_argument("--ablate", metavar="NAME", help="train ours with --set and add a row to --ablation-out")
    p.add_argument("--ablation-out", default=str(ROOT / "benchmarks" / "results" / "recipe_ablation.json"))
    p.add_argument("--trees", nargs="+", default=["2_1_3", "5_1_6", "4_2_8"])
    p.add_argument("--num-prompts", type=int, default=40, help="held-out prompts (all of them if fewer)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--peer", choices=sorted(PEERS), default="speculators", help="the other trainer")
    p.add_argument("--draft", choices=["eagle3", "eagle31"], default=None,
                   help="the EAGLE 3.1 options of BOTH (conf/draft/<name>.yaml; default: the run's)")
    p.add_argument("--peer-python", default=None, help="the peer's interpreter (default: its virtualenv's)")
    p.add_argument("--peer-mask-shift", type=int, default=0,
                   help="--peer specforge only, an ablation of it: its loss positions moved to ours (2) "
                        "(benchmarks/specforge_peer_worker.py --mask-shift)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peer_quality.json"))
    return p.parse_args(argv)


def draft_options(run_cfg) -> dict[str, bool]:
    """The EAGLE 3.1 options both trainers train with."""
    return {key: bool(run_cfg.draft[key]) for key in EAGLE31_OPTIONS}


def training_plan(run_cfg, store: HiddenStateStore, epochs: int) -> dict:
    """Our trainer's micro-batches (sample indices), learning rate at every optimizer step, TTT
    length, seed and EAGLE 3.1 options: everything the peer is given from our side."""
    tc = run_cfg.train
    if tc.grad_accum != 1 or tc.pack_tokens:
        raise SystemExit("train.grad_accum must be 1 and train.pack_tokens 0: one micro-batch per peer step")
    per_epoch = steps_per_epoch(len(global_batches(store.lengths, tc.batch_size, run_cfg.seed, 1)), 1, 1)
    steps = [batch for epoch in range(1, epochs + 1)
             for batch in global_batches(store.lengths, tc.batch_size, run_cfg.seed, epoch)[:per_epoch]]
    factor = cosine_with_warmup(len(steps), tc.warmup_ratio, tc.min_lr_ratio)
    return {"steps": steps, "lr": [tc.lr * factor(s) for s in range(len(steps))],
            "ttt_length": tc.ttt_length, "seed": run_cfg.seed,
            "options": draft_options(run_cfg)}


def export(store: HiddenStateStore, vocab: dict, plan: dict, out: Path) -> None:
    """What the peer reads: every sample once (as stored) and the plan."""
    tensors = {"d2t": vocab["d2t"], "t2d": vocab["t2d"]}
    for i in sorted({i for step in plan["steps"] for i in step}):
        sample = store[i]
        for key in ("input_ids", "loss_mask", "aux", "last"):
            tensors[f"{i}.{key}"] = sample[key].contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "samples.safetensors")
    write_json(out / "plan.json", plan)


def train_ours(run_cfg, run_dir: Path, work: Path, epochs: int, overrides: list[str]) -> Path:
    from omegaconf import OmegaConf

    from specforge import distributed as dist
    from specforge.train.loop import train

    ours = work / "ours"  # a rerun after a crash resumes from its training state
    ours.mkdir(parents=True, exist_ok=True)
    for name in ("data", "extract"):  # read-only inputs, shared with the run
        if not (ours / name).exists():
            (ours / name).symlink_to((run_dir / name).resolve())
    cfg = OmegaConf.merge(run_cfg, {"output_dir": str(work), "run_name": "ours",
                                    "train": {"epochs": epochs, "precision": "fp32"},
                                    "logging": {"wandb": False}}, OmegaConf.from_dotlist(overrides))
    dist.init_distributed()
    train(cfg, ours, fingerprint="peer_quality")
    return RunLayout(ours).checkpoint(epochs)


def check_step0_logits(draft: Eagle3Draft, store: HiddenStateStore, check_path: Path, first_position: int,
                       who: str) -> tuple[float, float]:
    """Our converted draft's step-0 logits against the peer's own (`check_path`: its logits on one training
    sample). Both align token t+1 with the feature of t; `first_position` is where the peer's positions
    start (speculators: 1, SpecForge: 0). Returns (max abs difference, logits scale)."""
    check = load_file(check_path)
    sample = store[int(check["sample"])]
    n = sample["input_ids"].shape[0]
    with torch.no_grad():
        _, logits, _ = draft.step(sample["input_ids"][1:][None], draft.project(sample["aux"][:-1].float()[None]),
                                  torch.arange(first_position, first_position + n - 1)[None])
    diff = (logits[0] - check["logits"]).abs().max().item()
    scale = check["logits"].abs().max().item()
    if diff > 1e-3 * max(scale, 1.0):
        raise SystemExit(f"conversion: step-0 logits differ from {who} by {diff:.3g} (scale {scale:.3g})")
    return diff, scale


def convert_peer(peer_dir: Path, ours_ckpt: Path, store: HiddenStateStore, out: Path) -> dict:
    """The peer's weights as a checkpoint of ours; returns the checks (round trip, logits)."""
    state = load_file(peer_dir / "weights.safetensors")
    config = json.loads((peer_dir / "config.json").read_text())
    tensors = from_speculators(state)
    back = to_speculators(tensors)
    round_trip = back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    if not round_trip:
        raise SystemExit("conversion: ours -> speculators does not give its state back bit for bit")
    cfg, _ = read_checkpoint(ours_ckpt, weights=False)  # same target, geometry, vocab size, aux layers
    if options_of(config) != cfg.eagle31_options:
        raise SystemExit(f"peer options {options_of(config)} differ from ours {cfg.eagle31_options}")
    draft = Eagle3Draft(cfg)
    draft.load_state_dict(tensors, strict=True)
    draft.eval()

    diff, scale = check_step0_logits(draft, store, peer_dir / "check.safetensors", first_position=1, who="the peer's")
    save_checkpoint(draft, out)
    return {"round_trip_bit_identical": round_trip, "logits_max_abs_diff": diff, "logits_scale": scale,
            "tensors": len(tensors)}


def convert_specforge(raw: Path, ours_ckpt: Path, run_cfg, store: HiddenStateStore, out: Path) -> dict:
    """SpecForge's checkpoint as ours, through `specforge import-draft` (what a user would run); checked
    against its step-0 logits on a training sample (its alignment: positions from 0)."""
    from specforge.checkpoint import load_draft
    from specforge.draft_import import import_draft

    imported = raw.parent / "imported"  # its float32 weights as ours; derived from raw/, written again
    shutil.rmtree(imported, ignore_errors=True)
    import_draft(raw, imported, run_cfg.target)
    cfg, _ = read_checkpoint(ours_ckpt, weights=False)
    draft = load_draft(imported, device="cpu", dtype=torch.float32)
    if draft.config.eagle31_options != cfg.eagle31_options:
        raise SystemExit(f"SpecForge's options {draft.config.eagle31_options} differ from ours {cfg.eagle31_options}")
    diff, scale = check_step0_logits(draft, store, raw / "check.safetensors", first_position=0, who="SpecForge's")
    save_checkpoint(draft, out)  # in bf16, as ours and the speculators peer's are saved
    return {"import_draft": True, "logits_max_abs_diff": diff, "logits_scale": scale}


def accept_lengths(run_cfg, ckpt: Path, eval_cfg) -> dict[str, float]:
    """Accept length per tree of one checkpoint: the engine over the prompts, speculative only."""
    from specforge.checkpoint import load_draft
    from specforge.engine.speculative import SpeculativeEngine
    from specforge.engine.tree_spec import TreeSpec
    from specforge.eval.engine_eval import aggregate, load_engine_inputs

    device, dtype_name, tokenizer, suites, target = load_engine_inputs(run_cfg, eval_cfg)
    draft = load_draft(ckpt, device=device, dtype=getattr(torch, dtype_name))
    prompts = [p for suite in suites.values() for p in suite]
    out = {}
    for tree in eval_cfg.trees:
        spec = TreeSpec.parse(tree)
        engine = SpeculativeEngine(target, draft, spec)
        stats = [engine.generate(p["input_ids"], eval_cfg.max_new_tokens, eos_token_id=tokenizer.eos_token_id)[1]
                 for p in prompts]
        out[tree] = round(aggregate(stats, spec.steps)["accept_length"], 4)
        print(f"[ablation] {ckpt} {tree}: accept length {out[tree]}", flush=True)
    return out


def ablate(args, run_cfg, run_dir: Path, work: Path, eval_cfg) -> int:
    baseline = json.loads(Path(args.out).read_text())
    if baseline["epochs"] != args.epochs or baseline["prompts"] > args.num_prompts:
        raise SystemExit(f"{args.out}: measured at {baseline['epochs']} epochs on {baseline['prompts']} prompts; "
                         "an ablation row must use the same budget and prompts")
    if baseline.get("ttt_length", run_cfg.train.ttt_length) != run_cfg.train.ttt_length:
        raise SystemExit(f"{args.out}: both trained with TTT {baseline['ttt_length']}, ours would unroll "
                         f"{run_cfg.train.ttt_length}: pass --ttt-length {baseline['ttt_length']}")
    options = draft_options(run_cfg)
    if baseline.get("draft_options", options) != options:
        raise SystemExit(f"{args.out}: both trained with the EAGLE 3.1 options {baseline['draft_options']}, ours "
                         f"would have {options}: pass that run's --draft")
    if baseline.get("seed", 0) != run_cfg.seed:
        raise SystemExit(f"{args.out}: the peer was trained with seed {baseline.get('seed', 0)}, ours would be "
                         f"{run_cfg.seed}: pass that run's --seed, or its --out")
    peer = {row["tree"]: row["peer"] for row in baseline["rows"]}
    out = Path(args.ablation_out)
    table = json.loads(out.read_text()) if out.exists() else {"rows": []}
    if table.get("peer", peer) != peer:  # another store or prompts: its rows do not compare
        raise SystemExit(f"{out}: rows measured against another peer run than {args.out}'s; "
                         "pass --ablation-out for this one's table")
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    ckpt = RunLayout(work / "ours").checkpoint(args.epochs)
    if not ckpt.exists():
        train_ours(run_cfg, run_dir, work, args.epochs, args.set)
    mine = accept_lengths(run_cfg, ckpt, eval_cfg)
    row = {"name": args.ablate, "set": args.set, "accept_length": mine,
           "vs_peer": {tree: round(mine[tree] / peer[tree], 4) for tree in mine if tree in peer}}
    table["rows"] = [r for r in table["rows"] if r["name"] != args.ablate] + [row]
    table.update({"epochs": args.epochs, "steps": baseline["steps"], "prompts": baseline["prompts"],
                  "samples": baseline["samples"], "peer": peer, "command": "python benchmarks/peer_quality.py --ablate NAME --set ... (see rows)"})
    write_json(out, table)
    print(f"[ablation] {row}")
    return 0


SAME_BUDGET = ("samples", "tokens", "steps", "epochs", "prompts", "max_new_tokens", "dtype", "ours_overrides",
               "ttt_length")


def seed_spread(results: dict[str, dict]) -> dict:
    """{file: peer_quality result} -> ours / peer per tree and seed, with the mean, min and max over
    seeds: how far one seed's ratio is from what the recipe gives. The runs must differ in their
    seed alone (same store, budget, prompts, trees and overrides)."""
    (first_path, first), *others = results.items()
    trees = [row["tree"] for row in first["rows"]]
    for path, r in others:
        differ = [k for k in SAME_BUDGET if r.get(k) != first.get(k)]
        if differ or [row["tree"] for row in r["rows"]] != trees:
            raise SystemExit(f"{path}: not the budget of {first_path} ({', '.join(differ) or 'trees'} differ)")
    seeds = [r.get("seed", 0) for r in results.values()]
    if len(set(seeds)) < len(seeds) or len(seeds) < 2:
        raise SystemExit(f"--spread needs runs of at least two different seeds, got seeds {seeds}")
    rows = []
    for tree in trees:
        ours, peer = zip(*((row["ours"], row["peer"]) for r in results.values() for row in r["rows"]
                           if row["tree"] == tree))
        ratios = [o / p for o, p in zip(ours, peer)]
        rows.append({"tree": tree, "ours": list(ours), "peer": list(peer), "ratio": ratios,
                     "ratio_mean": sum(ratios) / len(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return {"seeds": seeds, "files": list(results), "rows": rows, **{k: first.get(k) for k in SAME_BUDGET}}


def print_spread(spread: dict) -> None:
    seeds = spread["seeds"]
    print("| tree | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | min - max |")
    print("|---|" + "---|" * (len(seeds) + 2))
    for row in spread["rows"]:
        print(f"| {row['tree']} | " + " | ".join(f"{r:.3f}" for r in row["ratio"])
              + f" | **{row['ratio_mean']:.3f}** | {row['ratio_min']:.3f} - {row['ratio_max']:.3f} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.spread:
        spread = seed_spread({path: json.loads(Path(path).read_text()) for path in args.spread})
        spread["command"] = "python " + shlex.join(["benchmarks/peer_quality.py", *(argv if argv is not None else sys.argv[1:])])
        print_spread(spread)
        write_json(Path(args.spread_out), spread)
        print(f"wrote {args.spread_out}")
        return 0
    run_dir, work = Path(args.run), Path(args.work)
    peer_spec = PEERS[args.peer]
    peer_python = args.peer_python or peer_spec["python"]
    if not args.ablate and not Path(peer_python).exists():
        sys.exit(f"{peer_python} not found: run `make {peer_spec['make']}` first "
                 f"({args.peer} in its own virtualenv)")
    run_cfg = load_run_config(run_dir)
    from omegaconf import OmegaConf

    if any(kv.split("=", 1)[0].lstrip("+") == "seed" for kv in args.set):
        sys.exit("--set seed=...: would change our sample order but not the peer's; use --seed (both)")
    if any(kv.split("=", 1)[0].lstrip("+") == "train.ttt_length" for kv in args.set):
        sys.exit("--set train.ttt_length=...: would change our unroll but not the peer's; use --ttt-length (both)")
    if args.seed is not None:
        run_cfg = OmegaConf.merge(run_cfg, {"seed": args.seed})
    if args.ttt_length is not None:
        run_cfg = OmegaConf.merge(run_cfg, {"train": {"ttt_length": args.ttt_length}})
    if args.draft is not None:
        options = OmegaConf.load(ROOT / "conf" / "draft" / f"{args.draft}.yaml")
        run_cfg = OmegaConf.merge(run_cfg, {"draft": {key: bool(options[key]) for key in EAGLE31_OPTIONS}})
    if any(kv.split("=", 1)[0].lstrip("+") in {f"draft.{k}" for k in EAGLE31_OPTIONS} for kv in args.set) \
            and not args.ablate:
        sys.exit("--set draft.<option>=...: would change our draft but not the peer's; use --draft (both)")
    if args.peer_mask_shift and (args.peer != "specforge" or args.peer_mask_shift < 0):
        sys.exit("--peer-mask-shift: an ablation of SpecForge's loss positions (--peer specforge), >= 0")

    eval_cfg = OmegaConf.merge(run_cfg.eval, {"engine": "embedded", "trees": args.trees, "suites": [],
                                              "num_prompts": args.num_prompts, "planner": False,
                                              "max_new_tokens": args.max_new_tokens, "dtype": "float32",
                                              "temperature": 0.0})
    if args.ablate:
        return ablate(args, run_cfg, run_dir, work, eval_cfg)
    layout = RunLayout(run_dir)
    store = HiddenStateStore(layout.store("train"))
    if store.scored_last:
        sys.exit(f"{layout.store('train')}: an fp8 store keeps the target's final state only where our loss "
                 "reads it, and the peers read it at other positions too: extract with extract.dtype=bfloat16")
    ours_ckpt = RunLayout(work / "ours").checkpoint(args.epochs)
    peer_work = Path(args.peer_work or work)
    peer_ckpt = peer_work / peer_spec["dir"] / f"epoch_{args.epochs}"
    raw = peer_work / peer_spec["dir"] / "raw"
    trained_with = raw.parent / "trained_with.json"  # how the peer in raw/ was trained (none: as released)
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
        if peer_work != work:
            shutil.rmtree(peer_work / peer_spec["dir"], ignore_errors=True)
    if (raw / "check.safetensors").exists():  # reused: it must be the peer this run asks for
        shift = read_json(trained_with)["mask_shift"] if trained_with.exists() else 0
        if shift != args.peer_mask_shift:
            sys.exit(f"{raw}: the peer there was trained with --peer-mask-shift {shift}, not {args.peer_mask_shift}: "
                     "give another --peer-work, or --fresh")
    plan = training_plan(run_cfg, store, args.epochs)
    seconds = {}  # training time of each, where trained in this invocation
    if not ours_ckpt.exists():
        t0 = time.perf_counter()
        train_ours(run_cfg, run_dir, work, args.epochs, args.set)
        seconds["ours"] = round(time.perf_counter() - t0, 1)
    if not (raw / "check.safetensors").exists():
        export(store, load_file(layout.vocab), plan, peer_work / "export")
        t0 = time.perf_counter()
        env = mimalloc_env()  # the peer's worker on the same allocator as ours
        command = [peer_python, peer_spec["worker"], "--export", str(peer_work / "export"), "--out", str(raw),
                   "--target", str(resolve_target_path(run_cfg.target))]
        if args.peer == "specforge":  # the draft's geometry: our checkpoint's
            command += ["--draft-config", str(ours_ckpt / "config.json"), "--mask-shift", str(args.peer_mask_shift)]
        subprocess.run(command, check=True, env=env)
        seconds["peer"] = round(time.perf_counter() - t0, 1)
        write_json(trained_with, {"mask_shift": args.peer_mask_shift})
    if args.peer == "specforge":
        conversion = convert_specforge(raw, ours_ckpt, run_cfg, store, peer_ckpt)
    else:
        conversion = convert_peer(raw, ours_ckpt, store, peer_ckpt)
    conversion["train_seconds"] = seconds
    print(f"[peer_quality] conversion: {conversion}", flush=True)

    results = eval_with_engine(run_cfg, [ours_ckpt, peer_ckpt], eval_cfg)
    by = {(Path(r["checkpoint"]).parent.name, r["tree"]): r for r in results["configs"]}
    rows = []
    print("| tree | accept length ours | peer | ours / peer | speed-up ours | peer | lossless ours / peer |\n"
          "|---|---|---|---|---|---|---|")
    for tree in args.trees:
        mine, theirs = by[("ours", tree)], by[(peer_spec["dir"], tree)]
        row = {"tree": tree, "ours": round(mine["accept_length"], 4), "peer": round(theirs["accept_length"], 4),
               "ratio": round(mine["accept_length"] / theirs["accept_length"], 4),
               "speedup_ours": round(mine["speedup"], 4), "speedup_peer": round(theirs["speedup"], 4),
               "lossless_ours": mine["lossless"], "lossless_peer": theirs["lossless"]}
        rows.append(row)
        print(f"| {tree} | {row['ours']:.3f} | {row['peer']:.3f} | {row['ratio']:.3f} | {row['speedup_ours']:.2f}x | "
              f"{row['speedup_peer']:.2f}x | {row['lossless_ours']:.2f} / {row['lossless_peer']:.2f} |", flush=True)
    result = {
        "rows": rows, "steps": len(plan["steps"]), "epochs": args.epochs, "seed": run_cfg.seed,
        "ttt_length": run_cfg.train.ttt_length,
        "draft_options": draft_options(run_cfg),
        "ours_overrides": args.set,
        "samples": len(store), "tokens": store.num_tokens, "prompts": results["meta"]["prompts"],
        "max_new_tokens": args.max_new_tokens, "dtype": results["meta"]["dtype"],
        "threads": results["meta"]["threads"], "conversion": conversion, "allocator": running_allocator(),
        "peer": peer_spec["label"], "peer_mask_shift": args.peer_mask_shift,
        "command": "python " + shlex.join(["benchmarks/peer_quality.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    write_json(Path(args.out), result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
