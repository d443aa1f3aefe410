"""The actors of a cluster and where they run (DESIGN §7, "The cluster on Ray"): a shard
actor per shard folder, one coordinator, placed by `ClusterOptions` and started by
`start_actors`. Both restart when they die (`max_restarts=-1`): a shard rebuilds from its
snapshot, write-ahead log and transaction log; the coordinator from its decisions log.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path

from m31.cluster import channel
from m31.cluster.coordinator import Coordinator
from m31.cluster.layout import coordinator_dir, read_layout, shard_dir
from m31.cluster.read import RECOVERY_POLL_S
from m31.cluster.shard import Answer, Moved, Shard


@dataclass
class ClusterOptions:
    """How the actors are placed: one GPU each on a GPU cluster, CPU workers otherwise."""

    device: str = "cpu"
    shard_cpus: float = 1.0
    shard_gpus: float = 0.0
    max_concurrency: int = 8  # calls a shard serves at once (searches beside a commit)


# Calls the coordinator serves at once (through Ray, and again on its channel): those waiting
# to join the next group commit, and read points.
COORDINATOR_CALLS = 32


# A shard's side of the two-phase commit, served on its channel's connection threads.
_TWO_PHASE = frozenset({"prepare", "commit", "abort"})


class Cancelled(RuntimeError):
    """A start-up stopped before its end."""


def _serve(
    methods: dict, workers: int, inline: frozenset[str] = frozenset()
) -> tuple[channel.Server | None, tuple[str, str] | None]:
    """A channel serving `methods` beside Ray (`inline` ones on their connection's thread),
    and its endpoint (none where channels are not available)."""
    if not channel.available():
        return None, None
    import ray

    server = channel.Server(methods, workers, inline)
    return server, (ray.get_runtime_context().get_node_id(), server.name)


class _ShardActor(Shard):
    """A shard as its Ray actor runs it: it also serves its reads (searches, whose answers
    through Ray carry its endpoint; users, ads and groups) and its side of the two-phase commit
    on a channel (`m31.cluster.channel`)."""

    def __init__(self, path: str, index: int, device: str = "cpu", workers: int = 8) -> None:
        super().__init__(path, index, device)
        methods = {
            "search": super().search,
            "ranked_before": self.ranked_before,
            "stored_users": self.stored_users,
            "get": self.get,
            "groups": self.groups,
            "prepare": self.prepare,
            "commit": self.commit,
            "abort": self.abort,
        }
        # The coordinator's calls: one at a time, each waiting for the shard's mutex anyway
        self._server, self._endpoint = _serve(methods, workers, _TWO_PHASE)

    def endpoint(self) -> tuple[str, str] | None:
        return self._endpoint

    def search(self, payload, at: int | None = None) -> Answer | Moved:
        got = super().search(payload, at)
        return dataclasses.replace(got, endpoint=self._endpoint) if isinstance(got, Answer) else got


class _CoordinatorActor(Coordinator):
    """The coordinator as its Ray actor runs it: it also takes mutations, and gives read
    points, on a channel."""

    def __init__(self, path: str, shards: list, workers: int = COORDINATOR_CALLS) -> None:
        super().__init__(path, shards)
        methods = {"mutate": self.mutate, "read_point": self.read_point}
        self._server, self._endpoint = _serve(methods, workers)

    def endpoint(self) -> tuple[str, str] | None:
        return self._endpoint


def _actor_classes():
    import ray

    shard = ray.remote(max_restarts=-1, max_task_retries=0)(_ShardActor)
    coordinator = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)(_CoordinatorActor)
    return shard, coordinator


def start_shards(state: str | Path, options: ClusterOptions) -> list:
    """The shard actors of the cluster state folder `state`, started (not waited for)."""
    shard_cls, _ = _actor_classes()
    return [
        shard_cls.options(
            num_cpus=options.shard_cpus,
            num_gpus=options.shard_gpus,
            max_concurrency=options.max_concurrency,
        ).remote(str(shard_dir(state, i)), i, options.device, options.max_concurrency)
        for i in range(read_layout(state))
    ]


def start_actors(state: str | Path, options: ClusterOptions, stop: threading.Event | None):
    """(shard actors, coordinator) of the cluster state folder `state` (`m31 cluster init`
    makes one), started on the Ray cluster this process is connected to; once every shard
    opened and the coordinator resolved them (`Cancelled` if `stop` is set first: the actors
    go with this process's connection)."""
    import ray

    def wait(refs) -> None:
        while ray.wait(refs, num_returns=len(refs), timeout=0.2)[1]:
            if stop is not None and stop.is_set():
                raise Cancelled("stopped while the cluster started")

    state = Path(state).resolve()
    _, coordinator_cls = _actor_classes()
    shards = start_shards(state, options)
    # A shard whose folder cannot be opened fails here, with its error (a constructor that
    # fails is not restarted).
    refs = [s.pid.remote() for s in shards]
    wait(refs)
    ray.get(refs)
    coordinator = coordinator_cls.options(max_concurrency=COORDINATOR_CALLS).remote(
        str(coordinator_dir(state)), shards
    )
    while True:
        ref = coordinator.read_point.remote(RECOVERY_POLL_S)
        wait([ref])
        if not ray.get(ref)[2]:
            return shards, coordinator
