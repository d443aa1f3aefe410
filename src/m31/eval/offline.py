"""Offline, full-corpus evaluation of retrieval models (DESIGN §8).

Shapes: n requests, b requests in a batch, A ads, M seen (request, ad) pairs.

Each example row of a split is one request: its user, time and context, with the engaged ad held
out as the target. A model scores every ad (never sampled candidates). Ads the user engaged with
before the request, or in the same second as it, are excluded, as in the MovieLens leave-last-out
protocol, except the target itself: a repeat engagement is still a correct answer. Same-second
engagements are other answers of the same request (timestamps are whole seconds and ratings come
in bursts; see `m31.features.build._split`), so ranking them high is neither a hit nor a miss. Requests are scored in batches, so memory
is bounded by b x A per model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from m31.eval.metrics import (
    hit_rate_at_k,
    ndcg_at_k,
    overlap_at_k,
    recall_rows,
    target_rank,
    topk_rows,
)
from m31.features import Features
from m31.world.truth import GroundTruth

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Requests:
    user: np.ndarray  # [n] user rows
    ts: np.ndarray  # [n] Unix seconds
    surface: np.ndarray  # [n] index into the features' vocab["surface"]
    hour: np.ndarray  # [n] hour of day
    platform: np.ndarray  # [n] index into the features' vocab["platform"]

    def __post_init__(self) -> None:
        n = len(self.user)
        for f in fields(self):
            v = np.asarray(getattr(self, f.name), dtype=np.int64)
            if v.shape != (n,):
                raise ValueError(f"Requests.{f.name} must have shape ({n},), got {v.shape}")
            object.__setattr__(self, f.name, v)

    def __len__(self) -> int:
        return len(self.user)

    def take(self, rows: np.ndarray | slice) -> Requests:
        """The requests at `rows`, an index array or a slice."""
        return Requests(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


ScoreFn = Callable[[Requests], np.ndarray]  # Requests [n] -> scores [n, A], higher is better
RankFn = Callable[[Requests, np.ndarray], np.ndarray]  # candidate rows [n, k] -> scores [n, k]


def examples(
    feats: Features, split: str, max_users: int | None, seed: int
) -> tuple[Requests, np.ndarray]:
    """Requests of a split's example rows and their target ad rows [n]."""
    if split not in feats.splits:
        raise ValueError(f"unknown split {split!r}, expected one of {', '.join(feats.splits)}")
    cols = feats.splits[split]
    rows = np.arange(len(cols["user"]))
    if max_users is not None:
        if max_users <= 0:
            raise ValueError(f"max_users must be positive, got {max_users}")
        if max_users < len(rows):
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(len(rows), size=max_users, replace=False))
    req = Requests(**{f.name: cols[f.name][rows] for f in fields(Requests)})
    return req, cols["item"][rows].astype(np.int64)


def requests_from_split(
    feats: Features, split: str = "test", max_users: int | None = None, seed: int = 0
) -> Requests:
    """One request per example row of `split`; with max_users, a seeded random subset of rows."""
    return examples(feats, split, max_users, seed)[0]


