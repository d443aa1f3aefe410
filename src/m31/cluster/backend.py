"""`ClusterBackend`: the `Backend` the HTTP routes drive (`m31.serve.backend`), over a sharded
index on Ray, so the routes, batcher, middleware and metrics of one server are reused as they
are (DESIGN §7, "The cluster on Ray").

The ingress holds the model: it checks and prepares requests (`Retriever.prepare`, against a
schema-only index of the shards' schema), encodes each batch's queries once
(`Retriever.encode`) and new ads (ad tower, sentence encoder), then hands the shards the rest
through `Cluster`; `m31.cluster.batches` answers each call of a batch as its shards answer.
Versions are the coordinator's global sequence (`m31.cluster.coordinator`).

Outages answer 503 naming what is down, never 500: every error this backend raises for an
outage is an `Unavailable`. /health/ready is 503 while a shard or the coordinator is down or
recovering, and names them.

Users: the shards own them (`m31.cluster.shard`); events and attribute writes are mutations
routed to their owners through the coordinator, under one idempotency key per call. A replica
holds no user: preparing a call reads its stored users from their owners, one call per owner
in parallel (`Cluster.stored_users`), each as of its request's time; the calls that arrive
while one such read runs share the next (`m31.cluster.coalesce`). A commit is applied on its
owners before its call is acknowledged, so every read sees every acknowledged write, and
`min_version` needs only the shards' version (`reached`). The replica's features are loaded
without their per-user parts (`Features.load(users=False)`), so its memory does not grow with
the users.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from m31.cluster.batches import Batches
from m31.cluster.cluster import Cluster
from m31.cluster.coalesce import Coalesced
from m31.cluster.read import Gathered
from m31.engine import Retriever
from m31.engine.ad_encoder import AdEncoder
from m31.engine.load import model_and_features
from m31.engine.search import fold
from m31.engine.user_inputs import user_vocab
from m31.features.embedding_cache import embedding_cache_dir
from m31.index import AdIndex
from m31.index.errors import NotFound, Unavailable
from m31.ops.threads import single_threaded
from m31.serve.backend import Ask
from m31.serve.batcher import DynamicBatcher
from m31.serve.bodies import ad_attributes, encode_ads, event_columns, user_codes
from m31.serve.config import ServeConfig
from m31.serve.schemas import AdIn, EventIn, UserAttributesIn, check_bounds
from m31.users import UserStore

log = logging.getLogger("m31.cluster")

# How long readiness and metrics wait for the shards before naming those that did not answer.
STATUS_TIMEOUT_S = 2.0
# Mutations a replica sends at once: the coordinator commits the events and users calls that
# arrive while one commits as one transaction (`m31.cluster.group`), so more in flight, more
# grouped.
WRITERS = 32
# How long a replica starting waits for a first shard to answer (it needs one's schema).
LOAD_WAIT_S = 300.0


def schema_index(info: dict, device: str) -> AdIndex:
    """An empty index with a shard's dims, dtype and attribute schema: what `prepare` compiles
    filters against."""
    base = AdIndex(0, 0, capacity=1).schema
    extra = {k: v for k, v in info["schema"].items() if k not in base}
    return AdIndex(info["dim_g"], info["dim_x"], device, getattr(torch, info["dtype"]), 1, extra)


def check_model(info: dict, net) -> None:
    """The shards' vectors and user histories are what the model reads."""
    if info["dim_g"] != net.G or info["dim_x"] != net.D:
        raise ValueError(
            f"the shards' vectors are G = {info['dim_g']}, D = {info['dim_x']}; the "
            f"model's are G = {net.G}, D = {net.D}"
        )
    if info["users_length"] not in (None, net.cfg.max_len):
        raise ValueError(
            f"the shards keep {info['users_length']} engagements per user; the model reads "
            f"{net.cfg.max_len}"
        )


