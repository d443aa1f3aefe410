"""A sharded index on Ray, as an ingress sees it: start (or attach to) the shard actors and
the coordinator of a cluster state folder, scatter a query to every shard and merge their
top-k exactly, route mutations to their owning shards through the coordinator (DESIGN §7).

Shapes: B requests, E experts, G gate-key dim, D value dim.

Reads. The ingress sends the query (encoded once) and the requests to every shard and asks for
its top-k: through the shard's channel where it is on the ingress's node and connected
(`m31.cluster.channel`: Ray's call path costs more than a millisecond each way), else as a Ray
call; when it has no read point it asks the coordinator for one (version, touched, recovering)
in parallel. A shard answers at the last version that changed it; an answer is used when that
is touched[s] of the read point, so the merged answer is the whole index at exactly `version`.
A shard that committed something newer meanwhile is asked again at touched[s] (it keeps views
of its last few versions), or, if it no longer holds that view, the read point is taken again.
Ties across shards go to the lower ad id, as in one process (`m31.engine.merge`). `Read` is one
such scatter-gather in progress; `gather` drives one to its end, and `m31.cluster.service`
drives several at once.

Failure. A shard actor that dies is restarted by Ray (`max_restarts=-1`) and rebuilds from its
snapshot, write-ahead log and transaction log. A read whose shard call fails (a Ray call, or
its channel closing) asks it again through Ray (the call fails again every few seconds until
the restarted actor answers) until the read's deadline. A shard is *down* from a failed call,
or from a deadline it let pass unanswered (a stopped process fails nothing), until it answers
again; so is a shard the coordinator names as recovering (it restarted and has not resolved
that shard yet). At the deadline, shards still missing make the read fail with `Unavailable` —
or, for a read that allows a partial answer, the answer says which shards are missing; such a
read does not wait for a shard that is down, only for the others. Never a silently partial
answer.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from m31.cluster import channel
from m31.cluster.coordinator import Coordinator
from m31.cluster.layout import coordinator_dir, read_layout, shard_dir, shard_of
from m31.cluster.shard import Answer, Moved, Shard
from m31.engine import Retrieved, merge
from m31.engine.caps import group_cap
from m31.serve.service import Unavailable

__all__ = ["Cancelled", "Cluster", "ClusterOptions", "Gathered", "Read", "Unavailable", "ready"]

# Seconds a mutation may take before its caller gives up waiting (it may still commit): the
# coordinator refuses one whose shards are down within `PREPARE_WAIT_S`, so this bounds only
# a coordinator that does not answer at all.
MUTATION_TIMEOUT_S = 120.0
# A query this large (bytes of q, v, p) goes to several shards through the object store (when
# asked through Ray).
PUT_BYTES = 32 << 10
# How long one read-point call waits in the coordinator for recovering shards: reads waiting
# for them ask again, so this bounds how long a coordinator thread is held.
RECOVERY_POLL_S = 0.5


@dataclass
class Gathered:
    results: list[Retrieved]  # per request, best first
    version: int  # the global version every answering shard was read at
    missing: list[int] = field(default_factory=list)  # shards without an answer (partial)
    rows: int = 0  # rows scored per request, over the shards that answered
    timings_ms: dict[str, float] = field(default_factory=dict)  # the slowest shard's mask, score


@dataclass
class ClusterOptions:
    """How the actors are placed: one GPU each on a GPU cluster, CPU workers otherwise."""

    device: str = "cpu"
    shard_cpus: float = 1.0
    shard_gpus: float = 0.0
    max_concurrency: int = 8  # calls a shard serves at once (searches beside a commit)


class Cancelled(RuntimeError):
    """A start-up stopped before its end."""


class _ShardActor(Shard):
    """A shard as its Ray actor runs it: it also serves its searches on a channel, whose endpoint
    its answers through Ray carry (`m31.cluster.channel`)."""

    def __init__(self, path: str, index: int, device: str = "cpu", workers: int = 8) -> None:
        import ray

        super().__init__(path, index, device)
        self.endpoint = None
        if channel.available():
            server = channel.Server({"search": super().search}, workers)
            self.endpoint = (ray.get_runtime_context().get_node_id(), server.name)
            self._server = server

    def search(self, payload, at: int | None = None) -> Answer | Moved:
        got = super().search(payload, at)
        return dataclasses.replace(got, endpoint=self.endpoint) if isinstance(got, Answer) else got


def _actor_classes():
    import ray

    shard = ray.remote(max_restarts=-1, max_task_retries=0)(_ShardActor)
    coordinator = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)(Coordinator)
    return shard, coordinator


class Read:
    """One scatter-gather in progress: the calls out (`calls`: a Ray ref or a channel's Future
    -> shard, -1 for the read point), the answers in. `take` each call once it is done
    (`ready`); `complete(need)` says whether the shards `need` answered at the read point. Not
    thread-safe: one thread drives a read at a time."""

    def __init__(self, cluster: Cluster, payload) -> None:
        self.cluster, self.payload = cluster, payload
        self.n = len(cluster.shards)
        self.calls: dict[Any, int] = {}
        self._futures: dict[Any, Future] = {}  # Ray refs waited for beside a channel's calls
        self._stored = None  # the payload in Ray's object store, once put
        # The handle's last read point, until an answer does not fit it: answers that all fit
        # the last point need no call to the coordinator (see `Cluster.last_point`).
        self.point: tuple[int, list[int]] | None = cluster.last_point
        self.cached = self.point is not None
        self.recovering: set[int] = set()  # per the last read point
        self.answers: dict[int, Answer] = {}
        self.failed: set[int] = set()  # shards whose last call in this read failed
        self.coordinator_failed = False  # the last read-point call failed (no point yet)
        for s in range(self.n):
            self._ask(s)
        if not self.cached:
            self._ask_point()

    def _ask(self, s: int, at: int | None = None) -> None:
        direct = self.cluster.channel(s)
        if direct is not None:
            self.calls[direct.call("search", self.payload, at)] = s
        else:
            self.calls[self.cluster.shards[s].search.remote(self._ray_payload(), at)] = s

    def _ray_payload(self):
        """The payload for a Ray call: for several shards and a large query, put into the object
        store once (a put costs about a millisecond, more than a few small copies)."""
        query = self.payload[0]
        if self.n == 1 or sum(a.nbytes for a in query) < PUT_BYTES:
            return self.payload
        if self._stored is None:
            import ray

            self._stored = ray.put(self.payload)
        return self._stored

    def future(self, call) -> Future:
        """`call` as a Future (a Ray ref's made once), to wait for it beside a channel's."""
        if isinstance(call, Future):
            return call
        if call not in self._futures:
            self._futures[call] = call.future()
        return self._futures[call]

    def _ask_point(self, wait_s: float = 0.0) -> None:
        self.calls[self.cluster.coordinator.read_point.remote(wait_s)] = -1

    def take(self, ref) -> None:
        """Take the answer (or failure) of the ready call `ref`; ask again what it calls for. A
        shard's own error (not an outage) is raised: no retry hides a bug."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        s = self.calls.pop(ref)
        self._futures.pop(ref, None)
        try:
            got = ref.result() if isinstance(ref, Future) else ray.get(ref)
        except RayTaskError as e:
            raise e.cause from e
        except (RayActorError, channel.ChannelClosed):
            if s < 0:
                self.coordinator_failed = True
                self._ask_point()  # fails again every few seconds while it restarts
                return
            self.failed.add(s)
            self.cluster.down.add(s)
            # At the read point's version, but the latest against a kept point: an old view
            # would hide a write the shard took since.
            self._ask(s, None if self.point is None or self.cached else self.point[1][s])
            return
        if s < 0:
            version, touched, recovering = got
            self.point, self.recovering = (version, touched), set(recovering)
            self.coordinator_failed = False
            if not recovering:
                self.cluster.saw(self.point)
            if self.recovering and -1 not in self.calls.values():
                self._ask_point(RECOVERY_POLL_S)
            self._refresh()
            return
        self.cluster.down.discard(s)
        self.failed.discard(s)
        if isinstance(got, Moved):
            # The view asked for is gone (the shard moved on: a newer read point), or the shard
            # is behind it (recovering): either way the next read point says what to ask.
            if -1 not in self.calls.values():
                behind = self.point is not None and got.version < self.point[1][s]
                self._ask_point(RECOVERY_POLL_S if behind else 0.0)
            return
        self.answers[s] = got
        self.cluster.connect(s, got.endpoint)
        if self.cached and got.version != self.point[1][s]:
            # Something changed since the last read point (maybe acknowledged before this read
            # began): only the coordinator says at which version to read now.
            self.point, self.cached = None, False
            self._ask_point()
        elif self.point is not None and s not in self.recovering:
            if got.version != self.point[1][s]:
                del self.answers[s]
                self._ask(s, self.point[1][s])

    def _refresh(self) -> None:
        """Ask each shard whose answer does not fit the read point again, at it."""
        touched = self.point[1]
        busy = set(self.calls.values())
        for s in range(self.n):
            if s in busy or s in self.recovering:
                continue
            answer = self.answers.get(s)
            if answer is None or answer.version != touched[s]:
                self.answers.pop(s, None)
                self._ask(s, touched[s])

    def fits(self, s: int) -> bool:
        """Whether shard s answered at the read point."""
        return (
            self.point is not None
            and s not in self.recovering
            and s in self.answers
            and self.answers[s].version == self.point[1][s]
        )

    def complete(self, need) -> bool:
        return self.point is not None and all(self.fits(s) for s in need)

    def down(self) -> set[int]:
        """Shards not worth waiting for: down (failed, or silent past a deadline) or
        recovering."""
        return set(self.cluster.down) | self.failed | self.recovering

    def missing(self) -> list[int]:
        return [s for s in range(self.n) if not self.fits(s)]

    def overdue(self) -> None:
        """A deadline passed: the shards that have not answered are down until they do."""
        self.cluster.down.update(s for s in self.missing() if s in self.calls.values())

    def gathered(self, rows: Sequence[int], ks: Sequence[int]) -> Gathered:
        """The merged answer of requests `rows` (their ks) over the shards that fit."""
        if self.point is None:
            raise Unavailable("the coordinator did not answer within the deadline (down or "
                              "restarting)", [])  # fmt: skip
        ok = {s: a for s, a in self.answers.items() if self.fits(s)}
        results = []
        requests = self.payload[1]
        for r, k in zip(rows, ks, strict=True):
            parts = [Retrieved(*ok[s].results[r]) for s in sorted(ok)]
            results.append(merge(parts, k, group_cap(requests[r][0].max_per)))
        timings = {
            stage: max((a.timings_ms[stage] for a in ok.values()), default=0.0)
            for stage in ("mask", "score_topk")
        }
        rows_scored = sum(a.rows for a in ok.values())
        return Gathered(results, self.point[0], self.missing(), rows_scored, timings)

    def wait(self, until: float) -> bool:
        """Wait for a call until `until` (monotonic seconds) and take those done; False if none
        came."""
        left = until - time.monotonic()
        if left <= 0:
            return False
        if not self.calls:  # nothing out (not expected): no spinning until `until`
            time.sleep(min(left, 0.05))
            return False
        done = ready([self], left)
        for _, call in done:
            self.take(call)
        return bool(done)


def ready(reads: Sequence[Read], timeout: float) -> list[tuple[Read, Any]]:
    """The calls out of `reads` that are done, as (read, call), waiting up to `timeout` seconds
    for one: Ray's refs through `ray.wait`, and, beside a channel's calls, as Futures."""
    owner = {call: read for read in reads for call in read.calls}
    if not owner:
        return []
    if any(isinstance(call, Future) for call in owner):
        futures = {owner[call].future(call): call for call in owner}
        finished, _ = wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        return [(owner[futures[f]], futures[f]) for f in finished]
    import ray

    refs = list(owner)
    done, rest = ray.wait(refs, num_returns=1, timeout=timeout)
    if done and rest:
        done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
    return [(owner[ref], ref) for ref in done]


class Cluster:
    """Handles of one cluster's actors. `start` makes them (the caller owns them: they live
    while it does); the handles pickle, so Ray Serve replicas get them as arguments."""

    def __init__(self, shards: list, coordinator) -> None:
        self.shards, self.coordinator = list(shards), coordinator
        # Channels to the shards on this process's node, connected from their answers; not
        # pickled: each process that holds the handle connects its own.
        self.direct = channel.available()  # whether to connect them (else Ray calls only)
        self._channels: dict[int, channel.Channel] = {}
        self._refused: set[tuple[str, str]] = set()  # endpoints not to try again
        self._channel_lock = threading.Lock()
        self._node: str | None = None
        # Shards that are down as this handle saw them: a call failed, or a deadline passed
        # unanswered; cleared by any answer. Set operations are atomic, and reads share it.
        self.down: set[int] = set()
        self.ads: int | None = None  # live ads after this handle's last mutation
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
        import ray

        def wait(refs) -> None:
            while ray.wait(refs, num_returns=len(refs), timeout=0.2)[1]:
                if stop is not None and stop.is_set():
                    raise Cancelled("stopped while the cluster started")

        options = options or ClusterOptions()
        state = Path(state).resolve()
        n = read_layout(state)
        shard_cls, coordinator_cls = _actor_classes()
        shards = [
            shard_cls.options(
                num_cpus=options.shard_cpus,
                num_gpus=options.shard_gpus,
                max_concurrency=options.max_concurrency,
            ).remote(str(shard_dir(state, i)), i, options.device, options.max_concurrency)
            for i in range(n)
        ]
        # A shard whose folder cannot be opened fails here, with its error (a constructor that
        # fails is not restarted).
        refs = [s.pid.remote() for s in shards]
        wait(refs)
        ray.get(refs)
        coordinator = coordinator_cls.options(max_concurrency=32).remote(
            str(coordinator_dir(state)), shards
        )
        while True:
            ref = coordinator.read_point.remote(RECOVERY_POLL_S)
            wait([ref])
            if not ray.get(ref)[2]:
                return cls(shards, coordinator)

    def __reduce__(self):
        return (Cluster, (self.shards, self.coordinator))

    def channel(self, s: int) -> channel.Channel | None:
        """The open channel to shard s, if any."""
        found = self._channels.get(s)
        return found if found is not None and not found.closed else None

    def connect(self, s: int, endpoint: tuple[str, str] | None) -> None:
        """Connect to shard s's channel at `endpoint` (from its answer), if it is on this node
        and none is open; an endpoint that refuses is not tried again (its process is gone,
        and the next process has another)."""
        if endpoint is None or not self.direct or self.channel(s) is not None:
            return
        with self._channel_lock:
            if self.channel(s) is not None or endpoint in self._refused:
                return
            if self._node is None:
                import ray

                self._node = ray.get_runtime_context().get_node_id()
            if endpoint[0] != self._node:
                self._refused.add(endpoint)
                return
            try:
                self._channels[s] = channel.Channel(endpoint[1])
            except OSError:
                self._refused.add(endpoint)

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
            ready, _ = ray.wait(list(calls), num_returns=1,
                                timeout=max(deadline - time.monotonic(), 0))  # fmt: skip
            if not ready:
                break
            shard = calls.pop(ready[0])
            try:
                return ray.get(ready[0])
            except RayActorError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)  # a shard gone for good fails at once
                    calls[shard.info.remote()] = shard
        raise Unavailable(f"no shard answered within {timeout_s:g} s (down or restarting)",
                          list(range(len(self.shards))))  # fmt: skip

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
                raise Unavailable(f"the coordinator did not answer within {timeout_s:g} s "
                                  "(down or restarting)", []) from e  # fmt: skip
            if not recovering:
                return version, touched
            if time.monotonic() >= deadline:
                raise Unavailable(f"shards {recovering} are recovering (the coordinator "
                                  "restarted and waits for them)", recovering)  # fmt: skip

    # ---- reads --------------------------------------------------------------------------

    def scatter(
        self,
        query: tuple[np.ndarray, np.ndarray, np.ndarray],
        requests: Sequence[tuple[Any, Mapping]],
        ks: Sequence[int],
    ) -> Read:
        """Start a read: every shard asked (and the coordinator, without a last read point).
        The query and requests travel in the calls (`Read._ray_payload`)."""
        return Read(self, (query, list(requests), list(ks)))

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
        import ray
        from ray.exceptions import RayActorError

        s = int(shard_of([ad_id], len(self.shards))[0])
        deadline = time.monotonic() + timeout_s
        while True:
            ref = self.shards[s].get.remote(int(ad_id))
            ready, _ = ray.wait([ref], timeout=max(deadline - time.monotonic(), 0))
            if ready:
                try:
                    found = ray.get(ref)
                except RayActorError:
                    self.down.add(s)
                    if time.monotonic() < deadline:
                        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
                        continue
                else:
                    self.down.discard(s)
                    return found
            raise Unavailable(f"shard {s} (which holds ad id {ad_id}) did not answer within "
                              f"{timeout_s:g} s (down or restarting)", [s])  # fmt: skip

    # ---- mutations ----------------------------------------------------------------------

    def _mutate(self, ops: dict[int, tuple[str, dict, Any]], key: str | None = None) -> int:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        self.last_point = None  # the next read asks the coordinator (reads its own writes)
        try:
            out = ray.get(self.coordinator.mutate.remote(ops, key), timeout=MUTATION_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as e:
            raise Unavailable(f"the coordinator did not answer ({e}); the mutation may or "
                              "may not have been applied", []) from e  # fmt: skip
        if out[0] == "ok":
            self.ads = out[2]
            return out[1]
        if out[0] == "invalid":
            from m31.index import AdIndexError

            raise AdIndexError(out[1])
        raise Unavailable(out[1], out[2])

    def upsert(self, ad_ids, g, x, b, attributes) -> int:
        """Upsert ads (ids [n], g [n, G], x [n, D], b [n] numpy; attributes an arrow table or
        n dicts) on their shards, all or none; the new global version."""
        import pyarrow as pa

        ids = np.asarray(ad_ids, dtype=np.int64)
        if len(np.unique(ids)) != len(ids):
            from m31.index import AdIndexError

            uniq, counts = np.unique(ids, return_counts=True)
            raise AdIndexError(f"upsert: ad id {int(uniq[counts > 1][0])} appears more than once")
        table = attributes if isinstance(attributes, pa.Table) else None
        owner = shard_of(ids, len(self.shards))
        ops = {}
        for s in np.unique(owner).tolist():
            rows = np.flatnonzero(owner == s)
            attrs = (
                table.take(pa.array(rows)) if table is not None else [attributes[i] for i in rows]
            )
            ops[s] = ("upsert", {"ad_ids": ids[rows], "g": g[rows], "x": x[rows], "b": b[rows],
                                 "attributes": attrs}, None)  # fmt: skip
        return self._mutate(ops)

    def update_attributes(self, ad_id: int, attrs: Mapping[str, Any], check=None) -> int:
        s = int(shard_of([ad_id], len(self.shards))[0])
        return self._mutate({s: ("update_attributes", {"ad_id": int(ad_id), "attrs": dict(attrs)},
                                 check)})  # fmt: skip

    def delete(self, ad_ids) -> int:
        ids = np.asarray(ad_ids, dtype=np.int64).reshape(-1)
        owner = shard_of(ids, len(self.shards))
        return self._mutate(
            {s: ("delete", {"ad_ids": ids[owner == s]}, None) for s in np.unique(owner).tolist()}
        )

    def add_events(self, user_ids, ad_ids, ts, surfaces, key=None, types=None, weights=None) -> int:
        """Engagement events [n] each (`DurableIndex.add_events`'s arguments) on the shards
        owning their users, all or none; the new global version (a call whose idempotency `key`
        was committed already: its version; AdIndexError if that was another call)."""
        owner = shard_of(np.asarray(user_ids, dtype=np.int64), len(self.shards))
        columns = {"user_id": user_ids, "ad_id": ad_ids, "ts": ts, "surface": surfaces,
                   "type": types, "weight": weights}  # fmt: skip
        ops = {}
        for s in np.unique(owner).tolist():
            rows = np.flatnonzero(owner == s).tolist()
            args = {k: None if v is None else [v[i] for i in rows] for k, v in columns.items()}
            ops[s] = ("events", args, None)
        return self._mutate(ops, key)

    def set_users(self, users: Sequence[tuple[int, Mapping[str, int]]]) -> int:
        """Set attribute codes of users, (user id, codes) each, on their owning shards."""
        owner = shard_of([u for u, _ in users], len(self.shards)).tolist()
        ops: dict[int, tuple[str, dict, Any]] = {}
        for (user_id, codes), s in zip(users, owner, strict=True):
            ops.setdefault(s, ("users", {"users": []}, None))[1]["users"].append(
                [int(user_id), dict(codes)]
            )
        return self._mutate(ops)

    def user_changes(
        self, since: Mapping[int, int], timeout_s: float
    ) -> tuple[dict[int, tuple], list[int]]:
        """({shard: `Shard.user_changes` after since[shard]} of the shards asked in `since`
        that answered within `timeout_s`, the shards that did not)."""
        import ray
        from ray.exceptions import RayActorError

        calls = {self.shards[s].user_changes.remote(v): s for s, v in since.items()}
        ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        done = set(ray.wait(list(calls), num_returns=len(calls), timeout=0)[0])
        out, down = {}, []
        for ref, s in calls.items():
            try:
                if ref not in done:
                    raise TimeoutError
                out[s] = ray.get(ref)
                self.down.discard(s)
            except (RayActorError, TimeoutError):
                down.append(s)
        return out, sorted(down)

    def snapshot(self) -> int:
        """Snapshot every shard; the global version."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            out = ray.get(self.coordinator.snapshot.remote(), timeout=MUTATION_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as e:
            raise Unavailable(f"the coordinator did not answer ({e})", []) from e
        if out[0] != "ok":
            raise Unavailable(out[1], out[2])
        return out[1]
