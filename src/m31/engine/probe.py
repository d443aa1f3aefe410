"""Retrieval over the probed clusters of a hierarchical index (DESIGN §4, "The hierarchical
index"): a `Retriever` given a `Prober` scores each request's P best clusters exactly instead
of every row.

Shapes: B requests, N rows, C clusters, P clusters probed, E experts, G gate-key dim, D value dim.

Per request: the centroids are scored with the §2 scorer (fp32), the rows of its P best
clusters are gathered in row order, and `m31.engine.search.search` runs on them with the
request's own eligibility (filters, targeting, exclusions, deletions), so its answer is the
exact top-K of the eligible ads of those clusters, ties to the lower ad id; with P = C it is the
exhaustive answer. Rows are grouped by cluster once per version of the ads (`Clusters.assign`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
import torch

from m31.engine.search import search
from m31.index import IndexView
from m31.index.hierarchical import Clusters
from m31.ops import PackedMask, score


class Prober:
    def __init__(self, clusters: Clusters, n_probe: int) -> None:
        if not 1 <= n_probe <= clusters.n_clusters:
            raise ValueError(f"probe: must be in [1, {clusters.n_clusters}], got {n_probe}")
        self.clusters, self.n_probe = clusters, n_probe
        self._lock = threading.Lock()
        self._grouped: tuple | None = None  # (key, offsets [C + 1], rows [N])

    def rows_by_cluster(self, view: IndexView) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [C + 1], rows [N]): the view's rows grouped by cluster, ascending within
        each; cluster c holds rows[offsets[c]:offsets[c + 1]]."""
        key = (id(view._index), view.ads_version, int(view.row_ids.shape[0]))
        with self._lock:
            if self._grouped is not None and self._grouped[0] == key:
                return self._grouped[1:]
        assign = self.clusters.assign(view)
        rows = np.argsort(assign, kind="stable")
        counts = np.bincount(assign, minlength=self.clusters.n_clusters)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        with self._lock:
            self._grouped = (key, offsets, rows)
        return offsets, rows

    def search(
        self,
        query: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        view: IndexView,
        mask: PackedMask | torch.Tensor | None,
        ks: Sequence[int],
        caps: Sequence | None = None,
        valued: Sequence[bool] | None = None,
    ) -> tuple[list, int]:
        """(each request's top `ks[r]` eligible ads of its probed clusters, as `search` gives
        them; rows scored in all). mask: as `search` takes it ([B, N] or packed, or None);
        caps, valued: as `search` takes them (clusters are picked by relevance either way)."""
        q, v, p = query
        device = view.row_ids.device
        rep = tuple(t.to(device) for t in self.clusters.rep)
        coarse = score(q.float(), v.float(), p.float(), *rep)  # [B, C]
        probed = coarse.topk(self.n_probe, dim=1).indices.cpu().numpy()  # [B, P]
        offsets, rows = self.rows_by_cluster(view)
        results, scored = [], 0
        for i, clusters in enumerate(probed.tolist()):
            picked = np.sort(np.concatenate([rows[offsets[c] : offsets[c + 1]] for c in clusters]))
            at = torch.as_tensor(picked, device=device)
            sub = dataclasses.replace(
                view,
                g=view.g[at],
                x=view.x[at],
                b=view.b[at],
                row_ids=view.row_ids[at],
                scales=None if view.scales is None else tuple(s[at] for s in view.scales),
                attributes=view.attributes.rows(at),
                _memo={},
            )
            one = None
            if isinstance(mask, PackedMask):
                one = mask.select(torch.tensor([i], device=mask.device)).unpack()[:, at]
            elif mask is not None:
                one = mask[i : i + 1, at]
            cap = None if caps is None else [caps[i]]
            kind = None if valued is None else [valued[i]]
            results += search(
                (q[i : i + 1], v[i : i + 1], p[i : i + 1]), sub, one, [ks[i]], caps=cap, valued=kind
            )
            scored += len(picked)
        return results, scored
