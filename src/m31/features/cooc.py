"""Item co-engagement embeddings: a truncated SVD of the positive PMI of co-engaged items.

Shapes: A items, M engagements, P co-engaged pairs, d embedding dim.

Two items co-occur when one user engaged with both within `window` consecutive engagements.
Only the training engagements go in, so nothing of a held-out event leaks into the features.
"""

from __future__ import annotations

import numpy as np
import torch


def cooccurrence_pairs(
    user: np.ndarray, item: np.ndarray, ts: np.ndarray, window: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric co-occurrence counts as COO (rows [P], cols [P], counts [P])."""
    order = np.lexsort((ts, user))
    user, item = user[order], item[order]
    rows, cols = [], []
    for shift in range(1, window + 1):
        same = user[shift:] == user[:-shift]
        a, b = item[:-shift][same], item[shift:][same]
        distinct = a != b
        rows += [a[distinct], b[distinct]]
        cols += [b[distinct], a[distinct]]
    if not rows or not sum(len(r) for r in rows):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.float64)
    r, c = np.concatenate(rows).astype(np.int64), np.concatenate(cols).astype(np.int64)
    width = int(max(r.max(), c.max())) + 1
    key, counts = np.unique(r * width + c, return_counts=True)
    return key // width, key % width, counts.astype(np.float64)


def cooc_embeddings(
    user: np.ndarray,
    item: np.ndarray,
    ts: np.ndarray,
    n_items: int,
    dim: int = 32,
    window: int = 5,
    seed: int = 0,
) -> np.ndarray:
    """[A, dim] float32 item embeddings; rows of items never co-engaged are zero."""
    rows, cols, counts = cooccurrence_pairs(
        np.asarray(user), np.asarray(item), np.asarray(ts), window
    )
    out = np.zeros((n_items, dim), dtype=np.float32)
    if len(rows) == 0:
        return out
    marginal = np.bincount(rows, weights=counts, minlength=n_items)  # [A]
    total = counts.sum()
    pmi = np.log(counts * total / (marginal[rows] * marginal[cols]))
    keep = pmi > 0
    if not keep.any():
        return out
    matrix = torch.sparse_coo_tensor(
        np.stack([rows[keep], cols[keep]]),
        pmi[keep].astype(np.float32),
        (n_items, n_items),
        check_invariants=True,
    ).coalesce()
    rank = min(dim, n_items)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # svd_lowrank draws a random sketch
    try:
        u, s, _ = torch.svd_lowrank(matrix, q=rank, niter=4)
    finally:
        torch.random.set_rng_state(gen_state)
    out[:, :rank] = (u * s.sqrt()).numpy()
    return out
