"""What the engine is asked: ad requests, as given and as prepared.

An `AdRequest` names a user (stored, by id, or `InlineUser`) in a serving context, with its
filter and exclusions. `Retriever.prepare` (`m31.engine.prepare`) checks it once against the
model, the user store and the index, resolves the stored user's row and compiles the filter;
the `PreparedRequest` it returns is what travels (through a server's batcher, for one) to
`Retriever.retrieve`, which does not check it again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from m31.users.stored import StoredUser

if TYPE_CHECKING:
    from m31.index.filters import Clause, CompiledFilter


# How a request ranks its ads (`AdRequest.rank`)
RANKS = ("relevance", "value")


class RequestError(ValueError):
    """A request the engine cannot answer; the message names the field."""


def one_of(field: str, value, allowed: Sequence[str], error: type[Exception] = RequestError):
    """Raise `error` naming `field` unless `value` is in the vocabulary `allowed`."""
    if value not in allowed:
        if not allowed:
            raise error(f"{field}: {value!r}: the model knows no values here (its data had none)")
        raise error(f"{field}: {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Engagement:
    ad_id: int
    ts: int  # Unix seconds
    surface: str | None = None  # None: unknown


@dataclass(frozen=True)
class InlineUser:
    """A user the feature store does not hold (a new user, or features computed elsewhere).

    Ads of `history` that the model's catalogue does not know are skipped (the model has no
    features for them); only engagements strictly before the request time are read. A
    demographic left None is unknown, as a null is for a stored user: no input from it, and
    targeting on it reaches the user only through ads without that restriction.
    """

    country: str | None = None
    age: int | None = None
    gender: str | None = None
    # default: the most common cohort of the country's stored users (none without a country)
    cohort: int | None = None
    history: Sequence[Engagement] = ()  # engaged ads, any order
    organic_topics: Sequence[int] = ()  # topics of organic engagement, most recent last


def now() -> int:
    """The current time in Unix seconds: a request's default time."""
    return int(time.time())


@dataclass(frozen=True)
class FrequencyCap:
    """Leave out what the user engaged with `max` times or more in the `window_s` seconds
    before the request: the ad, or every ad of its campaign or advertiser (`per`)."""

    per: str  # "ad", "campaign" or "advertiser"
    max: int
    window_s: int


@dataclass(frozen=True)
class AdRequest:
    user_id: int | None = None  # a stored user; None when `user` is given inline
    # Unix seconds: history is read strictly before it, schedules are checked at it
    ts: int = field(default_factory=now)
    # None: unknown (a dataset without surfaces or platforms): no context input from it, and
    # only ads that do not target surfaces (platforms) are eligible
    surface: str | None = None
    platform: str | None = None
    hour: int | None = None  # of day; default: from ts (UTC)
    exclude_ads: Sequence[int] = ()
    exclude_advertisers: Sequence[int] = ()
    filter: Mapping | None = None  # JSON filter tree over ad attributes (m31.index.filters)
    user: InlineUser | None = None
    frequency_cap: FrequencyCap | None = None
    # At most this many results of one advertiser (or campaign), e.g. {"advertiser": 2}: one
    # grouping per request (`m31.engine.caps`)
    max_per: Mapping[str, int] | None = None
    # "relevance": the model's score; "value": the score plus the ad's value term
    # log(bid · pacing), over the ads with a bid (DESIGN §2, "The value term")
    rank: str = "relevance"
    # Explain the answer (`m31.engine.explain`): the ads left after each eligibility stage and
    # each result's score split over the experts; `why_not`: ad ids to say why they are not in
    # it (at most `m31.engine.explain.MAX_WHY_NOT`). Computed only for the requests that ask.
    explain: bool = False
    why_not: Sequence[int] = ()


@dataclass(frozen=True)
class PreparedRequest:
    """A request `Retriever.prepare` has checked, made by it only."""

    request: AdRequest
    k: int  # results wanted, >= 1
    user: StoredUser | None  # the stored user as of the request; None for an inline user
    # The request's filter and `clauses`, compiled (None: neither)
    filter: CompiledFilter | None
    targeting: Mapping  # the user's country, age and gender, for the ads' targeting
    # What the engine adds to the request's own filter (value ranking, a cap per campaign), as
    # typed clauses, so that a shard compiles the same filter from the request and these
    clauses: tuple[Clause, ...] = ()
