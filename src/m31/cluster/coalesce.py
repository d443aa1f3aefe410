"""Reads that arrive while one runs share the next (`Coalesced`): how an ingress reads its calls'
stored users from the owner shards with one Ray call per owner for many HTTP calls under load,
and with no added wait when idle (the first read runs at once). The group commit of writes does
the same on the coordinator (`m31.cluster.group`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class _Read:
    ids: np.ndarray
    ts: np.ndarray
    done: bool = False
    result: list = field(default_factory=list)
    error: BaseException | None = None


class Coalesced:
    """`read(ids [n], ts [n]) -> list [n]`, made shared: a call made while another runs waits
    for it, then the waiting calls run as one read of their ids concatenated (in arrival
    order), and each gets its own part, or the read's error."""

    def __init__(self, read: Callable[[np.ndarray, np.ndarray], list]) -> None:
        self.read = read
        self._changed = threading.Condition()
        self._waiting: list[_Read] = []
        self._running = False
        self.reads = 0  # reads run (a call's count, for tests and metrics)

    def __call__(self, ids, ts) -> list:
        me = _Read(np.asarray(ids, np.int64), np.asarray(ts, np.int64))
        with self._changed:
            self._waiting.append(me)
            while self._running and not me.done:
                self._changed.wait()
            if me.done:  # another call ran this one's read
                return self._answer(me)
            group, self._waiting, self._running = self._waiting, [], True
        ids = np.concatenate([r.ids for r in group])
        ts = np.concatenate([r.ts for r in group])
        try:
            out, error = self.read(ids, ts), None
        except BaseException as e:  # every call of the group gets it
            out, error = [], e
        with self._changed:
            at = 0
            for r in group:
                r.result, r.error, r.done = out[at : at + len(r.ids)], error, True
                at += len(r.ids)
            self._running = False
            self.reads += 1
            self._changed.notify_all()
        return self._answer(me)

    @staticmethod
    def _answer(r: _Read) -> list:
        if r.error is not None:
            raise r.error
        return r.result
