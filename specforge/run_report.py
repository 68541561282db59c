"""The run's `report.md` and `plots/*.png`: what a person reads to decide which epoch to ship.

Built only from files in the run directory, so it can be rewritten at any time by any stage.
"""
from __future__ import annotations

from pathlib import Path

from specforge.run_layout import RunLayout
from specforge.utils.io import read_json, write_text
from specforge.utils.metrics_log import read_metrics


def _table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def plot_training(metrics: list[dict], plots_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    made = []
    train = [m for m in metrics if m.get("split") == "train"]
    evals = [m for m in metrics if m.get("split") == "eval" and "sim_accept_length" in m]
    if train:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        ax[0].plot([m["step"] for m in train], [m["loss"] for m in train])
        ax[0].set(xlabel="step", ylabel="weighted TTT loss", title="training loss")
        ax[1].plot([m["step"] for m in train], [m["sim_accept_length"] for m in train], label="train")
        if evals:
            ax[1].plot([m["step"] for m in evals], [m["sim_accept_length"] for m in evals], "o-", label="held-out")
        ax[1].set(xlabel="step", ylabel="simulated accept length", title="accept length (simulated)")
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(plots_dir / "training.png", dpi=100)
        plt.close(fig)
        made.append("plots/training.png")
    if evals:
        last = evals[-1]
        ks = sorted(int(k.split("_")[1]) for k in last if k.startswith("acc_"))
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m in evals:
            ax.plot(ks, [m[f"acc_{k}"] for k in ks], "o-", label=f"epoch {m['epoch']}")
        ax.set(xlabel="TTT step k", ylabel="acc_k", title="held-out accuracy per draft step", ylim=(0, 1))
        ax.legend()
        fig.tight_layout()
        fig.savefig(plots_dir / "acc_per_step.png", dpi=100)
        plt.close(fig)
        made.append("plots/acc_per_step.png")
    return made


def write_run_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    layout = RunLayout(run_dir)
    parts = [f"# Run `{run_dir.name}`", ""]
    for stage in ("data", "extract", "train"):
        marker = layout.marker(stage)
        if marker.exists():
            s = read_json(marker).get("summary", {})
            flat = {k: v for k, v in s.items() if isinstance(v, (int, float, str))}
            if flat:
                parts += [f"## {stage}", "", _table(["field", "value"], [[k, v] for k, v in flat.items()]), ""]
    metrics = read_metrics(layout.metrics)
    evals = [m for m in metrics if m.get("split") == "eval" and "sim_accept_length" in m]
    if evals:
        ks = sorted(int(k.split("_")[1]) for k in evals[-1] if k.startswith("acc_"))
        parts += ["## Held-out metrics per epoch (simulated: teacher-forced TTT)", "",
                  _table(["epoch", "sim accept length", *[f"acc_{k}" for k in ks]],
                         [[m["epoch"], m["sim_accept_length"], *[m[f"acc_{k}"] for k in ks]] for m in evals]),
                  ""]
        best = max(evals, key=lambda m: m["sim_accept_length"])
        parts += [f"Best simulated accept length: epoch {best['epoch']} "
                  f"({best['sim_accept_length']:.3f}); checkpoint `epoch_{best['epoch']}/`.", ""]
    plots = plot_training(metrics, layout.plots_dir) if metrics else []
    parts += [f"![{Path(p).stem}]({p})" for p in plots]
    eval_md = layout.eval_report
    if eval_md.exists():  # its plot links are relative to eval/
        parts += ["", eval_md.read_text().replace("](plots/", "](eval/plots/")]
    out = layout.report
    write_text(out, "\n".join(parts) + "\n")
    return out
