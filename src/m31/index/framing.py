"""Crash-safe append-only files: the record framing and the fsync helpers that the index's
write-ahead log (`m31.index.durable`) and the cluster's transaction and decision logs
(`m31.cluster.records`) share.

A record is ``magic (4 bytes) | payload length u64 LE | CRC32 of (length bytes + payload) u32 LE
| payload``. A record that does not parse at the end of a file is a write that was never
acknowledged (torn by a crash); one followed by an intact record is corruption.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from pathlib import Path

FRAME = struct.Struct("<4sQI")  # magic, payload length, CRC32 of (length bytes + payload)


def frame(magic: bytes, payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return FRAME.pack(magic, len(payload), zlib.crc32(payload, zlib.crc32(length))) + payload


def parse(magic: bytes, buf: bytes | mmap.mmap, offset: int) -> tuple[bytes, int] | None:
    """(payload, offset after it) of a whole, intact record at `offset`; else None."""
    start = offset + FRAME.size
    if start > len(buf):
        return None
    found, length, crc = FRAME.unpack_from(buf, offset)
    if found != magic or start + length > len(buf):
        return None
    payload = buf[start : start + length]
    if zlib.crc32(payload, zlib.crc32(buf[offset + 4 : offset + 12])) != crc:
        return None
    return payload, start + length


def next_intact(magic: bytes, buf: bytes | mmap.mmap, offset: int) -> int | None:
    """Offset of the first intact record starting after `offset`, if any."""
    pos = buf.find(magic, offset + 1)
    while pos != -1:
        if parse(magic, buf, pos) is not None:
            return pos
        pos = buf.find(magic, pos + 1)
    return None


def sync_file(fd: int) -> None:
    # fdatasync persists the data and the file size, which is all an append needs.
    (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
