"""The coordinator of a cluster's mutations: global versions and the two-phase commit
(DESIGN §7). Plain Python run as one Ray actor (`m31.cluster.actors`); ingress replicas send
it mutations already encoded and split by shard, and ask it for read points.

Versions. One global sequence: every transaction (an upsert batch, however many shards it
spans; an update; a delete; a group of concurrent events or users calls, `m31.cluster.group`)
gets the next integer, and only after every shard it touches has committed it. So `version`
(the last acknowledged one) is a state every shard holds, and `read_point()` = (version,
touched, recovering) where touched[s] is the last version that changed shard s: a read
answered by each shard s at touched[s] is the whole index at `version`, never older, and never
a half-applied batch. That version is what the HTTP API calls `index_version`.

Two-phase commit of one transaction (one at a time, under a mutex; the calls to the shards go
on their channels where they share this process's machine, else through Ray,
`m31.cluster.channel.Link`):

1. prepare on every shard it touches (in parallel): each validates and fsyncs a prepare record,
   or says no (an invalid mutation: the error is the caller's 422) or is unreachable (down,
   restarting, or silent for `PREPARE_WAIT_S`);
2. all said yes: append ("commit", txn, version, shards, [[key, digest], ...]) to
   `decisions.log` and fsync — the commit point; otherwise send abort to every participant and
   answer at once (nothing was changed; a participant that missed the abort drops the
   transaction at its next prepare);
3. commit on every participant, retrying a shard that died until its restarted actor takes it
   (the shard, recovered from its logs, holds the transaction in doubt until then);
4. advance `version` and answer it.

Idempotency keys: a mutation may carry one (an events call's) with the digest of its call; both
are logged in its commit record (and carried into the base record a snapshot leaves). A
mutation whose key was committed already is answered with that commit's version without being
applied again, or refused as invalid if its digest differs (`m31.users.idempotency`).

A coordinator that dies is restarted by Ray. Its constructor reads `decisions.log` only, so it
cannot fail because shards are down (Ray does not restart an actor whose constructor failed);
a background thread then resolves every shard's transaction in doubt (commit if logged — that
shard's last logged transaction — else abort: presumed abort), retrying each shard until it
answers. Until a shard is resolved it is `recovering`: read points name it (its answers may be
older than touched[s]) and mutations touching it are refused as unavailable. Only commits are
logged.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from m31.cluster.channel import ChannelClosed, Link
from m31.cluster.group import GROUPED, Call, keys_of, merged
from m31.cluster.records import RecordLog
from m31.users.idempotency import IdempotencyKeys, KeyReused, call_digest

logger = logging.getLogger(__name__)


# How long a decided commit is retried against a shard that does not come back.
COMMIT_RETRY_S = 600.0
# How long a participant may take to prepare before the mutation is refused as unavailable: a
# shard that is stopped (not dead) never answers, and the coordinator serialises mutations.
PREPARE_WAIT_S = 10.0
# The shortest time between two calls of a recovery to one shard.
RESOLVE_RETRY_S = 1.0


class Coordinator:
    def __init__(self, path: str | Path, shards: list) -> None:
        """`shards`: the shard actors, in shard order."""
        self.path, self.shards = Path(path), list(shards)
        self._log, records = RecordLog.open(self.path / "decisions.log")
        self._mutex = threading.Lock()  # one transaction at a time
        self._queue: list[Call] = []  # events and users calls waiting for the next group
        self._queue_lock = threading.Lock()
        self._state = threading.Condition()  # guards version, touched, ads, recovering
        self._failed: str | None = None
        self.version, self.touched = 0, [0] * len(self.shards)
        self._keys = IdempotencyKeys()  # of the mutations committed
        last: list[tuple[str, int] | None] = [None] * len(self.shards)
        for record in records:
            if record[0] == "base":
                self.version, self.touched = record[1], list(record[2])
                self._keys = IdempotencyKeys(record[3] if len(record) > 3 else [])
            else:
                txn, version, participants = record[1:4]
                self.version = version
                for s in participants:
                    self.touched[s], last[s] = version, (txn, version)
                for key, digest in _logged_keys(record):
                    self._keys.remember(key, version, digest)
        self._last = last  # per shard: (txn, version) of the last commit that touched it
        self.held = [(0, 0)] * len(self.shards)  # per shard: (live ads, stored users)
        # The write path's calls to the shards: on their channels where they run on this node
        self._links = [Link(shard) for shard in self.shards]
        self._recovering = set(range(len(self.shards)))
        self._why: dict[int, str] = {}  # the last error of a shard still recovering
        threading.Thread(
            target=self._recover, args=(list(last),), name="m31-recover", daemon=True
        ).start()

    def _recover(self, last: list[tuple[str, int] | None]) -> None:
        """Resolve each shard's transaction in doubt, asking again a shard that fails, until
        every shard answered."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        def ask(s: int) -> None:
            calls[self.shards[s].resolve.remote(last[s])] = (s, time.monotonic())

        calls: dict[Any, tuple[int, float]] = {}  # ref -> (shard, sent at)
        later: dict[int, float] = {}  # shard -> when to ask it again
        for s in range(len(self.shards)):
            ask(s)
        while calls or later:
            now = time.monotonic()
            for s in [s for s, at in later.items() if at <= now]:
                del later[s]
                ask(s)
            timeout = max(min(later.values()) - now, 0.0) if later else None
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=timeout)
            if not ready:
                continue
            s, sent = calls.pop(ready[0])
            try:
                held = ray.get(ready[0])
            except (RayActorError, RayTaskError) as e:
                self._why[s] = (
                    "down or restarting"
                    if isinstance(e, RayActorError)
                    else f"it could not resolve its transaction in doubt: {e.cause}"
                )
                # A restarting actor's calls fail by themselves every few seconds; one gone
                # for good, or refusing, fails at once: not faster than RESOLVE_RETRY_S.
                later[s] = max(sent + RESOLVE_RETRY_S, time.monotonic())
                continue
            with self._state:
                self.held[s] = tuple(held)
                self._recovering.discard(s)
                self._why.pop(s, None)
                self._state.notify_all()

    def read_point(self, wait_s: float = 0.0) -> tuple[int, list[int], list[int]]:
        """(version, touched, recovering): `recovering` names the shards not resolved yet since
        this coordinator started; waits up to `wait_s` for them."""
        with self._state:
            if wait_s > 0:
                self._state.wait_for(lambda: not self._recovering, timeout=wait_s)
            return self.version, list(self.touched), sorted(self._recovering)

    def recovering(self) -> dict[int, str]:
        """The shards not resolved yet, each with why (its last error)."""
        with self._state:
            return {s: self._why.get(s, "not answered yet") for s in sorted(self._recovering)}

    def mutate(
        self, ops: Mapping[int, tuple[str, dict[str, Any], Any]], key: str | None = None
    ) -> tuple:
        """Apply {shard: (op, args, check)} atomically: ("ok", version, live ads, stored
        users), ("invalid", message) when a shard refused it, or ("unavailable", message,
        shards). A mutation whose idempotency `key` was committed already: ("ok", that version,
        live ads, stored users), or ("invalid", message) if that mutation applied other events
        (`events_digest`). Events and users calls that arrive while another transaction runs
        share the next one (`m31.cluster.group`), and its version."""
        call = Call(ops, key, None if key is None else events_digest(ops))
        if call.kind is None:
            with self._mutex:
                return self._alone(call)
        with self._queue_lock:
            self._queue.append(call)
        with self._mutex:
            if call.result is None:  # not taken by the group before: this thread commits
                with self._queue_lock:
                    calls, self._queue = self._queue, []
                try:
                    self._group(calls)
                except Exception as e:  # every queued call gets an answer, this one's too
                    logger.exception("a group of %d calls failed", len(calls))
                    why = self._failed or f"the coordinator failed during the transaction ({e})"
                    for queued in calls:
                        if queued.result is None:
                            queued.result = ("unavailable", f"{why}; it may have been applied", [])
        return call.result

    def _checked(self, call: Call) -> tuple | None:
        """The answer of a call that needs no transaction (its key was committed, or used for
        another call) or cannot have one now (refused or recovering shards); else None."""
        if call.key is not None:
            try:
                done = self._keys.applied(call.key, call.digest)
            except KeyReused as e:
                return ("invalid", str(e))
            if done is not None:
                return ("ok", done, *self.totals())
        if self._failed is not None:
            return ("unavailable", self._failed, [])
        with self._state:
            waiting = sorted(set(call.ops) & self._recovering)
        if waiting:
            why = "are recovering (the coordinator restarted and waits for them)"
            return ("unavailable", f"shards {waiting} {why}; nothing was changed", waiting)
        return None

    def _alone(self, call: Call) -> tuple:
        return self._checked(call) or self._transaction(call.ops, keys_of([call]))

    def _group(self, calls: list[Call]) -> None:
        """Answer every queued call: those of one kind in one transaction. A call repeating
        the key of one before it in the queue (a retry sent while the first was queued) is
        answered after that one, as a retry."""
        live, retries, keys = [], [], set()
        for call in calls:
            if call.key is not None and call.key in keys:
                retries.append(call)
                continue
            call.result = self._checked(call)
            if call.result is None:
                live.append(call)
                if call.key is not None:
                    keys.add(call.key)
        for kind in GROUPED:
            self._commit_group([c for c in live if c.kind == kind])
        for call in retries:
            call.result = self._alone(call)

    def _commit_group(self, calls: list[Call]) -> None:
        """One transaction for `calls` (of one kind). Refused by a shard: each call alone,
        for its own answer. A shard down: its calls answered unavailable, the rest again."""
        while len(calls) > 1:
            out = self._transaction(merged(calls), keys_of(calls))
            if out[0] == "invalid":
                break
            down = set(out[2]) if out[0] == "unavailable" else set()
            rest = [c for c in calls if down and not down & set(c.ops)]
            for call in calls:
                if call not in rest:
                    call.result = out
            calls = rest
        for call in calls:
            call.result = self._alone(call)

    def _transaction(self, ops: Mapping[int, tuple[str, dict[str, Any], Any]], keys) -> tuple:
        """The two-phase commit of `ops` (module docstring), logging the [key, digest] pairs
        `keys` with its decision: ("ok", version, live ads, stored users), ("invalid", message) or
        ("unavailable", message, shards)."""
        participants = sorted(ops)
        txn = uuid.uuid4().hex
        links, deadline = self._links, time.monotonic() + PREPARE_WAIT_S
        asked = {s: links[s].call("prepare", txn, *ops[s], self._last[s]) for s in participants}
        wait_futures(asked.values(), timeout=PREPARE_WAIT_S)
        # A channel that closed: its shard's process died. Asked again through Ray, which
        # waits for the restarted one (as a first call through Ray would have), within the wait.
        again = [s for s in participants if _closed(asked[s])]
        for s in again:
            asked[s] = links[s].call("prepare", txn, *ops[s], self._last[s])
        if again:
            wait_futures([asked[s] for s in again], timeout=max(deadline - time.monotonic(), 0))
        invalid, down, failed = None, [], None
        for s in participants:
            if not asked[s].done():
                down.append(s)  # silent: stopped, or its machine unreachable
                continue
            error = asked[s].exception()
            if isinstance(error, ValueError):  # the mutation is invalid (AdIndexError)
                invalid = str(error) if invalid is None else invalid
            elif isinstance(error, ChannelClosed):  # down or restarting
                down.append(s)
            elif error is not None:  # the shard's own failure, not an outage: said as such
                logger.error("shard %d failed to prepare", s, exc_info=error)
                failed = failed or f"shard {s} failed to prepare ({type(error).__name__}: {error})"
                down.append(s)
        if invalid is not None or down:
            # Not waited for: a shard still holding the transaction (it missed this abort,
            # or prepared after it) aborts it at its next prepare (`Shard.prepare`).
            for s in participants:
                links[s].call("abort", txn)
            if failed is not None:  # may pass (a shard recovering) or not (a bug): retried
                return ("unavailable", f"{failed}; nothing was changed", down)
            if invalid is not None:
                return ("invalid", invalid)
            why = "unavailable (down or restarting); nothing was changed"
            return ("unavailable", f"shards {down} {why}", down)
        version = self.version + 1
        self._log.append(("commit", txn, version, participants, keys))
        for key, digest in keys:
            self._keys.remember(key, version, digest)
        held = self._decide_all(participants, lambda s: links[s].call("commit", txn, version))
        with self._state:
            self.version = version
            for s in participants:
                self.touched[s], self.held[s] = version, tuple(held[s])
                self._last[s] = (txn, version)
        return ("ok", version, *self.totals())

    def totals(self) -> tuple[int, int]:
        """(live ads, stored users) of the cluster, as the shards last said."""
        return sum(a for a, _ in self.held), sum(u for _, u in self.held)

    def _decide_all(self, participants: list[int], send) -> dict[int, Any]:
        """Send a decision to every participant, again to those that died meanwhile (their
        restarted actors hold the transaction in doubt), until all took it; their replies.
        `send(s)` answers a Future (`Link.call`)."""
        deadline = time.monotonic() + COMMIT_RETRY_S
        todo, replies = list(participants), {}
        while todo:
            sent = {s: send(s) for s in todo}
            todo = []
            for s, future in sent.items():
                try:
                    replies[s] = future.result()
                except ChannelClosed:
                    todo.append(s)
            if todo and time.monotonic() > deadline:
                self._failed = (
                    f"shards {todo} did not take a decided transaction within "
                    f"{COMMIT_RETRY_S:.0f} s; mutations are refused until the coordinator restarts"
                )
                raise RuntimeError(self._failed)
        return replies

    def snapshot(self) -> tuple:
        """Snapshot every shard: ("ok", the global version (unchanged)) or ("unavailable",
        message, shards)."""
        import ray
        from ray.exceptions import RayActorError

        with self._mutex:
            with self._state:
                waiting = sorted(self._recovering)
            if waiting:
                why = "are recovering (the coordinator restarted and waits for them)"
                return ("unavailable", f"shards {waiting} {why}", waiting)
            refs = [
                shard.snapshot.remote(t) for shard, t in zip(self.shards, self._last, strict=True)
            ]
            down = []
            for s, ref in enumerate(refs):
                try:
                    ray.get(ref)
                except RayActorError:
                    down.append(s)
            if down:
                why = "unavailable (down or restarting); the others wrote their snapshots"
                return ("unavailable", f"shards {down} {why}", down)
            self._log.rewrite([("base", self.version, list(self.touched), self._keys.items())])
            return ("ok", self.version)

    def pid(self) -> int:
        import os

        return os.getpid()


def _closed(future) -> bool:
    return future.done() and isinstance(future.exception(), ChannelClosed)


def _logged_keys(record: tuple) -> list:
    """[key, digest] pairs a commit record logged: a list of them, or (records written before
    group commit) one key and its digest, or none."""
    logged = record[4] if len(record) > 4 else None
    if logged is None or isinstance(logged, list):
        return logged or []
    return [[logged, record[5] if len(record) > 5 else None]]


def events_digest(ops: Mapping[int, tuple[str, dict[str, Any], Any]]) -> str:
    """The digest (`call_digest`) of the events an events mutation gives its shards, in shard
    order: two calls that give every shard the same events in the same order apply the same
    thing, and digest the same."""
    names = ("user_id", "ad_id", "ts", "surface", "type", "weight")
    columns: dict[str, list] = {name: [] for name in names}
    for s in sorted(ops):
        op, args, _ = ops[s]
        if op != "events":
            raise ValueError(f"an idempotency key goes with events, not {op!r}")
        n = len(args["user_id"])
        for name in names:
            columns[name] += args[name] if args.get(name) is not None else [None] * n
    return call_digest(*(columns[name] for name in names))
