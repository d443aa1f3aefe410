"""Per-user event sequences as of a cutoff time, without leakage.

Shapes: n queries (user, cutoff), L the sequence length, M the events stored.

Events are kept sorted by (user, ts) with per-user offsets (CSR). For a query (u, t) the
sequence is the last L events of u with ts < t, oldest first, right-aligned and padded with -1
on the left, so position L-1 always holds the most recent event.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

_BAND = np.int64(1) << 36  # wider than any span of Unix seconds this century


@dataclass
class EventSequences:
    offsets: np.ndarray  # [U + 1] int64: events of user u are rows offsets[u]:offsets[u+1]
    ts: np.ndarray  # [M] int64, sorted within each user
    values: dict[str, np.ndarray]  # name -> [M] payload (item row, surface, ...)

    @classmethod
    def from_events(
        cls, user: np.ndarray, ts: np.ndarray, n_users: int, **values: np.ndarray
    ) -> EventSequences:
        user = np.asarray(user, dtype=np.int64)
        ts = np.asarray(ts, dtype=np.int64)
        if len(user) and (user.min() < 0 or user.max() >= n_users):
            raise ValueError(
                f"user rows must lie in [0, {n_users}), got [{user.min()}, {user.max()}]"
            )
        order = np.lexsort((ts, user))  # stable: equal (user, ts) keep their input order
        counts = np.bincount(user, minlength=n_users)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(offsets, ts[order], {k: np.asarray(v)[order] for k, v in values.items()})

    def last(self, n: int) -> EventSequences:
        """The last `n` events of each user (all of them for a user with fewer)."""
        counts = np.diff(self.offsets)  # [U]
        kept = np.minimum(counts, n)
        # position of each event within its user's run, counted from the run's start
        within = np.arange(len(self.ts)) - np.repeat(self.offsets[:-1], counts)
        keep = within >= np.repeat(counts - kept, counts)  # [M]
        offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
        return EventSequences(offsets, self.ts[keep], {k: v[keep] for k, v in self.values.items()})

    @property
    def n_users(self) -> int:
        return len(self.offsets) - 1

    def count_before(self, users: np.ndarray, cutoffs: np.ndarray) -> np.ndarray:
        """Number of events of each user with ts < cutoff: [n]."""
        users = np.asarray(users, dtype=np.int64)
        t_min, keys = self._keys
        cut = np.clip(np.asarray(cutoffs, dtype=np.int64) - t_min, 0, _BAND - 1)
        return np.searchsorted(keys, users * _BAND + cut, side="left") - self.offsets[users]

    @functools.cached_property
    def _keys(self) -> tuple[int, np.ndarray]:
        # One global binary search: each user's timestamps live in a disjoint band of the key.
        t_min = int(self.ts.min()) if len(self.ts) else 0
        row_user = np.repeat(np.arange(self.n_users, dtype=np.int64), np.diff(self.offsets))
        return t_min, row_user * _BAND + (self.ts - t_min)  # [M], sorted

    def before(
        self, users: np.ndarray, cutoffs: np.ndarray, max_len: int
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """The last `max_len` events of each user strictly before its cutoff.

        Returns (values, ts, lengths): each value and ts as [n, L] right-aligned, padded with -1;
        lengths [n].
        """
        users = np.asarray(users, dtype=np.int64)
        n_before = self.count_before(users, cutoffs)  # [n]
        lengths = np.minimum(n_before, max_len)
        end = self.offsets[users] + n_before  # exclusive
        pos = end[:, None] - max_len + np.arange(max_len)[None, :]  # [n, L]
        valid = np.arange(max_len)[None, :] >= (max_len - lengths)[:, None]
        safe = np.where(valid, pos, 0)
        ts = np.where(valid, self.ts[safe] if len(self.ts) else 0, -1)
        values = {
            k: np.where(valid, v[safe] if len(v) else 0, -1).astype(
                v.dtype if v.dtype.kind in "iu" else np.int64
            )
            for k, v in self.values.items()
        }
        return values, ts, lengths
