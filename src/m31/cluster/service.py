"""`ClusterService`: what the HTTP routes drive (`m31.serve.service`'s interface), over a
sharded index on Ray, so the routes, batcher, middleware and metrics of one server are reused
as they are.

The ingress holds the model: it checks and prepares requests (`Retriever.prepare`, against a
schema-only index of the shards' schema), encodes each batch's queries once
(`Retriever.encode`) and new ads (ad tower, sentence encoder), then hands the shards the rest
through `Cluster`. Versions are the coordinator's global sequence (`m31.cluster.coordinator`).

Outages answer 503 naming what is down, never 500: every error this service raises for an
outage is a `ClusterUnavailable`, the serve package's `Unavailable` that also answers 503 (with
Retry-After) on a route that does not catch it (readiness, `min_version`). /health/ready is 503
while a shard or the coordinator is down or recovering, and names them.

Users: the shards own them (`m31.cluster.shard`); events and attribute writes are mutations
routed to their owners through the coordinator, under one idempotency key per call. Each
replica keeps a copy of every user, which the retrieve path reads as one server reads its
store, and follows the owners' changes (`Shard.user_changes`): every `USERS_FOLLOW_S` in the
background, and before a call with `min_version` proceeds, until the copy holds every user
change up to that version (`reached`). Without `min_version`, a call sees what was
acknowledged about `USERS_FOLLOW_S` (plus one round trip) before it.

Retrieval: each call of a batch (a chunk) is answered on its own, as soon as the shards it needs
answered: all of them for a call that wants a whole answer, those that are not down for one
that allows a partial answer. A chunk still waiting just before its own deadline is answered
then (503 naming the missing shards, or the partial answer). Where the batcher settles a chunk
later (`DynamicBatcher.deferred_results`: `defer`), the batch's device call ends once only
chunks waiting for shards that are down are left, or once a shard is slower than a straggler
(`STRAGGLER_S`, or `STRAGGLER_FACTOR` times a typical batch): those chunks are handed to a
waiter thread, and the calls behind them run meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from starlette.exceptions import HTTPException

from m31.cluster.cluster import Cluster, Read, ready
from m31.cluster.shard import take_user_changes
from m31.engine import Retriever
from m31.engine.ad_encoder import AdEncoder
from m31.engine.load import model_and_features
from m31.index import AdIndex
from m31.ops.threads import single_threaded
from m31.pipeline import embedding_cache_dir
from m31.serve import batcher
from m31.serve.config import ServeConfig
from m31.serve.schemas import AdIn, EventIn, Ranked, UserAttributesIn, check_bounds
from m31.serve.service import Ask, NotFound, Service, Unavailable, event_columns

log = logging.getLogger("m31.cluster")

# A chunk still waiting is answered this share of its time before its deadline (within the
# bounds below), so that the answer (503 naming the shards, or partial) reaches its handler
# before the batcher's own timer answers 504 naming nothing.
ANSWER_MARGIN_SHARE = 0.1
ANSWER_MARGIN_S = (0.05, 0.5)
# The device call of a batch ends (its waiting chunks handed to the waiter) once it waited this
# long, or this many times a typical batch's gather, for a shard not known to be down (a
# stopped shard fails no call); a typical gather weighs the last ones by STRAGGLER_MEMORY.
STRAGGLER_S = 0.25
STRAGGLER_FACTOR = 4.0
STRAGGLER_MEMORY = 0.9
# How long readiness and metrics wait for the shards before naming those that did not answer.
STATUS_TIMEOUT_S = 2.0
# How long a replica starting waits for a first shard to answer (it needs one's schema).
LOAD_WAIT_S = 300.0
# How often the waiter looks for batches handed to it while it waits on Ray.
WAITER_POLL_S = 0.05
# How often a replica takes the shards' user changes in the background (the freshness bound
# of a call without min_version), and how long it waits for a shard's answer.
USERS_FOLLOW_S = 0.2
USERS_WAIT_S = 2.0


class ClusterUnavailable(Unavailable, HTTPException):
    """Shards or the coordinator are down: a serve `Unavailable` (503 where routes catch it)
    that answers 503 with Retry-After where they do not (readiness, `min_version`)."""

    def __init__(self, message: str, shards: Sequence[int] = ()) -> None:
        Unavailable.__init__(self, message, shards)
        HTTPException.__init__(self, 503, message, {"Retry-After": "1"})

    def __str__(self) -> str:
        return self.detail


def schema_index(info: dict, device: str) -> AdIndex:
    """An empty index with a shard's dims, dtype and attribute schema: what `prepare` compiles
    filters against."""
    base = AdIndex(0, 0, capacity=1).schema
    extra = {k: v for k, v in info["schema"].items() if k not in base}
    return AdIndex(info["dim_g"], info["dim_x"], device, getattr(torch, info["dtype"]), 1, extra)


@dataclass
class _Chunk:
    """One call's part of a batch: its requests (rows of the batch), deadline and policy."""

    rows: range
    ks: list[int]
    answer_at: float  # monotonic seconds: when it is answered with what there is
    allow_partial: bool
    answer: Any = None  # the part, or the exception, once settled
    settled: bool = False
    future: concurrent.futures.Future | None = None  # when handed to the waiter


