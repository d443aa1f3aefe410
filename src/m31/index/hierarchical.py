"""The hierarchical index of the 2024 design: k-means clusters of ads, scored coarse to fine
(DESIGN §4, "The hierarchical index").

Shapes: B requests, N rows, C clusters, P clusters probed, G gate-key dim, D value dim.

`Clusters` is k-means over an ad table's concatenated (g, x, b), kept by ad id, so it outlives
the rows it was built on: `m31 index build --clusters C` writes it into the snapshot's online
features (`clusters.npz`), and a server asked to probe (`m31 serve --probe P`) reads it. A
request scores every cluster's centroid with the §2 scorer and then scores exactly, with its own
eligibility, the rows of its P best clusters (`m31.engine.probe`). Rows of an ad the clusters do
not know (upserted after the build) go to the cluster of the nearest centroid; an ad updated
since keeps its cluster, deleted ones are not eligible. With P = C every row is scored, and the
answer is the exhaustive one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FILE = "clusters.npz"  # in a snapshot's online/ folder


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
        assign = nearest(points, centroids, chunk)
        sums = torch.zeros_like(centroids).index_add_(0, assign, points)
        counts = torch.bincount(assign, minlength=n_clusters).to(points.dtype)
        centroids = sums / counts.clamp_min(1)[:, None]
        empty = counts == 0
        if empty.any():  # an empty cluster restarts at a random point, so none is wasted
            restart = torch.randint(0, n, (int(empty.sum()),), generator=gen)
            centroids[empty] = points[restart.to(points.device)]
    return centroids, nearest(points, centroids, chunk)


def nearest(points: torch.Tensor, centroids: torch.Tensor, chunk: int = 65_536) -> torch.Tensor:
    """[N] the nearest centroid (Euclidean) of each point [N, F], in chunks of rows."""
    out = torch.empty(points.shape[0], dtype=torch.long, device=points.device)
    for lo in range(0, points.shape[0], chunk):
        out[lo : lo + chunk] = torch.cdist(points[lo : lo + chunk], centroids).argmin(1)
    return out


def table_points(g: torch.Tensor, x: torch.Tensor, b: torch.Tensor, scales=None) -> torch.Tensor:
    """[N, G + D + 1] float32: the rows' (g, x, b) as k-means reads them (an 8-bit table's
    codes times their row scales)."""
    if scales is not None:
        g, x = g.float() * scales[0][:, None], x.float() * scales[1][:, None]
    return torch.cat([g.float(), x.float(), b.float()[:, None]], dim=1)


@dataclass(frozen=True)
class Clusters:
    centroids: torch.Tensor  # [C, G + D + 1] float32: each cluster's mean (g, x, b)
    ids: np.ndarray  # [M] int64 ad ids, ascending
    cluster: np.ndarray  # [M] int64 the cluster of each
    dim_g: int

    @property
    def n_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def rep(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [C, G], x [C, D], b [C]): the centroids as an ad table, for the coarse score."""
        c, g = self.centroids, self.dim_g
        return c[:, :g], c[:, g:-1], c[:, -1]

    @classmethod
    def build(cls, view, n_clusters: int, seed: int = 0, iters: int = 20) -> Clusters:
        """k-means of the rows of an index view (`IndexView`: a fresh index's, every ad once)."""
        points = table_points(view.g, view.x, view.b, view.scales).cpu()
        centroids, assign = kmeans(points, n_clusters, iters, seed)
        ids = view.row_ids.cpu().numpy()
        order = np.argsort(ids, kind="stable")
        return cls(centroids, ids[order], assign.numpy()[order], int(view.g.shape[1]))

    def assign(self, view) -> np.ndarray:
        """[N] the cluster of each row of `view`: its ad's, or, for an ad the clusters do not
        know, that of the nearest centroid."""
        ids = view.row_ids.cpu().numpy()
        pos = np.minimum(np.searchsorted(self.ids, ids), max(len(self.ids) - 1, 0))
        known = (self.ids[pos] == ids) if len(self.ids) else np.zeros(len(ids), bool)
        out = np.where(known, self.cluster[pos] if len(self.ids) else 0, -1)
        unknown = np.flatnonzero(~known)
        if len(unknown):
            at = torch.as_tensor(unknown, device=view.g.device)
            scales = None if view.scales is None else tuple(s[at] for s in view.scales)
            points = table_points(view.g[at], view.x[at], view.b[at], scales).cpu()
            out[unknown] = nearest(points, self.centroids).numpy()
        return out

    def save(self, folder: Path) -> None:
        np.savez(
            Path(folder) / FILE,
            centroids=self.centroids.numpy(),
            ids=self.ids,
            cluster=self.cluster,
            dim_g=np.int64(self.dim_g),
        )

    @classmethod
    def load(cls, folder: Path) -> Clusters | None:
        """The clusters saved in `folder`, None if it holds none."""
        path = Path(folder) / FILE
        if not path.is_file():
            return None
        with np.load(path) as z:
            return cls(torch.from_numpy(z["centroids"]), z["ids"], z["cluster"], int(z["dim_g"]))
