"""The index's errors (their own module, so that every part of the index, and whatever serves
it, can raise them). None carries HTTP: the routes map them to status codes (`m31.serve.app`)."""

from __future__ import annotations

from collections.abc import Sequence


class AdIndexError(ValueError):
    """An invalid index operation or snapshot; the index is unchanged when this is raised."""


class NotFound(LookupError):
    """No such ad."""


class Unavailable(RuntimeError):
    """Part of a sharded index could not answer within the deadline (down, restarting or
    recovering); `shards` names it."""

    def __init__(self, message: str, shards: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.shards = list(shards)


class DurableIndexError(AdIndexError):
    """A durable index folder or log that cannot be used, or a DurableIndex that stopped
    taking mutations; the message names the file and, for the log, the byte offset."""