class _Batch:
    """The chunks of one batch over one `Read`; `settle` answers those that can be."""

    def __init__(self, service: ClusterService, read: Read, chunks: list[_Chunk], size: int,
                 encode_ms: float) -> None:  # fmt: skip
        self.service, self.read, self.chunks, self.size = service, read, chunks, size
        self.encode_ms, self.start = encode_ms, time.perf_counter()
        self.observed = False

    @property
    def open(self) -> list[_Chunk]:
        return [c for c in self.chunks if not c.settled]

    def next_deadline(self) -> float:
        return min(c.answer_at for c in self.open)

    def waits_only_for_down(self) -> bool:
        """Whether every open chunk waits only for shards (or a coordinator) known to be down,
        which no amount of waiting here will bring sooner."""
        read = self.read
        if read.point is None:
            return read.coordinator_failed
        return set(read.missing()) <= read.down()

    def settle(self, error: BaseException | None = None) -> None:
        """Answer each open chunk that has what it needs, or whose time is up (or `error`)."""
        read, now = self.read, time.monotonic()
        everyone = range(read.n)
        late = False
        for chunk in self.open:
            if error is not None:
                self._answer(chunk, error)
                continue
            need = everyone if not chunk.allow_partial else set(everyone) - read.down()
            if read.complete(need):
                self._answer(chunk, self._part(chunk))
            elif now >= chunk.answer_at:
                late = True
                if read.point is None:
                    self._answer(chunk, ClusterUnavailable(
                        "the coordinator did not answer within the deadline (down or "
                        "restarting)"))  # fmt: skip
                elif chunk.allow_partial:
                    self._answer(chunk, self._part(chunk))
                else:
                    missing = read.missing()
                    self._answer(chunk, ClusterUnavailable(
                        f"shards {missing} did not answer within the deadline (down or "
                        "restarting); pass allow_partial: true for an answer without them",
                        missing))  # fmt: skip
        if late:
            read.overdue()
        if not self.open and not self.observed and not read.missing():
            # A whole gather, on the device call or the waiter: what a typical batch takes.
            self.observed = True
            self.service._observe(time.perf_counter() - self.start)

    def _part(self, chunk: _Chunk):
        out = self.read.gathered(chunk.rows, chunk.ks)
        self.service._seen(out.version)
        if not out.missing:
            self.service._rows = out.rows
        timings = {
            "encode": self.encode_ms,
            **out.timings_ms,
            "gather": round(1000 * (time.perf_counter() - self.start), 3),
        }
        results = [Ranked(ad_ids=r.ad_ids.tolist(), scores=r.scores.tolist()) for r in out.results]
        return results, out.version, timings, self.size, out.missing

    def _answer(self, chunk: _Chunk, answer) -> None:
        chunk.answer, chunk.settled = answer, True
        if chunk.future is not None:
            if isinstance(answer, BaseException):
                chunk.future.set_exception(answer)
            else:
                chunk.future.set_result(answer)


