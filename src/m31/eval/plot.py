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


def pareto_front(points: dict[str, tuple[float, float, float]]) -> list[str]:
    """The models no other model beats at no more FLOPs: ordered by FLOPs, each one's metric
    above that of every cheaper one (`points`: name -> (FLOPs per pair, mean, std)); of two
    models level on both, the first by name."""
    front, best = [], float("-inf")
    for name in sorted(points, key=lambda n: (points[n][0], -points[n][1], n)):
        if points[name][1] > best:
            front.append(name)
            best = points[name][1]
    return front


def plot_pareto(
    points: dict[str, tuple[float, float, float]],
    metric: str,
    path: Path | str,
    title: str = "",
    baselines: dict[str, float] | None = None,
) -> Path:
    """PNG of each model's `metric` (mean ± std over training seeds; std NaN: no error bar)
    against its FLOPs per (request, ad) pair on a log scale, the Pareto front joined; `points`:
    name -> (FLOPs, mean, std). `baselines` (name -> metric), which count no FLOPs, are drawn
    as horizontal lines. Returns the path."""
    import math

    from matplotlib.figure import Figure

    if not points:
        raise ValueError("no models with FLOPs to plot (baselines have none)")
    fig = Figure(figsize=(6.5, 4.2), dpi=120)
    ax = fig.add_subplot()
    for i, (name, (flops, mean, std)) in enumerate(points.items()):
        err = None if math.isnan(std) else std
        ax.errorbar([flops], [mean], yerr=err, fmt="o", color=f"C{i % 10}", capsize=3)
        ax.annotate(name, (flops, mean), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = pareto_front(points)
    ax.plot(
        [points[n][0] for n in front],
        [points[n][1] for n in front],
        color="grey",
        linestyle="--",
        linewidth=1,
        label="Pareto front",
    )
    for name, value in (baselines or {}).items():
        ax.axhline(value, color="black", linestyle=":", linewidth=1)
        ax.annotate(
            name,
            (0.01, value),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.margins(x=0.12, y=0.12)  # room for the labels of the points at the edges
    ax.set_xlabel("FLOPs per (request, ad) pair")
    ax.set_ylabel(metric)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
