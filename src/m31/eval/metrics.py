"""Retrieval metrics over full-corpus scores.

Shapes: n requests, A ads, k results per request, m relevant ads per request.

One ranking rule everywhere (DESIGN §2): higher score first, ties broken by the lower ad row, so
metrics are deterministic and agree with the serving top-K. NaN scores have no place in that order
and are rejected. Every metric returns its mean over the requests.
"""

from __future__ import annotations

import numpy as np
import torch


def _scores(scores: np.ndarray) -> np.ndarray:
    s = np.asarray(scores)
    if s.ndim != 2:
        raise ValueError(f"scores must be [n, A], got shape {s.shape}")
    if s.dtype.kind == "f" and np.isnan(s).any():
        raise ValueError("scores contain NaN: their rank is undefined")
    return s


def _check_k(k: int) -> None:
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")


def _mean(x: np.ndarray) -> float:
    if len(x) == 0:
        raise ValueError("no requests")
    return float(np.mean(x))


def topk_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Rows of the k best ads of each request, best first: [n, A] -> [n, min(k, A)] int64.

    Exact with ties broken by the lower row. torch.topk finds the k-th best value v but may pick
    any of the ads equal to v; in the rare rows where more ads equal v than places are left, the
    winners are chosen again by value: every ad above v, then the lowest rows equal to v. A stable
    sort of the winners, taken in row order, then keeps equal scores in row order.
    """
    _check_k(k)
    s = _scores(scores)
    n, n_ads = s.shape
    k = min(k, n_ads)
    if n == 0 or k == 0:
        return np.zeros((n, k), dtype=np.int64)
    t = torch.as_tensor(s)
    top = torch.topk(t, k, dim=1, sorted=False)
    v = top.values.min(1, keepdim=True).values  # [n, 1] k-th best value
    rows = top.indices  # [n, k]
    # numpy counts a boolean mask several times faster than torch on CPU.
    crowded = torch.from_numpy(np.count_nonzero(s >= v.numpy(), axis=1) > k)  # [n]
    if crowded.any():
        sc, vc = t[crowded], v[crowded]  # [c, A], [c, 1]
        above, tie = sc > vc, sc == vc  # [c, A]
        room = k - above.sum(1, keepdim=True)  # [c, 1] places left for ads equal to v
        keep = above | (tie & (tie.cumsum(1, dtype=torch.int32) <= room))  # [c, A], k per row
        rows[crowded] = keep.nonzero()[:, 1].view(-1, k)
    rows = rows.sort(1).values  # [n, k]
    order = torch.sort(t.gather(1, rows), dim=1, descending=True, stable=True).indices
    return rows.gather(1, order).numpy()  # [n, k]


def target_rank(scores: np.ndarray, target: np.ndarray) -> np.ndarray:
    """0-based rank of each request's target ad among all ads, under the tie rule: [n] int64."""
    s = _scores(scores)
    t = np.asarray(target, dtype=np.int64)
    n, n_ads = s.shape
    if t.shape != (n,):
        raise ValueError(f"target must be [{n}], got shape {t.shape}")
    if n and (t.min() < 0 or t.max() >= n_ads):
        raise ValueError(f"target rows must lie in [0, {n_ads})")
    st = s[np.arange(n), t][:, None]  # [n, 1]
    tied_lower = (s == st) & (np.arange(n_ads)[None, :] < t[:, None])  # [n, A]
    return np.count_nonzero(s > st, axis=1) + np.count_nonzero(tied_lower, axis=1)


def hit_rate_at_k(ranks: np.ndarray, k: int) -> float:
    """Share of requests whose target ranks in the top k: ranks [n] from `target_rank`."""
    _check_k(k)
    return _mean(np.asarray(ranks) < k)


def ndcg_at_k(ranks: np.ndarray, k: int) -> float:
    """NDCG@k with one relevant ad per request: 1 / log2(rank + 2) if rank < k, else 0."""
    _check_k(k)
    r = np.asarray(ranks, dtype=np.float64)
    return _mean(np.where(r < k, 1.0 / np.log2(r + 2.0), 0.0))


def _matches(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a[i] ∩ b[i]| per row: [n, k], [n, m] of distinct non-negative rows -> [n]."""
    if len(a) != len(b):
        raise ValueError(f"lists for {len(a)} and {len(b)} requests")
    if (a.size and a.min() < 0) or (b.size and b.min() < 0):
        raise ValueError("ad rows must be non-negative")
    width = max(a.max(initial=-1), b.max(initial=-1)) + 1
    # One flat membership test: each request's rows live in their own band of width `width`.
    off = np.arange(len(a), dtype=np.int64)[:, None] * width  # [n, 1]
    return np.isin(a + off, b + off).sum(1)


def recall_at_k(retrieved: np.ndarray, relevant: np.ndarray, k: int) -> float:
    """|top k of retrieved ∩ relevant| / |relevant|: retrieved [n, >=k] ranked, relevant [n, m]."""
    return _mean(recall_rows(retrieved, relevant, k))


def recall_rows(retrieved: np.ndarray, relevant: np.ndarray, k: int) -> np.ndarray:
    """`recall_at_k` of each request: [n]."""
    _check_k(k)
    retrieved, relevant = np.asarray(retrieved), np.asarray(relevant)
    if retrieved.ndim != 2 or relevant.ndim != 2 or relevant.shape[1] == 0:
        raise ValueError(
            f"need retrieved [n, k] and non-empty relevant [n, m], got shapes "
            f"{retrieved.shape} and {relevant.shape}"
        )
    return _matches(retrieved[:, :k], relevant) / relevant.shape[1]


def overlap_at_k(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Share of the top k of a that is also in the top k of b: two ranked [n, >=k] lists."""
    _check_k(k)
    a, b = np.asarray(a)[:, :k], np.asarray(b)[:, :k]
    if a.shape != b.shape or a.shape[1] == 0:
        raise ValueError(f"top-{k} lists differ in shape or are empty: {a.shape} vs {b.shape}")
    return _mean(_matches(a, b) / a.shape[1])