class ClusterBackend:
    writers = WRITERS

    def __init__(
        self, retriever: Retriever, encoder: AdEncoder, cluster: Cluster, timeout_s: float = 1.0
    ) -> None:
        """`timeout_s`: how long a read of one ad waits for its shard (the server's deadline)."""
        self.retriever, self.encoder, self.cluster = retriever, encoder, cluster
        self.timeout_s = timeout_s
        self._ads = self._rows = self._version = self._users = 0
        self._shards: dict[int, tuple[int, int, int]] = {}  # shard -> (ads, rows, users), known
        self.batches = Batches(cluster, self._gathered)
        # Whether `retrieve_batch` may answer a chunk with a Future (the batcher settles it).
        self.defer = DynamicBatcher.deferred_results

    @classmethod
    def load(cls, config: ServeConfig, cluster: Cluster) -> ClusterBackend:
        """The model of `config` with the online features of its cluster state (`index`; the
        shards hold the ads and the users), without their per-user parts. Shards that are down
        are waited for, up to `LOAD_WAIT_S`, only until one answers."""
        net, feats = model_and_features(config.model, config.index, config.device, users=False)
        info = cluster.any_info(LOAD_WAIT_S)
        check_model(info, net)
        # The index here holds no ads, the store no users (it checks events): frequency caps
        # per group ask the shards for the groups, and users are read on their owners.
        index = schema_index(info, config.device)
        timeout_s = config.timeout_ms / 1000
        retriever = Retriever(
            net,
            feats,
            index,
            UserStore(net.cfg.max_len, user_vocab(feats.meta["vocab"])),
            groups=functools.partial(cluster.groups, timeout_s=timeout_s),
            source=Coalesced(functools.partial(cluster.stored_users, timeout_s=timeout_s)),
        )
        encoder = AdEncoder(net, feats, embedding_cache_dir())
        encoder.load_text_encoder()
        backend = cls(retriever, encoder, cluster, timeout_s)
        try:
            backend.stats()
        except Unavailable:
            pass  # what is known is kept; readiness says what is down
        return backend

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

    @property
    def users(self) -> int:
        """Users the shards hold (as of this replica's last mutation or `stats`)."""
        return self._users

    def stats(self) -> tuple[int, int, int]:
        """(ads, rows, version), from the shards that answer (the last known of the others);
        `Unavailable` naming what is down, after refreshing what answered."""
        info, point, down = self.cluster.status(STATUS_TIMEOUT_S)
        for s, i in info.items():
            self._shards[s] = (i["ads"], i["rows"], i["users"] or 0)
        known = np.array(list(self._shards.values()), np.int64).reshape(-1, 3)
        self._ads, self._rows, self._users = (int(t) for t in known.sum(0))
        if point is not None:
            self._seen(point[0])
        if point is None or down:
            parts = [f"shard {s} {why}" for s, why in down.items()]
            if point is None:
                parts.insert(0, "the coordinator is down or restarting")
            raise Unavailable(f"not ready: {'; '.join(parts)}", sorted(down))
        return self._ads, self._rows, self._version

    def _seen(self, version: int) -> None:
        self._version = max(self._version, version)

    def _gathered(self, out: Gathered) -> None:
        self._seen(out.version)
        if not out.missing:
            self._rows = out.rows

    def reached(self, version: int) -> bool:
        """Whether the cluster is at `version` or newer (asked of the coordinator if needed).
        Users need nothing more: they are read on their owners, where every acknowledged
        write is applied."""
        if self._version < version:
            self._seen(self.cluster.read_point(self.timeout_s)[0])
        return self._version >= version

    def close(self) -> None:
        """Nothing to stop: the actors belong to whoever started the cluster."""

    # -- retrieval ------------------------------------------------------------------------------

    def retrieve_batch(self, chunks: Sequence[Sequence[Ask]]):
        """The batch's queries encoded once, then scattered to the shards and merged; each
        chunk answered as `m31.cluster.batches` says (a `concurrent.futures.Future` for a
        chunk handed to the waiter)."""
        prepared = [a.prepared for chunk in chunks for a in chunk]
        t0 = time.perf_counter()
        # Small ops on one core, as the engine runs them (`m31.ops.threads`: on a busy machine
        # an OpenMP team's barriers made a B = 1 encoding 7 times slower).
        with single_threaded() if self.retriever.device.type == "cpu" else nullcontext():
            experts = self.retriever.encode_experts(prepared)  # [B, E, *] per expert slot
            folded = fold(*experts) if self.retriever.fold else experts
            query = tuple(t.float().cpu().numpy() for t in folded)
        encode_ms = round(1000 * (time.perf_counter() - t0), 3)
        asked = [i for i, one in enumerate(prepared) if one.request.explain or one.request.why_not]
        explain = None
        if asked:  # each asking request's query per expert slot, and the slots' names
            per = {i: tuple(t[i].float().cpu().numpy() for t in experts) for i in asked}
            explain = (per, self.retriever.expert_names)
        return self.batches.run(query, chunks, encode_ms, self.defer, explain)

    # -- reads and mutations --------------------------------------------------------------------

    def get_ad(self, ad_id: int) -> tuple[dict, int]:
        found = self.cluster.get(ad_id, self.timeout_s)
        if found is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return found

    def _mutated(self, version: int) -> int:
        self._seen(version)
        if self.cluster.ads is not None:
            self._ads, self._users = self.cluster.ads, self.cluster.users
        return version

    def upsert(self, ads: list[AdIn]) -> int:
        g, x, b = (np.asarray(t.float().cpu().numpy()) for t in encode_ads(self.encoder, ads))
        ids = np.array([a.ad_id for a in ads], dtype=np.int64)
        attributes = ad_attributes(self.retriever, ads)
        return self._mutated(self.cluster.upsert(ids, g, x, b, attributes))

    def update(self, ad_id: int, changes: Mapping[str, Any]) -> int:
        """The range check runs on the owning shard, in its prepare, against the stored ad."""
        if self.cluster.get(ad_id, self.timeout_s) is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self._mutated(self.cluster.update_attributes(ad_id, dict(changes), check_bounds))

    def delete(self, ad_id: int) -> int:
        if self.cluster.get(ad_id, self.timeout_s) is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self._mutated(self.cluster.delete([ad_id]))

    def snapshot(self) -> int:
        return self._mutated(self.cluster.snapshot())

    # -- users ----------------------------------------------------------------------------------

    def add_events(self, events: list[EventIn], key: str | None) -> int:
        """Checked here (a ValueError naming `events[i].field`), then committed on the shards
        owning the users, all or none; the global version that holds them."""
        users, ads, ts, surfaces, types, weights = event_columns(events)
        self.retriever.users.check(users, ads, ts, surfaces)
        return self._mutated(self.cluster.add_events(users, ads, ts, surfaces, key, types, weights))

    def set_users(self, users: list[UserAttributesIn]) -> int:
        """Replace the attributes of each user (created if new) on its shard."""
        return self._mutated(self.cluster.set_users(user_codes(self.retriever, users)))
