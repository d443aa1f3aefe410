"""Classic baselines, scored through the same `evaluate` path as the models (DESIGN §8).

Shapes: n requests, U users, A ads, M history events of a batch, L longest history in a batch,
f ALS factors, Z non-zeros of the train user x ad matrix.

Each baseline is a score function like `m31.model.ScoreFunction`: called on requests (anything
with user and ts arrays) it returns [n, A] scores, higher better. What each one may know:

* anything learnt (counts, item-item similarities, ALS item factors) comes from the train split;
* per request, the user's own engagements strictly before the request time, all of them (the
  models' history features see the same events, the last max_len of them);
* recent popularity: every user's engagements in the window strictly before the request time,
  what a live system knows at that moment. Under leave-last-out these include other users'
  held-out engagements that happened earlier: that can only make the baseline stronger.

Where a history-based score ties (no history, or ads no history item co-occurs with), train
popularity decides: a back-off far below any difference of the score itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch

from m31.features import Features

DAY_S = 86_400
RECENT_WINDOW_S = 7 * DAY_S
# Recency-weighted kNN: a history event's weight halves every this many later events. Set once
# from the literature's usual range (5-20), not tuned on any test split.
RECENCY_HALF_LIFE = 10.0
BASELINES = ("popularity", "recent-popularity", "item-knn", "recency-knn", "als")


def _popularity(feats: Features) -> np.ndarray:
    """Train engagements per ad: [A] float64."""
    return np.bincount(feats.splits["train"]["item"], minlength=feats.n_ads).astype(np.float64)


def _backoff(feats: Features) -> np.ndarray:
    """Train popularity scaled into [0, 1e-6): a tiebreak that never outweighs a real score."""
    pop = _popularity(feats)
    return pop / (pop.max(initial=0.0) + 1.0) * 1e-6


def _history(feats: Features, user: np.ndarray, ts: np.ndarray):
    """Each request's engagements strictly before its time: (request [M], ad [M], age [M]),
    age 0 for the most recent, 1 for the one before it, ..."""
    seq = feats.engagements
    user, ts = np.asarray(user, dtype=np.int64), np.asarray(ts, dtype=np.int64)
    n_before = seq.count_before(user, ts)  # [n]
    ends = np.cumsum(n_before)  # [n] exclusive end of each request's events in the output
    req = np.repeat(np.arange(len(user)), n_before)  # [M]
    pos = np.repeat(seq.offsets[user] - (ends - n_before), n_before) + np.arange(len(req))
    age = np.repeat(ends, n_before) - 1 - np.arange(len(req))  # [M]
    return req, seq.values["item"][pos].astype(np.int64), age


@contextmanager
def _sparse_quietly():
    """torch warns on every use that its sparse kernels are in beta; the results are checked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse", category=UserWarning)
        yield


class Popularity:
    """Train engagements per ad, the same list for every request."""

    def __init__(self, feats: Features):
        self.scores = _popularity(feats)  # [A]

    def __call__(self, req) -> np.ndarray:
        return np.broadcast_to(self.scores, (len(req.user), len(self.scores))).copy()


class RecentPopularity:
    """Engagements per ad in the `window_s` seconds strictly before each request's time."""

    def __init__(self, feats: Features, window_s: int = RECENT_WINDOW_S):
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        seq = feats.engagements
        order = np.argsort(seq.ts, kind="stable")
        self.ts, self.item = seq.ts[order], seq.values["item"][order].astype(np.int64)  # [M]
        self.window_s, self.n_ads, self.backoff = window_s, feats.n_ads, _backoff(feats)

    def __call__(self, req) -> np.ndarray:
        ts = np.asarray(req.ts, dtype=np.int64)
        lo = np.searchsorted(self.ts, ts - self.window_s, side="left")  # [n]
        hi = np.searchsorted(self.ts, ts, side="left")  # [n] strictly before
        count = hi - lo
        req_idx = np.repeat(np.arange(len(ts)), count)
        pos = np.repeat(lo - (np.cumsum(count) - count), count) + np.arange(len(req_idx))
        flat = np.bincount(req_idx * self.n_ads + self.item[pos], minlength=len(ts) * self.n_ads)
        return flat.reshape(len(ts), self.n_ads) + self.backoff  # [n, A]


