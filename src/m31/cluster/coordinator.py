"""The coordinator of a cluster's mutations: global versions and the two-phase commit
(DESIGN §7). Plain Python run as one Ray actor (`m31.cluster.cluster`); ingress replicas send
it mutations already encoded and split by shard, and ask it for read points.

Versions. One global sequence: every acknowledged mutation (an upsert batch, however many shards
it spans; an update; a delete) gets the next integer, and only after every shard it touches has
committed it. So `version` (the last acknowledged one) is a state every shard holds, and
`read_point()` = (version, touched) where touched[s] is the last version that changed shard s:
a read answered by each shard s at touched[s] is the whole index at `version`, never older, and
never a half-applied batch. That version is what the HTTP API calls `index_version`.

Two-phase commit of one mutation (one at a time, under a mutex):

1. prepare on every shard it touches (in parallel): each validates and fsyncs a prepare record,
   or says no (an invalid mutation: the error is the caller's 422) or is unreachable;
2. all said yes: append ("commit", txn, version, shards) to `decisions.log` and fsync — the
   commit point; otherwise abort on every participant and raise;
3. commit on every participant, retrying a shard that died until its restarted actor takes it
   (the shard, recovered from its logs, holds the transaction in doubt until then);
4. advance `version` and answer it.

A coordinator that dies is restarted by Ray: it rereads `decisions.log` and resolves every
shard's transaction in doubt (commit if logged — that shard's last logged transaction — else
abort: presumed abort). Only commits are logged.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from m31.cluster.records import RecordLog


def ray_get(refs):
    import ray

    return ray.get(refs)


# How long a decided commit is retried against a shard that does not come back.
COMMIT_RETRY_S = 600.0


class Unavailable(RuntimeError):
    """Shards could not be reached (down, restarting); nothing was changed."""

    def __init__(self, message: str, shards: list[int]) -> None:
        super().__init__(message)
        self.shards = shards


class Coordinator:
    def __init__(self, path: str | Path, shards: list) -> None:
        """`shards`: the shard actors, in shard order."""
        self.path, self.shards = Path(path), list(shards)
        self._log, records = RecordLog.open(self.path / "decisions.log")
        self._mutex = threading.Lock()  # one mutation at a time
        self._state = threading.Lock()  # guards version and touched
        self._failed: str | None = None
        self.version, self.touched = 0, [0] * len(self.shards)
        last: list[tuple[str, int] | None] = [None] * len(self.shards)
        for record in records:
            if record[0] == "base":
                self.version, self.touched = record[1], list(record[2])
            else:
                _, txn, version, participants = record
                self.version = version
                for s in participants:
                    self.touched[s], last[s] = version, (txn, version)
        self._resolve(last)
        self.ads = [info["ads"] for info in ray_get([s.info.remote() for s in self.shards])]

    def _resolve(self, last: list[tuple[str, int] | None]) -> None:
        ray_get([shard.resolve.remote(t) for shard, t in zip(self.shards, last, strict=True)])

    def live_ads(self) -> int:
        with self._state:
            return sum(self.ads)

    def read_point(self) -> tuple[int, list[int]]:
        with self._state:
            return self.version, list(self.touched)

    def mutate(self, ops: Mapping[int, tuple[str, dict[str, Any], Any]]) -> tuple:
        """Apply {shard: (op, args, check)} atomically. ("ok", version, live ads), ("invalid",
        message) when a shard refused it, or ("unavailable", message, shards)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        with self._mutex:
            if self._failed is not None:
                return ("unavailable", self._failed, [])
            txn = uuid.uuid4().hex
            participants = sorted(ops)
            refs = {
                s: self.shards[s].prepare.remote(txn, ops[s][0], ops[s][1], ops[s][2])
                for s in participants
            }
            invalid, down = None, []
            for s in participants:
                try:
                    ray.get(refs[s])
                except RayTaskError as e:
                    cause = e.cause
                    if isinstance(cause, ValueError) and invalid is None:
                        invalid = str(cause)
                    elif not isinstance(cause, ValueError):
                        down.append(s)
                except RayActorError:
                    down.append(s)
            if invalid is not None or down:
                self._decide_all(participants, lambda s: self.shards[s].abort.remote(txn))
                if invalid is not None:
                    return ("invalid", invalid)
                return ("unavailable", f"shards {down} unavailable; nothing was changed", down)
            version = self.version + 1
            self._log.append(("commit", txn, version, participants))
            ads = self._decide_all(
                participants, lambda s: self.shards[s].commit.remote(txn, version)
            )
            with self._state:
                self.version = version
                for s in participants:
                    self.touched[s], self.ads[s] = version, ads[s]
            return ("ok", version, sum(self.ads))

    def _decide_all(self, participants: list[int], send) -> dict[int, Any]:
        """Send a decision to every participant, again to those that died meanwhile (their
        restarted actors hold the transaction in doubt), until all took it; their replies."""
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + COMMIT_RETRY_S
        todo, replies = list(participants), {}
        while todo:
            refs = {s: send(s) for s in todo}
            todo = []
            for s, ref in refs.items():
                try:
                    replies[s] = ray.get(ref)
                except RayActorError:
                    todo.append(s)
            if todo and time.monotonic() > deadline:
                self._failed = (
                    f"shards {todo} did not take a decided transaction within "
                    f"{COMMIT_RETRY_S:.0f} s; mutations are refused until the coordinator restarts"
                )
                raise RuntimeError(self._failed)
        return replies

    def snapshot(self) -> int:
        """Snapshot every shard; the global version (unchanged)."""
        import ray

        with self._mutex:
            ray.get([shard.snapshot.remote() for shard in self.shards])
            self._log.rewrite([("base", self.version, list(self.touched))])
            return self.version

    def pid(self) -> int:
        import os

        return os.getpid()
