"""A crash-safe ad index and user store: write-ahead log, snapshots and replay (DESIGN §4, §7).

Shapes: n ads in one upsert, G gate-key dim, D value dim.

Layout of a durable index folder DIR::

    DIR/LOCK                          flock'd by the one process that has DIR open (holds its pid)
    DIR/snapshot -> snapshot-<v>      symlink naming the current snapshot (a plain snapshot
                                      folder is accepted too, e.g. one `AdIndex.save` wrote)
    DIR/snapshot-<v>/                 an `AdIndex.save` folder of the index at version v, with
                                      users/ (the user store at v) when it has one
    DIR/wal.log                       write-ahead log: every mutation since the snapshot

Users (a `UserState`, `m31.index.wal`: the serving's `m31.users.UserStore`): engagement
events (`add_events`) and user attributes (`set_users`) are mutations of the same log, in the
same version order as the ads' (`AdIndex.advance_version` gives them a version without touching
the ads); a store given to `open` is seeded by its owner (from the online features) and then
takes the snapshot's users and the log's records. An events call's idempotency key is logged
with it, so a retry after a crash is still applied once.

`wal.log` is the header b"M31WAL1\\n" followed by self-delimiting records, each a mutation's
validated, normalised arguments and the version it produced (the format: `m31.index.wal`).

Write path, one mutation at a time under a mutex (the log order is the version order):
validate against the index without changing it (a bad call raises `AdIndexError` and logs
nothing), append the record and fdatasync it, and only then apply it to the in-memory index
and return. So every version a reader can see or a caller is told is on disk, and a failed
log write leaves the index as it was. The record is built by the index's own side-effect-free
validators (`AdIndex.check_upsert`, `check_vocabulary`, `check_update`, `check_delete`, the
ones its mutations run), called without the index's lock: this object is the only mutator of
its index and validates under its own mutex. So applying a record cannot fail for a reason
validation missed; if it still fails (say, out of device memory), or if a log write or fsync
fails (after which the kernel may have dropped the page: retrying would lie), this object
stops taking mutations; reads go on, and reopening the folder recovers every acknowledged
mutation. Readers never wait for an fsync: the index's own lock is held only while a record
is applied.

A folder opened with `sync=False` skips that fdatasync: for an owner that logs every mutation
durably in a log of its own first and applies again at open what this log lacks (a cluster
shard, whose transaction log holds each prepared change and its commit, `m31.cluster.shard`).
A killed process loses nothing either way (its writes are in the page cache); a machine that
loses power loses at most the tail that was not synced yet, which the owner's log restores
(opened so, the log ends at its first damaged record even with intact ones after it: an
unsynced tail may keep a later record and not an earlier one).

Open (`m31.index.recovery`): take the lock, load the snapshot, replay the log records newer
than it (each must produce exactly the version it logged), then append after them. A damaged
record at the end of the log is the torn write of a mutation that was never acknowledged: it is
cut off with a warning. A damaged record followed by a valid one is corruption, and an error.

`snapshot()` compacts (a logged mutation), writes `snapshot-<v>` beside the current one,
repoints the `snapshot` symlink by an atomic rename (the commit point), then replaces the log
by an empty one. A crash before the commit point leaves the old snapshot and the full log; a
crash after it leaves a log whose records are all in the snapshot, and replay skips records
not newer than the snapshot. Every create, rename and truncation is followed by an fsync of
the file and of DIR.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from m31.index.ad_index import AdIndex
from m31.index.errors import AdIndexError, DurableIndexError
from m31.index.framing import sync_dir, sync_file, write_all
from m31.index.recovery import (
    LINK,
    current_snapshot,
    lock_folder,
    point_link,
    remove_leftovers,
    replay,
    snapshot_name,
)
from m31.index.wal import LOG, LOG_HEADER, CheckedEvents, Record, UserState, apply, new_log

logger = logging.getLogger(__name__)

USERS = "users"  # a snapshot's users (`UserState.save`), when the index has them


class DurableIndex:
    """An `AdIndex` whose acknowledged mutations survive a crash; see the module docstring.

    Make one with `create` or `open`. Read through `index` (`table`, `snapshot_view`,
    `eligible_mask`, ...); mutate only through this object, which owns the index.
    """

    def __init__(
        self,
        path: Path,
        index: AdIndex,
        lock_fd: int,
        log_fd: int,
        log_end: int,
        snapshot_version: int,
        users: UserState | None = None,
        sync: bool = True,
    ):
        """Internal: use `create` or `open`."""
        self._path = path
        self._sync = sync  # fdatasync each log record (module docstring)
        self._index = index
        self._users = users
        self._lock_fd = lock_fd
        self._log_fd = log_fd
        self._log_end = log_end  # bytes of intact log; the next record goes here
        self._version = index.version  # the last version logged and applied
        self._snapshot_version = snapshot_version
        self._mutex = threading.Lock()  # one mutation (or snapshot) at a time
        self._failed: str | None = None
        self._closed = False

    # ---- opening ----------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | Path,
        source: AdIndex | str | Path,
        device: str | torch.device = "cpu",
        users: Callable[[Path], None] | None = None,
    ) -> DurableIndex:
        """Initialise the folder `path` (absent or empty) from an index or a snapshot folder.

        An `AdIndex` is taken over as it is, `model_hash` included (its owner must not mutate
        it afterwards); a snapshot folder is loaded onto `device`. The first snapshot is
        written at the index's version, with an empty log; `users(folder)` writes its users/
        (`m31.users.store.write_state`: the users a cluster's shard starts with).
        """
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise DurableIndexError(f"{path}: exists and is not an empty folder")
        if not isinstance(source, AdIndex | str | Path):
            raise DurableIndexError(
                f"source: expected an AdIndex or a snapshot folder, got {type(source).__name__}"
            )
        if not path.exists():
            path.mkdir(parents=True)
            sync_dir(path.parent)
        lock_fd = lock_folder(path)
        log_fd = -1
        try:
            index = source if isinstance(source, AdIndex) else AdIndex.load(source, device)
            name = snapshot_name(index.version)
            beside = None if users is None else lambda tmp: users(tmp / USERS)
            index.save(path / name, model_hash=index.model_hash, beside=beside)
            log_fd = new_log(path)
            point_link(path, name)  # last, so a folder with a link is always complete
        except BaseException:
            if log_fd >= 0:
                os.close(log_fd)
            os.close(lock_fd)
            raise
        return cls(path, index, lock_fd, log_fd, len(LOG_HEADER), index.version)

    @staticmethod
    def is_folder(path: str | Path) -> bool:
        """Whether `path` is a durable index folder (one `create` completed)."""
        return (Path(path) / LOG).is_file()

    @classmethod
    def open(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        users: UserState | None = None,
        sync: bool = True,
    ) -> DurableIndex:
        """Load the snapshot of the folder `path` onto `device` and replay its log.

        `users`: the user store that the log's events go to (`add_events`), as seeded (from the
        online features); a snapshot that holds one (`users/`) replaces its content. `sync`:
        False only for an owner that logs every mutation durably itself (module docstring)."""
        path = Path(path)
        if not path.is_dir():
            raise DurableIndexError(f"{path}: no such durable index folder")
        lock_fd = lock_folder(path)
        try:
            snapshot = current_snapshot(path)
            remove_leftovers(path)
            index = AdIndex.load(snapshot, device)
            if users is not None and (snapshot / USERS).is_dir():
                users.restore(snapshot / USERS)
            snapshot_version = index.version
            log_fd, log_end = replay(path, index, users, synced=sync)
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(path, index, lock_fd, log_fd, log_end, snapshot_version, users, sync)

    # ---- reading ----------------------------------------------------------------------------

    @property
    def index(self) -> AdIndex:
        """The in-memory index, for reads; every version it shows is already logged."""
        return self._index

    @property
    def version(self) -> int:
        return self._version

    @property
    def snapshot_version(self) -> int:
        """Version of the snapshot on disk; the log holds the mutations after it."""
        return self._snapshot_version

    @property
    def path(self) -> Path:
        return self._path

    # ---- mutations (each returns the new version) -------------------------------------------

    def upsert(self, ad_ids: Any, g: Any, x: Any, b: Any, attributes: Any) -> int:
        """`AdIndex.upsert` (ids [n], g [n, G], x [n, D], b [n]), logged before it is applied."""

        def prepare(version: int) -> Record:
            checked = self._index.check_upsert(ad_ids, g, x, b, attributes)
            # Without the index's lock: only this object mutates the index, under its mutex.
            self._index.check_vocabulary(checked.columns, checked.ids)
            args = {
                "ad_ids": checked.ids,  # [n]
                # Widened from the table dtype to float32, which holds its values exactly.
                "g": checked.g.float().cpu().numpy(),  # [n, G]
                "x": checked.x.float().cpu().numpy(),  # [n, D]
                "b": checked.b.float().cpu().numpy(),  # [n]
                "attributes": checked.columns,
            }
            return Record("upsert", version, args)

        return self._mutate(prepare)

    def update_attributes(self, ad_id: int, **attrs: Any) -> int:
        """`AdIndex.update_attributes`, logged before it is applied."""

        def prepare(version: int) -> Record:
            checked = self._index.check_update(ad_id, attrs)  # without the lock, as in upsert
            args = {"ad_id": checked.ad_id, "attrs": checked.attrs}
            return Record("update_attributes", version, args)

        return self._mutate(prepare)

    def pause(self, ad_id: int) -> int:
        return self.update_attributes(ad_id, status="paused")

    def resume(self, ad_id: int) -> int:
        return self.update_attributes(ad_id, status="active")

    def delete(self, ad_ids: Any) -> int:
        """`AdIndex.delete`, logged before it is applied."""

        def prepare(version: int) -> Record:
            ids = self._index.check_delete(ad_ids)  # [n]; without the lock, as in upsert
            return Record("delete", version, {"ad_ids": ids})

        return self._mutate(prepare)

    def compact(self) -> int:
        """`AdIndex.compact`, logged before it is applied."""
        return self._mutate(lambda version: Record("compact", version, {}))

    @property
    def users(self) -> UserState | None:
        return self._users

    def add_events(
        self,
        user_ids,
        ad_ids,
        ts,
        surfaces,
        key: str | None = None,
        types=None,
        weights=None,
        checked: CheckedEvents | None = None,
    ) -> int:
        """Engagement events [n] (`UserState.check`), logged before they reach the user store;
        the version that holds them. A call whose idempotency `key` was applied already is not
        applied again: its version is answered (KeyReused, a ValueError, if that was another
        call). Event `types` and `weights` (optional, [n],
        None each where not given) are logged with them; the store keeps neither. `checked`:
        what `check` answered for these columns, when the caller has it (a shard's prepare)."""
        users = self._require_users()
        with self._mutex:
            digest = None
            if key is not None:
                digest = users.call_digest(user_ids, ad_ids, ts, surfaces, types, weights)
                if (done := users.version_of(key, digest)) is not None:
                    return done

            def prepare(version: int) -> Record:
                nonlocal checked
                if checked is None:
                    checked = users.check(user_ids, ad_ids, ts, surfaces)  # ValueError: no log
                args = {
                    "user_id": checked.user_id,  # [n] int64 blobs
                    "ad_id": checked.ad_id,
                    "ts": checked.ts,
                    "surface": list(surfaces),  # names, not codes: JSON
                    "type": list(types) if types is not None else None,
                    "weight": list(weights) if weights is not None else None,
                    "key": key,
                    "digest": digest,
                }
                return Record("events", version, args, checked)

            return self._mutate_locked(prepare)

    def set_users(self, users: list[tuple[int, dict[str, int]]]) -> int:
        """Set attribute codes of users, (user id, codes) each (`UserState.set_attributes`),
        logged first."""
        self._require_users()
        rows = [[int(u), {k: int(v) for k, v in codes.items()}] for u, codes in users]
        return self._mutate(lambda version: Record("users", version, {"users": rows}))

    def _require_users(self) -> UserState:
        if self._users is None:
            raise DurableIndexError(f"{self._path}: opened without a user store")
        return self._users

    def _mutate(self, prepare: Callable[[int], Record]) -> int:
        with self._mutex:
            return self._mutate_locked(prepare)

    def _mutate_locked(self, prepare: Callable[[int], Record]) -> int:
        self._check_usable()
        record = prepare(self._version + 1)  # AdIndexError here: nothing logged or changed
        data = record.encode()
        try:
            write_all(self._log_fd, data, self._log_end)
            if self._sync:
                sync_file(self._log_fd)
        except OSError as e:
            self._fail(f"writing the log failed ({e})")
            raise DurableIndexError(
                f"{self._path / LOG}: {self._failed}; version {record.version} was not applied"
            ) from e
        self._log_end += len(data)
        try:
            version = apply(self._index, self._users, record)
        except Exception as e:
            self._fail(f"applying logged version {record.version} failed ({e})")
            raise DurableIndexError(f"{self._path}: {self._failed}") from e
        if version != record.version:
            self._fail(f"applying a record gave version {version}, logged {record.version}")
            raise DurableIndexError(f"{self._path}: {self._failed}")
        self._version = version
        return version

    def _fail(self, why: str) -> None:
        self._failed = (
            f"{why}; this DurableIndex takes no more mutations (reads still work): reopen the "
            "folder to recover every acknowledged mutation"
        )
        logger.error("%s: %s", self._path, self._failed)

    def _check_usable(self) -> None:
        if self._closed:
            raise DurableIndexError(f"{self._path}: this DurableIndex is closed")
        if self._failed is not None:
            raise DurableIndexError(f"{self._path}: {self._failed}")
        if self._index.version != self._version:
            raise DurableIndexError(
                f"{self._path}: the AdIndex moved to version {self._index.version} outside this "
                f"DurableIndex (last logged {self._version}); those changes are not in the log: "
                "mutate through the DurableIndex only"
            )

    # ---- snapshots --------------------------------------------------------------------------

    def snapshot(self) -> int:
        """Compact, write a snapshot of the current version and empty the log; its version.

        Mutations wait while it runs; reads do not (except while `AdIndex.save` copies the
        table). If the snapshot cannot be written the log is kept and nothing is lost.
        """
        with self._mutex:
            self._check_usable()
            if self._index.num_rows > len(self._index):  # tombstones to reclaim
                self._mutate_locked(lambda version: Record("compact", version, {}))
            version = self._version
            if version == self._snapshot_version:
                return version
            name = snapshot_name(version)
            try:
                users = self._users
                self._index.save(
                    self._path / name,
                    self._index.model_hash,
                    overwrite=True,
                    beside=None if users is None else lambda tmp: users.save(tmp / USERS),
                )
                sync_dir(self._path)
            except (OSError, AdIndexError) as e:
                raise DurableIndexError(
                    f"{self._path / name}: snapshot not written ({e}); the log still holds every "
                    "mutation"
                ) from e
            try:
                self._swap_snapshot(name)
                self._start_new_log()
            except OSError as e:
                self._fail(f"switching to snapshot {name} failed ({e})")
                raise DurableIndexError(f"{self._path}: {self._failed}") from e
            self._snapshot_version = version
            try:
                remove_leftovers(self._path)
            except OSError as e:  # only disk space is at stake; the next open retries
                logger.warning("%s: could not remove old snapshots (%s)", self._path, e)
            return version

    def _swap_snapshot(self, name: str) -> None:
        """The commit point: DIR/snapshot names the new folder."""
        link = self._path / LINK
        if not link.is_symlink():
            # A plain folder cannot be swapped atomically: move it aside first. A crash
            # right here leaves no DIR/snapshot, and `open` takes the newest snapshot-<v>.
            os.rename(link, self._path / snapshot_name(self._snapshot_version))
            sync_dir(self._path)
        point_link(self._path, name)

    def _start_new_log(self) -> None:
        fd = new_log(self._path)
        os.close(self._log_fd)
        self._log_fd, self._log_end = fd, len(LOG_HEADER)

    # ---- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the log and release the folder; mutations are refused afterwards."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            os.close(self._log_fd)
            os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> DurableIndex:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DurableIndex({str(self._path)!r}, version={self._version}, "
            f"snapshot_version={self._snapshot_version}, ads={len(self._index)})"
        )
