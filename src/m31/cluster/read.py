"""A read of a sharded index in progress, as an ingress drives it (DESIGN §7, "Read points"):
the query scattered to every shard, their top-k gathered at one read point and merged exactly.

Shapes: B requests, E experts, G gate-key dim, D value dim.

The ingress sends the query (encoded once) and the requests to every shard and asks for its
top-k: through the shard's channel where it is on the ingress's node and connected
(`m31.cluster.channel`: Ray's call path costs more than a millisecond each way), else as a Ray
call; when it has no read point it asks the coordinator for one (version, touched, recovering)
in parallel. A shard answers at the last version that changed it; an answer is used when that
is touched[s] of the read point, so the merged answer is the whole index at exactly `version`.
A shard that committed something newer meanwhile is asked again at touched[s] (it keeps views
of its last few versions), or, if it no longer holds that view, the read point is taken again.
Ties across shards go to the lower ad id, as in one process (`m31.engine.merge`). `Read` is one
such scatter-gather; `Cluster.gather` drives one to its end, and `m31.cluster.batches` drives
several at once (`ready`).

Failure. A read whose shard call fails (a Ray call, or its channel closing) asks it again
through Ray (the call fails again every few seconds until the restarted actor answers) until
the read's deadline. A shard is *down* from a failed call, or from a deadline it let pass
unanswered (a stopped process fails nothing), until it answers again; so is a shard the
coordinator names as recovering (it restarted and has not resolved that shard yet). At the
deadline, shards still missing make the read fail with `Unavailable` — or, for a read that
allows a partial answer, the answer says which shards are missing; such a read does not wait
for a shard that is down, only for the others. Never a silently partial answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from m31.cluster import channel
from m31.cluster.shard import Answer, Moved
from m31.engine import Retrieved, merge
from m31.engine.caps import group_cap
from m31.engine.explain import finish
from m31.index.errors import Unavailable

if TYPE_CHECKING:
    from m31.cluster.cluster import Cluster

# A query this large (bytes of q, v, p) goes to several shards through the object store (when
# asked through Ray).
PUT_BYTES = 32 << 10
# How long the second round of an explanation (each shard's count of its eligible ads ranked
# before the asked ones) may take; its cost is one scoring of the shard's eligible ads.
RANK_TIMEOUT_S = 30.0
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
    # per request, its `m31.engine.explain.Explanation` if it asked why (over the shards that
    # answered), else None
    explanations: list = field(default_factory=list)


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
        self.calls[self.cluster.ask_point(wait_s)] = -1

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
            raise Unavailable(
                "the coordinator did not answer within the deadline (down or restarting)", []
            )
        ok = {s: a for s, a in self.answers.items() if self.fits(s)}
        results, explanations = [], []
        requests = self.payload[1]
        for r, k in zip(rows, ks, strict=True):
            parts = [Retrieved(*ok[s].results[r]) for s in sorted(ok)]
            cap = group_cap(requests[r][0].max_per)
            results.append(merge(parts, k, cap))
            asked = any(r in a.parts for a in ok.values())
            explanations.append(self._explained(r, k, cap, results[-1], ok) if asked else None)
        timings = {
            stage: max((a.timings_ms[stage] for a in ok.values()), default=0.0)
            for stage in ("mask", "score_topk")
        }
        rows_scored = sum(a.rows for a in ok.values())
        missing = self.missing()
        return Gathered(results, self.point[0], missing, rows_scored, timings, explanations)

    def _explained(self, r: int, k: int, cap, found: Retrieved, ok: dict[int, Answer]):
        """Request `r`'s explanation from the answering shards' parts: a second round asks
        each how many of its eligible ads rank before each eligible asked ad, at the read's
        version (`m31.engine.explain.finish`)."""
        request = self.payload[1][r]
        names = self.payload[3][1]
        parts = [ok[s].parts[r] for s in sorted(ok)]
        pairs = [pair for p in parts for pair in p.scores.items()]
        before = dict.fromkeys((a for a, _ in pairs), 0)
        if pairs:
            query = tuple(t[r] for t in self.payload[0])
            at = self.point[0]
            calls = {}
            for s in sorted(ok):
                direct = self.cluster.channel(s)
                if direct is not None:
                    calls[s] = direct.call("ranked_before", request, query, pairs, at)
                else:
                    ref = self.cluster.shards[s].ranked_before.remote(request, query, pairs, at)
                    calls[s] = ref.future()
            from ray.exceptions import RayActorError

            for s, call in calls.items():
                try:
                    counts = call.result(timeout=RANK_TIMEOUT_S)
                except (channel.ChannelClosed, RayActorError, TimeoutError) as e:  # died, hangs
                    why = f"shard {s} did not answer the explanation's ranks ({e or 'timeout'})"
                    raise Unavailable(why, [s]) from e
                if isinstance(counts, Moved):
                    raise Unavailable(f"shard {s} moved past version {at} while explaining", [s])
                for (a, _), n in zip(pairs, counts, strict=True):
                    before[a] += n
        why_not = request[0].why_not
        return finish(parts, before, found, k, cap, names, why_not)

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
