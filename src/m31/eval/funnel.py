"""Simulated ad funnel on the synthetic marketplace (DESIGN §8).

Shapes: n requests, b requests in a batch, A ads, k retrieved candidates, S shown slots.

Per retrieval model: retrieve k ads -> score them with the ranking model -> show the best S ->
each shown ad converts with its true probability. Outcomes use common random numbers: the uniform
draw of (request r, ad a) is a hash of (seed, r, a), not the next number of a sequential generator,
so two models that show the same ad to the same request get the same outcome, and the paired
difference between models carries only the noise of the ads in which they differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from m31.data import dataset
from m31.eval.offline import RankFn, Requests
from m31.features import Features
from m31.world.truth import GroundTruth

RetrieveFn = Callable[[Requests], np.ndarray]  # Requests [n] -> ranked ad rows [n, k]
Z95 = 1.959963984540054  # two-sided 95% normal quantile

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def crn_uniform(seed: int, request: np.ndarray, ad: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) draw of each (request, ad) pair, a pure function of (seed, request, ad).

    request and ad are non-negative integer arrays that broadcast together; returns float64.
    """
    r, a = np.asarray(request, dtype=np.int64), np.asarray(ad, dtype=np.int64)
    if (r.size and r.min() < 0) or (a.size and a.min() < 0) or (a.size and a.max() >= 2**32):
        raise ValueError("request and ad must be non-negative, ad below 2**32")
    with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 by design
        key = (r.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)  # distinct per (r, a)
        salt = _splitmix64(np.array([seed % 2**64], dtype=np.uint64))[0]
        z = _splitmix64(key ^ salt)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53  # top 53 bits: exact doubles


def _shown(
    retrieve: RetrieveFn,
    rank_fn: RankFn,
    req: Requests,
    k: int,
    slots: int,
    eligible: np.ndarray | None,
    n_ads: int,
    name: str,
) -> tuple[np.ndarray, np.ndarray]:
    """(shown ad rows [b, S], whether each slot is filled [b, S]) for one retrieval model."""
    cand = np.asarray(retrieve(req))
    if cand.ndim != 2 or len(cand) != len(req):
        raise ValueError(f"{name!r} returned shape {cand.shape}, expected [{len(req)}, k]")
    cand = cand[:, :k].astype(np.int64)  # [b, k]
    if cand.size and (cand.min() < 0 or cand.max() >= n_ads):
        raise ValueError(f"{name!r} returned ad rows outside [0, {n_ads})")
    score = np.asarray(rank_fn(req, cand), dtype=np.float64)  # [b, k]
    if score.shape != cand.shape:
        raise ValueError(f"rank_fn returned shape {score.shape} for candidates {cand.shape}")
    if np.isnan(score).any():
        raise ValueError("rank_fn returned NaN scores")
    if eligible is not None:
        ok = eligible[cand] if eligible.ndim == 1 else np.take_along_axis(eligible, cand, 1)
        score = np.where(ok, score, -np.inf)  # [b, k]
    top = np.argsort(-score, axis=1, kind="stable")[:, :slots]  # [b, S] ties: retrieval order
    # A candidate scored -inf (ineligible, or vetoed by the ranker) is never shown.
    filled = np.take_along_axis(score, top, 1) > -np.inf  # [b, S]
    return np.take_along_axis(cand, top, 1), filled


def paired(x: np.ndarray, y: np.ndarray, prefix: str) -> dict:
    """Mean per-request difference x - y per 1,000 requests, its 95% CI and the lift over y."""
    d = x - y  # [n]
    mean, base = d.mean(), y.mean()
    half = Z95 * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    return {
        f"{prefix}diff_per_1k": float(1000 * mean),
        f"{prefix}ci_per_1k": (float(1000 * (mean - half)), float(1000 * (mean + half))),
        f"{prefix}lift_pct": float(100 * mean / base) if base > 0 else math.nan,
    }


