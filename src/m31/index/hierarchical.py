"""The hierarchical index of the 2024 design: k-means clusters of ads, scored coarse to fine.

Shapes: B requests, N ads, C clusters, P clusters probed, E experts, G gate-key dim, D value dim.

A request first scores every cluster's representative (the centroid of its ads' g, x and b) with
the same §2 scorer, then scores exhaustively only the ads of its P best clusters. With P = C it
scores every ad and equals `score_topk` exactly (the ads are gathered in row order, so ties still
go to the lower row); fewer probes trade recall for speed, which `bench/hierarchical.py` measures.
Exhaustive scoring stays the default everywhere.
"""

from __future__ import annotations

import torch

from m31.ops import NO_ROW, score, score_topk


def kmeans(
    points: torch.Tensor, n_clusters: int, iters: int = 20, seed: int = 0, chunk: int = 65_536
):
    """Lloyd's k-means: points [N, F] -> (centroids [C, F], assignment [N]). Seeded, chunked."""
    n = points.shape[0]
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters must be in [1, {n}], got {n_clusters}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    centroids = points[torch.randperm(n, generator=gen)[:n_clusters].to(points.device)].clone()
    assign = torch.empty(n, dtype=torch.long, device=points.device)
    for _ in range(iters):
        for lo in range(0, n, chunk):
            d = torch.cdist(points[lo : lo + chunk], centroids)  # [chunk, C]
            assign[lo : lo + chunk] = d.argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, points)
        counts = torch.bincount(assign, minlength=n_clusters).to(points.dtype)
        centroids = sums / counts.clamp_min(1)[:, None]
        empty = counts == 0
        if empty.any():  # an empty cluster restarts at a random point, so none is wasted
            restart = torch.randint(0, n, (int(empty.sum()),), generator=gen)
            centroids[empty] = points[restart.to(points.device)]
    return centroids, assign


class HierarchicalIndex:
    def __init__(
        self, g: torch.Tensor, x: torch.Tensor, b: torch.Tensor, n_clusters: int, seed: int = 0
    ):
        """Cluster the ad table (g [N, G], x [N, D], b [N]) on its concatenated vectors."""
        g, x, b = g.float(), x.float(), b.float()
        centroids, assign = kmeans(torch.cat([g, x, b[:, None]], dim=1), n_clusters, seed=seed)
        gdim, ddim = g.shape[1], x.shape[1]
        self.rep = (centroids[:, :gdim], centroids[:, gdim : gdim + ddim], centroids[:, -1])
        order = torch.sort(assign, stable=True).indices  # rows grouped by cluster, ascending within
        counts = torch.bincount(assign, minlength=n_clusters)
        self.offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [C + 1]
        self.rows = order  # [N]
        self.table = (g, x, b)
        self.n_clusters = n_clusters

    def search(
        self,
        query: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        k: int,
        n_probe: int,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(scores [B, K'], rows [B, K'], ads scored) with K' = min(k, N), like `score_topk`."""
        if not 1 <= n_probe <= self.n_clusters:
            raise ValueError(f"n_probe must be in [1, {self.n_clusters}], got {n_probe}")
        q, v, p = query
        n_ads = self.table[0].shape[0]
        k_out = min(k, n_ads)
        coarse = score(q, v, p, *self.rep)  # [B, C]
        probe = coarse.topk(n_probe, dim=1).indices  # [B, P]
        out_s = torch.full((len(p), k_out), float("-inf"), device=p.device)
        out_r = torch.full((len(p), k_out), NO_ROW, dtype=torch.long, device=p.device)
        scored = 0
        for i in range(len(p)):
            clusters = probe[i].tolist()
            rows = torch.cat([self.rows[self.offsets[c] : self.offsets[c + 1]] for c in clusters])
            rows = torch.sort(rows).values  # row order keeps the lower-row tie rule
            scored += len(rows)
            m = None if mask is None else (mask if mask.dim() == 1 else mask[i])[rows]
            s, r = score_topk(
                (q[i : i + 1], v[i : i + 1], p[i : i + 1]), tuple(t[rows] for t in self.table), m, k
            )
            n = s.shape[1]
            out_s[i, :n] = s[0]
            out_r[i, :n] = torch.where(r[0] == NO_ROW, NO_ROW, rows[r[0].clamp_min(0)])
        return out_s, out_r, scored