def seen_mask(
    feats: Features, req: Requests, same_second: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Ads each user engaged with before its request: (request index [M], ad row [M]).

    With `same_second`, engagements at the request's own second count too (the target among them).

    Read from the engagement CSR directly, so the whole history counts, not just the last max_len.
    Index a [n, A] score matrix with the pair to mask them.
    """
    seq = feats.engagements
    n_before = seq.count_before(req.user, req.ts + 1 if same_second else req.ts)  # [n]
    req_idx = np.repeat(np.arange(len(req)), n_before)  # [M]
    # Event j of request i sits at offsets[user_i] + j; its place in the flat output is
    # sum(n_before[:i]) + j.
    start = seq.offsets[req.user] - (np.cumsum(n_before) - n_before)  # [n]
    pos = np.repeat(start, n_before) + np.arange(len(req_idx))  # [M]
    return req_idx, seq.values["item"][pos].astype(np.int64)


def _masked(scores: np.ndarray, drop: tuple | None, shape: tuple[int, int], name: str):
    s = np.asarray(scores)
    if s.shape != shape:
        raise ValueError(f"model {name!r} returned scores of shape {s.shape}, expected {shape}")
    if drop is None:
        return s
    # A float copy: the model may hand back an array it keeps, and integer scores cannot be -inf.
    s = s.astype(np.result_type(s.dtype, np.float32))
    s[drop] = -np.inf
    return s


def evaluate(
    score_fns: dict[str, ScoreFn],
    feats: Features,
    split: str = "test",
    ks: tuple[int, ...] = (10, 50, 100, 500),
    max_users: int | None = None,
    exclude_seen: bool = True,
    truth: GroundTruth | None = None,
    reference: str | None = None,
    batch: int = 256,
    progress: Progress | None = None,
    return_ranks: bool = False,
    rerank: dict[str, tuple[str, RankFn, int]] | None = None,
    return_truth_recall: bool = False,
):
    """Full-corpus metrics of each model on the same requests: model -> metric -> mean.

    `rerank` adds two-stage models: name -> (first, rank_fn, k): the model `first` of
    `score_fns` retrieves its top k (after the exclusions), `rank_fn` (a `RankFn`, e.g.
    `ScoreFunction.rank` of a ranking model) orders them, and every other ad ranks below them, so
    its HR@K for K ≤ k is the ranker's over the first stage's candidates (beyond k it is the first
    stage's recall@k).

    With `return_ranks`, (metrics, ranks): ranks maps each model to the 0-based rank of every
    request's target [n] (`target_rank`, after the exclusions), from which any request's HR@K and
    NDCG@K follow, for paired comparisons (`m31.eval.stats`). With `return_truth_recall` as well
    (and `truth`), (metrics, ranks, truth_recall): model -> `truth_recall@K` -> each request's
    value [n], for the same comparisons.

    Metrics for every K: `hr@K`, `ndcg@K`; with `truth`, `truth_recall@K` (share of the K ads
    with the highest true conversion probability for the request's user, context and time that
    the model retrieves in its top K, seen ads excluded from both); with `reference` (a model
    name), `ref_overlap@K` (share of the model's top K in the reference model's top K).
    """
    rerank = dict(rerank or {})
    ks = tuple(ks)
    names = _checked(score_fns, rerank, reference, ks, batch)
    if return_truth_recall and (truth is None or not return_ranks):
        raise ValueError("return_truth_recall needs a truth and return_ranks")
    req, target = examples(feats, split, max_users, seed=0)
    n, n_ads = len(req), feats.n_ads
    if n == 0:
        raise ValueError(f"split {split!r} has no examples")
    if progress is not None:  # the total before the first batch, which can take a while
        progress("evaluate", 0, n)
    k_top = min(max(ks), n_ads)
    all_ads = np.arange(n_ads)[None, :]  # [1, A] one candidate list shared by the whole batch
    sums = {name: defaultdict(float) for name in names}
    all_ranks = {name: np.empty(n, dtype=np.int64) for name in names}
    truth_rows = {  # [n] per model and K: each request's truth recall
        name: {f"truth_recall@{k}": np.empty(n) for k in ks} for name in names if truth is not None
    }

    for lo in range(0, n, batch):
        r, t = req.take(slice(lo, lo + batch)), target[lo : lo + batch]
        b = len(r)
        drop = None
        if exclude_seen:
            idx, ads = seen_mask(feats, r)
            keep = ads != t[idx]
            drop = (idx[keep], ads[keep])
        truth_top = None
        if truth is not None:
            p = truth.probabilities(r.user, all_ads, r.surface, r.hour, r.platform, r.ts)[1]
            truth_top = topk_rows(_masked(p, drop, (b, n_ads), "truth"), k_top)  # [b, K]
        scores = _scores(score_fns, rerank, r, drop, n_ads)
        tops = {}
        for name, s in scores.items():
            ranks = target_rank(s, t)  # [b]
            all_ranks[name][lo : lo + b] = ranks
            m = sums[name]
            for k in ks:
                m[f"hr@{k}"] += hit_rate_at_k(ranks, k) * b
            for k in ks:
                m[f"ndcg@{k}"] += ndcg_at_k(ranks, k) * b
            if truth is not None or reference is not None:
                tops[name] = topk_rows(s, k_top)  # [b, K]
            if truth is not None:
                for k in ks:
                    rows = recall_rows(tops[name], truth_top[:, :k], k)
                    truth_rows[name][f"truth_recall@{k}"][lo : lo + b] = rows
                    m[f"truth_recall@{k}"] += float(rows.sum())
        if reference is not None:
            for name, top in tops.items():
                for k in ks:
                    sums[name][f"ref_overlap@{k}"] += overlap_at_k(top, tops[reference], k) * b
        if progress is not None:
            progress("evaluate", lo + b, n)
    metrics = {name: {key: v / n for key, v in m.items()} for name, m in sums.items()}
    if return_truth_recall:
        return metrics, all_ranks, truth_rows
    return (metrics, all_ranks) if return_ranks else metrics


def _checked(score_fns: dict, rerank: dict, reference: str | None, ks: tuple, batch: int) -> list:
    """The names `evaluate` reports (models, then two-stage models), its arguments checked."""
    if not score_fns:
        raise ValueError("no models to evaluate")
    for name, (first, _, k) in rerank.items():
        if first not in score_fns or name in score_fns:
            raise ValueError(
                f"rerank {name!r}: its first stage must be one of {', '.join(score_fns)} and its "
                "name another"
            )
        if k <= 0:
            raise ValueError(f"rerank {name!r}: k must be positive, got {k}")
    names = [*score_fns, *rerank]
    if reference is not None and reference not in names:
        raise ValueError(f"reference {reference!r} is not one of {', '.join(names)}")
    if not ks or min(ks) <= 0:
        raise ValueError(f"ks must be positive cut-offs, got {ks}")
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    return names


def _scores(score_fns: dict, rerank: dict, r: Requests, drop, n_ads: int) -> dict:
    """Every model's and two-stage model's scores [b, A] of a batch of requests, the dropped
    (seen) ads masked: a two-stage model scores its first stage's top k with its ranker and
    puts every other ad below them."""
    b = len(r)
    scores = {name: _masked(fn(r), drop, (b, n_ads), name) for name, fn in score_fns.items()}
    for name, (first, rank_fn, k) in rerank.items():
        cand = topk_rows(scores[first], min(k, n_ads))  # [b, k]
        second = np.full((b, n_ads), -np.inf, dtype=np.float32)
        np.put_along_axis(second, cand, rank_fn(r, cand), axis=1)
        scores[name] = _masked(second, drop, (b, n_ads), name)
    return scores


def format_table(results: dict[str, dict[str, float]]) -> str:
    """Markdown table: one row per model, one column per metric, 4 decimals."""
    metrics = list(dict.fromkeys(key for m in results.values() for key in m))
    lines = [
        "| model | " + " | ".join(metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for name, m in results.items():
        cells = (f"{m[key]:.4f}" if key in m else "" for key in metrics)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
