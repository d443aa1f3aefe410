"""A stored user as of a request's time (`StoredUser`), read where the user lives: the server's
own store, or, on a cluster, the shard that owns the user (`m31.cluster.shard.Shard.stored_users`),
so that an ingress holds no user (DESIGN §7, "Users").

Shapes: B users asked, L' the store's length, O the organic length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from m31.users.organic import OrganicEvents
from m31.users.store import UserStore


@dataclass(frozen=True, eq=False)
class StoredUser:
    """A stored user as of its request's time, as a request is prepared and encoded with it:
    what the user store holds of it (`UserStore.history`) and its organic events. Arrays of
    the store's length L', right-aligned, most recent last."""

    attributes: Mapping[str, int]  # the store's codes: cohort, age_bucket, gender, country, age
    targeting: Mapping  # country, age and gender as the ads' targeting reads them
    ads: np.ndarray  # [L'] ad ids engaged strictly before the request's time, -1 padding
    surfaces: np.ndarray  # [L'] surface codes, 0 padding
    times: np.ndarray  # [L'] Unix seconds, -1 padding
    organic: np.ndarray  # [O] organic topics strictly before the request's time, -1 padding

    def engaged(self, ts: int, window_s: int) -> tuple[np.ndarray, np.ndarray]:
        """(ad ids, counts) of the engagements in [ts - window_s, ts)."""
        inside = (self.ads >= 0) & (self.times >= ts - window_s)
        return np.unique(self.ads[inside], return_counts=True)


def read_users(
    store: UserStore | None, organic: OrganicEvents, user_ids: np.ndarray, ts: np.ndarray
) -> list[StoredUser | None]:
    """Users `user_ids` [B] as of their times `ts` [B] (None for one `store` does not hold;
    every one without a store): one read of the store, so each user's attributes, targeting
    and engagements are of one state."""
    ids, ts = np.asarray(user_ids, np.int64), np.asarray(ts, np.int64)
    out: list[StoredUser | None] = [None] * len(ids)
    if store is None or not len(ids):
        return out
    rows = store.rows_of(ids)
    held = np.flatnonzero(rows >= 0)
    if not len(held):
        return out
    attrs, ads, surfaces, times = store.history(rows[held], ts[held])  # [h], [h, L'] each
    topics = organic.before(ids[held], ts[held])  # [h, O]
    for j, i in enumerate(held.tolist()):
        codes = {k: int(v[j]) for k, v in attrs.items()}
        targeting = store.targeting_of(codes)  # of the same read as the history
        out[i] = StoredUser(codes, targeting, ads[j], surfaces[j], times[j], topics[j])
    return out
