"""Evaluation outputs: results.json / results.csv, report.md with one table per run plus where the
time goes per configuration, and plots of accept length and speed-up per epoch and over tree
configurations."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from specforge.data.template import THINKING_SWITCH
from specforge.utils.io import write_json, write_text

COLUMNS = [("epoch", "epoch"), ("tree", "tree"), ("prefill_s", "prefill s"), ("accept_rate", "accept rate"),
           ("accept_length", "accept length"), ("e2e_s", "e2e s"), ("tok_s", "tok/s"),
           ("speedup", "speed-up"), ("tpot_ms_mean", "TPOT ms"), ("tpot_ms_p99", "TPOT p99 ms"),
           ("lossless", "lossless")]

ROUND_PHASES = ("draft", "verify", "accept", "cache", "other")  # as specforge.eval.engine_eval.ROUND_PHASES
PROFILE_KEYS = (["ms_per_round"] + [f"{p}_ms_per_round" for p in ROUND_PHASES]
                + ["round_cost_steps", "verify_cost_steps", "draft_cost_steps", "ms_per_step",
                   "decode_ms_per_step", "other_ms_per_step"]
                + [f"share_{p}" for p in ("prefill", "draft", "verify", "accept", "cache", "decode", "other")])


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def best_config(results: dict) -> dict | None:
    """The configuration to ship: the highest speed-up among the fully lossless ones (or among all,
    marked `all_lossy`, when none is)."""
    configs = results["configs"]
    lossless = [r for r in configs if r["lossless"] in (None, 1.0)]
    if not configs:
        return None
    best = max(lossless or configs, key=lambda r: r["speedup"])
    return {**best, "all_lossy": not lossless}


def best_chain(rows: list[dict], epoch: int, key: str) -> dict | None:
    """For servers that draft chains only (vLLM): the chain (topk 1) of `epoch` with the highest
    `key` (the engine's `speedup`, or the planner's `predicted_speedup`), lossless ones first as in
    best_config; None when no chain of that epoch was measured."""
    from specforge.engine.tree_spec import TreeSpec

    chains = [r for r in rows if r["epoch"] == epoch and TreeSpec.parse(r["tree"]).topk == 1
              and not _nan(r.get(key))]
    lossless = [r for r in chains if r.get("lossless") in (None, 1.0)]
    best = max(lossless or chains, key=lambda r: r[key], default=None)
    return None if best is None else {"tree": best["tree"], "accept_length": best["accept_length"], key: best[key]}


def ship_line(name: str, tree: str, speedup: float, measured: str, details: str) -> str:
    """The report's headline: ship `name` with `tree`, or, when even the fastest configuration is
    no faster than the base model (speed-up <= 1), say that speculative decoding does not pay here."""
    if speedup > 1.0:
        return f"**Ship `{name}` with tree `{tree}`**: {measured} {speedup:.2f}x, {details}."
    return (f"**No configuration was faster than the base model here**: the fastest, `{name}` with tree "
            f"`{tree}`, reached a {measured} of {speedup:.2f}x ({details}). Speculative decoding with these drafts "
            "does not pay on this hardware: serve the target alone, or measure smaller trees, later epochs, or "
            "the serving engine on its own hardware (a GPU verifies a tree for about the price of one token).")


def _nan(v) -> bool:
    return not isinstance(v, (int, float)) or math.isnan(v)


def _ms(v, share=None) -> str:
    if _nan(v):
        return "nan"
    return f"{v:.2f}" + ("" if _nan(share) else f" ({100 * share:.0f}%)")


def profile_lines(results: dict) -> list[str]:
    """"Where the time goes": ms per verify round of each phase (its share of e2e time in
    parentheses), the round's cost in base decode steps, and one sentence on the best configuration."""
    base, configs = results["base"], results["configs"]
    if "ms_per_step" not in base or not all("ms_per_round" in r for r in configs):
        return []  # results from before the engine timed its phases
    lines = ["### Where the time goes", "",
             "Wall-clock ms per verify round (share of the e2e time; prefill takes the rest): draft = "
             "draft forwards + tree building + catch-up over the accepted tokens, verify = the target's "
             "tree forward, accept = the walk over the tree, cache = KV compaction, other = the loop's "
             "own Python, emitting tokens (each phase includes its own Python). Round cost = ms per "
             "round / the base model's ms per decode step; speed-up ~= accept length / round cost.", "",
             "| epoch | tree | ms/round | " + " | ".join(ROUND_PHASES)
             + " | round cost (decode steps) | accept length |",
             "|" + "---|" * (len(ROUND_PHASES) + 5)]
    for r in configs:
        cells = [_fmt(r.get("epoch")), r["tree"], _ms(r["ms_per_round"])]
        cells += [_ms(r[f"{p}_ms_per_round"], r.get(f"share_{p}")) for p in ROUND_PHASES]
        cells += [_fmt(r.get("round_cost_steps")), _fmt(r["accept_length"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Base model: {_ms(base['ms_per_step'])} ms per decode step (one-token forward "
                  f"{_ms(base['decode_ms_per_step'], base.get('share_decode'))}, other "
                  f"{_ms(base['other_ms_per_step'], base.get('share_other'))}; prefill "
                  f"{100 * base.get('share_prefill', math.nan):.0f}% of e2e)."]
    best = best_config(results)
    if best and not _nan(best.get("round_cost_steps")):
        cost, length = best["round_cost_steps"], best["accept_length"]
        top = max(ROUND_PHASES, key=lambda p: best[f"{p}_ms_per_round"])
        top_share = best[f"{top}_ms_per_round"] / best["ms_per_round"]
        name = (f"epoch_{best['epoch']}" if best.get("epoch") is not None
                else Path(best.get("checkpoint", "?")).name)
        lines += ["", f"For `{name}` / `{best['tree']}` (the fastest configuration) a round costs "
                      f"{cost:.2f} decode steps (verify {best['verify_cost_steps']:.2f}, draft "
                      f"{best['draft_cost_steps']:.2f} one-token forwards; {top} is {100 * top_share:.0f}% "
                      f"of the round) and commits {length:.2f} tokens: {length:.2f} / {cost:.2f} = "
                      f"{length / cost:.2f}x expected, {best['speedup']:.2f}x measured end to end "
                      f"({best.get('decode_speedup', math.nan):.2f}x after prefill)."]
    return lines


def _prompts(meta: dict) -> str:
    """"16 held-out prompts", or with other suites (eval.suites) their names and sizes."""
    suites = meta.get("suites") or {"heldout": meta["prompts"]}
    if list(suites) == ["heldout"]:
        return f"{meta['prompts']} held-out prompts"
    return f"{meta['prompts']} prompts (" + ", ".join(f"{name}: {n}" for name, n in suites.items()) + ")"


def suite_lines(results: dict) -> list[str]:
    """With several suites (eval.suites): every configuration on each suite, against the base model
    on that suite's prompts; the table above pools them all."""
    bases = results.get("suite_base") or {}
    if len(bases) < 2:
        return []
    lines = ["", "### Per suite", "",
             "Each suite against the base model on its own prompts (the table above pools every suite).", "",
             "| suite | base tok/s | epoch | tree | accept length | tok/s | speed-up | lossless |", "|" + "---|" * 8]
    for r in results.get("suite_configs", []):
        cells = [r["suite"], bases[r["suite"]]["tok_s"], r.get("epoch"), r["tree"], r["accept_length"],
                 r["tok_s"], r.get("speedup"), r["lossless"]]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return lines


def _shared_prefix(meta: dict) -> str:
    shared = {name: n for name, n in (meta.get("shared_prefix_tokens") or {}).items() if n}
    if not shared:
        return ""
    return (" The prefix every prompt of a suite starts with stayed cached, base and speculative alike "
            "(eval.shared_prefix, as SGLang's radix cache): " + ", ".join(f"{name} {n} tokens" for name, n in shared.items())
            + " per prompt not prefilled.")


def _thinking(meta: dict) -> str:
    """The thinking mode prompts were rendered in, where the chat template has the switch."""
    if meta.get("thinking") is None:
        return ""
    return (f" Prompts rendered with the chat template's {THINKING_SWITCH}={str(meta['thinking']).lower()} "
            "(eval.thinking; by default as most held-out answers were written).")


def _resumed_lines(results: dict) -> list[str]:
    kept = [f"{_ckpt_name(r)} {r['tree']}" for r in results["configs"] if r.get("resumed")]
    if not kept:
        return []
    return [f"Measured by an earlier run of this evaluation that stopped, and kept (same target, prompts, "
            f"settings, machine and checkpoint bytes): {', '.join(kept)}. Their speed-ups are against this "
            "run's base passes.", ""]


def markdown(results: dict) -> str:
    base, meta = results["base"], results["meta"]
    lines = ["## Evaluation: speculative decoding vs the base model", "",
             f"{_prompts(meta)}, max {meta['max_new_tokens']} new tokens, temperature "
             f"{meta['temperature']}, batch 1, {meta['dtype']} on {meta['device']} ({meta['threads']} threads). "
             "Accept length = completion tokens / verify rounds (SGLang's definition); speed-up = tok/s over "
             "the base model's tok/s measured in the same run (mean of a pass before and after)."
             + _shared_prefix(meta) + _thinking(meta), "",
             f"Base model: {base['tok_s']:.2f} tok/s (passes: {base['tok_s_first_pass']:.2f}, "
             f"{base['tok_s_second_pass']:.2f}), prefill {base['prefill_s']:.3f} s, TPOT "
             f"{base['tpot_ms_mean']:.1f} ms (p99 {base['tpot_ms_p99']:.1f}), e2e {base['e2e_s']:.2f} s.", "",
             *_resumed_lines(results),
             "| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results["configs"]:
        lines.append("| " + " | ".join(_fmt(r.get(k)) for k, _ in COLUMNS) + " |")
    best = best_config(results)
    if best:
        if best["lossless"] is None:  # sampled: no output to compare with the base model's
            why = f"best speed-up (sampled at temperature {meta['temperature']}: outputs not compared with the base model's)"
        elif best["all_lossy"]:
            why = ("best speed-up; NO configuration reproduced the base output on every request: at low "
                   "precision a tree forward and a one-token decode round differently at near-ties "
                   "(try eval.dtype=float32)")
        else:
            why = "best speed-up among lossless configurations"
        details = f"accept length {best['accept_length']:.2f}, lossless {_fmt(best['lossless'])}; {why}"
        lines += ["", ship_line(f"epoch_{best['epoch']}", best["tree"], best["speedup"], "speed-up", details), "",
                  "Accepted drafts per round (0, 1, ... T) for that configuration: "
                  f"{best['accept_histogram']}."]
    lines += suite_lines(results)
    profile = profile_lines(results)
    if profile:
        lines += [""] + profile
    return "\n".join(lines) + "\n"


def plot(results: dict, plots_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    configs = results["configs"]
    trees = list(dict.fromkeys(r["tree"] for r in configs))
    epochs = sorted({r["epoch"] for r in configs if r["epoch"] is not None})
    made = []
    if epochs:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        for tree in trees:
            rows = sorted((r for r in configs if r["tree"] == tree and r["epoch"] is not None),
                          key=lambda r: r["epoch"])
            ax[0].plot([r["epoch"] for r in rows], [r["accept_length"] for r in rows], "o-", label=tree)
            ax[1].plot([r["epoch"] for r in rows], [r["speedup"] for r in rows], "o-", label=tree)
        ax[0].set(xlabel="epoch", ylabel="accept length", title="accept length per epoch")
        ax[1].axhline(1.0, color="grey", lw=0.8)
        ax[1].set(xlabel="epoch", ylabel="speed-up vs base", title="speed-up per epoch")
        for a in ax:
            a.set_xticks(epochs)
            a.legend()
        fig.tight_layout()
        fig.savefig(plots_dir / "per_epoch.png", dpi=100)
        plt.close(fig)
        made.append("plots/per_epoch.png")
    last = max(epochs) if epochs else None
    rows = [r for r in configs if r["epoch"] == last]
    if rows:
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows)), 3.5))
        # positions + labels: tree names like "2_1_3" parse as numbers, and matplotlib says so
        ax.bar(range(len(rows)), [r["accept_length"] for r in rows])
        ax.set_xticks(range(len(rows)), [r["tree"] for r in rows])
        ax.set(xlabel="tree (steps_topk_drafttokens)", ylabel="accept length",
               title=f"accept length over trees ({'epoch_%s' % last if last else 'checkpoint'})")
        fig.tight_layout()
        fig.savefig(plots_dir / "per_tree.png", dpi=100)
        plt.close(fig)
        made.append("plots/per_tree.png")
    return made


def write_results(results: dict, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    write_json(out_dir / "results.json", results)
    buf = io.StringIO()
    keys = [k for k, _ in COLUMNS] + ["round_accept_length", "decode_tok_s", "decode_speedup", "ttft_s",
                                       "completion_tokens", "verify_rounds", "checkpoint", *PROFILE_KEYS]
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    writer.writeheader()
    writer.writerow({"tree": "base", **results["base"]})
    for r in results["configs"]:
        writer.writerow(r)
    write_text(out_dir / "results.csv", buf.getvalue())
    plots = plot(results, out_dir / "plots")
    md = markdown(results) + "\n" + "\n".join(f"![{Path(p).stem}]({p})" for p in plots) + "\n"
    write_text(out_dir / "report.md", md)
    return out_dir / "report.md"


# ---- eval.planner=true (specforge/eval/planner_eval.py) -------------------------------------------


def _ckpt_name(row: dict) -> str:
    return f"epoch_{row['epoch']}" if row.get("epoch") is not None else Path(row["checkpoint"]).name


def planner_markdown(planner: dict, plots: list[str] = ()) -> str:
    """The planner's section: every tree of the recommended epoch (marked), its chains by length
    (vLLM's choice), the best tree of every epoch, the cost model's figures, the confirmation by the
    engine when it ran, and the wall time."""
    meta, best, cost = planner["meta"], planner["recommended"], planner["cost_model"]
    rows = [r for r in planner["rows"] if r["checkpoint"] == best["checkpoint"] and r.get("grid", True)]
    confirmed = {r["tree"]: r for r in planner.get("confirmed", [])}
    ms = lambda s: f"{1000 * s:.2f}"  # noqa: E731
    lines = ["## Tree planner: every epoch x tree from one greedy pass", "",
             f"{meta['prompts']} held-out prompts, max {meta['max_new_tokens']} new tokens, temperature 0, "
             f"{meta['dtype']} on {meta['device']} ({meta['threads']} threads). Accept length and rate are the "
             "engine's own figures, from its rounds replayed against the greedy tokens (specforge/eval/planner.py); "
             "depth = mean deepest node of the built trees, width = (N-1) / depth; predicted speed-up = accept "
             "length x base step / round cost (a decode speed-up: prefill left out), round costs measured on "
             "this machine (specforge/eval/cost_model.py).", "",
             ship_line(_ckpt_name(best), best["tree"], best["predicted_speedup"], "predicted speed-up",
                       f"accept length {best['accept_length']:.2f}"), "",
             f"Trees of `{_ckpt_name(best)}` (the grid, eval.planner_trees):", "",
             "| tree | accept length | accept rate | depth | width | ms/round | predicted speed-up |"
             + (" measured speed-up |" if confirmed else ""),
             "|" + "---|" * (7 + bool(confirmed))]
    for r in sorted(rows, key=lambda r: -r["predicted_speedup"] if not _nan(r["predicted_speedup"]) else math.inf):
        tree = f"**{r['tree']}** (recommended)" if r["tree"] == best["tree"] else r["tree"]
        cells = [tree, *(_fmt(r.get(k)) for k in ("accept_length", "accept_rate", "tree_depth", "tree_width")),
                 f"{r['t_round_ms']:.2f}", _fmt(r["predicted_speedup"])]
        if confirmed:
            cells.append(_fmt(confirmed[r["tree"]]["measured_speedup"]) if r["tree"] in confirmed else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += _chain_lines(best, planner["rows"])
    epochs = list(dict.fromkeys(r["checkpoint"] for r in planner["rows"]))
    if len(epochs) > 1:
        lines += ["", "Best tree per checkpoint:", "", "| checkpoint | tree | accept length | predicted speed-up |",
                  "|---|---|---|---|"]
        for ckpt in epochs:
            top = max((r for r in planner["rows"] if r["checkpoint"] == ckpt),
                      key=lambda r: -math.inf if _nan(r["predicted_speedup"]) else r["predicted_speedup"])
            lines.append(f"| {_ckpt_name(top)} | {top['tree']} | {_fmt(top['accept_length'])} | "
                         f"{_fmt(top['predicted_speedup'])} |")
    if confirmed:
        lines += ["", "Confirmed by the engine (base model before and after, same prompts): error = predicted / "
                      "measured decode speed-up - 1.", "",
                  "| tree | accept length (planner) | accept length (engine) | predicted | measured decode | "
                  "measured e2e | error | lossless |", "|" + "---|" * 8]
        for c in planner["confirmed"]:
            lines.append(f"| {c['tree']} | {_fmt(c['accept_length'])} | {_fmt(c['measured_accept_length'])} | "
                         f"{_fmt(c['predicted_speedup'])} | {_fmt(c['measured_speedup'])} | "
                         f"{_fmt(c['measured_e2e_speedup'])} | {100 * c['error']:+.1f}% | {_fmt(c['lossless'])} |")
    verify = ", ".join(f"N={n}: {ms(t)}" for n, t in sorted(cost["t_verify"].items(), key=lambda x: int(x[0])))
    step = ", ".join(f"K={k}: {ms(t)}" for k, t in sorted(cost["t_step"].items(), key=lambda x: int(x[0])))
    seconds = planner["seconds"]
    resumed = list(dict.fromkeys(_ckpt_name(r) for r in planner["rows"] if r.get("resumed")))
    lines += ["", f"Cost model ({'measured now' if cost['measured_now'] else 'reused'}, `{cost['path']}`; "
                  f"prefix of {cost['key']['prefix_len']} tokens), ms: base step {ms(cost['t_base'])}; verify "
                  f"{verify}; draft step {step}; catch-up over 1..{len(cost['t_extend'])} tokens "
                  f"{ms(min(cost['t_extend']))}-{ms(max(cost['t_extend']))}.", "",
              f"Planner: {len(meta['trees'])} trees"
              + (f" and {len(meta['chains'])} more chains" if meta.get("chains") else "")
              + f" x {len(epochs)} checkpoint(s) in "
              f"{seconds['planner']:.1f} s (cost model {seconds['cost_model']:.1f} s)"
              + (f"; engine confirmation {seconds['confirm']:.1f} s." if "confirm" in seconds else ".")
              + (f" Planned by an earlier run that stopped, and kept: {', '.join(resumed)}." if resumed else "")]
    lines += [""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _chain_lines(best: dict, rows: list[dict]) -> list[str]:
    """The recommended epoch's chains by length, for servers that draft chains only (vLLM's
    num_speculative_tokens); the one best_chain picks is marked."""
    from specforge.engine.tree_spec import TreeSpec

    chains = sorted((r for r in rows if r["checkpoint"] == best["checkpoint"] and TreeSpec.parse(r["tree"]).topk == 1),
                    key=lambda r: TreeSpec.parse(r["tree"]).steps)
    if not chains:
        return []
    pick = best_chain(chains, best["epoch"], "predicted_speedup")
    lines = ["", f"Chains of `{_ckpt_name(best)}` (vLLM drafts chains only: num_speculative_tokens = T):", "",
             "| num_speculative_tokens | chain | accept length | ms/round | predicted speed-up |", "|---|---|---|---|---|"]
    for r in chains:
        marks = [m for m, on in (("recommended", r["tree"] == best["tree"]),
                                  ("vLLM", pick is not None and r["tree"] == pick["tree"])) if on]
        tree = f"**{r['tree']}** ({', '.join(marks)})" if marks else r["tree"]
        lines.append(f"| {TreeSpec.parse(r['tree']).steps} | {tree} | {_fmt(r['accept_length'])} | "
                     f"{r['t_round_ms']:.2f} | {_fmt(r['predicted_speedup'])} |")
    return lines


def plot_planner(planner: dict, plots_dir: Path) -> list[str]:
    """One heatmap per topk K for the recommended checkpoint: steps T x draft tokens N, coloured by
    the predicted speed-up, each cell annotated with its accept length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from specforge.engine.tree_spec import TreeSpec

    plots_dir.mkdir(parents=True, exist_ok=True)
    best = planner["recommended"]
    rows = {TreeSpec.parse(r["tree"]): r for r in planner["rows"] if r["checkpoint"] == best["checkpoint"]}
    made = []
    for k in sorted({s.topk for s in rows}):
        specs = [s for s in rows if s.topk == k]
        ts, ns = sorted({s.steps for s in specs}), sorted({s.num_draft_tokens for s in specs})
        grid = np.full((len(ts), len(ns)), np.nan)
        for s in specs:
            grid[ts.index(s.steps), ns.index(s.num_draft_tokens)] = rows[s]["predicted_speedup"]
        fig, ax = plt.subplots(figsize=(max(4.5, 1.8 + 0.8 * len(ns)), max(3.2, 1.6 + 0.45 * len(ts))))
        image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", origin="lower", aspect="auto")
        for s in specs:
            i, j = ts.index(s.steps), ns.index(s.num_draft_tokens)
            dark = image.norm(grid[i, j]) < 0.5 if not np.isnan(grid[i, j]) else False
            ax.text(j, i, f"{rows[s]['accept_length']:.2f}" + ("*" if s.name == best["tree"] else ""),
                    ha="center", va="center", fontsize=8, color="white" if dark else "black")
        fig.colorbar(image, ax=ax, label="predicted speed-up")
        ax.set_xticks(range(len(ns)), [str(n) for n in ns])
        ax.set_yticks(range(len(ts)), [str(t) for t in ts])
        ax.set_xlabel("draft tokens N")
        ax.set_ylabel("steps T")
        ax.set_title(f"topk {k}, {_ckpt_name(best)}\ncolour: predicted speed-up, text: accept length (* ship)",
                     fontsize=9)
        fig.tight_layout()
        name = f"planner_topk{k}.png"
        fig.savefig(plots_dir / name, dpi=100)
        plt.close(fig)
        made.append(f"plots/{name}")
    return made


def write_planner(planner: dict, out_dir: str | Path, results: dict | None = None) -> Path:
    """planner.json, the heatmaps and report.md: the confirmation's engine report (results.json /
    csv as any evaluation) when it ran, then the planner's section."""
    out_dir = Path(out_dir)
    write_json(out_dir / "planner.json", planner)
    head = write_results(results, out_dir).read_text() + "\n" if results is not None else ""
    write_text(out_dir / "report.md", head + planner_markdown(planner, plot_planner(planner, out_dir / "plots")))
    return out_dir / "report.md"
