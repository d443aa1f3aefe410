"""The retrieval engine: a trained retrieval model and an `AdIndex` -> ranked ads per request.

Shapes: B requests, N rows of the ad table, E experts, G gate-key dim, D value dim, K results.

One call of `Retriever.retrieve` encodes the batch's requests once (user experts, context
folded in), evaluates each request's eligibility into a bitmask over the index's rows, and runs
the exhaustive score·filter·top-K pass (`m31.ops.score_topk`). Table and masks come from one
`snapshot_view` of the index, so a batch is answered at one consistent version.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from m31.data.schema import GENDERS, PLATFORMS, SURFACES
from m31.features import Features
from m31.index import AdIndex, RequestContext, compile_filter
from m31.model import Catalog, RetrievalModel, make_requests
from m31.ops import NO_ROW, score_topk


class RequestError(ValueError):
    """A request the engine cannot answer; the message names the field."""


@dataclass(frozen=True)
class AdRequest:
    user_id: int
    ts: int  # Unix seconds: history is read strictly before it, schedules are checked at it
    surface: str
    platform: str
    hour: int | None = None  # of day; default: from ts (UTC)
    exclude_ads: Sequence[int] = ()
    exclude_advertisers: Sequence[int] = ()
    filter: Mapping | None = None  # JSON filter tree over ad attributes (m31.index.filters)


@dataclass
class Retrieved:
    ad_ids: np.ndarray  # [k'] int64, best first (k' <= k: fewer when fewer are eligible)
    scores: np.ndarray  # [k'] float32


@dataclass
class RetrievalResult:
    results: list[Retrieved]
    version: int  # index version every request of the batch saw
    timings_ms: dict[str, float] = field(default_factory=dict)  # encode, mask, score_topk


class Retriever:
    def __init__(self, model: RetrievalModel, feats: Features, index: AdIndex, users) -> None:
        """`users`: the dataset's users table (pyarrow), for targeting (country, age, gender)."""
        if not isinstance(model, RetrievalModel):
            raise TypeError(
                "the engine serves retrieval models (moe, two-tower), not ranking models"
            )
        self.model = model.eval()
        self.feats = feats
        self.index = index
        self.device = index.device
        self.catalog = Catalog.from_features(feats).to(self.device)
        self.model.to(self.device)
        ids = feats.users["user_id"]
        self._user_order = np.argsort(ids, kind="stable")
        self._user_sorted = ids[self._user_order]
        by_id = {
            r["user_id"]: r
            for r in users.select(["user_id", "country", "age", "gender"]).to_pylist()
        }
        self._targeting = [by_id.get(int(i)) for i in ids]  # [U] per feature row

    def _user_rows(self, requests: Sequence[AdRequest]) -> np.ndarray:
        ids = np.array([r.user_id for r in requests], dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._user_sorted, ids), len(self._user_sorted) - 1)
        bad = self._user_sorted[pos] != ids
        if bad.any():
            raise RequestError(f"user_id: unknown user {int(ids[bad][0])}")
        return self._user_order[pos]

    @torch.no_grad()
    def retrieve(self, requests: Sequence[AdRequest], k: int) -> RetrievalResult:
        if k <= 0:
            raise RequestError(f"k must be positive, got {k}")
        if not requests:
            return RetrievalResult([], self.index.version)
        for i, r in enumerate(requests):
            if r.surface not in SURFACES:
                raise RequestError(
                    f"requests[{i}].surface: {r.surface!r} is not one of {', '.join(SURFACES)}"
                )
            if r.platform not in PLATFORMS:
                raise RequestError(
                    f"requests[{i}].platform: {r.platform!r} is not one of {', '.join(PLATFORMS)}"
                )
            if r.hour is not None and not 0 <= r.hour < 24:
                raise RequestError(f"requests[{i}].hour: {r.hour} is not an hour of day")
        filters = [
            compile_filter(r.filter, self.index.schema) if r.filter else None for r in requests
        ]

        t0 = time.perf_counter()
        rows = self._user_rows(requests)
        ts = np.array([r.ts for r in requests], dtype=np.int64)
        hour = np.array(
            [r.hour if r.hour is not None else (r.ts % 86_400) // 3600 for r in requests]
        )
        surface = np.array([SURFACES.index(r.surface) for r in requests])
        platform = np.array([PLATFORMS.index(r.platform) for r in requests])
        inputs = make_requests(
            self.feats, rows, ts, surface, hour, platform, self.model.cfg.max_len
        )
        q, v, p = self.model.encode_requests(inputs.to(self.device), self.catalog)  # [B, E, *]
        t1 = time.perf_counter()

        with self.index.snapshot_view() as view:
            masks = []
            for r, row, f in zip(requests, rows, filters, strict=True):
                who = self._targeting[row] or {}
                gender = who.get("gender")
                ctx = RequestContext(
                    country=who.get("country"),
                    age=who.get("age"),
                    gender=gender if gender in GENDERS else None,
                    platform=r.platform,
                    surface=r.surface,
                    ts=r.ts,
                    exclude_ads=r.exclude_ads,
                    exclude_advertisers=r.exclude_advertisers,
                )
                masks.append(view.eligible_mask(ctx, f))
            mask = torch.stack(masks) if masks else None  # [B, N]
            t2 = time.perf_counter()
            scores, top = score_topk((q, v, p), (view.g, view.x, view.b), mask, k)  # [B, K']
            ids = torch.where(top == NO_ROW, NO_ROW, view.row_ids[top.clamp_min(0)])
            version = view.version
        t3 = time.perf_counter()

        scores, ids = scores.cpu().numpy(), ids.cpu().numpy()
        results = [
            Retrieved(ad_ids=i[i != NO_ROW], scores=s[i != NO_ROW])
            for s, i in zip(scores, ids, strict=True)
        ]
        timings = {"encode": t1 - t0, "mask": t2 - t1, "score_topk": t3 - t2}
        return RetrievalResult(
            results, version, {k_: round(1000 * v_, 3) for k_, v_ in timings.items()}
        )
