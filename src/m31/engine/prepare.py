"""Request preparation: check each request once, resolve its user and compile what limits its
ads into one filter (`PreparedRequest`), so that a batch runs without checking again.

The request's own filter is compiled as given; what the engine adds to it is typed
(`m31.index.filters.Clause`), never spliced into the request's JSON: ranking by value keeps the
ads with a bid (`HAS_BID`), and a frequency cap per campaign leaves out the capped campaigns
(`NoneOf`); caps per ad and per advertiser add to the request's exclusions.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from m31.engine.caps import GROUP_FIELDS
from m31.engine.explain import MAX_WHY_NOT
from m31.engine.requests import (
    RANKS,
    AdRequest,
    PreparedRequest,
    RequestError,
    StoredUser,
    one_of,
)
from m31.engine.user_inputs import UserInputs
from m31.index import AdIndex, CompiledFilter, compile_filter
from m31.index.filters import Clause, HasValue, NoneOf, with_clauses

# What ranking by value keeps: only ads with a bid have a value term (DESIGN §2, "The value term")
HAS_BID = HasValue("bid")
# What a frequency cap counts by: the index field of an ad's group (None: the ad itself).
CAP_GROUPS = {"ad": None, "campaign": "campaign_id", "advertiser": "advertiser_id"}


def _positive(where: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RequestError(f"{where}: must be a positive integer, got {value!r}")


# The groups of ads: (ad ids, an int field of the index) -> each ad's value, None for a null or
# an ad not held (`AdIndex.numeric_values`; a cluster's ingress asks the shards that hold them).
GroupLookup = Callable[[Sequence[int], str], list]


class RequestPreparer:
    """Prepares requests for `index` and the users of `users`. `groups`: where frequency caps
    per campaign or advertiser read the groups of the ads a user engaged with (default: `index`,
    which a cluster's ingress holds without ads: it passes the shards', `m31.cluster.backend`)."""

    def __init__(
        self, index: AdIndex, users: UserInputs, *, groups: GroupLookup | None = None
    ) -> None:
        self.index = index
        self.users = users
        self.groups = index.numeric_values if groups is None else groups

    def prepare(
        self, requests: Sequence[AdRequest], k: int | Sequence[int]
    ) -> list[PreparedRequest]:
        """Check requests without running them (RequestError naming the first bad field),
        resolve their users and compile their filters. `k`: one for all, or one per request.
        The frequency caps per group of the batch read the ads' groups in one lookup a field."""
        ks = [k] * len(requests) if isinstance(k, numbers.Integral) else list(k)
        if len(ks) != len(requests):
            raise RequestError(f"k: {len(ks)} values for {len(requests)} requests")
        for i, (r, k_) in enumerate(zip(requests, ks, strict=True)):
            self._check(i, r, k_)
        users: list[StoredUser | None] = [None] * len(requests)
        stored = [i for i, r in enumerate(requests) if r.user is None]
        if stored:
            ids = np.array([requests[i].user_id for i in stored], np.int64)
            ts = np.array([requests[i].ts for i in stored], np.int64)
            for i, user in zip(stored, self.users.stored(ids, ts, stored), strict=True):
                users[i] = user
        engaged = {
            i: self._engaged(r, users[i])
            for i, r in enumerate(requests)
            if r.frequency_cap is not None
        }
        groups = self._groups_of(requests, engaged)
        return [
            self._prepared(i, r, int(k_), user, engaged.get(i), groups)
            for i, (r, k_, user) in enumerate(zip(requests, ks, users, strict=True))
        ]

    def _check(self, i: int, r: AdRequest, k: int) -> None:
        """RequestError naming requests[i]'s first bad field."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise RequestError(f"requests[{i}]: k must be positive, got {k!r}")
        for name in ("surface", "platform"):
            if getattr(r, name) is not None:
                one_of(f"requests[{i}].{name}", getattr(r, name), self.users.vocab[name])
        if r.hour is not None and not 0 <= r.hour < 24:
            raise RequestError(f"requests[{i}].hour: {r.hour} is not an hour of day")
        if (r.user_id is None) == (r.user is None):
            raise RequestError(f"requests[{i}]: give exactly one of user_id and user")
        if r.user is not None:
            self.users.check(f"requests[{i}].user", r.user)
        if r.max_per is not None:
            self._check_max_per(i, r.max_per)
        if r.frequency_cap is not None:
            self._check_frequency_cap(i, r.frequency_cap)
        one_of(f"requests[{i}].rank", r.rank, RANKS)
        if not isinstance(r.explain, bool):
            raise RequestError(f"requests[{i}].explain: true or false, got {r.explain!r}")
        if len(r.why_not) > MAX_WHY_NOT:
            raise RequestError(
                f"requests[{i}].why_not: at most {MAX_WHY_NOT} ad ids, got {len(r.why_not)}"
            )
        for j, ad_id in enumerate(r.why_not):
            if isinstance(ad_id, bool) or not isinstance(ad_id, numbers.Integral):
                raise RequestError(f"requests[{i}].why_not[{j}]: an ad id, got {ad_id!r}")
        if r.rank == "value" and self.index.schema.get("bid") is None:
            raise RequestError(f"requests[{i}].rank: value ranks by the bid; the index has none")

    def _prepared(
        self, i: int, r: AdRequest, k: int, user: StoredUser | None, engaged, groups: dict
    ) -> PreparedRequest:
        clauses: list[Clause] = [HAS_BID] if r.rank == "value" else []
        if r.frequency_cap is not None:
            r, clauses = self._frequency_capped(r, engaged, groups, clauses)
        if r.user is not None:
            who = {"country": r.user.country, "age": r.user.age, "gender": r.user.gender}
        else:
            who = user.targeting
        compiled = with_clauses(self._compiled(i, r.filter), clauses, self.index.schema)
        return PreparedRequest(r, k, user, compiled, who, tuple(clauses))

    def _engaged(self, r: AdRequest, user: StoredUser | None) -> tuple[np.ndarray, np.ndarray]:
        """(ad ids, engagements of each) of the stored or inline user in the window of `r`'s
        frequency cap."""
        window = r.frequency_cap.window_s
        if r.user is None:
            return user.engaged(r.ts, window)
        inside = [e.ad_id for e in r.user.history if r.ts - window <= e.ts < r.ts]
        return np.unique(np.array(inside, np.int64), return_counts=True)

    def _groups_of(self, requests: Sequence[AdRequest], engaged: dict) -> dict[str, dict]:
        """{field: {ad id: its group or None}} of every ad that a frequency cap per group in
        `requests` counts: one lookup per field."""
        wanted: dict[str, set[int]] = {}
        for i, (ads, _) in engaged.items():
            field_ = CAP_GROUPS[requests[i].frequency_cap.per]
            if field_ is not None:
                wanted.setdefault(field_, set()).update(ads.tolist())
        out = {}
        for field_, ads in wanted.items():
            ordered = sorted(ads)
            out[field_] = dict(zip(ordered, self.groups(ordered, field_), strict=True))
        return out

    def _frequency_capped(
        self, r: AdRequest, engaged, groups: dict[str, dict], clauses: list[Clause]
    ) -> tuple[AdRequest, list[Clause]]:
        """`r` with what its frequency cap leaves out added to its exclusions, or (per
        campaign) a clause: counted over the `engaged` ads (the stored or inline user's, in
        the cap's window), grouped by `groups`."""
        cap, (ads, counts) = r.frequency_cap, engaged
        field_ = CAP_GROUPS[cap.per]
        if field_ is None:
            capped = ads[counts >= cap.max].tolist()
        else:
            totals: dict[int, int] = {}
            for a, c in zip(ads.tolist(), counts.tolist(), strict=True):
                g = groups[field_][a]
                if g is not None:
                    totals[g] = totals.get(g, 0) + c
            capped = sorted(g for g, c in totals.items() if c >= cap.max)
        if not capped:
            return r, clauses
        if cap.per == "ad":
            return dataclasses.replace(r, exclude_ads=(*r.exclude_ads, *capped)), clauses
        if cap.per == "advertiser":
            excluded = (*r.exclude_advertisers, *capped)
            return dataclasses.replace(r, exclude_advertisers=excluded), clauses
        return r, [*clauses, NoneOf(field_, tuple(capped))]

    def _check_frequency_cap(self, i: int, cap) -> None:
        where = f"requests[{i}].frequency_cap"
        if cap.per not in CAP_GROUPS:
            raise RequestError(f"{where}.per: {cap.per!r} is not one of {', '.join(CAP_GROUPS)}")
        _positive(f"{where}.max", cap.max)
        _positive(f"{where}.window_s", cap.window_s)
        field_ = CAP_GROUPS[cap.per]
        if field_ is not None and field_ not in self.index.schema:
            raise RequestError(f"{where}.per: the index has no {field_} to cap by")

    def _check_max_per(self, i: int, max_per: Mapping) -> None:
        where = f"requests[{i}].max_per"
        if not isinstance(max_per, Mapping) or len(max_per) != 1:
            raise RequestError(f'{where}: give one grouping, e.g. {{"advertiser": 2}}')
        ((name, most),) = max_per.items()
        if name not in GROUP_FIELDS:
            raise RequestError(f"{where}: {name!r} is not one of {', '.join(GROUP_FIELDS)}")
        _positive(f"{where}.{name}", most)
        if self.index.schema.get(GROUP_FIELDS[name]) != "int":
            raise RequestError(f"{where}.{name}: the index has no {GROUP_FIELDS[name]} to cap by")

    def _compiled(self, i: int, tree: Mapping | None) -> CompiledFilter | None:
        try:
            return compile_filter(tree, self.index.schema) if tree else None
        except ValueError as e:
            raise RequestError(f"requests[{i}].filter: {e}") from e
