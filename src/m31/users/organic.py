"""Organic events of stored users by id: the topics of each user's organic engagement (DESIGN
§4), which come with the online features and which no route writes.

Shapes: U users held, M events held, n users asked, O the organic length the model reads.

A server holds them for every user its features seed; a cluster's shard for the users it owns
(`owned`), so that it answers its users whole (`m31.users.stored.read_users`).
"""

from __future__ import annotations

import numpy as np

from m31.features.sequences import EventSequences


class OrganicEvents:
    """`sequences` (values: topic) of the users `user_ids` [U] (row u of the sequences is user
    `user_ids[u]`), of which a read gives the last `length` before its time."""

    def __init__(self, user_ids: np.ndarray, sequences: EventSequences, length: int) -> None:
        ids = np.asarray(user_ids, np.int64)
        if len(ids) != sequences.n_users:
            raise ValueError(f"{len(ids)} user ids for {sequences.n_users} users' sequences")
        self._order = np.argsort(ids, kind="stable")
        self._sorted = ids[self._order]
        self.sequences, self.length = sequences, length

    @classmethod
    def empty(cls, length: int) -> OrganicEvents:
        """No user's: every read gives padding."""
        none = np.zeros(0, np.int64)
        return cls(none, EventSequences.from_events(none, none, 0, topic=none), length)

    def __len__(self) -> int:
        return len(self._sorted)

    def rows_of(self, user_ids: np.ndarray) -> np.ndarray:
        """[n] the sequences' row of each user, -1 for one not held."""
        ids = np.asarray(user_ids, np.int64)
        if not len(self._sorted):
            return np.full(len(ids), -1, np.int64)
        pos = np.minimum(np.searchsorted(self._sorted, ids), len(self._sorted) - 1)
        return np.where(self._sorted[pos] == ids, self._order[pos], -1)

    def before(self, user_ids: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """[n, length] each user's topics strictly before its time, right-aligned, -1 padding
        (all of it for a user not held)."""
        rows = self.rows_of(user_ids)
        out = np.full((len(rows), self.length), -1, np.int64)
        held = np.flatnonzero(rows >= 0)
        if len(held):
            values, _, _ = self.sequences.before(rows[held], np.asarray(ts)[held], self.length)
            out[held] = values["topic"]
        return out

    def owned(self, keep) -> OrganicEvents:
        """The events of the users whose id `keep(ids [U]) -> bool [U]` selects."""
        seq = self.sequences
        ids = self._sorted[np.argsort(self._order)]  # in row order
        kept = np.flatnonzero(keep(ids)) if len(ids) else np.zeros(0, np.int64)
        new_row = np.full(len(ids), -1, np.int64)
        new_row[kept] = np.arange(len(kept))
        user = np.repeat(np.arange(seq.n_users), np.diff(seq.offsets))
        mine = new_row[user] >= 0
        values = {k: v[mine] for k, v in seq.values.items()}
        owned = EventSequences.from_events(new_row[user[mine]], seq.ts[mine], len(kept), **values)
        return OrganicEvents(ids[kept], owned, self.length)
