"""A small append-only log of records, each fsync'd unless its caller says otherwise: the
transaction log of a shard and the decision log of the coordinator (`m31.cluster.shard`,
`m31.cluster.coordinator`).

Layout: the header b"M31TXN1\\n", then framed records::

    b"M31T" | payload length u64 LE | CRC32 of (length bytes + payload) u32 LE | payload

The payload is a pickled tuple; the file is written and read by m31 alone. A damaged record at
the end is a write that was never acknowledged (a crash during `append`): it is cut off when the
log is opened. A damaged record followed by an intact one is corruption, and an error.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from m31.index.framing import frame, next_intact, parse, sync_dir, sync_file, write_all

HEADER = b"M31TXN1\n"
MAGIC = b"M31T"


class RecordLogError(RuntimeError):
    """A log that cannot be used; the message names the file and the byte offset."""


def _frame(record: tuple) -> bytes:
    return frame(MAGIC, pickle.dumps(record, protocol=5))


class RecordLog:
    """Open with `open`, which also returns the records already there."""

    def __init__(self, path: Path, fd: int, end: int) -> None:
        self.path, self._fd, self._end = path, fd, end

    @classmethod
    def open(cls, path: str | Path) -> tuple[RecordLog, list[tuple]]:
        """(the log, its intact records in order); an absent file starts empty."""
        path = Path(path)
        if not path.exists():
            return cls(path, *cls._fresh(path, [])), []
        data = path.read_bytes()
        if not data.startswith(HEADER):
            raise RecordLogError(f"{path}: not an m31 record log (bad header)")
        records, offset = [], len(HEADER)
        while offset < len(data):
            parsed = parse(MAGIC, data, offset)
            if parsed is None:
                if next_intact(MAGIC, data, offset) is not None:
                    raise RecordLogError(
                        f"{path}: damaged record at byte {offset} followed by an intact one"
                    )
                break  # a torn last write, never acknowledged
            payload, offset = parsed
            records.append(pickle.loads(payload))
        fd = os.open(path, os.O_RDWR)
        if offset < len(data):
            os.ftruncate(fd, offset)
            os.fsync(fd)
        return cls(path, fd, offset), records

    @staticmethod
    def _fresh(path: Path, records: list[tuple]) -> tuple[int, int]:
        """Atomically replace `path` by a log of `records`; (fd, end)."""
        tmp = path.with_name(path.name + ".next")
        data = HEADER + b"".join(_frame(r) for r in records)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            os.replace(tmp, path)
            sync_dir(path.parent)
        except BaseException:
            os.close(fd)
            raise
        return fd, len(data)

    def append(self, record: tuple, sync: bool = True) -> None:
        """Write `record` and fsync it: once this returns, it survives a crash. `sync=False`:
        not fsync'd by itself, only by the next synced append (which syncs the whole file),
        for a record whose loss in a crash of the machine the caller can recover from."""
        data = _frame(record)
        write_all(self._fd, data, self._end)
        if sync:
            sync_file(self._fd)
        self._end += len(data)

    def rewrite(self, records: list[tuple]) -> None:
        """Replace the whole log by `records`, atomically (a crash leaves one or the other)."""
        fd, end = self._fresh(self.path, records)
        os.close(self._fd)
        self._fd, self._end = fd, end

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_records(path: str | Path) -> list[Any]:
    """The intact records of a log, without opening it for writing (offline tools)."""
    log, records = RecordLog.open(path)
    log.close()
    return records
