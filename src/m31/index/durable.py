"""A crash-safe ad index and user store: write-ahead log, snapshots and replay (DESIGN §4, §7).

Shapes: n ads in one upsert, G gate-key dim, D value dim.

Layout of a durable index folder DIR::

    DIR/LOCK                          flock'd by the one process that has DIR open (holds its pid)
    DIR/snapshot -> snapshot-<v>      symlink naming the current snapshot (a plain snapshot
                                      folder is accepted too, e.g. one `AdIndex.save` wrote)
    DIR/snapshot-<v>/                 an `AdIndex.save` folder of the index at version v, with
                                      users/ (the user store at v) when it has one
    DIR/wal.log                       write-ahead log: every mutation since the snapshot

Users (`m31.index.users`): engagement events (`add_events`) and user attributes (`set_users`)
are mutations of the same log, in the same version order as the ads' (`AdIndex.advance_version`
gives them a version without touching the ads); a store given to `open` is seeded by its owner
(from the online features) and then takes the snapshot's users and the log's records. An
events call's idempotency key is logged with it, so a retry after a crash is still applied once.

`wal.log` is the header b"M31WAL1\\n" followed by self-delimiting records::

    b"M31R" | payload length u64 LE | CRC32 of (length bytes + payload) u32 LE | payload
    payload = meta length u32 LE | meta JSON {op, version, args, blobs} | blobs

where blobs are arrays as raw little-endian bytes (ids int64; g, x, b float32, which holds
bf16 and fp16 table values exactly) and attribute tables as an Arrow IPC stream. The record
holds the validated, normalised arguments and the version the mutation produced.

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

Open: take the lock, load the snapshot, replay the log records newer than it (each must
produce exactly the version it logged), then append after them. A damaged record at the
end of the log is the torn write of a mutation that was never acknowledged: it is cut off
with a warning. A damaged record followed by a valid one is corruption, and an error.

`snapshot()` compacts (a logged mutation), writes `snapshot-<v>` beside the current one,
repoints the `snapshot` symlink by an atomic rename (the commit point), then replaces the log
by an empty one. A crash before the commit point leaves the old snapshot and the full log; a
crash after it leaves a log whose records are all in the snapshot, and replay skips records
not newer than the snapshot. Every create, rename and truncation is followed by an fsync of
the file and of DIR.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import re
import shutil
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from m31.index.ad_index import AdIndex, AdIndexError
from m31.index.framing import frame, next_intact, parse, sync_dir, sync_file, write_all
from m31.index.idempotency import call_digest
from m31.index.snapshot import read_manifest
from m31.index.users import UserStore

logger = logging.getLogger(__name__)

LOG = "wal.log"
LINK = "snapshot"
LOCK = "LOCK"
USERS = "users"  # a snapshot's user store (`m31.index.users`), when the index has one
LOG_HEADER = b"M31WAL1\n"
RECORD_MAGIC = b"M31R"
_META_LEN = struct.Struct("<I")
_SNAPSHOT = re.compile(r"snapshot-(\d+)")
# Our own temporaries: `write_atomic`'s folders for a snapshot, the next symlink, the next log.
_TEMPORARY = re.compile(r"\.snapshot-\d+\.(tmp|old)-.*|\.snapshot\.next|wal\.log\.next")


class DurableIndexError(AdIndexError):
    """A durable index folder or log that cannot be used, or a DurableIndex that stopped
    taking mutations; the message names the file and, for the log, the byte offset."""


@dataclass(frozen=True)
class _Record:
    """One logged mutation: `op` applied to the index at `version - 1` gives `version`."""

    op: str
    version: int
    args: dict[str, Any]  # numpy arrays and arrow tables travel as blobs, the rest as JSON
    # what `args` mean once checked, when the writer has it (not logged: replay checks again)
    checked: Any = field(default=None, compare=False, repr=False)

    def encode(self) -> bytes:
        """The framed record, ready to append."""
        meta: dict[str, Any] = {"op": self.op, "version": self.version, "args": {}, "blobs": []}
        blobs = []
        for name, value in self.args.items():
            if isinstance(value, np.ndarray):
                little = value.astype(value.dtype.newbyteorder("<"), copy=False)
                data = np.ascontiguousarray(little).tobytes()
                desc = {"dtype": little.dtype.str, "shape": list(value.shape)}
            elif isinstance(value, pa.Table):
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, value.schema) as writer:
                    writer.write_table(value)
                data, desc = sink.getvalue().to_pybytes(), {"arrow": True}
            else:
                meta["args"][name] = value
                continue
            meta["blobs"].append({"name": name, "nbytes": len(data), **desc})
            blobs.append(data)
        head = json.dumps(meta, separators=(",", ":")).encode()
        payload = b"".join([_META_LEN.pack(len(head)), head, *blobs])
        return frame(RECORD_MAGIC, payload)

    @classmethod
    def decode(cls, payload: bytes) -> _Record:
        """Inverse of `encode` for a payload whose CRC already checked out."""
        view = memoryview(payload)
        (n,) = _META_LEN.unpack_from(view, 0)
        meta = json.loads(bytes(view[_META_LEN.size : _META_LEN.size + n]))
        pos = _META_LEN.size + n
        args = dict(meta["args"])
        for blob in meta["blobs"]:
            data = view[pos : pos + blob["nbytes"]]
            pos += blob["nbytes"]
            if blob.get("arrow"):
                args[blob["name"]] = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
            else:
                array = np.frombuffer(data, dtype=np.dtype(blob["dtype"]))
                args[blob["name"]] = array.reshape(blob["shape"]).copy()  # writable, owned
        if pos != len(payload):
            raise ValueError(f"{len(payload) - pos} bytes after the last blob")
        return cls(meta["op"], meta["version"], args)


def _apply(index: AdIndex, users: UserStore | None, record: _Record) -> int:
    a = record.args
    if record.op in ("events", "users"):
        if users is None:
            raise ValueError(f"a {record.op} record, and no user store to apply it to")
        if record.op == "events":
            events = record.checked or users.check(a["user_id"], a["ad_id"], a["ts"], a["surface"])
            users.add(events, record.version, a.get("key"), a.get("digest"))
        else:
            for user_id, codes in a["users"]:
                users.set_attributes(user_id, codes)
        return index.advance_version()  # after the change: a reader at this version sees it
    if record.op == "upsert":
        return index.upsert(a["ad_ids"], a["g"], a["x"], a["b"], a["attributes"])
    if record.op == "update_attributes":
        return index.update_attributes(a["ad_id"], **a["attrs"])
    if record.op == "delete":
        return index.delete(a["ad_ids"])
    if record.op == "compact":
        return index.compact()
    raise ValueError(f"unknown operation {record.op!r}")


def _snapshot_name(version: int) -> str:
    return f"snapshot-{version:012d}"


def _lock(path: Path) -> int:
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DurableIndexError(
            f"{path}: already open by another DurableIndex (pid {holder}); only one process "
            "may serve a durable index folder"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _new_log(path: Path) -> int:
    """Atomically replace DIR/wal.log by an empty log; its fd, open for writing."""
    tmp = path / f"{LOG}.next"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, LOG_HEADER, 0)
        sync_file(fd)
        os.replace(tmp, path / LOG)
        sync_dir(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _point_link(path: Path, name: str) -> None:
    """Make DIR/snapshot a symlink to `name` with one atomic rename."""
    tmp = path / f".{LINK}.next"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, path / LINK)
    sync_dir(path)


def _current_snapshot(path: Path) -> Path:
    """The folder DIR/snapshot names; if the name is missing (a crash between retiring a
    plain snapshot folder and linking its successor), the newest complete snapshot-<v>."""
    link = path / LINK
    if link.is_symlink() or link.exists():
        if not link.is_dir():
            raise DurableIndexError(f"{link}: does not lead to a snapshot folder")
        return link
    found = []
    for p in path.iterdir():
        if _SNAPSHOT.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            try:
                found.append((read_manifest(p)["index_version"], p.name))
            except AdIndexError:
                continue  # not one of ours or incomplete: never chosen
    if not found:
        raise DurableIndexError(
            f"{path}: no {LINK!r} folder or link (not a durable index folder; "
            "make one with DurableIndex.create)"
        )
    _point_link(path, max(found)[1])
    return link


def _remove_leftovers(path: Path) -> None:
    """Delete our snapshots other than the current one and our temporaries."""
    link = path / LINK
    keep = os.readlink(link) if link.is_symlink() else None
    removed = False
    for p in path.iterdir():
        if _SNAPSHOT.fullmatch(p.name) and p.name != keep and not p.is_symlink():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        elif _TEMPORARY.fullmatch(p.name):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        else:
            continue
        removed = True
    if removed:
        sync_dir(path)


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
        users: UserStore | None = None,
    ):
        """Internal: use `create` or `open`."""
        self._path = path
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
        (`m31.index.users.write_state`: the users a cluster's shard starts with).
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
        lock_fd = _lock(path)
        log_fd = -1
        try:
            index = source if isinstance(source, AdIndex) else AdIndex.load(source, device)
            name = _snapshot_name(index.version)
            beside = None if users is None else lambda tmp: users(tmp / USERS)
            index.save(path / name, model_hash=index.model_hash, beside=beside)
            log_fd = _new_log(path)
            _point_link(path, name)  # last, so a folder with a link is always complete
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
        cls, path: str | Path, device: str | torch.device = "cpu", users: UserStore | None = None
    ) -> DurableIndex:
        """Load the snapshot of the folder `path` onto `device` and replay its log.

        `users`: the user store that the log's events go to (`add_events`), as seeded (from the
        online features); a snapshot that holds one (`users/`) replaces its content."""
        path = Path(path)
        if not path.is_dir():
            raise DurableIndexError(f"{path}: no such durable index folder")
        lock_fd = _lock(path)
        try:
            snapshot = _current_snapshot(path)
            _remove_leftovers(path)
            index = AdIndex.load(snapshot, device)
            if users is not None and (snapshot / USERS).is_dir():
                users.restore(snapshot / USERS)
            snapshot_version = index.version
            log_fd, log_end = cls._replay(path, index, users)
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(path, index, lock_fd, log_fd, log_end, snapshot_version, users)

    @staticmethod
    def _replay(path: Path, index: AdIndex, users: UserStore | None) -> tuple[int, int]:
        """Apply the log's records newer than `index`; (log fd, end of its intact records)."""
        file = path / LOG
        if not file.exists():
            logger.info("%s: no log yet, starting an empty one", file)
            return _new_log(path), len(LOG_HEADER)
        fd = os.open(file, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if os.pread(fd, len(LOG_HEADER), 0) != LOG_HEADER:
                raise DurableIndexError(f"{file}: not an m31 write-ahead log (bad header)")
            end = len(LOG_HEADER)
            if size > end:
                with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
                    end = DurableIndex._replay_records(file, buf, index, users)
            if end < size:
                os.ftruncate(fd, end)
                sync_file(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd, end

    @staticmethod
    def _replay_records(file: Path, buf: mmap.mmap, index: AdIndex, users: UserStore | None) -> int:
        offset, last = len(LOG_HEADER), None
        while offset < len(buf):
            parsed = parse(RECORD_MAGIC, buf, offset)
            if parsed is None:
                later = next_intact(RECORD_MAGIC, buf, offset)
                if later is not None:
                    raise DurableIndexError(
                        f"{file}: damaged record at byte {offset}, yet an intact one follows at "
                        f"byte {later}: the log is corrupt, not torn by a crash"
                    )
                logger.warning(
                    "%s: cutting off a torn record at byte %d (%d bytes): a mutation that was "
                    "never acknowledged",
                    file,
                    offset,
                    len(buf) - offset,
                )
                return offset
            payload, after = parsed
            try:
                record = _Record.decode(payload)
            except (ValueError, KeyError, TypeError, pa.ArrowInvalid) as e:
                raise DurableIndexError(
                    f"{file}: record at byte {offset} is unreadable ({e})"
                ) from e
            if last is not None and record.version <= last:
                raise DurableIndexError(
                    f"{file}: record at byte {offset} has version {record.version}, "
                    f"not after the previous record's {last}"
                )
            last = record.version
            # Records up to the snapshot's version are already in it: a crash came between
            # a snapshot's commit and the truncation of the log.
            if record.version > index.version:
                if record.version != index.version + 1:
                    raise DurableIndexError(
                        f"{file}: record at byte {offset} has version {record.version} but the "
                        f"index is at {index.version}: mutations in between are missing"
                    )
                try:
                    got = _apply(index, users, record)
                except (ValueError, KeyError, TypeError) as e:  # AdIndexError included
                    raise DurableIndexError(
                        f"{file}: record at byte {offset} (version {record.version}) cannot be "
                        f"replayed: {e}"
                    ) from e
                if got != record.version:
                    raise DurableIndexError(
                        f"{file}: record at byte {offset} produced version {got}, logged "
                        f"{record.version}"
                    )
            offset = after
        return offset

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

        def prepare(version: int) -> _Record:
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
            return _Record("upsert", version, args)

        return self._mutate(prepare)

    def update_attributes(self, ad_id: int, **attrs: Any) -> int:
        """`AdIndex.update_attributes`, logged before it is applied."""

        def prepare(version: int) -> _Record:
            checked = self._index.check_update(ad_id, attrs)  # without the lock, as in upsert
            args = {"ad_id": checked.ad_id, "attrs": checked.attrs}
            return _Record("update_attributes", version, args)

        return self._mutate(prepare)

    def pause(self, ad_id: int) -> int:
        return self.update_attributes(ad_id, status="paused")

    def resume(self, ad_id: int) -> int:
        return self.update_attributes(ad_id, status="active")

    def delete(self, ad_ids: Any) -> int:
        """`AdIndex.delete`, logged before it is applied."""

        def prepare(version: int) -> _Record:
            ids = self._index.check_delete(ad_ids)  # [n]; without the lock, as in upsert
            return _Record("delete", version, {"ad_ids": ids})

        return self._mutate(prepare)

    def compact(self) -> int:
        """`AdIndex.compact`, logged before it is applied."""
        return self._mutate(lambda version: _Record("compact", version, {}))

    @property
    def users(self) -> UserStore | None:
        return self._users

    def add_events(
        self, user_ids, ad_ids, ts, surfaces, key: str | None = None, types=None, weights=None
    ) -> int:
        """Engagement events [n] (`UserStore.check`), logged before they reach the user store;
        the version that holds them. A call whose idempotency `key` was applied already is not
        applied again: its version is answered (KeyReused, a ValueError, if that was another
        call). Event `types` and `weights` (optional, [n],
        None each where not given) are logged with them; the store keeps neither."""
        users = self._require_users()
        with self._mutex:
            digest = None
            if key is not None:
                digest = call_digest(user_ids, ad_ids, ts, surfaces, types, weights)
                if (done := users.version_of(key, digest)) is not None:
                    return done

            def prepare(version: int) -> _Record:
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
                return _Record("events", version, args, checked)

            return self._mutate_locked(prepare)

    def set_users(self, users: list[tuple[int, dict[str, int]]]) -> int:
        """Set attribute codes of users, (user id, codes) each (`UserStore.set_attributes`),
        logged first."""
        self._require_users()
        rows = [[int(u), {k: int(v) for k, v in codes.items()}] for u, codes in users]
        return self._mutate(lambda version: _Record("users", version, {"users": rows}))

    def _require_users(self) -> UserStore:
        if self._users is None:
            raise DurableIndexError(f"{self._path}: opened without a user store")
        return self._users

    def _mutate(self, prepare: Callable[[int], _Record]) -> int:
        with self._mutex:
            return self._mutate_locked(prepare)

    def _mutate_locked(self, prepare: Callable[[int], _Record]) -> int:
        self._check_usable()
        record = prepare(self._version + 1)  # AdIndexError here: nothing logged or changed
        data = record.encode()
        try:
            write_all(self._log_fd, data, self._log_end)
            sync_file(self._log_fd)
        except OSError as e:
            self._fail(f"writing the log failed ({e})")
            raise DurableIndexError(
                f"{self._path / LOG}: {self._failed}; version {record.version} was not applied"
            ) from e
        self._log_end += len(data)
        try:
            version = _apply(self._index, self._users, record)
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
                self._mutate_locked(lambda version: _Record("compact", version, {}))
            version = self._version
            if version == self._snapshot_version:
                return version
            name = _snapshot_name(version)
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
                _remove_leftovers(self._path)
            except OSError as e:  # only disk space is at stake; the next open retries
                logger.warning("%s: could not remove old snapshots (%s)", self._path, e)
            return version

    def _swap_snapshot(self, name: str) -> None:
        """The commit point: DIR/snapshot names the new folder."""
        link = self._path / LINK
        if not link.is_symlink():
            # A plain folder cannot be swapped atomically: move it aside first. A crash
            # right here leaves no DIR/snapshot, and `open` takes the newest snapshot-<v>.
            os.rename(link, self._path / _snapshot_name(self._snapshot_version))
            sync_dir(self._path)
        _point_link(self._path, name)

    def _start_new_log(self) -> None:
        fd = _new_log(self._path)
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
