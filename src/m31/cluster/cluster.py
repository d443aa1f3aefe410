"""A sharded index on Ray, as an ingress sees it (DESIGN §7): `Cluster`, the handle of one
cluster's actors. It starts them (`m31.cluster.actors`) or is handed them, scatters a query to
every shard and merges their top-k exactly (`m31.cluster.read`), reads one ad from its shard,
routes mutations to their owning shards through the coordinator (`m31.cluster.mutations`), and
tells readiness what is down.

A shard actor that dies is restarted by Ray and rebuilds from its snapshot, write-ahead log and
transaction log; meanwhile its calls fail, and the handle counts it *down* (`down`) from a
failed call or a deadline it let pass unanswered until it answers again. What cannot be
answered for an outage raises `Unavailable` naming the shards; never a silently partial answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import numpy as np

from m31.cluster import channel, mutations
from m31.cluster.actors import ClusterOptions, start_actors
from m31.cluster.layout import shard_of
from m31.cluster.read import RECOVERY_POLL_S, Gathered, Read
from m31.index.errors import Unavailable


class Cluster:
    """Handles of one cluster's actors. `start` makes them (the caller owns them: they live
    while it does); the handles pickle, so Ray Serve replicas get them as arguments."""

    def __init__(self, shards: list, coordinator) -> None:
        self.shards, self.coordinator = list(shards), coordinator
        # Calls to the shards and the coordinator, on their channels where they run on this
        # process's node (`m31.cluster.channel.Link`); not pickled: each process links its own.
        self._links = [channel.Link(shard) for shard in self.shards]
        self._writes = channel.Link(coordinator)  # mutations and read points
        # Shards that are down as this handle saw them: a call failed, or a deadline passed
        # unanswered; cleared by any answer. Set operations are atomic, and reads share it.
        self.down: set[int] = set()
        # Live ads and stored users after this handle's last mutation (None: none yet)
        self.ads: int | None = None
        self.users: int | None = None
        # The newest read point this handle was given (None after its own mutations): shards
        # answering at its touched versions are the whole index at its version, since a
        # mutation acknowledged before a read began shows in the answer of a shard it touched.
        self.last_point: tuple[int, list[int]] | None = None

    @classmethod
    def start(
        cls,
        state: str | Path,
        options: ClusterOptions | None = None,
        stop: threading.Event | None = None,
    ) -> Cluster:
        """Start the shard actors and the coordinator of the cluster state folder `state`
        (`m31 cluster init` makes one) on the Ray cluster this process is connected to; returns
        once every shard opened and the coordinator resolved them (`Cancelled` if `stop` is
        set first: the actors go with this process's connection)."""
        shards, coordinator = start_actors(state, options or ClusterOptions(), stop)
        return cls(shards, coordinator)

    def __reduce__(self):
        return (Cluster, (self.shards, self.coordinator))

    @property
    def direct(self) -> bool:
        """Whether calls take the channels of the actors on this node (else Ray calls only)."""
        return self._writes.direct

    @direct.setter
    def direct(self, on: bool) -> None:
        for link in (*self._links, self._writes):
            link.direct = on

    def channel(self, s: int) -> channel.Channel | None:
        """The open channel to shard s, if any."""
        return self._links[s].channel

    def connect(self, s: int, endpoint: tuple[str, str] | None) -> None:
        """Connect to shard s's channel at `endpoint` (from its answer), if it is on this node
        and not the open one."""
        self._links[s].connect(endpoint)

    def ask_point(self, wait_s: float = 0.0) -> Future:
        """A Future of the coordinator's read point (`Coordinator.read_point`), on its channel
        where it runs on this node: a read asks one whenever a shard moved on since the last
        (under a stream of events, most reads), and a Ray call costs several times a channel's
        (`m31.cluster.channel`)."""
        return self._writes.call("read_point", wait_s)

    def saw(self, point: tuple[int, list[int]]) -> None:
        """Keep `point` as the last read point if it is the newest seen."""
        last = self.last_point
        if last is None or point[0] >= last[0]:
            self.last_point = point

    def info(self) -> list[dict]:
        import ray

        return ray.get([s.info.remote() for s in self.shards])

    def any_info(self, timeout_s: float) -> dict:
        """The info of the first shard to answer (shards share their schema and dims), asking
        again those that fail, for up to `timeout_s`."""
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + timeout_s
        calls = {s.info.remote(): s for s in self.shards}
        while calls:
            left = max(deadline - time.monotonic(), 0)
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=left)
            if not ready:
                break
            shard = calls.pop(ready[0])
            try:
                return ray.get(ready[0])
            except RayActorError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)  # a shard gone for good fails at once
                    calls[shard.info.remote()] = shard
        raise Unavailable(
            f"no shard answered within {timeout_s:g} s (down or restarting)",
            list(range(len(self.shards))),
        )

    def status(self, timeout_s: float) -> tuple[dict[int, dict], tuple | None, dict[int, str]]:
        """(info of each shard that answered, the read point or None, what is down and why),
        within `timeout_s`: for readiness and metrics, which must answer during an outage."""
        import ray
        from ray.exceptions import RayActorError

        calls = {s.info.remote(): i for i, s in enumerate(self.shards)}
        point_ref, why_ref = (
            self.coordinator.read_point.remote(),
            self.coordinator.recovering.remote(),
        )
        refs = [*calls, point_ref, why_ref]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        info, down = {}, {}
        for ref, s in calls.items():
            try:
                if ref not in done:
                    raise TimeoutError
                info[s] = ray.get(ref)
                self.down.discard(s)
            except (RayActorError, TimeoutError):
                down[s] = "down or restarting"
                self.down.add(s)
        point = None
        try:
            if point_ref not in done or why_ref not in done:
                raise TimeoutError
            version, touched, _ = ray.get(point_ref)
            point = (version, touched)
            for s, why in ray.get(why_ref).items():
                down.setdefault(s, f"recovering: {why}")
        except (RayActorError, TimeoutError):
            pass
        return info, point, dict(sorted(down.items()))

    def read_point(self, timeout_s: float = 60.0) -> tuple[int, list[int]]:
        """(version, touched) once no shard is recovering; `Unavailable` naming those still
        recovering after `timeout_s`."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                version, touched, recovering = ray.get(
                    self.coordinator.read_point.remote(min(RECOVERY_POLL_S, max(left, 0))),
                    timeout=max(left, 0.001),
                )
            except (RayActorError, GetTimeoutError) as e:
                if time.monotonic() < deadline:
                    time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
                    continue
                raise Unavailable(
                    f"the coordinator did not answer within {timeout_s:g} s (down or restarting)",
                    [],
                ) from e
            if not recovering:
                return version, touched
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"shards {recovering} are recovering (the coordinator restarted and waits "
                    "for them)",
                    recovering,
                )

    # ---- reads --------------------------------------------------------------------------

    def scatter(
        self,
        query: tuple[np.ndarray, np.ndarray, np.ndarray],
        requests: Sequence[tuple[Any, Mapping]],
        ks: Sequence[int],
        explain: tuple[dict[int, tuple], list[str]] | None = None,
    ) -> Read:
        """Start a read: every shard asked (and the coordinator, without a last read point).
        The query and requests travel in the calls (`Read._ray_payload`), and with `explain`
        the query per expert slot of each request that asks why (by its row) and the slots'
        names."""
        payload = (query, list(requests), list(ks))
        return Read(self, payload if explain is None else (*payload, explain))

    def search(
        self,
        query: tuple[np.ndarray, np.ndarray, np.ndarray],
        requests: Sequence[tuple[Any, Mapping]],
        ks: Sequence[int],
        deadline: float,
        allow_partial: bool = False,
    ) -> Gathered:
        """The top ks[r] ads of each request over every shard, at one global version.

        query = (q [B, E, G], v [B, E, D], p [B, E]) fp32 numpy; requests: (AdRequest,
        targeting) pairs; deadline: `time.monotonic()` seconds. Shards that did not answer by
        the deadline raise `Unavailable`, unless `allow_partial` (then `missing` names them,
        and shards that are down are not waited for).
        """
        out = self.gather(query, requests, ks, deadline, wait_for_failed=not allow_partial)
        if out.missing and not allow_partial:
            raise Unavailable(
                f"shards {out.missing} did not answer within the deadline (down or restarting); "
                "pass allow_partial for an answer without them",
                out.missing,
            )
        return out

    def gather(
        self,
        query: tuple[np.ndarray, np.ndarray, np.ndarray],
        requests: Sequence[tuple[Any, Mapping]],
        ks: Sequence[int],
        deadline: float,
        wait_for_failed: bool = True,
    ) -> Gathered:
        """`search`, with the shards that did not answer listed in `missing` rather than
        raised; `wait_for_failed`: wait for shards that are down too (else only for the
        others)."""
        read = self.scatter(query, requests, ks)
        everyone = range(len(self.shards))
        while not read.complete(everyone if wait_for_failed else set(everyone) - read.down()):
            if not read.wait(deadline):
                read.overdue()
                break
        return read.gathered(range(len(ks)), ks)

    def get(self, ad_id: int, timeout_s: float = 60.0) -> tuple[dict, int] | None:
        """(attributes, version) of a live ad, None if no shard holds it; `Unavailable` naming
        its shard if that does not answer within `timeout_s` (asked again while it restarts)."""
        ask = lambda link, ids, _: link.call("get", ids[0])  # noqa: E731
        _, answers = self._ask_owners([ad_id], ask, f"holding ad id {ad_id}", timeout_s)
        return next(iter(answers.values()))

    def groups(self, ad_ids: Sequence[int], name: str, timeout_s: float = 60.0) -> list:
        """The int field `name` of each ad (None: null, or no shard holds it), each asked of
        the shard that would hold it, in parallel; `Unavailable` naming the shards that did
        not answer within `timeout_s` (asked again while they restart)."""
        ask = lambda link, ids, _: link.call("groups", ids, name)  # noqa: E731
        what = "holding ads a frequency cap counts"
        return self._spread(*self._ask_owners(ad_ids, ask, what, timeout_s))

    def stored_users(self, user_ids, ts, timeout_s: float = 60.0) -> list:
        """Users `user_ids` [B] as of their times `ts` [B], each read on its owner shard, in
        parallel (`Shard.stored_users`): a `StoredUser`, None for one no shard holds, or, for
        one whose owner did not answer within `timeout_s`, the `Unavailable` naming it (so that
        the calls a read serves together fail only for their own users' owners)."""
        ts = np.asarray(ts, dtype=np.int64)
        ask = lambda link, ids, at: link.call("stored_users", ids, ts[at].tolist())  # noqa: E731
        owners, answers = self._ask_owners(user_ids, ask, "owning users asked", timeout_s, False)
        out = self._spread(owners, {s: a[0] for s, a in answers.items() if a is not None})
        for s in {s for s, a in answers.items() if a is None}:
            why = f"shard {s} (owning users asked) did not answer within {timeout_s:g} s"
            for i in np.flatnonzero(owners == s).tolist():  # one error each: raised apart
                out[i] = Unavailable(f"{why} (down or restarting)", [s])
        return out

    @staticmethod
    def _spread(owners: np.ndarray, answers: dict[int, list]) -> list:
        """Each id's value from its owner's answer (a list in the order that owner was asked)."""
        out: list = [None] * len(owners)
        for s, values in answers.items():
            for i, v in zip(np.flatnonzero(owners == s).tolist(), values, strict=True):
                out[i] = v
        return out

    def _ask_owners(
        self, ids, ask, what: str, timeout_s: float, strict: bool = True
    ) -> tuple[np.ndarray, dict]:
        """(owner shard of each id [n], {shard: answer}): `ask(its Link, its ids as a list,
        their positions in ids)` (a Future) of each shard that owns some of `ids` (ads and users
        are partitioned alike), in parallel, and again while it restarts; `Unavailable` naming
        the shards that did not answer within `timeout_s` (`what` they hold, for the message),
        or, not `strict`, None as their answer."""
        ids = np.asarray(ids, dtype=np.int64)
        owners = shard_of(ids, len(self.shards)) if len(ids) else np.zeros(0, np.int64)
        todo = {int(s): np.flatnonzero(owners == s) for s in np.unique(owners)}
        answers: dict = {}
        deadline = time.monotonic() + timeout_s
        while todo:
            asked = {s: ask(self._links[s], ids[at].tolist(), at) for s, at in todo.items()}
            wait_futures(asked.values(), timeout=max(deadline - time.monotonic(), 0))
            for s, future in asked.items():
                if not future.done():
                    continue
                try:
                    answers[s] = future.result()
                except channel.ChannelClosed:
                    self.down.add(s)
                    continue
                self.down.discard(s)
                del todo[s]
            if todo and time.monotonic() >= deadline and not strict:
                return owners, {**answers, **dict.fromkeys(todo)}
            if todo and time.monotonic() >= deadline:
                shards = sorted(todo)
                named = f"shard {shards[0]}" if len(shards) == 1 else f"shards {shards}"
                raise Unavailable(
                    f"{named} ({what}) did not answer within {timeout_s:g} s (down or restarting)",
                    shards,
                )
            if todo:
                time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        return owners, answers

    # ---- mutations ----------------------------------------------------------------------

    def _mutate(self, ops: mutations.Ops, key: str | None = None) -> int:
        self.last_point = None  # the next read asks the coordinator (reads its own writes)
        version, self.ads, self.users = mutations.commit(self._writes, ops, key)
        return version

    def upsert(self, ad_ids, g, x, b, attributes) -> int:
        """Upsert ads (ids [n], g [n, G], x [n, D], b [n] numpy; attributes an arrow table or
        n dicts) on their shards, all or none; the new global version."""
        return self._mutate(mutations.upsert_ops(ad_ids, g, x, b, attributes, len(self.shards)))

    def update_attributes(self, ad_id: int, attrs: Mapping[str, Any], check=None) -> int:
        return self._mutate(mutations.update_ops(ad_id, attrs, check, len(self.shards)))

    def delete(self, ad_ids) -> int:
        return self._mutate(mutations.delete_ops(ad_ids, len(self.shards)))

    def add_events(self, user_ids, ad_ids, ts, surfaces, key=None, types=None, weights=None) -> int:
        """Engagement events [n] each (`DurableIndex.add_events`'s arguments) on the shards
        owning their users, all or none; the new global version (a call whose idempotency `key`
        was committed already: its version; AdIndexError if that was another call)."""
        n = len(self.shards)
        return self._mutate(
            mutations.event_ops(user_ids, ad_ids, ts, surfaces, types, weights, n), key
        )

    def set_users(self, users: Sequence[tuple[int, Mapping[str, int]]]) -> int:
        """Set attribute codes of users, (user id, codes) each, on their owning shards."""
        return self._mutate(mutations.user_ops(users, len(self.shards)))

    def snapshot(self) -> int:
        """Snapshot every shard; the global version."""
        return mutations.snapshot(self.coordinator)