class ItemKNN:
    """Cosine similarity of ads over the binary train user x ad matrix; a request scores each ad
    by its summed similarity to the user's history, each event weighted 0.5 ** (age / half_life)
    with `half_life`, or 1 without."""

    def __init__(self, feats: Features, half_life: float | None = None):
        if half_life is not None and half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        n_ads, tr = feats.n_ads, feats.splits["train"]
        pairs = np.unique(tr["user"].astype(np.int64) * n_ads + tr["item"])
        user, item = torch.from_numpy(pairs // n_ads), torch.from_numpy(pairs % n_ads)
        with _sparse_quietly():
            r = torch.sparse_coo_tensor(
                torch.stack([user, item]), torch.ones(len(pairs)), (feats.n_users, n_ads)
            ).coalesce()  # [U, A]
            co = torch.sparse.mm(r.t().coalesce(), r).coalesce()  # [A, A] co-engaged users
            i, j = co.indices()
            norm = torch.bincount(item, minlength=n_ads).double().sqrt()  # [A]
            off_diag = i != j
            sim = co.values().double()[off_diag] / (norm[i[off_diag]] * norm[j[off_diag]])
            sim = torch.sparse_coo_tensor(co.indices()[:, off_diag], sim, (n_ads, n_ads))
            self.sim = sim.coalesce().to_sparse_csr()  # [A, A]
        self.feats, self.half_life, self.backoff = feats, half_life, _backoff(feats)

    def __call__(self, req) -> np.ndarray:
        n, n_ads = len(req.user), self.feats.n_ads
        idx, ads, age = _history(self.feats, req.user, req.ts)
        w = np.ones(len(idx)) if self.half_life is None else 0.5 ** (age / self.half_life)
        with _sparse_quietly():
            h = torch.sparse_coo_tensor(
                torch.from_numpy(np.stack([idx, ads])), torch.from_numpy(w), (n, n_ads)
            ).coalesce()  # [n, A] weighted history
            scores = torch.sparse.mm(h.to_sparse_csr(), self.sim).to_dense().numpy()  # [n, A]
        top = scores.max(axis=1, keepdims=True) if n_ads else np.zeros((n, 1))
        # The back-off is relative, so it stays below every request's own score differences.
        return scores + self.backoff * np.maximum(top, 1.0)


class ALS:
    """Implicit-feedback ALS (Hu, Koren and Volinsky 2008) on the binary train user x ad matrix
    with confidence 1 + alpha on engaged pairs: `iterations` alternating updates, each solved by
    `cg_steps` steps of conjugate gradient warm-started from the last factors (as the `implicit`
    library does). A request's user vector is solved exactly from the user's history before
    the request ("fold-in"), so a model trained on the train split scores later requests with
    everything the user did before them, as the neural models do."""

    def __init__(
        self,
        feats: Features,
        factors: int = 64,
        reg: float = 1.0,
        alpha: float = 10.0,
        iterations: int = 15,
        cg_steps: int = 3,
        seed: int = 0,
    ):
        if factors <= 0 or iterations < 0 or cg_steps <= 0 or reg <= 0 or alpha < 0:
            raise ValueError("ALS needs factors, cg_steps, reg > 0 and iterations, alpha >= 0")
        n_ads, tr = feats.n_ads, feats.splits["train"]
        pairs = np.unique(tr["user"].astype(np.int64) * n_ads + tr["item"])
        user, item = torch.from_numpy(pairs // n_ads), torch.from_numpy(pairs % n_ads)  # [Z]
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(feats.n_users, factors, generator=g, dtype=torch.float64) * 0.01
        y = torch.randn(n_ads, factors, generator=g, dtype=torch.float64) * 0.01
        for _ in range(iterations):
            x = _cg_solve(x, y, user, item, alpha, reg, cg_steps)  # [U, f]
            y = _cg_solve(y, x, item, user, alpha, reg, cg_steps)  # [A, f]
        self.feats, self.y, self.alpha, self.reg = feats, y, alpha, reg

    def user_vectors(self, user: np.ndarray, ts: np.ndarray) -> torch.Tensor:
        """[n, f]: each user's vector from their engagements strictly before ts."""
        idx, ads, _ = _history(self.feats, user, ts)
        n, f = len(user), self.y.shape[1]
        lengths = np.bincount(idx, minlength=n)
        width = int(lengths.max(initial=0))
        slot = np.arange(len(idx)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        hist = torch.zeros(n, max(width, 1), f, dtype=torch.float64)  # [n, L, f] zero-padded
        hist[torch.from_numpy(idx), torch.from_numpy(slot)] = self.y[torch.from_numpy(ads)]
        gram = self.y.T @ self.y + self.reg * torch.eye(f, dtype=torch.float64)  # [f, f]
        a = gram + self.alpha * hist.transpose(1, 2) @ hist  # [n, f, f]
        b = (1.0 + self.alpha) * hist.sum(1)  # [n, f]
        return torch.linalg.solve(a, b)

    def __call__(self, req) -> np.ndarray:
        return (self.user_vectors(req.user, req.ts) @ self.y.T).numpy()  # [n, A]


def _cg_solve(x, y, rows, cols, alpha: float, reg: float, steps: int) -> torch.Tensor:
    """Rows of x [R, f] solving (YᵀY + alpha Σ_{c∈row} y_c y_cᵀ + reg I) x_r = (1 + alpha)
    Σ_{c∈row} y_c for y [C, f] and the (rows, cols) [Z] non-zeros: `steps` CG steps from x."""
    gram = y.T @ y + reg * torch.eye(y.shape[1], dtype=y.dtype)  # [f, f]
    yc = y[cols]  # [Z, f]

    def apply(p):  # [R, f] -> [R, f]
        out = p @ gram
        return out.index_add_(0, rows, alpha * (p[rows] * yc).sum(1, keepdim=True) * yc)

    b = torch.zeros_like(x).index_add_(0, rows, (1.0 + alpha) * yc)  # [R, f]
    r = b - apply(x)
    p, rs = r.clone(), (r * r).sum(1)  # [R, f], [R]
    for _ in range(steps):
        ap = apply(p)
        step = rs / (p * ap).sum(1).clamp_min(1e-30)
        x = x + step[:, None] * p
        r = r - step[:, None] * ap
        rs_next = (r * r).sum(1)
        p = r + (rs_next / rs.clamp_min(1e-30))[:, None] * p
        rs = rs_next
    return x


def make_baselines(names, feats: Features) -> dict[str, Callable]:
    """Score functions by name (any of `BASELINES`), fitted on `feats`' train split."""
    makers = {
        "popularity": lambda: Popularity(feats),
        "recent-popularity": lambda: RecentPopularity(feats),
        "item-knn": lambda: ItemKNN(feats),
        "recency-knn": lambda: ItemKNN(feats, half_life=RECENCY_HALF_LIFE),
        "als": lambda: ALS(feats),
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(
            f"unknown baseline {unknown[0]!r}, expected some of {', '.join(BASELINES)}"
        )
    return {name: makers[name]() for name in names}
