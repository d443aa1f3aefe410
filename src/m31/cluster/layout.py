"""Where a cluster's state lives and which shard owns an ad: no Ray here, so the offline
commands (`m31 cluster init`, `m31 cluster reshard`) and the tests use it alone.

Layout of a cluster state folder STATE::

    STATE/cluster.json              {"format": "m31.cluster", "format_version", "shards": S,
                                     "partition": "splitmix64(ad_id) mod S"}
    STATE/coordinator/decisions.log the coordinator's durable decisions (m31.cluster.coordinator)
    STATE/shard-<i>/index/          shard i's DurableIndex (snapshot + write-ahead log), with the
                                users it owns (users/ in its snapshot, events in its log)
STATE/online/                   the online features (`m31.engine.load`), users seeded from them
    STATE/shard-<i>/txn.log         shard i's two-phase-commit log (m31.cluster.shard)

An ad belongs to shard `splitmix64(ad_id) mod S`, and a user to `splitmix64(user_id) mod S`:
the finaliser of SplitMix64 spreads any id pattern (sequential, strided) evenly, and depends on
nothing but the id and S, so every process, on any machine, routes an ad to the same shard.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from m31.cluster.records import RecordLog, read_records
from m31.index import AdIndex, DurableIndex, read_manifest
from m31.index.durable import USERS
from m31.users.store import read_state, write_state

FORMAT = "m31.cluster"
FORMAT_VERSION = 1
MANIFEST = "cluster.json"
PARTITION = "splitmix64(ad_id) mod S"
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class ClusterStateError(ValueError):
    """A cluster state folder that cannot be used; the message names the file."""


def shard_of(ad_ids, shards: int) -> np.ndarray:
    """[n] int64: the shard of each ad id (int64 [n]) among `shards`."""
    z = np.asarray(ad_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(shards)).astype(np.int64)


def shard_dir(state: Path, i: int) -> Path:
    return Path(state) / f"shard-{i}"


def coordinator_dir(state: Path) -> Path:
    return Path(state) / "coordinator"


def read_layout(state: str | Path) -> int:
    """The number of shards of the cluster state folder `state`."""
    path = Path(state) / MANIFEST
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ClusterStateError(f"{path}: not a cluster state folder ({e})") from e
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ClusterStateError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r} v1")
    return int(meta["shards"])


def is_cluster_state(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_snapshot(path: Path) -> dict:
    """The arrays and attributes of an `AdIndex.save` folder, read with numpy and pyarrow."""
    path = Path(path)
    meta = read_manifest(path)
    return {
        # (L, state, keys) of its users/ (a serving folder's snapshot), if it has one
        "users": read_state(path / USERS) if (path / USERS).is_dir() else None,
        "meta": meta,
        "ids": np.load(path / "ids.npy"),  # [n]
        "g": np.load(path / "g.npy"),  # [n, G]
        "x": np.load(path / "x.npy"),  # [n, D]
        "b": np.load(path / "b.npy"),  # [n]
        "attributes": pq.read_table(path / "attributes.parquet"),
    }


def _index_of(parts: dict, rows: np.ndarray, device: str) -> AdIndex:
    """An AdIndex of the snapshot `parts`' rows `rows`, with the snapshot's schema and dtype."""
    import torch

    meta = parts["meta"]
    dtype = getattr(torch, meta["dtype"])
    base = AdIndex(0, 0, capacity=1).schema
    extra = {k: v for k, v in meta["fields"].items() if k not in base}
    index = AdIndex(
        int(meta["dim_g"]),
        int(meta["dim_x"]),
        device,
        dtype,
        max(len(rows), 1),
        extra,
        targeting=meta.get("targeting"),
    )
    index.model_hash = meta.get("model_hash")
    if len(rows):
        take = pa.array(rows)
        index.upsert(
            parts["ids"][rows],
            parts["g"][rows],
            parts["x"][rows],
            parts["b"][rows],
            parts["attributes"].take(take),
        )
    return index


def write_cluster(
    parts: dict,
    out: Path,
    shards: int,
    base_version: int,
    device: str = "cpu",
    log: Callable[[str], None] | None = None,
) -> Path:
    """A new cluster state folder `out` of `shards` shards holding the ads (and the users, if
    any) of `parts` (`read_snapshot`'s dict), whose global version starts at `base_version`.
    Written beside `out` and renamed into place, so `out` is complete when it exists. The
    users' idempotency keys are not carried (the coordinator's start empty)."""
    out = Path(out)
    if shards < 1:
        raise ClusterStateError(f"shards: at least 1, got {shards}")
    if out.exists():
        raise ClusterStateError(f"{out}: exists; give a new folder")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        owner = shard_of(parts["ids"], shards)
        users = parts.get("users")
        user_owner = None if users is None else shard_of(users[1]["ids"], shards)
        for i in range(shards):
            rows = np.flatnonzero(owner == i)
            mine = None
            if users is not None:
                length, state = users[0], {k: v[user_owner == i] for k, v in users[1].items()}

                def mine(folder: Path, length=length, state=state) -> None:
                    write_state(folder, length, state)

            index = _index_of(parts, rows, device)
            DurableIndex.create(shard_dir(tmp, i) / "index", index, users=mine).close()
            RecordLog.open(shard_dir(tmp, i) / "txn.log")[0].rewrite([("base", base_version, None)])
            if log is not None:
                log(f"shard {i}: {len(rows):,} ads")
        coordinator_dir(tmp).mkdir()
        decisions, _ = RecordLog.open(coordinator_dir(tmp) / "decisions.log")
        decisions.rewrite([("base", base_version, [base_version] * shards)])
        decisions.close()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "shards": shards,
            "partition": PARTITION,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def init_cluster(snapshot: Path, out: Path, shards: int, device: str = "cpu", log=None) -> Path:
    """`m31 cluster init`: a cluster state folder of `shards` shards from one index snapshot."""
    parts = read_snapshot(snapshot)
    return write_cluster(parts, out, shards, int(parts["meta"]["index_version"]), device, log)


def reshard(state: Path, shards: int, out: Path, device: str = "cpu", log=None) -> Path:
    """`m31 cluster reshard`: the ads of the cluster state folder `state` (offline: no server
    may have it open) re-partitioned over `shards` shards into the new folder `out`.

    Each shard's DurableIndex is opened (its snapshot and log replayed, its users seeded from
    the state's online features) and its live ads and users written out; the global version
    carries over, so versions keep growing. A shard holding
    a prepared transaction without a decision is refused: start the cluster once (its
    coordinator resolves it), stop it, and reshard then.
    """
    import tempfile

    from m31.engine.load import online_users

    old = read_layout(state)
    decisions = read_records(coordinator_dir(state) / "decisions.log")
    version = max(r[1] if r[0] == "base" else r[2] for r in decisions)
    chunks, users = [], []
    with tempfile.TemporaryDirectory(dir=Path(out).parent) as tmp:
        for i in range(old):
            records = read_records(shard_dir(state, i) / "txn.log")
            open_txns = {r[1] for r in records if r[0] == "prepare"} - {
                r[1] for r in records if r[0] in ("commit", "abort")
            }
            if open_txns:
                raise ClusterStateError(
                    f"{shard_dir(state, i)}: a prepared transaction awaits its decision; start "
                    "the cluster once to resolve it, then reshard"
                )
            seeded = online_users(state, lambda ids, i=i: shard_of(ids, old) == i)
            path = shard_dir(state, i) / "index"
            with DurableIndex.open(path, device=device, users=seeded) as store:
                folder = Path(tmp) / f"shard-{i}"
                store.index.save(folder, model_hash=store.index.model_hash)
                if store.users is not None:
                    users.append((store.users.length, store.users.dump()))
            chunks.append(read_snapshot(folder))
        merged = {k: np.concatenate([u[k] for _, u in users]) for k in users[0][1]} if users else {}
        parts = {
            "users": (users[0][0], merged, []) if users else None,
            "meta": chunks[0]["meta"],
            **{k: np.concatenate([c[k] for c in chunks]) for k in ("ids", "g", "x", "b")},
            "attributes": pa.concat_tables([c["attributes"] for c in chunks]),
        }
        return write_cluster(parts, out, shards, version, device, log)


def serving_cluster(
    index: Path, state: Path | None, shards: int | None, device: str = "cpu", log=None
) -> Path:
    """The cluster state folder `m31 serve --ray --index INDEX` serves: INDEX itself when it is
    one, else one made once (at `state`, default INDEX.cluster) from the snapshot INDEX (or
    the snapshot of the serving folder INDEX) with `shards` shards (default 2)."""
    index = Path(index)
    if is_cluster_state(index):
        found = read_layout(index)
        if shards is not None and shards != found:
            raise ClusterStateError(
                f"--shards: {index} has {found} shards, not {shards}; make a new state with "
                f"`m31 cluster reshard --from {index} --shards {shards} --out NEW`"
            )
        return index
    snapshot = index / "snapshot" if (index / "wal.log").is_file() else index
    if not (snapshot / "manifest.json").is_file():
        raise ClusterStateError(
            f"--index: {index} is neither an index snapshot, a serving folder nor a cluster state"
        )
    state = Path(state) if state is not None else index.with_name(index.name + ".cluster")
    if is_cluster_state(state):
        return serving_cluster(state, None, shards)
    if log is not None:
        log(f"initialising the cluster state {state} from the snapshot {snapshot}")
    return init_cluster(snapshot, state, shards or 2, device, log)
