"""A mutation of a sharded index as the coordinator takes it (DESIGN §7, "Two-phase commit"):
each owning shard's part, {shard: (kind, arguments, check)}, made here from the caller's
arguments (plain functions of the layout: `m31.cluster.layout.shard_of`), and the call that
commits it. An ad belongs to the shard of its id, a user (events, attributes) to the shard of
its user id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from m31.cluster.channel import ChannelClosed, Link
from m31.cluster.layout import shard_of
from m31.index import AdIndexError
from m31.index.errors import Unavailable

# Seconds a mutation may take before its caller gives up waiting (it may still commit): the
# coordinator refuses one whose shards are down within `PREPARE_WAIT_S`, so this bounds only
# a coordinator that does not answer at all.
MUTATION_TIMEOUT_S = 120.0

Ops = dict[int, tuple[str, dict, Any]]  # shard -> (kind, arguments, check or None)


def upsert_ops(ad_ids, g, x, b, attributes, shards: int) -> Ops:
    """Ads (ids [n], g [n, G], x [n, D], b [n] numpy; attributes an arrow table or n dicts)
    by their shards; AdIndexError for an id given twice."""
    import pyarrow as pa

    ids = np.asarray(ad_ids, dtype=np.int64)
    if len(np.unique(ids)) != len(ids):
        uniq, counts = np.unique(ids, return_counts=True)
        raise AdIndexError(f"upsert: ad id {int(uniq[counts > 1][0])} appears more than once")
    table = attributes if isinstance(attributes, pa.Table) else None
    owner = shard_of(ids, shards)
    ops = {}
    for s in np.unique(owner).tolist():
        rows = np.flatnonzero(owner == s)
        attrs = table.take(pa.array(rows)) if table is not None else [attributes[i] for i in rows]
        args = {"ad_ids": ids[rows], "g": g[rows], "x": x[rows], "b": b[rows], "attributes": attrs}
        ops[s] = ("upsert", args, None)
    return ops


def update_ops(ad_id: int, attrs: Mapping[str, Any], check, shards: int) -> Ops:
    """Some attributes of one ad, checked by `check(changes, stored)` in its shard's prepare."""
    s = int(shard_of([ad_id], shards)[0])
    return {s: ("update_attributes", {"ad_id": int(ad_id), "attrs": dict(attrs)}, check)}


def delete_ops(ad_ids, shards: int) -> Ops:
    ids = np.asarray(ad_ids, dtype=np.int64).reshape(-1)
    owner = shard_of(ids, shards)
    return {s: ("delete", {"ad_ids": ids[owner == s]}, None) for s in np.unique(owner).tolist()}


def event_ops(user_ids, ad_ids, ts, surfaces, types, weights, shards: int) -> Ops:
    """Engagement events [n] each (`DurableIndex.add_events`'s columns) by their users'
    shards."""
    owner = shard_of(np.asarray(user_ids, dtype=np.int64), shards)
    columns = {
        "user_id": user_ids,
        "ad_id": ad_ids,
        "ts": ts,
        "surface": surfaces,
        "type": types,
        "weight": weights,
    }
    ops = {}
    for s in np.unique(owner).tolist():
        rows = np.flatnonzero(owner == s).tolist()
        args = {k: None if v is None else [v[i] for i in rows] for k, v in columns.items()}
        ops[s] = ("events", args, None)
    return ops


def user_ops(users: Sequence[tuple[int, Mapping[str, int]]], shards: int) -> Ops:
    """Attribute codes of users, (user id, codes) each, by their shards."""
    owner = shard_of([u for u, _ in users], shards).tolist()
    ops: Ops = {}
    for (user_id, codes), s in zip(users, owner, strict=True):
        part = ops.setdefault(s, ("users", {"users": []}, None))
        part[1]["users"].append([int(user_id), dict(codes)])
    return ops


def commit(coordinator: Link, ops: Ops, key: str | None = None) -> tuple[int, int, int]:
    """Commit `ops` through the coordinator, all or none: (the new global version, live ads,
    stored users).
    A call whose idempotency `key` was committed already: its version (AdIndexError if that
    was another call). AdIndexError where a shard refuses, `Unavailable` where one is down."""
    try:
        out = coordinator.call("mutate", ops, key).result(timeout=MUTATION_TIMEOUT_S)
    except (ChannelClosed, TimeoutError) as e:
        raise Unavailable(
            f"the coordinator did not answer ({e}); the mutation may or may not have been applied",
            [],
        ) from e
    if out[0] == "ok":
        return out[1], out[2], out[3]
    if out[0] == "invalid":
        raise AdIndexError(out[1])
    raise Unavailable(out[1], out[2])


def snapshot(coordinator) -> int:
    """Snapshot every shard; the global version."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        out = ray.get(coordinator.snapshot.remote(), timeout=MUTATION_TIMEOUT_S)
    except (RayActorError, GetTimeoutError) as e:
        raise Unavailable(f"the coordinator did not answer ({e})", []) from e
    if out[0] != "ok":
        raise Unavailable(out[1], out[2])
    return out[1]
