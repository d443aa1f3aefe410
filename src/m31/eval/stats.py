"""Statistics of the evaluation protocol: several training seeds per model, paired comparisons.

Shapes: S seeds (training runs) of a model, n test requests, B bootstrap resamples.

A model's quality is a distribution over training seeds, not one run: `seed_summary` gives the
mean and the sample standard deviation (n - 1 in the denominator) of each metric over seeds.

Two models are compared on the same test requests (`paired_comparison`): each request's metric
is averaged over each model's seeds, the per-request differences are averaged, and the 95%
interval is a percentile bootstrap over test requests (one per test user under leave-last-out)
with a fixed seed, so the same inputs always give the same interval. The bootstrap resamples
users, not training seeds: it says how sure the difference is on this population of users for
these trained models; the spread over seeds (`seed_summary`) says how much a retraining moves
each model. Both are reported. The same resamples give an interval for the ratio of the means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
_CHUNK = 500  # resamples drawn at once: B x n indices would not fit for the demo's 16k requests


@dataclass(frozen=True)
class SeedSummary:
    mean: float
    std: float  # sample standard deviation over seeds; NaN with a single seed
    seeds: int


def seed_summary(values: Sequence[float]) -> SeedSummary:
    """Mean and sample standard deviation of one metric over training seeds."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"need one value per seed, got shape {x.shape}")
    std = float(x.std(ddof=1)) if len(x) > 1 else math.nan
    return SeedSummary(float(x.mean()), std, len(x))


def aggregate_seeds(runs: Sequence[dict[str, float]]) -> dict[str, SeedSummary]:
    """metric -> summary over runs, each run a {metric: value} dict with the same metrics."""
    if not runs:
        raise ValueError("no runs to aggregate")
    keys = list(runs[0])
    if any(set(r) != set(keys) for r in runs):
        raise ValueError("runs report different metrics")
    return {k: seed_summary([r[k] for r in runs]) for k in keys}


@dataclass(frozen=True)
class PairedComparison:
    mean_a: float
    mean_b: float
    diff: float  # mean over requests of (a - b)
    diff_lo: float  # 95% percentile-bootstrap interval of diff
    diff_hi: float
    ratio: float  # mean_a / mean_b (NaN when mean_b is 0)
    ratio_lo: float  # its 95% interval over the same resamples; ratio_hi may be inf
    ratio_hi: float
    requests: int
    resamples: int

    def as_dict(self) -> dict[str, float | None]:
        """JSON-ready: an undefined ratio (NaN) or an unbounded end of its interval (inf) is
        None (null), as JSON has neither."""
        return {k: v if math.isfinite(v) else None for k, v in asdict(self).items()}


