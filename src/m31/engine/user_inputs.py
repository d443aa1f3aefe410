"""Users as the model reads them: the store's codes of a user's attributes, and the model inputs
of a batch of requests, stored users from the user store and inline ones as given.

Shapes: B requests, L the model's history length.

A stored user is read as of its request's time where it lives (`UserSource`: the server's
store, or on a cluster the shard that owns it): its attributes, its last L engagements, of
which the model reads those on ads of its catalogue (it has no features for the others), and
its organic events (`m31.users.stored.read_users`). An inline user is checked against the
model's vocabularies (`check`) and coded as the store codes a stored one (`codes`). The serving
context (surface, hour, platform) is coded here too, since it is read beside the user.

`seed_users` makes the user store a set of features seeds: every user of the features with
their attributes and last engagements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from m31.data.schema import N_AGE_BUCKETS, age_bucket
from m31.engine.requests import (
    AdRequest,
    InlineUser,
    PreparedRequest,
    RequestError,
    StoredUser,
    one_of,
)
from m31.features import Features
from m31.model.inputs import RequestInputs, concat_requests, inline_requests, request_inputs
from m31.users.organic import OrganicEvents
from m31.users.store import ATTRIBUTES as USER_ATTRIBUTES
from m31.users.store import Events, UserStore, Vocab
from m31.users.stored import read_users


def seed_users(feats: Features, length: int) -> UserStore:
    """The user store `feats` seed: every user of the features, their attributes and last
    `length` engagements (rows in the features' order, so a seeded user's row is its feature
    row)."""
    return users_of(feats.meta["vocab"], feats.users, feats.ads["ad_id"], feats.engagements, length)


def users_of(
    vocab: Mapping, users: Mapping[str, np.ndarray], ad_ids: np.ndarray, engagements, length: int
) -> UserStore:
    """`seed_users` from the parts of features it reads: the vocabularies, the users' columns,
    the catalogue's ad ids and the engagement sequences (`EventSequences`, items as catalogue
    rows)."""
    seq = engagements.last(length)
    user_ids = users["user_id"]
    events = Events(
        user_id=user_ids[np.repeat(np.arange(seq.n_users), np.diff(seq.offsets))],
        ad_id=ad_ids[seq.values["item"]],
        ts=seq.ts,
        surface=seq.values["surface"].astype(np.int16),
    )
    attributes = {a: users[a] for a in USER_ATTRIBUTES}
    return UserStore.seed(length, user_vocab(vocab), user_ids, attributes, events)


def user_vocab(vocab: Mapping) -> Vocab:
    """What a user store's codes mean, from the features' vocabularies."""
    return Vocab(
        surfaces=tuple(vocab["surface"]),
        countries=tuple(vocab["country"]),
        genders=tuple(vocab["gender"]),
        cohorts=tuple(vocab["cohort"]),
        n_age_buckets=N_AGE_BUCKETS,
    )


# Where stored users are read: (user ids [B], request times [B]) -> each user as of its time,
# None for one not held, or the exception to raise for it (`m31.users.stored.read_users` of
# the server's store; a cluster's ingress asks the owner shards and gives the `Unavailable`
# naming an owner that did not answer, `m31.cluster.cluster.Cluster.stored_users`).
UserSource = Callable[[np.ndarray, np.ndarray], list]


def organic_of(feats: Features) -> OrganicEvents:
    """The organic events of the users `feats` hold, by user id."""
    return OrganicEvents(feats.users["user_id"], feats.organic, feats.config.organic_len)


class UserInputs:
    """The model inputs of requests' users: `feats` the features the model reads (its
    catalogue and vocabularies), `users` the stored users, `max_len` the model's L. `source`:
    where stored users are read (default: `users`, with the organic events of `feats`)."""

    def __init__(
        self, feats: Features, users: UserStore, max_len: int, source: UserSource | None = None
    ) -> None:
        self.feats = feats
        self.users = users
        self.max_len = max_len
        if source is None:
            source = functools.partial(read_users, users, organic_of(feats))
        self.source = source
        vocab = feats.meta["vocab"]
        self._countries = {c: i for i, c in enumerate(vocab["country"])}
        # The model's values of each categorical field: a request naming another is refused.
        self.vocab = {name: tuple(vocab[name]) for name in ("surface", "platform", "gender")}
        self._codes = {name: {v: i for i, v in enumerate(vs)} for name, vs in self.vocab.items()}
        self._cohorts = {int(c): i for i, c in enumerate(vocab["cohort"])}
        self._country_cohort = feats.common_cohorts()
        ad_ids = feats.ads["ad_id"]
        self._ad_order = np.argsort(ad_ids, kind="stable")
        self._ad_sorted = ad_ids[self._ad_order]
        self._n_topics = int(feats.meta["n_topics"])

    def code(self, name: str, value: str | None) -> int:
        """The code of a checked `value` of vocabulary `name`; None is the unknown value's."""
        codes = self._codes[name]
        return len(codes) if value is None else codes[value]

    def stored(self, ids: np.ndarray, ts: np.ndarray, where: Sequence[int]) -> list[StoredUser]:
        """Stored users `ids` [B] as of their requests' times `ts` [B], from the source
        (RequestError naming requests[where[i]] for an unknown one; the source's error for one
        it could not read)."""
        users = self.source(ids, ts)
        for i, user in enumerate(users):
            if isinstance(user, Exception):
                raise user
            if user is None:
                raise RequestError(f"requests[{where[i]}].user_id: unknown user {int(ids[i])}")
        return users

    def check(self, where: str, u: InlineUser) -> None:
        """RequestError naming `where`.field unless the model knows every value of `u`."""
        if u.country is not None and u.country not in self._countries:
            known = ", ".join(sorted(self._countries)[:8]) or "none: the users have no country"
            raise RequestError(
                f"{where}.country: unknown country {u.country!r} (known: {known}, …)"
            )
        if u.gender is not None:
            one_of(f"{where}.gender", u.gender, self.vocab["gender"])
        if u.age is not None and not 0 <= u.age < 150:
            raise RequestError(f"{where}.age: {u.age} is not an age")
        if u.cohort is not None and u.cohort not in self._cohorts:
            raise RequestError(f"{where}.cohort: unknown cohort {u.cohort}")
        for j, e in enumerate(u.history):
            if e.surface is not None:
                one_of(f"{where}.history[{j}].surface", e.surface, self.vocab["surface"])
        bad = [t for t in u.organic_topics if not 0 <= t < self._n_topics]
        if bad:
            known = (
                f"0..{self._n_topics - 1}" if self._n_topics else "none: the model has no topics"
            )
            raise RequestError(f"{where}.organic_topics: topic {bad[0]} is outside {known}")

    def codes(self, u: InlineUser) -> dict[str, int]:
        """The store's codes of a checked user's attributes: what it leaves out (None) is the
        unknown value, no input from it; the cohort defaults to its country's most common."""
        country = self._countries.get(u.country, len(self._countries))
        if u.cohort is not None:
            cohort = self._cohorts[u.cohort]
        else:
            cohort = self._country_cohort.get(country, len(self._cohorts))
        return {
            "cohort": cohort,
            "age_bucket": N_AGE_BUCKETS if u.age is None else int(age_bucket(np.array(u.age))),
            "gender": self.code("gender", u.gender),
            "country": country,
            "age": -1 if u.age is None else int(u.age),
        }

    def of(self, prepared: Sequence[PreparedRequest]) -> RequestInputs:
        """The model inputs of prepared requests [B], in their order: stored users as of each
        request's time, inline ones as given, each with its serving context."""
        requests = [one.request for one in prepared]
        context = self._context(requests)
        stored = [i for i, r in enumerate(requests) if r.user is None]
        inline = [i for i, r in enumerate(requests) if r.user is not None]
        parts = []
        if stored:
            users = [prepared[i].user for i in stored]
            parts.append(self._stored(users, {k: c[stored] for k, c in context.items()}))
        if inline:
            some = [requests[i] for i in inline]
            parts.append(self._inline(some, {k: c[inline] for k, c in context.items()}))
        return concat_requests(parts, np.argsort(np.array(stored + inline), kind="stable"))

    def _context(self, requests: Sequence[AdRequest]) -> dict[str, np.ndarray]:
        """The serving context's codes [B] each: time, surface, hour of day (default: from the
        time, UTC) and platform."""
        hours = [r.hour if r.hour is not None else (r.ts % 86_400) // 3600 for r in requests]
        return {
            "ts": np.array([r.ts for r in requests], dtype=np.int64),
            "surface": np.array([self.code("surface", r.surface) for r in requests]),
            "hour": np.array(hours),
            "platform": np.array([self.code("platform", r.platform) for r in requests]),
        }

    def _catalog_rows(self, ad_ids: np.ndarray) -> np.ndarray:
        """Catalogue row of each ad id, -1 for ads the model's catalogue does not hold."""
        if not len(self._ad_sorted):
            return np.full(len(ad_ids), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._ad_sorted, ad_ids), len(self._ad_sorted) - 1)
        return np.where(self._ad_sorted[pos] == ad_ids, self._ad_order[pos], -1)

    def _stored(self, users: Sequence[StoredUser], context: dict[str, np.ndarray]) -> RequestInputs:
        """Inputs of stored users as of each request's time: their attributes, the engagements
        the store holds on ads of the model's catalogue, and the organic events of the users
        the features seeded."""
        ts = context["ts"]
        L = self.max_len
        ads = np.stack([u.ads[-L:] for u in users])  # [B, L]
        surface = np.stack([u.surfaces[-L:] for u in users])
        when = np.stack([u.times[-L:] for u in users])
        items = np.where(ads >= 0, self._catalog_rows(ads.ravel()).reshape(ads.shape), -1)
        # Right-align the engagements the catalogue holds, in their order.
        order = np.argsort(items >= 0, axis=1, kind="stable")
        items = np.take_along_axis(items, order, 1)
        held = items >= 0
        surface = np.where(held, np.take_along_axis(surface, order, 1), 0)
        when = np.where(held, np.take_along_axis(when, order, 1), -1)
        organic = np.stack([u.organic for u in users]).astype(np.int64)  # [B, O]
        demographics = {
            k: np.array([u.attributes[k] for u in users], np.int64)
            for k in ("cohort", "age_bucket", "gender", "country")
        }
        serving = {k: context[k] for k in ("surface", "hour", "platform")}
        return request_inputs(demographics, ts, serving, items, surface, when, organic)

    def _history(self, u: InlineUser) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An inline user's engagements on ads of the catalogue, oldest first: (catalogue rows,
        surface codes, times)."""
        events = sorted(u.history, key=lambda e: e.ts)
        rows = self._catalog_rows(np.array([e.ad_id for e in events], dtype=np.int64))
        surfaces = np.array([self.code("surface", e.surface) for e in events], dtype=np.int64)
        times = np.array([e.ts for e in events], dtype=np.int64)
        known = rows >= 0
        return rows[known], surfaces[known], times[known]

    def _inline(self, requests: Sequence[AdRequest], context: dict[str, np.ndarray]):
        """Inputs of inline users, as given."""
        users = [r.user for r in requests]
        codes = [self.codes(u) for u in users]
        return inline_requests(
            self.feats,
            **{a: np.array([c[a] for c in codes]) for a in ("cohort", "age_bucket", "gender")},
            country=np.array([c["country"] for c in codes]),
            histories=[self._history(u) for u in users],
            organic=[np.array(u.organic_topics, dtype=np.int64) for u in users],
            max_len=self.max_len,
            **context,
        )
