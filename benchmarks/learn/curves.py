"""The held-out curves of replicated runs in one figure: ``python benchmarks/learn/curves.py OUT.png RUN_DIR...``.

One panel per compression ratio: each run's greedy held-out KL (``heldout.csv``, mean over its requests) divided by
its step-0 value (the warm start), against the step; a marker on the step each run kept (its stopping rule's best).
Below 1: the policy's KL is lower than the warm start's on the stopping rule's requests (not the final test).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvsieve.learn.heldout import mean_by_step, read_heldout
from kvsieve.learn.stopping import StoppingRule

__all__ = ["plot_runs"]


def plot_runs(runs: list[Path], out: Path, patience: int = 0, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = {run: read_heldout(run / "heldout.csv", 10 ** 9) for run in runs}
    ratios = sorted({r["ratio"] for rows in histories.values() for r in rows})
    fig, axes = plt.subplots(1, len(ratios) + 1, figsize=(4 * (len(ratios) + 1), 3.4), sharey=True)
    for i, run in enumerate(runs):
        rows = histories[run]
        best = StoppingRule(patience).verdict(mean_by_step(rows)).best_step if rows else None
        for panel, ratio in zip(axes, [*ratios, None]):
            points = mean_by_step(rows, ratio)
            if not points:
                continue
            base = points[0][1]
            steps, values = [p[0] for p in points], [p[1] / base for p in points]
            panel.plot(steps, values, "o-", ms=3, color=f"C{i}", label=run.name)
            if best is not None and best in steps:
                panel.plot([best], [values[steps.index(best)]], "*", ms=12, color=f"C{i}")
    for panel, ratio in zip(axes, [*ratios, None]):
        panel.axhline(1.0, color="grey", lw=0.8)
        panel.set_title("mean over ratios" if ratio is None else f"{100 * (1 - ratio):g}% kept")
        panel.set_xlabel("step")
    axes[0].set_ylabel("held-out KL / warm start's")
    axes[-1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    plot_runs([Path(p) for p in sys.argv[2:]], Path(sys.argv[1]))
