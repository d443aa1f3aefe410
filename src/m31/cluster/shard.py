"""One shard of a cluster: the ads that `shard_of` routes to it, in its own DurableIndex, and
its side of the two-phase commit (DESIGN §7). Plain Python: `m31.cluster.actors` runs it as a
Ray actor (restarted by Ray when it dies), the tests also run it in-process.

Shapes: B requests, N rows of the shard's table, E experts, G gate-key dim, D value dim.

Search: the ingress sends the query it encoded once (q [B, E, G], v [B, E, D], p [B, E]), the
requests (filter trees and targeting, compiled here against this shard's schema) and each
request's k; the shard builds the masks over its rows and runs `m31.engine.search`, so its
answer is its own exact top-k under the global tie rule. It answers at a global version: the
last transaction it committed (`applied`), or an older one it still holds a view of.

Users: the shard owns the users `shard_of(user_id)` routes to it (the same partition as the
ads'), seeded from the cluster state's online features (`m31.engine.load.online_users`, and
their organic events, `online_organic`) and kept in its DurableIndex's user store: engagement
events and user attributes are mutations like the ads' (ops "events" and "users"), logged and
versioned the same way. The shard serves its users to the ingresses (`stored_users`: each as of
its request's time, as one server reads its store), so that no ingress holds a user.

Mutations (two-phase, one transaction at a time; the coordinator serialises them):

* `prepare(txn, op, args, check, last)` first decides a transaction still prepared here with
  `last`, the coordinator's last commit on this shard (as `resolve` does), then validates the
  mutation against the index (touching nothing), appends ("prepare", txn, op, args, local
  version it will make) to `txn.log` and fsyncs it, and holds the shard for `txn`. An invalid
  mutation raises `AdIndexError` and logs nothing.
* `commit(txn, version)` appends ("commit", txn, version) and applies the mutation to the
  DurableIndex, neither fsync'd, and answers at the new global version. The coordinator's
  decision log is the commit point and the prepare record holds the change: a machine that
  loses power before the next prepare (whose fsync syncs the whole transaction log) may lose
  the commit record, and the change the DurableIndex had not synced (it is opened with
  `sync=False`); recovery then holds the transaction in doubt, the coordinator's `resolve`
  commits it again, and the change is applied where the index lacks it.
* `abort(txn)` appends ("abort", txn) and lets go. The coordinator does not wait for aborts: one
  lost with a dead process, or overtaken by its prepare, leaves the transaction prepared until
  the next prepare (or snapshot, or resolve) decides it from `last` — an abort, since the
  coordinator delivers every commit before it sends anything else.

Recovery (a new process on the folder, as after a kill): the DurableIndex replays its log; the
transaction log is read in order. A commit record whose mutation is not in the index yet (a
crash before the index's log had it on disk; the index's local version tells) is applied now. A
prepare record without a decision stays prepared ("in doubt") until the coordinator sends
commit or abort: its own retry of the decision, `resolve` when the coordinator restarts, or
the next prepare.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from m31.cluster.layout import read_layout, shard_of
from m31.cluster.records import RecordLog
from m31.engine import eligible_masks, request_context, search
from m31.engine.caps import group_cap
from m31.engine.explain import explain_part, ranked_before
from m31.engine.load import online_organic, online_users
from m31.index import AdIndexError, DurableIndex, DurableIndexError, compile_filter
from m31.index.filters import with_clauses
from m31.ops.threads import single_threaded
from m31.users.stored import StoredUser, read_users

# Views of older versions a shard keeps for reads that started before its last commit.
KEEP_VIEWS = 2
# How long a (re)starting shard waits for its folder's lock before it gives up.
LOCK_WAIT_S = 300.0


class TransactionError(RuntimeError):
    """A commit or prepare this shard cannot take (another transaction holds it, or the
    transaction is unknown here)."""


@dataclass
class _Prepared:
    txn: str
    op: str
    args: dict[str, Any]
    local_version: int  # the DurableIndex version applying it makes
    # an events op's events as its prepare checked them (not logged: a recovered prepare's
    # are checked again when applied)
    events: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class Answer:
    """A shard's search answer: per request (ad ids [k'], scores [k'], groups or None:
    `Retrieved`'s), at global `version`."""

    results: list[tuple[np.ndarray, np.ndarray]]
    version: int
    rows: int  # rows scored (N)
    timings_ms: dict[str, float]  # mask, score_topk
    # (node id, name) of the channel the shard serves its calls on (`m31.cluster.channel`):
    # set on answers through Ray, so that an ingress on its node connects
    endpoint: tuple[str, str] | None = None
    # Per request that asked why (by its row): this shard's `m31.engine.explain.Part`
    parts: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Moved:
    """The shard no longer holds a view of the asked version (it is at `version` now)."""

    version: int


class Shard:
    def __init__(self, path: str | Path, index: int, device: str = "cpu") -> None:
        self.path, self.number, self.device = Path(path), index, device
        shards = read_layout(self.path.parent)
        mine = lambda ids: shard_of(ids, shards) == index  # noqa: E731
        self._store = self._open(self.path / "index", device, online_users(self.path.parent, mine))
        self._organic = online_organic(self.path.parent, mine)
        self._log, records = RecordLog.open(self.path / "txn.log")
        self._mutex = threading.Lock()  # one prepare/commit/abort/snapshot at a time
        self._state = threading.Lock()  # guards applied and views
        self._prepared: _Prepared | None = None
        self.applied, self._last_txn = 0, None
        for record in records:
            self._recover(record)
        self._views: dict[int, Any] = {}
        # The versions since which the ads are as they are now: a search asked at any of them is
        # answered from the latest view (users' events and attributes change no ad). Since
        # `applied` after a restart: the logs do not say which commits changed ads.
        self._ads_since = self.applied

    @staticmethod
    def _open(path: Path, device: str, users) -> DurableIndex:
        """Open the shard's DurableIndex, waiting while another process still holds it: the
        process a restart replaces may take a moment to be gone (or hang, stopped)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                # Not synced: the transaction log holds every change first (module docstring).
                return DurableIndex.open(path, device=device, users=users, sync=False)
            except DurableIndexError as e:
                if "already open" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _recover(self, record: tuple) -> None:
        kind = record[0]
        if kind == "base":
            self.applied, self._last_txn = record[1], record[2]
        elif kind == "prepare":
            self._prepared = _Prepared(*record[1:])
        elif kind == "commit":
            txn, version = record[1], record[2]
            prepared = self._prepared
            if prepared is None or prepared.txn != txn:
                raise TransactionError(f"{self.path}/txn.log: commit of unknown txn {txn}")
            self._apply(prepared)
            self._prepared, self.applied, self._last_txn = None, version, txn
        elif kind == "abort":
            self._prepared = None

    # ---- reading ------------------------------------------------------------------------

    def info(self) -> dict:
        index = self._store.index
        ads, users = self.held()
        return {
            "shard": self.number,
            "ads": ads,
            "rows": index.num_rows,
            "version": self.applied,
            "local_version": self._store.version,
            "in_doubt": self._prepared.txn if self._prepared else None,
            "schema": index.schema,
            "dim_g": index.dim_g,
            "dim_x": index.dim_x,
            "dtype": str(index.dtype).removeprefix("torch."),
            "model_hash": index.model_hash,
            "users": None if self._store.users is None else users,
            "users_length": None if self._store.users is None else self._store.users.length,
        }

    def _view(self, at: int | None):
        """(view, version) at global version `at` (None: the latest), or None if not held."""
        with self._state:
            if at is None or self._ads_since <= at <= self.applied:
                view = self._store.index.frozen_view()
                self._views[self.applied] = view
                for old in sorted(self._views)[: -KEEP_VIEWS - 1]:
                    del self._views[old]
                return view, self.applied if at is None else at
            view = self._views.get(at)
            return None if view is None else (view, at)

    @torch.no_grad()
    def search(
        self,
        payload: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], Sequence[tuple], Sequence[int]],
        at: int | None = None,
    ) -> Answer | Moved:
        """payload = (query (q, v, p) as numpy, requests, ks), and for requests that ask why
        ({row: its query per expert slot}, the slots' names); a request is (AdRequest,
        targeting) or (AdRequest, targeting, clauses), its filter compiled here with the
        clauses the engine added to it, as `Retriever.prepare` compiles it
        (`m31.engine.prepare`). The answer holds this shard's `Part` of each explanation."""
        (q, v, p), asked, ks, *rest = payload
        asking = rest[0][0] if rest else {}  # request row -> its query per expert slot
        requests = [(r, who, more[0] if more else ()) for r, who, *more in asked]
        got = self._view(at)
        if got is None:
            return Moved(self.applied)
        view, version = got
        t0 = time.perf_counter()
        # Masks are small ops: on one core, as the engine builds them (`m31.ops.threads`).
        with single_threaded() if self.device == "cpu" else contextlib.nullcontext():
            filters = [self._filter(r, more) for r, _, more in requests]
            contexts = [request_context(r, who) for r, who, _ in requests]
            masks = eligible_masks(view, list(zip(contexts, filters, strict=True)))  # [B, N]
            query = tuple(torch.tensor(t, device=self.device) for t in (q, v, p))  # [B, E, *]
        t1 = time.perf_counter()
        caps = [group_cap(r.max_per) for r, _, _ in requests]
        valued = [r.rank == "value" for r, _, _ in requests]
        found = search(query, view, masks, ks, caps=caps, valued=valued)
        t2 = time.perf_counter()
        timings = {"mask": round(1000 * (t1 - t0), 3), "score_topk": round(1000 * (t2 - t1), 3)}
        rows = int(view.row_ids.shape[0])
        parts = {}
        for i, experts in asking.items():  # its part of each explanation (`m31.engine.explain`)
            r, _, more = requests[i]
            parts[i] = explain_part(
                view, contexts[i], filters[i],
                tuple(torch.tensor(t, device=self.device) for t in experts),
                tuple(t[i] for t in query), found[i], valued[i], r.why_not, r.filter, more,
                r.explain,
            )  # fmt: skip
        results = [(r.ad_ids, r.scores, r.groups) for r in found]
        return Answer(results, version, rows, timings, parts=parts)

    @torch.no_grad()
    def ranked_before(
        self, request: tuple, query: tuple[np.ndarray, np.ndarray, np.ndarray], pairs, at: int
    ) -> list[int] | Moved:
        """For each (ad id, score) of `pairs`, how many of this shard's eligible ads for
        `request` (as `search` takes one) rank before it at global version `at`, under the
        request's `query` (q, v, p of it alone): `m31.engine.explain.ranked_before`."""
        r, who, *more = request
        got = self._view(at)
        if got is None:
            return Moved(self.applied)
        view, _ = got
        filter_fn = self._filter(r, more[0] if more else ())
        scored = tuple(torch.tensor(t, device=self.device) for t in query)
        context = request_context(r, who)
        return ranked_before(view, context, filter_fn, scored, r.rank == "value", pairs)

    def _filter(self, r, clauses):
        """A request's filter with the clauses the engine added to it, compiled against this
        shard's schema, as `Retriever.prepare` compiles it (`m31.engine.prepare`)."""
        schema = self._store.index.schema
        return with_clauses(compile_filter(r.filter, schema) if r.filter else None, clauses, schema)

    def get(self, ad_id: int) -> tuple[dict, int] | None:
        """(attributes, global version) of a live ad, None if this shard does not hold it."""
        with self._state:
            index = self._store.index
            if ad_id not in index:
                return None
            return index.get(ad_id).attributes, self.applied

    def groups(self, ad_ids: list[int], name: str) -> list[int | None]:
        """The int field `name` of each ad (None: null, or an ad this shard does not hold):
        the groups a frequency cap per campaign or advertiser counts (`Cluster.groups`)."""
        with self._state:
            return self._store.index.numeric_values(ad_ids, name)

    def contains(self, ad_id: int) -> bool:
        return ad_id in self._store.index

    def stored_users(
        self, user_ids: Sequence[int], ts: Sequence[int]
    ) -> tuple[list[StoredUser | None], int]:
        """(each user as of its time `ts[i]`, None for one this shard does not hold; the global
        version they are at). Every call acknowledged before this one is in it: a commit is
        applied here before the coordinator acknowledges its call."""
        with self._state:
            users = read_users(self._store.users, self._organic, user_ids, ts)
            return users, self.applied

    # ---- two-phase commit ---------------------------------------------------------------

    def prepare(
        self,
        txn: str,
        op: str,
        args: Mapping[str, Any],
        check: Callable | None = None,
        last: tuple[str, int] | None = None,
    ):
        """Validate and log `op` (upsert, update_attributes, delete, events, users) for `txn`;
        AdIndexError (ValueError) if invalid. `check(attrs, stored)`: an extra check of an
        update against the ad's stored attributes (e.g. a range with one end changed). `last`:
        as in `resolve`, which decides a transaction still prepared here first."""
        with self._mutex:
            if self._prepared is not None and self._prepared.txn == txn:
                return
            self._resolve(last)
            index, events = self._store.index, None
            if op == "upsert":
                # Copies: arrays from Ray's object store are read-only.
                g, x, b = (np.array(args[k]) for k in ("g", "x", "b"))
                checked = index.check_upsert(args["ad_ids"], g, x, b, args["attributes"])
                index.check_vocabulary(checked.columns, checked.ids)
                logged = {
                    "ad_ids": checked.ids,  # [n]
                    "g": checked.g.float().cpu().numpy(),  # [n, G], exact for bf16 tables
                    "x": checked.x.float().cpu().numpy(),  # [n, D]
                    "b": checked.b.float().cpu().numpy(),  # [n]
                    "attributes": checked.columns,
                }
            elif op == "update_attributes":
                checked = index.check_update(args["ad_id"], args["attrs"])
                if check is not None:
                    check(args["attrs"], index.get(args["ad_id"]).attributes)
                logged = {"ad_id": checked.ad_id, "attrs": checked.attrs}
            elif op == "delete":
                logged = {"ad_ids": index.check_delete(args["ad_ids"])}
            elif op in ("events", "users"):
                logged, events = self._check_users(op, args)
            else:
                raise AdIndexError(f"unknown operation {op!r}")
            prepared = _Prepared(txn, op, logged, self._store.version + 1, events)
            self._log.append(("prepare", txn, op, logged, prepared.local_version))
            self._prepared = prepared

    def _check_users(self, op: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """(the logged form of a user mutation, its checked events or None); AdIndexError if
        invalid."""
        users = self._store.users
        if users is None:
            raise AdIndexError(
                "this cluster has no user store (its state folder has no online features to "
                "seed it: make it from an index `m31 index build` wrote)"
            )
        if op == "users":
            rows = [[int(u), {k: int(v) for k, v in c.items()}] for u, c in args["users"]]
            return {"users": rows}, None
        try:
            checked = users.check(args["user_id"], args["ad_id"], args["ts"], args["surface"])
        except ValueError as e:
            raise AdIndexError(str(e)) from e
        logged = {
            "user_id": checked.user_id,  # [n] int64 each
            "ad_id": checked.ad_id,
            "ts": checked.ts,
            "surface": list(args["surface"]),  # names, as the DurableIndex logs them
            "type": args.get("type"),
            "weight": args.get("weight"),
        }
        return logged, checked

    def commit(self, txn: str, version: int) -> tuple[int, int]:
        """Apply the prepared `txn` as global `version`; idempotent (a retried commit). The
        shard's live ads and stored users after it (`held`)."""
        with self._mutex:
            return self._commit(txn, version)

    def _commit(self, txn: str, version: int) -> tuple[int, int]:
        prepared = self._prepared
        if prepared is None or prepared.txn != txn:
            if txn == self._last_txn:
                return self.held()
            raise TransactionError(f"shard {self.number}: no prepared txn {txn}")
        self._log.append(("commit", txn, version), sync=False)  # the decision is logged
        with self._state:  # a view is labelled with the version its rows are at
            self._apply(prepared)
            self._prepared, self.applied, self._last_txn = None, version, txn
            if prepared.op not in ("events", "users"):
                self._ads_since = version
        return self.held()

    def held(self) -> tuple[int, int]:
        """(live ads, stored users) of this shard."""
        users = self._store.users
        return len(self._store.index), 0 if users is None else len(users)

    def abort(self, txn: str) -> None:
        """Drop the prepared `txn`; nothing if this shard does not hold it (an abort may
        overtake its prepare, which the next `prepare` or `resolve` then drops)."""
        with self._mutex:
            if self._prepared is not None and self._prepared.txn == txn:
                self._log.append(("abort", txn))
                self._prepared = None

    def resolve(self, last: tuple[str, int] | None) -> tuple[int, int]:
        """`last` = (txn, version) of the last transaction the coordinator committed on this
        shard (from its log). A transaction still prepared here is that one (commit) or one
        it did not commit (abort: it aborted it, or never decided it before a restart). The
        shard's live ads and stored users (`held`)."""
        with self._mutex:
            self._resolve(last)
            return self.held()

    def _resolve(self, last: tuple[str, int] | None) -> None:
        prepared = self._prepared
        if prepared is None:
            return
        if last is not None and prepared.txn == last[0]:
            self._commit(*last)
        else:
            self._log.append(("abort", prepared.txn))
            self._prepared = None

    def _apply(self, prepared: _Prepared) -> None:
        """Apply a committed change to the DurableIndex, unless it holds it already (a commit
        it took whose record this shard's transaction log lost)."""
        a, store = prepared.args, self._store
        if store.version >= prepared.local_version:
            return
        if prepared.op == "upsert":
            store.upsert(a["ad_ids"], a["g"], a["x"], a["b"], a["attributes"])
        elif prepared.op == "update_attributes":
            store.update_attributes(a["ad_id"], **a["attrs"])
        elif prepared.op == "events":
            columns = (a["user_id"], a["ad_id"], a["ts"], a["surface"])
            store.add_events(
                *columns, None, types=a["type"], weights=a["weight"], checked=prepared.events
            )
        elif prepared.op == "users":
            store.set_users(a["users"])
        else:
            store.delete(a["ad_ids"])
        if store.version != prepared.local_version:
            raise TransactionError(
                f"shard {self.number}: applying txn {prepared.txn} made local version "
                f"{store.version}, prepared for {prepared.local_version}"
            )

    # ---- maintenance --------------------------------------------------------------------

    def snapshot(self, last: tuple[str, int] | None = None) -> int:
        """Snapshot the DurableIndex and fold the transaction log into one base record (a
        transaction still prepared is resolved first, as in `resolve`)."""
        with self._mutex:
            self._resolve(last)
            self._store.snapshot()
            self._log.rewrite([("base", self.applied, self._last_txn)])
            return self.applied

    def pid(self) -> int:
        import os

        return os.getpid()

    def close(self) -> None:
        with self._mutex:
            self._log.close()
            self._store.close()
