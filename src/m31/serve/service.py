"""The engine as the service drives it: retrieval batches from the batcher, and mutations on
the writer thread. Everything here runs off the event loop.

The routes and the app use only this interface, which `m31.cluster.service.ClusterService`
implements too (the same routes over a sharded index on Ray): `retriever` (its `prepare`),
`encoder`, `retrieve_batch`, `assemble`, `reached`, `get_ad`, `upsert`, `update`, `delete`,
`snapshot`, `stats`, the `version`, `ads` and `rows` last known, and `close`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from m31.engine import InlineUser, PreparedRequest, Retriever
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.engine.load import load_engine
from m31.index import AdIndexError, DurableIndex
from m31.serve.config import ServeConfig
from m31.serve.schemas import AdIn, EventIn, Ranked, UserAttributesIn, check_bounds


class NotFound(LookupError):
    """No such ad (-> 404)."""


class Unavailable(RuntimeError):
    """Part of the index could not answer within the deadline (-> 503); `shards` names it."""

    def __init__(self, message: str, shards: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.shards = list(shards)


@dataclass(frozen=True)
class Ask:
    """One request of an HTTP call as the batcher carries it to `retrieve_batch`."""

    prepared: PreparedRequest
    deadline: float  # time.monotonic() seconds: the call's deadline
    allow_partial: bool = False  # a sharded index may answer without shards that are down


class Service:
    """The loaded parts: engine, durable index, ad encoder (`m31.engine.load`)."""

    def __init__(self, retriever: Retriever, store: DurableIndex, encoder: AdEncoder) -> None:
        self.retriever, self.store, self.encoder = retriever, store, encoder

    @classmethod
    def load(cls, config: ServeConfig) -> Service:
        engine = load_engine(config.index, config.model, config.device, config.probe)
        try:
            # Now, not on the first upsert: loading the sentence model takes seconds to a minute.
            engine.encoder.load_text_encoder()
        except BaseException:
            engine.close()
            raise
        return cls(engine.retriever, engine.store, engine.encoder)

    # -- state ----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.store.version

    @property
    def ads(self) -> int:
        """Live ads."""
        return len(self.store.index)

    @property
    def rows(self) -> int:
        """Rows a request scores (tombstones included)."""
        return self.store.index.num_rows

    def stats(self) -> tuple[int, int, int]:
        """(ads, rows, version), fresh."""
        return self.ads, self.rows, self.version

    def reached(self, version: int) -> bool:
        """Whether the index is at `version` or newer."""
        return self.store.version >= version

    def close(self) -> None:
        self.store.close()

    # -- retrieval: one call per batch of HTTP calls ------------------------------------------

    def retrieve_batch(self, chunks: Sequence[Sequence[Ask]]):
        """The prepared requests of the batch's chunks in one engine call, then split: per chunk
        (results, index version, timings, requests in the engine call, missing shards). Each
        request gets its own k of the exact top-K (`Retriever.retrieve`)."""
        requests = [a.prepared for chunk in chunks for a in chunk]
        out = self.retriever.retrieve(requests)
        answers, at = [], 0
        for chunk in chunks:
            results = [
                Ranked(ad_ids=r.ad_ids.tolist(), scores=r.scores.tolist())
                for r in out.results[at : at + len(chunk)]
            ]
            at += len(chunk)
            answers.append((results, out.version, out.timings_ms, len(requests), []))
        return answers

    @staticmethod
    def assemble(parts: Sequence[tuple[list[Ranked], int, dict[str, float], int, list[int]]]):
        """One call's (results, index version, timings, batch requests, missing shards) from
        its chunks' parts.

        A call larger than a batch runs in several engine calls, each at one version: the
        oldest is reported (every request saw it or a newer one), timings add up, the batch
        size is the largest, and the missing shards are those any chunk missed.
        """
        timings = {stage: round(sum(p[2][stage] for p in parts), 3) for stage in parts[0][2]}
        results = [r for p in parts for r in p[0]]
        missing = sorted({s for p in parts for s in p[4]})
        return results, min(p[1] for p in parts), timings, max(p[3] for p in parts), missing

    # -- reads and mutations (mutations on the writer thread) -----------------------------------

    def get_ad(self, ad_id: int) -> tuple[dict, int]:
        """(attributes, version read at) of a live ad; NotFound if there is none."""
        index = self.store.index
        try:
            with index.snapshot_view() as view:
                return index.get(ad_id).attributes, view.version
        except AdIndexError as e:
            raise NotFound(str(e)) from e

    def upsert(self, ads: list[AdIn]) -> int:
        g, x, b = self.encode(ads)
        return self.store.upsert([a.ad_id for a in ads], g, x, b, self.attributes(ads))

    def encode(self, ads: list[AdIn]):
        """(g [n, G], x [n, D], b [n]): the new ads through the model's ad tower."""
        new = [
            NewAd(
                a.ad_id,
                a.advertiser_id,
                a.objective,
                a.format,
                a.topic,
                a.category,
                a.text,
                a.quality,
            )  # no item attributes: the ad routes take the index's base fields only
            for a in ads
        ]
        self.encoder.check(new)  # ValueError naming ads[i].field before any work
        return self.encoder.encode(new)

    def attributes(self, ads: list[AdIn]) -> list[dict]:
        """The index attributes of each ad (the fields of the index's schema)."""
        schema = self.retriever.index.schema
        return [{name: a.model_dump().get(name) for name in schema} for a in ads]

    def update(self, ad_id: int, changes: Mapping[str, Any]) -> int:
        """Change some attributes of one ad. A range with one end changed is checked against
        the ad's other end; on the writer thread, so no other write comes in between."""
        if ad_id not in self.store.index:
            raise NotFound(f"ad id {ad_id} is not in the index")
        check_bounds(changes, self.store.index.get(ad_id).attributes)
        return self.store.update_attributes(ad_id, **changes)

    def delete(self, ad_id: int) -> int:
        if ad_id not in self.store.index:
            raise NotFound(f"ad id {ad_id} is not in the index")
        return self.store.delete([ad_id])

    def snapshot(self) -> int:
        return self.store.snapshot()

    # -- users ----------------------------------------------------------------------------------

    @property
    def users(self) -> int:
        """Users the store holds."""
        return len(self.retriever.users)

    def add_events(self, events: list[EventIn], key: str | None) -> int:
        """Log the engagement events, then add them to the user store; the version that holds
        them (a call whose key was applied already: that call's version)."""
        users, ads, ts, surfaces, types, weights = event_columns(events)
        return self.store.add_events(users, ads, ts, surfaces, key, types=types, weights=weights)

    def set_users(self, users: list[UserAttributesIn]) -> int:
        """Replace the attributes of each user (created if new); the version that holds them."""
        return self.store.set_users(self.user_codes(users))

    def user_codes(self, users: list[UserAttributesIn]) -> list[tuple[int, dict[str, int]]]:
        """(user id, the store's codes of its attributes) of each user; RequestError naming
        the field before anything is logged."""
        return [
            (
                u.user_id,
                self.retriever.user_codes(
                    f"users[{i}]", InlineUser(u.country, u.age, u.gender, u.cohort)
                ),
            )
            for i, u in enumerate(users)
        ]


def event_columns(events: list[EventIn]) -> tuple[list, ...]:
    """(user ids, ad ids, times, surfaces, types, weights) of the events, [n] each."""
    return tuple(
        [getattr(e, name) for e in events]
        for name in ("user_id", "ad_id", "ts", "surface", "type", "weight")
    )
