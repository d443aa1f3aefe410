"""`ClusterService`: what the HTTP routes drive (`m31.serve.service`'s interface), over a
sharded index on Ray, so the routes, batcher, middleware and metrics of one server are reused
as they are.

The ingress holds the model: it checks and prepares requests (`Retriever.prepare`, against a
schema-only index of the shards' schema), encodes each batch's queries once
(`Retriever.encode`) and new ads (ad tower, sentence encoder), then hands the shards the rest
through `Cluster`. Versions are the coordinator's global sequence (`m31.cluster.coordinator`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from m31.cluster.cluster import Cluster
from m31.cluster.coordinator import Unavailable as ClusterUnavailable
from m31.engine import Retriever
from m31.engine.ad_encoder import AdEncoder
from m31.engine.load import load_model
from m31.index import AdIndex
from m31.pipeline import embedding_cache_dir
from m31.serve.config import ServeConfig
from m31.serve.schemas import AdIn, Ranked, check_bounds
from m31.serve.service import Ask, NotFound, Service, Unavailable


def schema_index(info: dict, device: str) -> AdIndex:
    """An empty index with a shard's dims, dtype and attribute schema: what `prepare` compiles
    filters against."""
    base = AdIndex(0, 0, capacity=1).schema
    extra = {k: v for k, v in info["schema"].items() if k not in base}
    return AdIndex(info["dim_g"], info["dim_x"], device, getattr(torch, info["dtype"]), 1, extra)


# The gather stops this long before the call's deadline, so that a missing shard is answered
# as such (503 naming it, or a partial answer) rather than by the deadline's 504.
ANSWER_MARGIN_S = 0.05


class ClusterService(Service):
    def __init__(self, retriever: Retriever, encoder: AdEncoder, cluster: Cluster) -> None:
        self.retriever, self.encoder, self.cluster = retriever, encoder, cluster
        self._ads = self._rows = self._version = 0

    @classmethod
    def load(cls, config: ServeConfig, cluster: Cluster) -> ClusterService:
        """The model of `config` (its `index` is not read: the shards hold the index)."""
        net, feats = load_model(config.model, config.data, config.device)
        info = cluster.info()
        if info[0]["dim_g"] != net.G or info[0]["dim_x"] != net.D:
            raise ValueError(
                f"the shards' vectors are G = {info[0]['dim_g']}, D = {info[0]['dim_x']}; the "
                f"model's are G = {net.G}, D = {net.D}"
            )
        users = pq.read_table(config.data / "users.parquet")
        retriever = Retriever(net, feats, schema_index(info[0], config.device), users)
        encoder = AdEncoder(net, feats, embedding_cache_dir())
        encoder.load_text_encoder()
        service = cls(retriever, encoder, cluster)
        service.stats()
        return service

    # -- state ----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def ads(self) -> int:
        return self._ads

    @property
    def rows(self) -> int:
        return self._rows

    def stats(self) -> tuple[int, int, int]:
        info = self.cluster.info()
        self._ads = sum(i["ads"] for i in info)
        self._rows = sum(i["rows"] for i in info)
        self._seen(self.cluster.read_point()[0])
        return self._ads, self._rows, self._version

    def _seen(self, version: int) -> None:
        self._version = max(self._version, version)

    def reached(self, version: int) -> bool:
        if self._version < version:
            self._seen(self.cluster.read_point()[0])
        return self._version >= version

    def close(self) -> None:
        """Nothing: the actors belong to whoever started the cluster."""

    # -- retrieval ------------------------------------------------------------------------------

    def retrieve_batch(self, chunks: Sequence[Sequence[Ask]]):
        """As `Service.retrieve_batch`, scattered to the shards and merged. The batch waits for
        the shards until just before the latest deadline among its calls; a call that did not allow a
        partial answer fails (`Unavailable`, 503) when a shard is missing then."""
        asks = [a for chunk in chunks for a in chunk]
        prepared = [a.prepared for a in asks]
        t0 = time.perf_counter()
        q, v, p = (t.float().cpu().numpy() for t in self.retriever.encode(prepared))  # [B, E, *]
        t1 = time.perf_counter()
        out = self.cluster.gather(
            (q, v, p),
            [(one.request, dict(one.targeting)) for one in prepared],
            [one.k for one in prepared],
            max(a.deadline for a in asks) - ANSWER_MARGIN_S,
            wait_for_failed=not all(a.allow_partial for a in asks),
        )
        t2 = time.perf_counter()
        self._seen(out.version)
        self._rows = out.rows if not out.missing else self._rows
        timings = {
            "encode": round(1000 * (t1 - t0), 3),
            **out.timings_ms,
            "gather": round(1000 * (t2 - t1), 3),
        }
        answers, at = [], 0
        for chunk in chunks:
            part = out.results[at : at + len(chunk)]
            at += len(chunk)
            if out.missing and not chunk[0].allow_partial:
                answers.append(
                    Unavailable(
                        f"shards {out.missing} did not answer within the deadline (down or "
                        "restarting); pass allow_partial: true for an answer without them",
                        out.missing,
                    )
                )
                continue
            results = [Ranked(ad_ids=r.ad_ids.tolist(), scores=r.scores.tolist()) for r in part]
            answers.append((results, out.version, timings, len(asks), out.missing))
        return answers

    # -- reads and mutations --------------------------------------------------------------------

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except ClusterUnavailable as e:
            raise Unavailable(str(e), e.shards) from e

    def get_ad(self, ad_id: int) -> tuple[dict, int]:
        found = self._call(self.cluster.get, ad_id)
        if found is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return found

    def _mutated(self, version: int) -> int:
        self._seen(version)
        if self.cluster.ads is not None:
            self._ads = self.cluster.ads
        return version

    def upsert(self, ads: list[AdIn]) -> int:
        g, x, b = (np.asarray(t.float().cpu().numpy()) for t in self.encode(ads))
        ids = np.array([a.ad_id for a in ads], dtype=np.int64)
        return self._mutated(self._call(self.cluster.upsert, ids, g, x, b, self.attributes(ads)))

    def update(self, ad_id: int, changes: Mapping[str, Any]) -> int:
        """The range check runs on the owning shard, in its prepare, against the stored ad."""
        if self._call(self.cluster.get, ad_id) is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self._mutated(
            self._call(self.cluster.update_attributes, ad_id, dict(changes), check_bounds)
        )

    def delete(self, ad_id: int) -> int:
        if self._call(self.cluster.get, ad_id) is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self._mutated(self._call(self.cluster.delete, [ad_id]))

    def snapshot(self) -> int:
        return self._mutated(self._call(self.cluster.snapshot))
