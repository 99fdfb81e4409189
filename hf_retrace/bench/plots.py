"""PNG figures of `hf-retrace bench` results (the rows of `results.json`). Uses matplotlib's object API (`Figure`),
so no pyplot state and no GUI backend are involved."""

import math
from pathlib import Path

from matplotlib.figure import Figure


def plot_tau(rows: list[dict], path: str | Path) -> None:
    """Grouped bars: tau (pooled over cycles) per prompt set (and `pooled`), one bar per method."""
    sets = list(dict.fromkeys(row["prompt_set"] for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    tau = {(row["method"], row["prompt_set"]): row["tau"] or 0.0 for row in rows}
    width = 0.8 / len(methods)
    fig = Figure(figsize=(max(6.0, 1.2 * len(sets) * max(1, len(methods) / 3)) + 2.0, 4.0))
    ax = fig.add_subplot()
    for i, method in enumerate(methods):
        xs = [s + (i - (len(methods) - 1) / 2) * width for s in range(len(sets))]
        bars = ax.bar(xs, [tau.get((method, name), 0.0) for name in sets], width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("tau (tokens per cycle, pooled over cycles)")
    ax.set_title("Acceptance length per method and prompt set")
    ax.set_ylim(0, 1.12 * max(list(tau.values()) + [1.0]))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_acceptance_histograms(rows: list[dict], path: str | Path) -> None:
    """One panel per method: share of cycles committing 1..B tokens, pooled over all prompt sets."""
    pooled = [row for row in rows if row["prompt_set"] == "pooled"]
    ncols = min(len(pooled), 4)
    nrows = math.ceil(len(pooled) / ncols)
    fig = Figure(figsize=(4.0 * ncols, 3.2 * nrows))
    for i, row in enumerate(pooled):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        counts = row["acceptance_histogram"]
        total = max(sum(counts), 1)
        lengths = range(1, len(counts) + 1)
        ax.bar(lengths, [c / total for c in counts])
        ax.set_xticks(lengths if len(counts) <= 16 else range(1, len(counts) + 1, 2))
        ax.set_xlim(0.4, len(counts) + 0.6)
        tau = "n/a" if row["tau"] is None else f"{row['tau']:.2f}"
        ax.set_title(f"{row['method']} (tau {tau}, {row['num_cycles']} cycles)", fontsize=9)
        ax.set_xlabel("tokens committed per cycle")
        if i % ncols == 0:
            ax.set_ylabel("share of cycles")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
