"""Plots of evaluation results (matplotlib, imported only here)."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from pathlib import Path


def plot_recall_at_k(
    results: dict[str, dict[str, float]], path: Path | str, metric_prefix: str = "truth_recall"
) -> Path:
    """PNG of `{metric_prefix}@K` against K (log scale) with one line per model; returns the path.

    `results` is what `evaluate` returns; `metric_prefix` is e.g. "truth_recall", "hr" or "ndcg".
    """
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no global backend state

    series = {}
    for name, metrics in results.items():
        points = sorted(
            (int(key.rpartition("@")[2]), value)
            for key, value in metrics.items()
            if key.rpartition("@")[0] == metric_prefix
        )
        if points:
            series[name] = points
    if not series:
        raise ValueError(f"no {metric_prefix}@K metrics in the results")
    fig = Figure(figsize=(6, 4), dpi=120)
    ax = fig.add_subplot()
    for name, points in series.items():
        ks, values = zip(*points, strict=True)
        ax.plot(ks, values, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("K")
    ax.set_ylabel(f"{metric_prefix}@K")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def plot_ablation(
    variants: dict[str, tuple[float, float]],
    references: dict[str, float],
    metric: str,
    path: Path | str,
    retrained: AbstractSet[str] = frozenset(),
) -> Path:
    """PNG of one metric by ablation variant: horizontal bars of mean ± std over training seeds
    (std NaN: no error bar), those of models retrained as the variant (`retrained`) in their own
    colour, and a dashed line per reference model (its mean); returns the path."""
    import math

    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not variants:
        raise ValueError("no variants to plot")
    names = list(variants)
    means = [variants[n][0] for n in names]
    errors = [0.0 if math.isnan(variants[n][1]) else variants[n][1] for n in names]
    fig = Figure(figsize=(6.5, 0.45 * len(names) + 1.4), dpi=120)
    ax = fig.add_subplot()
    colours = ["#dd8452" if n in retrained else "#4c72b0" for n in names]
    ax.barh(range(len(names)), means, xerr=errors, color=colours, capsize=3)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()  # the full model on top
    for i, (name, value) in enumerate(references.items()):  # not the bars' blue and orange
        ax.axvline(value, color=f"C{i + 2}", linestyle="--", label=name)
    ax.set_xlabel(metric)
    ax.grid(True, axis="x", alpha=0.3)
    handles = ax.get_legend_handles_labels()[0]
    if retrained & set(names):
        handles += [
            Patch(color="#4c72b0", label="the trained moe, rewritten"),
            Patch(color="#dd8452", label="retrained"),
        ]
    if handles:  # below the axes, clear of the bars
        rows = math.ceil(len(handles) / 2)
        fig.legend(handles=handles, loc="lower center", ncol=2, frameon=False)
        fig.tight_layout(rect=(0, 0.3 * rows / fig.get_figheight(), 1, 1))
    else:
        fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
