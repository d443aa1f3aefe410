"""Stored users as live state: each user's attributes and last L engagements (DESIGN §4).

Shapes: U users, C >= U rows of capacity, L engagements kept per user, n events in one call,
B requests.

The store is seeded from the online features (`UserStore.seed`: the users of the dataset and
their last L engagements) and grows with the engagement events a server takes
(`m31.index.durable.DurableIndex.add_events`, which logs them first: the store is the
`UserState` it logs beside the ads). An event of a user the
store does not hold creates that user with no attributes (every one unknown: no input from it,
and targeting on it reaches the user only through ads without that restriction). A user's
engagements are kept in time order (ties in arrival order); when more than L are held, the
oldest roll off, and an event older than all L a full user holds is dropped.

Engagements are kept by ad id, whatever the ad: one the model's catalogue does not hold (an ad
upserted after training, or one deleted or never indexed) is kept too. The model reads only
the ones its catalogue holds (it has no features for the others; `m31.engine.user_inputs`), and
frequency caps count them all (`engaged`).

Memory: per user, L × 18 bytes of engagements (ad id and time int64, surface int16), 21 bytes
of attributes, and the id map's entry (about 100 bytes of Python dict): at L = 50 about 1 KB
(`nbytes_per_user`, measured by `tests/test_users.py`). Organic events, which no route writes,
are held beside the store (`m31.users.organic`).

Concurrency: one writer at a time (the DurableIndex's mutex); readers copy the rows they need
under the store's lock, which a write holds while it changes rows, so a reader sees every
event of a call or none.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from m31.users.idempotency import IdempotencyKeys, call_digest

# Demographic codes as the model reads them (`m31.features.build`): the vocabulary's length is
# the unknown value; `age` is the raw age for targeting, -1 unknown.
ATTRIBUTES = ("cohort", "age_bucket", "gender", "country", "age")
FILES = ("users.npz", "keys.json")
# A user's state as `dump` gives it, one array each: ids first.
ARRAYS = ("ids", "ad", "ts", "surface", "held", *ATTRIBUTES)


@dataclass(frozen=True)
class Vocab:
    """What a user store's codes mean: the model's values of each field."""

    surfaces: tuple[str, ...]
    countries: tuple[str, ...]
    genders: tuple[str, ...]
    cohorts: tuple[int, ...]
    n_age_buckets: int

    def unknown(self) -> dict[str, int]:
        """The codes of a user with no attributes."""
        return {
            "cohort": len(self.cohorts),
            "age_bucket": self.n_age_buckets,
            "gender": len(self.genders),
            "country": len(self.countries),
            "age": -1,
        }


@dataclass(frozen=True)
class Events:
    """Engagement events, checked: [n] each."""

    user_id: np.ndarray  # int64
    ad_id: np.ndarray  # int64
    ts: np.ndarray  # int64 Unix seconds
    surface: np.ndarray  # int16 codes into Vocab.surfaces; len(surfaces): none


class UserStore:
    """Each stored user's attribute codes and last `length` engagements; see the module
    docstring."""

    def __init__(self, length: int, vocab: Vocab, capacity: int = 1024) -> None:
        if length < 1:
            raise ValueError(f"length must be positive, got {length}")
        self.length, self.vocab = length, vocab
        self._lock = threading.Lock()
        self._n_users = 0
        self._row: dict[int, int] = {}  # user id -> row
        self._keys = IdempotencyKeys()  # of the events calls applied
        self._alloc(max(capacity, 1))

    def _alloc(self, capacity: int) -> None:
        L, old = self.length, getattr(self, "_ids", None)
        fresh = {
            "_ids": np.full(capacity, -1, np.int64),
            "_ad": np.full((capacity, L), -1, np.int64),  # left-aligned, oldest first
            "_ts": np.zeros((capacity, L), np.int64),
            "_surface": np.zeros((capacity, L), np.int16),
            "_held": np.zeros(capacity, np.int32),  # engagements held per row
            **{f"_{a}": np.zeros(capacity, np.int32) for a in ATTRIBUTES},
        }
        for name, array in fresh.items():
            if old is not None:
                array[: self._n_users] = getattr(self, name)[: self._n_users]
            setattr(self, name, array)

    # ---- building ---------------------------------------------------------------------------

    @classmethod
    def seed(
        cls,
        length: int,
        vocab: Vocab,
        user_ids: np.ndarray,
        attributes: Mapping[str, np.ndarray],
        events: Events,
    ) -> UserStore:
        """A store of `user_ids` [U] with their `attributes` (name -> [U] codes, `ATTRIBUTES`)
        and engagement `events` (of those users only), of which each user keeps the last
        `length`."""
        store = cls(length, vocab, capacity=len(user_ids))
        ids = np.asarray(user_ids, np.int64)
        if len(np.unique(ids)) != len(ids):
            raise ValueError("user_ids: an id is given twice")
        store._ids[: len(ids)] = ids
        for a in ATTRIBUTES:
            getattr(store, f"_{a}")[: len(ids)] = attributes[a]
        store._row = {int(u): i for i, u in enumerate(ids.tolist())}
        store._n_users = len(ids)
        store._append(store._rows_or_new(events.user_id), events)
        return store

    # ---- reading ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n_users

    def __contains__(self, user_id: int) -> bool:
        return int(user_id) in self._row

    def rows_of(self, user_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[n] the row of each user, -1 for a user the store does not hold."""
        return np.array([self._row.get(int(u), -1) for u in user_ids], np.int64)

    def history(
        self, rows: np.ndarray, ts: np.ndarray
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """(attributes name -> [B], ad ids [B, L], surfaces [B, L], times [B, L]) of each row's
        engagements strictly before its request time `ts`, right-aligned, most recent last,
        padded with -1 (ad ids and times) and 0 (surfaces)."""
        rows, ts = np.asarray(rows, np.int64), np.asarray(ts, np.int64)
        with self._lock:
            ad, t, s = self._ad[rows], self._ts[rows], self._surface[rows]
            held = self._held[rows]
            attrs = {a: getattr(self, f"_{a}")[rows].astype(np.int64) for a in ATTRIBUTES}
        L = self.length
        slot = np.arange(L)
        # Held engagements are in time order, so those before ts are a prefix: right-align it.
        k = ((slot[None, :] < held[:, None]) & (t < ts[:, None])).sum(1)  # [B]
        src = slot[None, :] - (L - k)[:, None]  # [B, L]
        ok = src >= 0
        src = np.where(ok, src, 0)
        take = lambda a, fill: np.where(ok, np.take_along_axis(a, src, 1), fill)  # noqa: E731
        return attrs, take(ad, -1), take(s.astype(np.int64), 0), take(t, -1)

    def targeting(self, row: int) -> dict:
        """The user's country, age and gender as the ads' targeting reads them (None: unknown)."""
        with self._lock:
            codes = {a: int(getattr(self, f"_{a}")[row]) for a in ("country", "gender", "age")}
        return self.targeting_of(codes)

    def targeting_of(self, codes: Mapping[str, int]) -> dict:
        """`targeting` of a user's attribute codes (as `history` gives them)."""
        v = self.vocab
        country, gender, age = (int(codes[a]) for a in ("country", "gender", "age"))
        return {
            "country": v.countries[country] if country < len(v.countries) else None,
            "age": None if age < 0 else age,
            "gender": v.genders[gender] if gender < len(v.genders) else None,
        }

    def version_of(self, key: str, digest: str | None = None) -> int | None:
        """The version an idempotency key's call was applied at, if it was (and is remembered);
        KeyReused (a ValueError) if that call's digest is not `digest` (`call_digest`)."""
        return self._keys.applied(key, digest)

    @staticmethod
    def call_digest(user_ids, ad_ids, ts, surfaces, types=None, weights=None) -> str:
        """The digest an events call's idempotency key is remembered with
        (`m31.users.idempotency.call_digest`)."""
        return call_digest(user_ids, ad_ids, ts, surfaces, types, weights)

    def nbytes_per_user(self) -> float:
        """Bytes of the store per user it holds (its arrays' capacity and the id map)."""
        import sys

        arrays = sum(
            getattr(self, n).nbytes
            for n in ("_ids", "_ad", "_ts", "_surface", "_held", *(f"_{a}" for a in ATTRIBUTES))
        )
        per_row = arrays / len(self._ids)
        map_bytes = sys.getsizeof(self._row) + sum(sys.getsizeof(k) for k in self._row) * 2
        return per_row + map_bytes / max(self._n_users, 1)

    # ---- checking and writing (the DurableIndex logs what `check` returns, then applies it) -

    def check(self, user_ids, ad_ids, ts, surfaces: Sequence[str | None]) -> Events:
        """Validate events given as sequences [n]; ValueError naming `events[i].field`."""
        n = len(user_ids)
        if not n or not (len(ad_ids) == len(ts) == len(surfaces) == n):
            raise ValueError(
                f"events: {n} user ids, {len(ad_ids)} ad ids, {len(ts)} times and "
                f"{len(surfaces)} surfaces; give at least one event, each complete"
            )
        codes = {s: i for i, s in enumerate(self.vocab.surfaces)}
        surface = np.empty(n, np.int16)
        for i, s in enumerate(surfaces):
            if s is None:
                surface[i] = len(codes)
            elif s in codes:
                surface[i] = codes[s]
            else:
                known = ", ".join(self.vocab.surfaces) or "none: the model knows no surfaces"
                raise ValueError(f"events[{i}].surface: {s!r} is not one of {known}")
        return Events(
            np.asarray(user_ids, np.int64),
            np.asarray(ad_ids, np.int64),
            np.asarray(ts, np.int64),
            surface,
        )

    def add(
        self, events: Events, version: int, key: str | None = None, digest: str | None = None
    ) -> None:
        """Append checked events (creating unknown users), remembering that the call `digest`
        under `key` was applied at `version`."""
        with self._lock:
            self._append(self._rows_or_new(events.user_id), events)
            if key is not None:
                self._keys.remember(key, version, digest)

    def set_attributes(self, user_id: int, codes: Mapping[str, int]) -> None:
        """Set some attribute codes of a user (created if new, the others unknown)."""
        with self._lock:
            (row,) = self._rows_or_new(np.array([user_id], np.int64))
            for name, code in codes.items():
                getattr(self, f"_{name}")[row] = code

    def _rows_or_new(self, user_ids: np.ndarray) -> np.ndarray:
        rows = np.empty(len(user_ids), np.int64)
        unknown = self.vocab.unknown()
        for i, u in enumerate(user_ids.tolist()):
            row = self._row.get(u)
            if row is None:
                row = self._n_users
                if row == len(self._ids):
                    self._alloc(2 * row)
                self._ids[row] = u
                for a, code in unknown.items():
                    getattr(self, f"_{a}")[row] = code
                self._row[u], self._n_users = row, row + 1
            rows[i] = row
        return rows

    def _append(self, rows: np.ndarray, events: Events) -> None:
        """Merge `events` into the held engagements of `rows`, keeping the last L of each."""
        if not len(rows):
            return
        L = self.length
        touched, local = np.unique(rows, return_inverse=True)  # [m], [n]: rows' places in it
        held = self._held[touched]
        old = np.arange(L)[None, :] < held[:, None]  # [m, L]
        place = np.concatenate([np.repeat(np.arange(len(touched)), held), local])
        ad = np.concatenate([self._ad[touched][old], events.ad_id])
        ts = np.concatenate([self._ts[touched][old], events.ts])
        surface = np.concatenate([self._surface[touched][old], events.surface])
        # lexsort is stable: equal times keep arrival order (held ones first, then the call's)
        order = np.lexsort((ts, place))
        place, ad, ts, surface = place[order], ad[order], ts[order], surface[order]
        counts = np.bincount(place, minlength=len(touched))  # [m]
        rank_from_end = np.repeat(np.cumsum(counts), counts) - np.arange(len(place))  # 1: newest
        keep = rank_from_end <= L
        kept = np.minimum(counts, L)
        slot = np.arange(keep.sum()) - np.repeat(np.cumsum(kept) - kept, kept)
        r = touched[place[keep]]
        self._ad[r, slot] = ad[keep]
        self._ts[r, slot] = ts[keep]
        self._surface[r, slot] = surface[keep]
        self._held[touched] = kept

    # ---- moving users between stores (a cluster's shards and ingress replicas) -------------

    def dump(self, keep=None) -> dict[str, np.ndarray]:
        """The users' state as arrays [n, ...] (`ARRAYS`): every user, or those whose id
        `keep(ids [U]) -> bool [U]` selects; `put` gives it to another store of the same L."""
        with self._lock:
            n = self._n_users
            rows = np.arange(n) if keep is None else np.flatnonzero(keep(self._ids[:n]))
            return {name: getattr(self, f"_{name}")[rows].copy() for name in ARRAYS}

    def put(self, state: Mapping[str, np.ndarray]) -> None:
        """Give each user of `state` (`dump`'s) exactly the state it holds there, creating
        the users this store does not hold; other users are left as they are."""
        if state["ad"].shape[1:] != (self.length,):
            raise ValueError(
                f"users kept with L = {state['ad'].shape[1]}, this store keeps {self.length}"
            )
        with self._lock:
            rows = self._rows_or_new(np.asarray(state["ids"], np.int64))
            for name in ARRAYS[1:]:
                getattr(self, f"_{name}")[rows] = state[name]

    def owned(self, keep) -> UserStore:
        """A new store of the users whose id `keep` selects (as in `dump`), keys left out."""
        store = UserStore(self.length, self.vocab, capacity=max(self._n_users, 1))
        store.put(self.dump(keep))
        return store

    # ---- on disk ----------------------------------------------------------------------------

    def save(self, folder: Path) -> None:
        """Write the store into `folder` (which exists; a snapshot folder being written)."""
        with self._lock:
            keys = self._keys.items()
        write_state(folder, self.length, self.dump(), keys)

    def restore(self, folder: Path) -> None:
        """Replace the content by what `save` wrote into `folder`."""
        length, state, keys = read_state(folder)
        if length != self.length:
            raise ValueError(
                f"{folder}: users saved with L = {length}, this store keeps {self.length}"
            )
        with self._lock:
            self._n_users, self._row = 0, {}
            self._alloc(max(len(state["ids"]), 1))
            self._keys = IdempotencyKeys(keys)
        self.put(state)


def write_state(folder: Path, length: int, state: Mapping[str, np.ndarray], keys=()) -> None:
    """Write users' state (`UserStore.dump`, kept with L = `length`) and idempotency keys
    ((key, version, digest) each) into `folder`, as a snapshot holds them."""
    folder = Path(folder)
    folder.mkdir(exist_ok=True)
    np.savez(folder / FILES[0], length=np.int64(length), **{k: state[k] for k in ARRAYS})
    (folder / FILES[1]).write_text(json.dumps(list(keys)))


def read_state(folder: Path) -> tuple[int, dict[str, np.ndarray], list]:
    """(L, state, keys) as `write_state` wrote them into `folder`."""
    folder = Path(folder)
    with np.load(folder / FILES[0]) as z:
        length, state = int(z["length"]), {name: z[name] for name in ARRAYS}
    return length, state, [tuple(k) for k in json.loads((folder / FILES[1]).read_text())]