class _Waiter:
    """One thread that drives the reads of batches handed over by their device calls, until
    every chunk of each is answered."""

    def __init__(self) -> None:
        self._new: list[_Batch] = []
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="m31-waiter", daemon=True)
        self._thread.start()

    def add(self, batch: _Batch) -> None:
        with self._wake:
            self._new.append(batch)
            self._wake.notify()

    def _run(self) -> None:
        batches: list[_Batch] = []
        while True:
            with self._wake:
                if not batches and not self._new:
                    self._wake.wait()
                batches += self._new
                self._new.clear()
            try:
                self._step(batches)
            except Exception as e:  # not a shard's: its calls fail with it, the thread goes on
                for b in batches:
                    b.settle(e)
            batches = [b for b in batches if b.open]

    @staticmethod
    def _step(batches: list[_Batch]) -> None:
        """Take what came for any batch (waiting up to the next deadline, or the poll for new
        batches), then answer what can be."""
        owner = {b.read: b for b in batches}
        wake = min(b.next_deadline() for b in batches)
        timeout = max(min(wake - time.monotonic(), WAITER_POLL_S), 0.0)
        if any(read.calls for read in owner):
            for read, call in ready(list(owner), timeout):
                try:
                    read.take(call)
                except Exception as e:  # a shard's bug: the batch's calls fail with it
                    owner[read].settle(e)
        else:
            time.sleep(timeout)
        for b in batches:
            if b.open:
                b.settle()


