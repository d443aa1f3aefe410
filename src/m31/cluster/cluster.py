"""A sharded index on Ray, as an ingress sees it: start (or attach to) the shard actors and
the coordinator of a cluster state folder, scatter a query to every shard and merge their
top-k exactly, route mutations to their owning shards through the coordinator (DESIGN §7).

Shapes: B requests, E experts, G gate-key dim, D value dim.

Reads. The ingress puts the query (encoded once) and the requests into Ray's object store once
and asks every shard for its top-k; in parallel it asks the coordinator for a read point
(version, touched). A shard answers at the last version that changed it; an answer is used
when that is touched[s] of the read point, so the merged answer is the whole index at exactly
`version`. A shard that committed something newer meanwhile is asked again at touched[s] (it
keeps views of its last few versions), or, if it no longer holds that view, the read point is
taken again. Ties across shards go to the lower ad id, as in one process (`m31.engine.merge`).

Failure. A shard actor that dies is restarted by Ray (`max_restarts=-1`) and rebuilds from its
snapshot, write-ahead log and transaction log. A read whose shard call fails asks it again (the
call waits for the restarted actor) until the read's deadline. At the deadline, shards still
missing make the read fail with `Unavailable` — or, for a read that allows a partial answer,
the answer says which shards are missing; such a read does not wait for a shard it saw fail,
only for the others. Never a silently partial answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from m31.cluster.coordinator import Coordinator, Unavailable
from m31.cluster.layout import coordinator_dir, read_layout, shard_dir, shard_of
from m31.cluster.shard import Answer, Moved, Shard
from m31.engine import Retrieved, merge

# Seconds a mutation may take before its caller gives up waiting (it may still commit).
MUTATION_TIMEOUT_S = 120.0


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


def _actor_classes():
    import ray

    shard = ray.remote(max_restarts=-1, max_task_retries=0)(Shard)
    coordinator = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)(Coordinator)
    return shard, coordinator


class Cluster:
    """Handles of one cluster's actors. `start` makes them (the caller owns them: they live
    while it does); the handles pickle, so Ray Serve replicas get them as arguments."""

    def __init__(self, shards: list, coordinator) -> None:
        self.shards, self.coordinator = list(shards), coordinator
        self._down: set[int] = set()  # shards whose last call failed
        self.ads: int | None = None  # live ads after this handle's last mutation

    @classmethod
    def start(cls, state: str | Path, options: ClusterOptions | None = None) -> Cluster:
        """Start the shard actors and the coordinator of the cluster state folder `state`
        (`m31 cluster init` makes one) on the Ray cluster this process is connected to."""
        import ray

        options = options or ClusterOptions()
        state = Path(state).resolve()
        n = read_layout(state)
        shard_cls, coordinator_cls = _actor_classes()
        shards = [
            shard_cls.options(
                num_cpus=options.shard_cpus,
                num_gpus=options.shard_gpus,
                max_concurrency=options.max_concurrency,
            ).remote(str(shard_dir(state, i)), i, options.device)
            for i in range(n)
        ]
        coordinator = coordinator_cls.options(max_concurrency=8).remote(
            str(coordinator_dir(state)), shards
        )
        ray.get(coordinator.read_point.remote())  # up: every shard opened, doubts resolved
        return cls(shards, coordinator)

    def __reduce__(self):
        return (Cluster, (self.shards, self.coordinator))

    def info(self) -> list[dict]:
        import ray

        return ray.get([s.info.remote() for s in self.shards])

    def read_point(self) -> tuple[int, list[int]]:
        import ray

        return ray.get(self.coordinator.read_point.remote())

    # ---- reads --------------------------------------------------------------------------

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
        and shards seen failing are not waited for).
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
        raised; `wait_for_failed`: wait for shards seen failing too (else only for the
        others)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        payload = ray.put((query, list(requests), list(ks)))
        n = len(self.shards)
        calls: dict[Any, int] = {}  # ref -> shard (or -1: the read point)

        def ask(s: int, at: int | None = None) -> None:
            calls[self.shards[s].search.remote(payload, at)] = s

        def ask_point() -> None:
            calls[self.coordinator.read_point.remote()] = -1

        for s in range(n):
            ask(s)
        ask_point()
        point: tuple[int, list[int]] | None = None
        answers: dict[int, Answer] = {}
        failed: set[int] = set()

        def settled() -> bool:
            if point is None:
                return False
            need = set(range(n)) - (set() if wait_for_failed else self._down | failed)
            return all(s in answers and answers[s].version == point[1][s] for s in need)

        while not settled():
            left = deadline - time.monotonic()
            if left <= 0 or not calls:
                break
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=left)
            if not ready:
                break
            ref = ready[0]
            s = calls.pop(ref)
            try:
                got = ray.get(ref)
            except RayTaskError as e:  # a bug, not an outage: no retry hides it
                raise e.cause from e
            except RayActorError:
                if s < 0:
                    ask_point()  # waits for the restarted coordinator
                    continue
                failed.add(s)
                self._down.add(s)
                ask(s)  # waits for the restarted actor
                continue
            if s < 0:
                point = got
                for t, answer in list(answers.items()):
                    if answer.version < point[1][t]:
                        del answers[t]
                        ask(t, point[1][t])
                    elif answer.version > point[1][t]:
                        del answers[t]  # newer than the read point: ask at its version
                        ask(t, point[1][t])
                continue
            self._down.discard(s)
            failed.discard(s)
            if isinstance(got, Moved):
                if point is not None and got.version > point[1][s]:
                    ask_point()  # the view is gone: a newer read point
                ask(s, None if point is None else max(point[1][s], got.version))
                continue
            if point is not None and got.version != point[1][s]:
                ask(s, point[1][s])
                continue
            answers[s] = got
        if point is None:
            raise Unavailable("the coordinator did not answer within the deadline", [])
        ok = {s: a for s, a in answers.items() if a.version == point[1][s]}
        missing = sorted(set(range(n)) - set(ok))
        results = []
        for r, k in enumerate(ks):
            parts = [Retrieved(*ok[s].results[r]) for s in sorted(ok)]
            results.append(merge(parts, k))
        rows = sum(a.rows for a in ok.values())
        timings = {
            stage: max((a.timings_ms[stage] for a in ok.values()), default=0.0)
            for stage in ("mask", "score_topk")
        }
        return Gathered(results, point[0], missing, rows, timings)

    def get(self, ad_id: int) -> tuple[dict, int] | None:
        """(attributes, version) of a live ad, None if no shard holds it."""
        import ray

        s = int(shard_of([ad_id], len(self.shards))[0])
        return ray.get(self.shards[s].get.remote(int(ad_id)))

    # ---- mutations ----------------------------------------------------------------------

    def _mutate(self, ops: dict[int, tuple[str, dict, Any]]) -> int:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            out = ray.get(self.coordinator.mutate.remote(ops), timeout=MUTATION_TIMEOUT_S)
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

    def snapshot(self) -> int:
        import ray

        return ray.get(self.coordinator.snapshot.remote())
