"""What the HTTP API drives (DESIGN §7): `Backend`, the contract between the routes and what
serves the index. Two implement it: one process over a durable index (`m31.serve.local`), and
a sharded index on Ray (`m31.cluster.backend`); the command line picks one, and nothing in
`m31.serve` imports the cluster.

Everything here runs off the event loop: retrieval batches on the batcher's device thread,
mutations one at a time on the app's writer thread, the rest on worker threads. A backend's
errors carry no HTTP; the routes and the app map them: `NotFound` 404, `Unavailable` 503 (with
Retry-After), and an invalid input (`AdIndexError`, `RequestError`, any `ValueError`) 422
naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from m31.engine import PreparedRequest, Retriever
from m31.engine.ad_encoder import AdEncoder
from m31.serve.schemas import AdIn, EventIn, Ranked, UserAttributesIn

# One call's answer, or a chunk's part of it: (results, index version, timings in ms, requests
# in the engine call, shards missing from the answer).
Part = tuple[list[Ranked], int, dict[str, float], int, list[int]]


@dataclass(frozen=True)
class Ask:
    """One request of an HTTP call as the batcher carries it to `retrieve_batch`."""

    prepared: PreparedRequest
    deadline: float  # time.monotonic() seconds: the call's deadline
    allow_partial: bool = False  # a sharded index may answer without shards that are down


class Backend(Protocol):
    """The index as the routes see it. The models live with the routes' process: requests are
    checked and prepared against `retriever` (which also holds the users and the
    vocabularies), new ads encoded by `encoder`."""

    retriever: Retriever
    encoder: AdEncoder
    # Mutations it takes at once (the routes' writer threads): 1 for one process, whose
    # DurableIndex has one writer; a cluster's coordinator orders concurrent calls itself and
    # commits those that arrive while one commits as one transaction (group commit).
    writers: int

    @property
    def version(self) -> int:
        """The index version last known."""
        ...

    @property
    def ads(self) -> int:
        """Live ads, last known."""
        ...

    @property
    def rows(self) -> int:
        """Rows a request scores (tombstones included), last known."""
        ...

    @property
    def users(self) -> int:
        """Users stored (the retriever's store; a cluster's shards, last known)."""
        ...

    def stats(self) -> tuple[int, int, int]:
        """(ads, rows, version), fresh; `Unavailable` naming what is down."""
        ...

    def reached(self, version: int) -> bool:
        """Whether a retrieve now reads `version` or newer."""
        ...

    def retrieve_batch(
        self, chunks: Sequence[Sequence[Ask]]
    ) -> list[Part | BaseException | Future]:
        """The batcher's run function: each chunk (one call's requests, or a slice of them)
        answered with its `Part`, an exception of its own, or a Future of either
        (`DynamicBatcher.deferred_results`)."""
        ...

    def get_ad(self, ad_id: int) -> tuple[dict, int]:
        """(attributes, version read at) of a live ad; `NotFound` if there is none."""
        ...

    def upsert(self, ads: list[AdIn]) -> int:
        """Encode and upsert the ads, all or none; the version that holds them."""
        ...

    def update(self, ad_id: int, changes: Mapping[str, Any]) -> int:
        """Change some attributes of one ad (a range checked against its other end)."""
        ...

    def delete(self, ad_id: int) -> int:
        """Tombstone an ad; `NotFound` if there is none."""
        ...

    def add_events(self, events: list[EventIn], key: str | None) -> int:
        """Log the engagement events; the version that holds them (a call whose idempotency
        `key` was applied already: that call's version)."""
        ...

    def set_users(self, users: list[UserAttributesIn]) -> int:
        """Replace the attributes of each user (created if new); the version that holds them."""
        ...

    def snapshot(self) -> int:
        """Compact, snapshot and start a fresh log; the version snapshotted."""
        ...

    def close(self) -> None: ...


def assemble(parts: Sequence[Part]) -> Part:
    """One call's answer from its chunks' parts.

    A call larger than a batch runs in several engine calls, each at one version: the oldest is
    reported (every request saw it or a newer one), timings add up (a stage some engine calls
    had, such as explaining, counts where it ran), the batch size is the largest, and the
    missing shards are those any chunk missed.
    """
    stages = list(dict.fromkeys(stage for p in parts for stage in p[2]))
    timings = {stage: round(sum(p[2].get(stage, 0.0) for p in parts), 3) for stage in stages}
    results = [r for p in parts for r in p[0]]
    missing = sorted({s for p in parts for s in p[4]})
    return results, min(p[1] for p in parts), timings, max(p[3] for p in parts), missing