class ClusterService(Service):
    def __init__(
        self, retriever: Retriever, encoder: AdEncoder, cluster: Cluster, timeout_s: float = 1.0
    ) -> None:
        """`timeout_s`: how long a read of one ad waits for its shard (the server's deadline)."""
        self.retriever, self.encoder, self.cluster = retriever, encoder, cluster
        self.timeout_s = timeout_s
        self._ads = self._rows = self._version = 0
        self._shards: dict[int, tuple[int, int]] = {}  # shard -> (ads, rows), last known
        self._waiter: _Waiter | None = None
        self._waiter_lock = threading.Lock()
        self._typical_s = 0.0  # a batch's gather, when every shard answers
        # Whether `retrieve_batch` may answer a chunk with a Future (the batcher settles it).
        self.defer = batcher.DynamicBatcher.deferred_results
        # The user copy holds every change of shard s's users up to version _users_at[s]; -1:
        # none taken yet (the first take is each shard's whole state).
        self._users_at = [-1] * len(cluster.shards)
        self._users_lock = threading.Lock()  # one take of user changes at a time
        self._closed = threading.Event()

    @classmethod
    def load(cls, config: ServeConfig, cluster: Cluster) -> ClusterService:
        """The model of `config` with the online features of its cluster state (`index`; the
        shards hold the ads). Shards that are down are waited for, up to `LOAD_WAIT_S`, only
        until one answers."""
        net, feats = model_and_features(config.model, config.index, config.device)
        info = cluster.any_info(LOAD_WAIT_S)
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
        retriever = Retriever(net, feats, schema_index(info, config.device))
        retriever.group_caps = False  # the ads' campaigns and advertisers are on the shards
        encoder = AdEncoder(net, feats, embedding_cache_dir())
        encoder.load_text_encoder()
        service = cls(retriever, encoder, cluster, config.timeout_ms / 1000)
        try:
            service.stats()
        except Unavailable:
            pass  # what is known is kept; readiness says what is down
        service.follow_users()
        threading.Thread(target=service._follow, name="m31-users", daemon=True).start()
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
        """(ads, rows, version), from the shards that answer (the last known of the others);
        `ClusterUnavailable` naming what is down, after refreshing what answered."""
        info, point, down = self.cluster.status(STATUS_TIMEOUT_S)
        for s, i in info.items():
            self._shards[s] = (i["ads"], i["rows"])
        self._ads = sum(a for a, _ in self._shards.values())
        self._rows = sum(r for _, r in self._shards.values())
        if point is not None:
            self._seen(point[0])
        untaken = [s for s, at in enumerate(self._users_at) if at < 0]
        if point is None or down or untaken:
            parts = [f"shard {s} {why}" for s, why in down.items()]
            if point is None:
                parts.insert(0, "the coordinator is down or restarting")
            if untaken and not down:
                parts.append(f"the users of shards {untaken} are not taken yet")
            raise ClusterUnavailable(f"not ready: {'; '.join(parts)}", sorted({*down, *untaken}))
        return self._ads, self._rows, self._version

    def _seen(self, version: int) -> None:
        self._version = max(self._version, version)

    def reached(self, version: int) -> bool:
        """Whether the shards are at `version` or newer and the user copy holds every user
        change up to it (taken from the shards that changed since, if needed)."""
        if self._version < version or min(self._users_at) < version:
            point = self._call(self.cluster.read_point, self.timeout_s)
            self._seen(point[0])
            if point[0] >= version:
                self._users_up_to(point)
        return self._version >= version and min(self._users_at) >= version

    def _users_up_to(self, point: tuple[int, list[int]]) -> None:
        """Make the user copy hold every user change up to the read point (version, touched):
        a shard whose copy reaches touched[s] has no change after it up to `version`; the
        others are asked for theirs. `ClusterUnavailable` naming those that do not answer."""
        version, touched = point
        with self._users_lock:
            behind = {s: at for s, at in enumerate(self._users_at) if at < touched[s]}
            if behind:
                self._take_users(behind, self.timeout_s)
            for s, at in enumerate(self._users_at):
                if at >= touched[s]:
                    self._users_at[s] = max(at, version)

    def follow_users(self) -> list[int]:
        """Take every shard's user changes since the copy's version of it; the shards that did
        not answer (their changes are taken next time)."""
        with self._users_lock:
            return self._take_users(dict(enumerate(self._users_at)), USERS_WAIT_S, strict=False)

    def _take_users(
        self, since: dict[int, int], timeout_s: float, strict: bool = True
    ) -> list[int]:
        answers, down = self.cluster.user_changes(since, timeout_s)
        for s, answer in answers.items():
            version = take_user_changes(self.retriever.users, answer)
            self._users_at[s] = max(self._users_at[s], version)
        if down and strict:
            raise ClusterUnavailable(
                f"shards {down} did not give their users' changes within {timeout_s:g} s (down "
                "or restarting)", down)  # fmt: skip
        return down

    def _follow(self) -> None:
        """Take the shards' user changes every `USERS_FOLLOW_S` until closed."""
        failing = False
        while not self._closed.wait(USERS_FOLLOW_S):
            try:
                self.follow_users()
                failing = False
            except Exception as e:  # a shard's bug, or Ray going away: the next round tries again
                if not failing:  # once per run of failures, not every round
                    log.warning("taking the shards' user changes failed: %s", e)
                failing = True

    def close(self) -> None:
        """Stop following the users; the actors belong to whoever started the cluster."""
        self._closed.set()

    # -- retrieval ------------------------------------------------------------------------------

    def retrieve_batch(self, chunks: Sequence[Sequence[Ask]]):
        """As `Service.retrieve_batch`, scattered to the shards and merged; each chunk is
        answered as the module's docstring says (a `concurrent.futures.Future` for a chunk
        handed to the waiter)."""
        asks = [a for chunk in chunks for a in chunk]
        prepared = [a.prepared for a in asks]
        t0 = time.perf_counter()
        # Small ops on one core, as the engine runs them (`m31.ops.threads`: on a busy machine
        # an OpenMP team's barriers made a B = 1 encoding 7 times slower).
        with single_threaded() if self.retriever.device.type == "cpu" else nullcontext():
            q, v, p = (
                t.float().cpu().numpy() for t in self.retriever.encode(prepared)
            )  # [B, E, *]
        encode_ms = round(1000 * (time.perf_counter() - t0), 3)
        read = self.cluster.scatter(
            (q, v, p),
            [(one.request, dict(one.targeting)) for one in prepared],
            [one.k for one in prepared],
        )
        now, parts, at = time.monotonic(), [], 0
        for chunk in chunks:
            left = chunk[0].deadline - now
            margin = min(max(ANSWER_MARGIN_SHARE * left, ANSWER_MARGIN_S[0]), ANSWER_MARGIN_S[1])
            rows = range(at, at + len(chunk))
            ks = [a.prepared.k for a in chunk]
            parts.append(_Chunk(rows, ks, chunk[0].deadline - margin, chunk[0].allow_partial))
            at += len(chunk)
        batch = _Batch(self, read, parts, len(asks), encode_ms)
        straggler_at = time.monotonic() + max(STRAGGLER_S, STRAGGLER_FACTOR * self._typical_s)
        deferred = self.defer
        while True:
            try:
                batch.settle()
            except Exception as e:  # a shard's bug: every chunk fails with it
                batch.settle(e)
            if not batch.open:
                break
            if deferred and (time.monotonic() >= straggler_at or batch.waits_only_for_down()):
                for chunk in batch.open:
                    chunk.future = concurrent.futures.Future()
                self._waiting().add(batch)
                break
            until = batch.next_deadline()
            if deferred:
                until = min(until, straggler_at)
            try:
                read.wait(until)
            except Exception as e:
                batch.settle(e)
        return [c.future if c.future is not None else c.answer for c in parts]

    def _observe(self, seconds: float) -> None:
        keep = STRAGGLER_MEMORY if self._typical_s else 0.0
        self._typical_s = keep * self._typical_s + (1 - keep) * seconds

    def _waiting(self) -> _Waiter:
        with self._waiter_lock:
            if self._waiter is None:
                self._waiter = _Waiter()
            return self._waiter

    # -- reads and mutations --------------------------------------------------------------------

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except ClusterUnavailable:
            raise
        except Unavailable as e:
            raise ClusterUnavailable(str(e), e.shards) from e

    def get_ad(self, ad_id: int) -> tuple[dict, int]:
        found = self._call(self.cluster.get, ad_id, self.timeout_s)
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
        if self._call(self.cluster.get, ad_id, self.timeout_s) is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self._mutated(
            self._call(self.cluster.update_attributes, ad_id, dict(changes), check_bounds)
        )

    def delete(self, ad_id: int) -> int:
        if self._call(self.cluster.get, ad_id, self.timeout_s) is None:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self._mutated(self._call(self.cluster.delete, [ad_id]))

    def snapshot(self) -> int:
        return self._mutated(self._call(self.cluster.snapshot))

    # -- users ----------------------------------------------------------------------------------

    @property
    def users(self) -> int:
        """Users the replica's copy holds."""
        return len(self.retriever.users)

    def add_events(self, events: list[EventIn], key: str | None) -> int:
        """Checked here (a ValueError naming `events[i].field`), then committed on the shards
        owning the users, all or none; the global version that holds them."""
        users, ads, ts, surfaces, types, weights = event_columns(events)
        self.retriever.users.check(users, ads, ts, surfaces)
        return self._mutated(
            self._call(self.cluster.add_events, users, ads, ts, surfaces, key, types, weights)
        )

    def set_users(self, users: list[UserAttributesIn]) -> int:
        """Replace the attributes of each user (created if new) on its shard."""
        return self._mutated(self._call(self.cluster.set_users, self.user_codes(users)))
