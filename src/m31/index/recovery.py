"""Opening a durable index folder (DESIGN §4, "DurableIndex"; the layout and the crash analysis
are in `m31.index.durable`): the folder's lock, which snapshot is current, the removal of what a
crash left behind, and the replay of the write-ahead log (`m31.index.wal`).

Replay applies the log's records newer than the snapshot, each of which must produce exactly
the version it logged. A damaged record at the end of the log is the torn write of a mutation
that was never acknowledged: it is cut off with a warning. A damaged record followed by a valid
one is corruption, and an error.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa

from m31.index.ad_index import AdIndex
from m31.index.errors import AdIndexError, DurableIndexError
from m31.index.framing import next_intact, parse, sync_dir, sync_file
from m31.index.snapshot import read_manifest
from m31.index.wal import LOG, LOG_HEADER, RECORD_MAGIC, Record, UserState, apply, new_log

logger = logging.getLogger(__name__)

LINK = "snapshot"
LOCK = "LOCK"
_SNAPSHOT = re.compile(r"snapshot-(\d+)")
# Our own temporaries: `write_folder_atomic`'s folders for a snapshot, the next symlink, the next
# log.
_TEMPORARY = re.compile(r"\.snapshot-\d+\.(tmp|old)-.*|\.snapshot\.next|wal\.log\.next")


def snapshot_name(version: int) -> str:
    return f"snapshot-{version:012d}"


def lock_folder(path: Path) -> int:
    """Take DIR/LOCK (the flock of the one process that has DIR open, holding its pid); its fd."""
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


def point_link(path: Path, name: str) -> None:
    """Make DIR/snapshot a symlink to `name` with one atomic rename."""
    tmp = path / f".{LINK}.next"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, path / LINK)
    sync_dir(path)


def current_snapshot(path: Path) -> Path:
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
    point_link(path, max(found)[1])
    return link


def remove_leftovers(path: Path) -> None:
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


def replay(
    path: Path, index: AdIndex, users: UserState | None, synced: bool = True
) -> tuple[int, int]:
    """Apply the log's records newer than `index`; (log fd, end of its intact records).
    `synced=False`: a log written without fsync (`DurableIndex.open(sync=False)`), whose owner
    restores what it lacks; a power loss may have kept a later record and not an earlier one,
    so a damaged record there ends the log even with intact ones after it."""
    file = path / LOG
    if not file.exists():
        logger.info("%s: no log yet, starting an empty one", file)
        return new_log(path), len(LOG_HEADER)
    fd = os.open(file, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if os.pread(fd, len(LOG_HEADER), 0) != LOG_HEADER:
            raise DurableIndexError(f"{file}: not an m31 write-ahead log (bad header)")
        end = len(LOG_HEADER)
        if size > end:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
                end = _replay_records(file, buf, index, users, synced)
        if end < size:
            os.ftruncate(fd, end)
            sync_file(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, end


def _replay_records(
    file: Path, buf: mmap.mmap, index: AdIndex, users: UserState | None, synced: bool
) -> int:
    """Apply the records of the log `buf` (from after its header) newer than `index`; the end
    of its intact records."""
    offset, last = len(LOG_HEADER), None
    while offset < len(buf):
        parsed = parse(RECORD_MAGIC, buf, offset)
        if parsed is None:
            later = next_intact(RECORD_MAGIC, buf, offset)
            if later is not None and not synced:
                logger.warning(
                    "%s: cutting off the log at a damaged record at byte %d (%d bytes, intact "
                    "records after it): a tail never synced, which this index's owner restores",
                    file,
                    offset,
                    len(buf) - offset,
                )
                return offset
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
            record = Record.decode(payload)
        except (ValueError, KeyError, TypeError, pa.ArrowInvalid) as e:
            raise DurableIndexError(f"{file}: record at byte {offset} is unreadable ({e})") from e
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
                got = apply(index, users, record)
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
