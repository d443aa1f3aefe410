"""The write-ahead log of a `DurableIndex` (DESIGN §4, "DurableIndex"): its file, its records,
and what a record does when it is applied.

`wal.log` is the header b"M31WAL1\\n" followed by self-delimiting records (`m31.index.framing`)::

    b"M31R" | payload length u64 LE | CRC32 of (length bytes + payload) u32 LE | payload
    payload = meta length u32 LE | meta JSON {op, version, args, blobs} | blobs

where blobs are arrays as raw little-endian bytes (ids int64; g, x, b float32, which holds
bf16 and fp16 table values exactly) and attribute tables as an Arrow IPC stream. The record
holds the validated, normalised arguments and the version the mutation produced.

A record's op is a mutation of the ads (upsert, update_attributes, delete, compact) or of the
users beside them (events, users). The users are a `UserState`: what a DurableIndex asks of
the user store it logs (`m31.users.UserStore`), so that the index imports nothing of users.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from m31.index.ad_index import AdIndex
from m31.index.framing import frame, sync_dir, sync_file, write_all

LOG = "wal.log"
LOG_HEADER = b"M31WAL1\n"
RECORD_MAGIC = b"M31R"
_META_LEN = struct.Struct("<I")


class CheckedEvents(Protocol):
    """Engagement events as `UserState.check` gives them: [n] int64 each (and whatever else
    the store applies)."""

    user_id: np.ndarray
    ad_id: np.ndarray
    ts: np.ndarray


class UserState(Protocol):
    """The users a `DurableIndex` logs beside its ads (`m31.users.UserStore`): events and
    attribute codes are checked before they are logged and applied after, in the version order
    of the ads; a snapshot holds the users in its users/ folder."""

    def call_digest(self, user_ids, ad_ids, ts, surfaces, types=None, weights=None) -> str:
        """The digest of an events call, kept with its idempotency key."""

    def version_of(self, key: str, digest: str | None = None) -> int | None:
        """The version the call of idempotency `key` was applied at, if it was; a ValueError
        if that call's digest is not `digest`."""

    def check(self, user_ids, ad_ids, ts, surfaces) -> CheckedEvents:
        """Engagement events [n], validated (ValueError naming the event otherwise)."""

    def add(
        self, events: Any, version: int, key: str | None = None, digest: str | None = None
    ) -> None:
        """Apply checked events at `version`, remembering the call's key and digest."""

    def set_attributes(self, user_id: int, codes: Mapping[str, int]) -> None:
        """Set some attribute codes of a user."""

    def save(self, folder: Path) -> None:
        """Write the users into `folder` (a snapshot's users/, being written)."""

    def restore(self, folder: Path) -> None:
        """Replace the users by what `save` wrote into `folder`."""


@dataclass(frozen=True)
class Record:
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
    def decode(cls, payload: bytes) -> Record:
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


def apply(index: AdIndex, users: UserState | None, record: Record) -> int:
    """Apply `record` to `index` (or to `users`); the version it gives."""
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


def new_log(path: Path) -> int:
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