def paired_comparison(
    a: np.ndarray,
    b: np.ndarray,
    level: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> PairedComparison:
    """Model a against model b on the same requests.

    a, b: [S, n] or [n] per-request metric values (e.g. hit@10 as 0/1), one row per training seed
    of that model (the two may have different numbers of seeds). Each request's value is averaged
    over seeds, then the requests are resampled with replacement `resamples` times.
    """
    a, b = _per_request(a, "a"), _per_request(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b cover different requests: {a.shape[0]} vs {b.shape[0]}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if resamples <= 0:
        raise ValueError(f"resamples must be positive, got {resamples}")
    n = len(a)
    rng = np.random.default_rng(seed)
    sum_a, sum_b = np.empty(resamples), np.empty(resamples)  # [B]
    for lo in range(0, resamples, _CHUNK):
        idx = rng.integers(0, n, size=(min(_CHUNK, resamples - lo), n))  # [chunk, n]
        sum_a[lo : lo + len(idx)] = a[idx].sum(1)
        sum_b[lo : lo + len(idx)] = b[idx].sum(1)
    tails = [(1.0 - level) / 2 * 100, (1.0 + level) / 2 * 100]
    d_lo, d_hi = np.percentile((sum_a - sum_b) / n, tails)
    r_lo, r_hi = _ratio_interval(sum_a, sum_b, tails)
    mean_a, mean_b = float(a.mean()), float(b.mean())
    return PairedComparison(
        mean_a=mean_a,
        mean_b=mean_b,
        diff=float((a - b).mean()),
        diff_lo=float(d_lo),
        diff_hi=float(d_hi),
        ratio=mean_a / mean_b if mean_b > 0 else math.nan,
        ratio_lo=float(r_lo),
        ratio_hi=float(r_hi),
        requests=n,
        resamples=resamples,
    )


def _ratio_interval(sum_a: np.ndarray, sum_b: np.ndarray, tails: list[float]) -> np.ndarray:
    """Percentiles of the resampled ratio sum_a / sum_b. A resample where b scores nothing and
    a does has an unbounded ratio (+inf, so the upper end may be inf); one where neither scores
    has none and is left out (NaN when no resample has a ratio). With a few hits per model (HR@10
    on a few hundred requests) both happen, and the interval still says what the data allows."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = sum_a / sum_b  # x / 0 = inf for x > 0, 0 / 0 = NaN
    ratio = np.sort(ratio[~np.isnan(ratio)])
    if len(ratio) == 0:
        return np.array([math.nan, math.nan])
    # numpy's linear percentile, which gives NaN next to an inf: between sorted values lo and hi
    h = (len(ratio) - 1) * np.asarray(tails) / 100.0
    lo, hi = np.floor(h).astype(np.int64), np.ceil(h).astype(np.int64)
    low, high = ratio[lo], ratio[hi]
    with np.errstate(invalid="ignore"):
        return np.where(high == low, low, low + (high - low) * (h - lo))


def _per_request(x: np.ndarray, name: str) -> np.ndarray:
    """[S, n] or [n] -> [n]: the mean over seeds."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be [seeds, requests] with both non-empty, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} has non-finite values")
    return x.mean(0)


def per_request(ranks: np.ndarray, metric: str) -> np.ndarray:
    """A metric's value on each request from target ranks [..., n]: `hr@K` (0/1) or `ndcg@K`."""
    kind, _, k = metric.partition("@")
    if kind not in ("hr", "ndcg") or not k.isdigit() or int(k) <= 0:
        raise ValueError(f"per-request metrics are hr@K and ndcg@K, got {metric!r}")
    r = np.asarray(ranks, dtype=np.float64)
    hit = r < int(k)
    return hit.astype(np.float64) if kind == "hr" else np.where(hit, 1.0 / np.log2(r + 2.0), 0.0)


def format_seed_table(summaries: dict[str, dict[str, SeedSummary]]) -> str:
    """Markdown: one row per model, `mean ± std` over its seeds per metric (4 decimals)."""
    metrics = list(dict.fromkeys(k for m in summaries.values() for k in m))
    lines = [
        "| model | seeds | " + " | ".join(metrics) + " |",
        "|---|---:|" + "---:|" * len(metrics),
    ]
    for name, m in summaries.items():
        seeds = max(s.seeds for s in m.values())
        cells = (
            ""
            if key not in m
            else f"{m[key].mean:.4f}"
            if math.isnan(m[key].std)
            else f"{m[key].mean:.4f} ± {m[key].std:.4f}"
            for key in metrics
        )
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_paired(a: str, b: str, comparisons: dict[str, PairedComparison]) -> str:
    """Markdown: one row per metric, a vs b with the difference and ratio and their 95% CIs."""
    lines = [
        f"| metric | {a} | {b} | Δ [95% CI] | ratio [95% CI] |",
        "|---|---:|---:|---:|---:|",
    ]
    for metric, c in comparisons.items():
        lines.append(
            f"| {metric} | {c.mean_a:.4f} | {c.mean_b:.4f} | "
            f"{c.diff:+.4f} [{c.diff_lo:+.4f}, {c.diff_hi:+.4f}] | "
            f"{c.ratio:.3f} [{c.ratio_lo:.3f}, {c.ratio_hi:.3f}] |"
        )
    return "\n".join(lines)