def simulate(
    retrievers: dict[str, RetrieveFn],
    rank_fn: RankFn,
    truth: GroundTruth,
    req: Requests,
    k: int = 500,
    slots: int = 4,
    seed: int = 0,
    eligible: np.ndarray | None = None,
    batch: int = 1024,
) -> dict:
    """Conversions per 1,000 requests of each retrieval model, and paired differences.

    `eligible` (bool, [A] or [n, A]) marks the ads that may be shown; retrieved ads outside it are
    dropped after ranking. Each pair compares a retriever with every retriever listed before it
    (its baseline), on sampled conversions and on expected conversions (the sum of the shown ads'
    true probabilities: the same mean, less variance).

    Returns {"requests", "k", "slots", "models": {name: {"conversions_per_1k",
    "expected_per_1k"}}, "pairs": [{"model", "baseline", "diff_per_1k", "ci_per_1k",
    "lift_pct", "expected_diff_per_1k", "expected_ci_per_1k", "expected_lift_pct"}]}.
    """
    if not retrievers:
        raise ValueError("no retrievers to compare")
    for arg, v in (("k", k), ("slots", slots), ("batch", batch)):
        if v <= 0:
            raise ValueError(f"{arg} must be positive, got {v}")
    n, n_ads = len(req), truth.n_ads
    if n == 0:
        raise ValueError("no requests")
    if eligible is not None:
        eligible = np.asarray(eligible, dtype=bool)
        if eligible.shape not in ((n_ads,), (n, n_ads)):
            raise ValueError(f"eligible must be [{n_ads}] or [{n}, {n_ads}], got {eligible.shape}")
    conv = {name: np.zeros(n) for name in retrievers}  # [n] conversions of each request
    expected = {name: np.zeros(n) for name in retrievers}  # [n]

    for lo in range(0, n, batch):
        r = req.take(slice(lo, lo + batch))
        hi = lo + len(r)
        ok = eligible if eligible is None or eligible.ndim == 1 else eligible[lo:hi]
        for name, retrieve in retrievers.items():
            shown, filled = _shown(retrieve, rank_fn, r, k, slots, ok, n_ads, name)  # [b, S]
            p = truth.probabilities(r.user, shown, r.surface, r.hour, r.platform, r.ts)[1]
            p = np.where(filled, p, 0.0)  # [b, S]
            u = crn_uniform(seed, np.arange(lo, hi)[:, None], shown)  # [b, S]
            conv[name][lo:hi] = (u < p).sum(1)
            expected[name][lo:hi] = p.sum(1)

    names = list(retrievers)
    return {
        "requests": n,
        "k": k,
        "slots": slots,
        "models": {
            name: {
                "conversions_per_1k": float(1000 * conv[name].mean()),
                "expected_per_1k": float(1000 * expected[name].mean()),
            }
            for name in names
        },
        "pairs": [
            {
                "model": name,
                "baseline": base,
                **paired(conv[name], conv[base], ""),
                **paired(expected[name], expected[base], "expected_"),
            }
            for i, base in enumerate(names)
            for name in names[i + 1 :]
        ],
    }


def format_funnel(result: dict) -> str:
    """Markdown tables: conversions per model, then each paired difference with its 95% CI."""

    def ci(lo_hi: tuple[float, float]) -> str:
        return f"[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"

    lines = [
        f"{result['requests']:,} requests, {result['k']} retrieved, {result['slots']} shown",
        "",
        "| model | conversions / 1k | expected / 1k |",
        "|---|---:|---:|",
    ]
    for name, m in result["models"].items():
        lines.append(f"| {name} | {m['conversions_per_1k']:.3f} | {m['expected_per_1k']:.3f} |")
    if result["pairs"]:
        lines += [
            "",
            "| model vs baseline | Δ conversions / 1k [95% CI] | lift | "
            "Δ expected / 1k [95% CI] | lift |",
            "|---|---:|---:|---:|---:|",
        ]
        for p in result["pairs"]:
            lines.append(
                f"| {p['model']} vs {p['baseline']} "
                f"| {p['diff_per_1k']:+.3f} {ci(p['ci_per_1k'])} | {p['lift_pct']:+.2f}% "
                f"| {p['expected_diff_per_1k']:+.3f} {ci(p['expected_ci_per_1k'])} "
                f"| {p['expected_lift_pct']:+.2f}% |"
            )
    return "\n".join(lines)


def funnel_eligibility(data: Path, feats: Features) -> Callable[[np.ndarray], np.ndarray]:
    """ts [n] -> [n, A]: the ads that may be shown at each request time (active, created)."""
    ads = dataset.load(Path(data)).ads
    active = np.asarray(ads["status"].to_pylist()) == "active"  # [A]
    created = feats.ads["created_at"]  # [A]
    return lambda ts: active[None, :] & (created[None, :] <= np.asarray(ts)[:, None])
