"""The inference API: ad vectors for the index, request queries, and full-corpus scoring.

Shapes: B requests, A ads, E experts, G gate-key dim, D value dim, k candidates.
"""

from __future__ import annotations

import numpy as np
import torch

from m31.features import Features
from m31.model.inputs import Catalog, RequestInputs, make_requests
from m31.model.retrieval import RetrievalModel
from m31.ops import score


@torch.no_grad()
def encode_ads(model: RetrievalModel, catalog: Catalog, batch: int = 8192):
    """(g [A, G], x [A, D], b [A]) for every ad of `catalog`, in batches."""
    model.eval()
    parts = [
        model.encode_ads(
            catalog.take(
                torch.arange(lo, min(lo + batch, len(catalog)), device=catalog.ad_id.device)
            )
        )
        for lo in range(0, len(catalog), batch)
    ]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


@torch.no_grad()
def encode_requests(
    model: RetrievalModel, feats: Features, catalog: Catalog, user, ts, surface, hour, platform
):
    """(q [B, E, G], v [B, E, D], p [B, E]) for requests given as user rows, times and context ids."""
    model.eval()
    device = catalog.ad_id.device
    r = make_requests(feats, user, ts, surface, hour, platform, model.cfg.max_len).to(device)
    return model.encode_requests(r, catalog)


class ScoreFunction:
    """A trained model as `m31.eval` uses it.

    Calling it scores requests (anything with user, ts, surface, hour, platform arrays) against
    the full corpus: [n, A]. `rank` scores given candidates only: [n, k]. Retrieval models encode
    the catalogue once. Ads are scored `ad_chunk` at a time; by default the ranking model's 4,096
    (its activations' memory), and a retrieval model's as many as keep the gate's [B, E, chunk]
    intermediates at `GATE_ELEMENTS` on a CPU (in cache: ~3x faster than the whole corpus of
    Beauty or Sports at once, the same scores) and at 2⁸ times that elsewhere (memory only).
    `query_map`, for a retrieval model, rewrites each batch's query (q, v, p) before scoring
    (an ablation).
    """

    GATE_ELEMENTS = 1 << 20

    def __init__(
        self,
        model,
        feats: Features,
        catalog: Catalog,
        ad_chunk: int | None = None,
        query_map=None,
        history: list[dict] | None = None,
    ):
        self.model, self.feats, self.catalog = model.eval(), feats, catalog
        self.history = history  # the checkpoint's training history, per epoch, where known
        if ad_chunk is not None and ad_chunk < 1:
            raise ValueError(f"ad_chunk must be positive, got {ad_chunk}")
        self.ad_chunk = ad_chunk
        if query_map is not None and not isinstance(model, RetrievalModel):
            raise ValueError("query_map changes a retrieval model's query; this is a ranking model")
        self.query_map = query_map  # (q, v, p) -> (q, v, p) before scoring (`m31.eval.ablation`)
        self.device = catalog.ad_id.device
        self._ads = encode_ads(model, catalog) if isinstance(model, RetrievalModel) else None

    def _inputs(self, req) -> RequestInputs:
        return make_requests(
            self.feats,
            req.user,
            req.ts,
            req.surface,
            req.hour,
            req.platform,
            self.model.cfg.max_len,
        ).to(self.device)

    def _query(self, r: RequestInputs):
        """A retrieval model's (q, v, p) of the requests, through `query_map` if given."""
        q, v, p = self.model.encode_requests(r, self.catalog)
        return (q, v, p) if self.query_map is None else self.query_map(q, v, p)

    @torch.no_grad()
    def __call__(self, req) -> np.ndarray:
        r = self._inputs(req)
        n_ads = len(self.catalog)
        out = np.empty((len(r), n_ads), dtype=np.float32)
        if self._ads is not None:
            q, v, p = self._query(r)
            chunk = self.ad_chunk or self._gate_chunk(*q.shape[:2])
            for lo in range(0, n_ads, chunk):
                ads = (t[lo : lo + chunk] for t in self._ads)
                out[:, lo : lo + chunk] = score(q, v, p, *ads).cpu().numpy()
            return out
        chunk = self.ad_chunk or 4096
        for lo in range(0, n_ads, chunk):
            rows = torch.arange(lo, min(lo + chunk, n_ads), device=self.device)
            out[:, lo : lo + len(rows)] = self.model(r, self.catalog, rows).cpu().numpy()
        return out

    def _gate_chunk(self, n_requests: int, n_experts: int) -> int:
        budget = self.GATE_ELEMENTS << (0 if self.device.type == "cpu" else 8)
        return max(256, budget // max(1, n_requests * n_experts))

    @torch.no_grad()
    def rank(self, req, cand_rows: np.ndarray) -> np.ndarray:
        """Scores [n, k] of candidate ad rows [n, k]: what a ranking stage does. A retrieval
        model scores each request against its own candidates' encoded rows (the §2 score, as
        the full corpus gets it, up to fp32 rounding)."""
        rows = torch.from_numpy(np.ascontiguousarray(cand_rows, dtype=np.int64)).to(self.device)
        if self._ads is not None:
            g, x, b = (t[rows] for t in self._ads)  # [n, k, G], [n, k, D], [n, k]
            return score(*self._query(self._inputs(req)), g, x, b).cpu().numpy()
        return self.model(self._inputs(req), self.catalog, rows).cpu().numpy()
