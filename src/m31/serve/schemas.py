"""Request and response bodies of the HTTP API (pydantic; they make the OpenAPI schema).

Inputs are strict: unknown keys are rejected (a misspelt field is an error, not a silently
ignored option), and no value is coerced (`"10"`, `true` and `10.0` are not integers; a
`number` field takes integers too). Nulls mean the same in every body: a schedule or age bound
that is null is open, a targeting list that is null is empty (no restriction), `tags` null is no
tags; `status` cannot be null.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import Path as PathParam
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from m31.engine.explain import MAX_WHY_NOT
from m31.index.filters import check_size
from m31.vocabularies import STATUSES

MAX_K = 4096  # results per request
MAX_REQUESTS = 1024  # requests per call
# Results per call (the sum of its requests' k): about 6 MB of JSON. The largest call that fits
# asks 1,024 requests for 256 results each, or 64 for all of MAX_K.
MAX_RESULTS = 1 << 18
MAX_ADS = 10_000  # ads per upsert call, users per user upsert
MAX_EVENTS = 10_000  # events per call
MAX_LIST = 10_000  # history, exclusions, targeting lists
# Requests of one call that may ask for an explanation (`explain`, `why_not`): each costs a pass
# over the attribute columns and, for a why-not, a scoring of the eligible ads
MAX_EXPLAINED = 16
I64_MAX = 2**63 - 1

# A value of one of the served model's vocabularies: checked against them once it is loaded
# (422 naming the accepted values), and listed in the OpenAPI schema then (`vocab_schema`).
VOCAB_KEY = "x-m31-vocabulary"


def _vocab_value(name: str) -> Any:
    return Annotated[str, Field(min_length=1, max_length=64, json_schema_extra={VOCAB_KEY: name})]


Surface = _vocab_value("surface")
Platform = _vocab_value("platform")
Gender = _vocab_value("gender")
Objective = _vocab_value("objective")
Format = _vocab_value("format")
Status = Literal[STATUSES]  # type: ignore[valid-type]
# Every integer that reaches an array or a column is an int64: larger ones are a 422, not an
# overflow deep inside.
I64 = Annotated[int, Field(ge=-(2**63), le=I64_MAX)]
Id = Annotated[int, Field(ge=0, le=I64_MAX)]  # ads, advertisers, campaigns, users, cohorts

LISTS = ("target_countries", "target_genders", "target_platforms", "target_surfaces", "tags")
# (lower, upper, whether the upper bound is exclusive): an empty range is refused, since it
# would make an ad that nobody can ever be shown.
BOUNDS = (("target_age_min", "target_age_max", False), ("schedule_start", "schedule_end", True))


def check_bounds(given: Mapping[str, Any], stored: Mapping[str, Any] | None = None) -> None:
    """ValueError when a range with one end in `given` is empty; the other end comes from
    `given` or else `stored` (an ad's current attributes, for a change of one end)."""
    for lo_name, hi_name, exclusive in BOUNDS:
        if lo_name not in given and hi_name not in given:
            continue
        ends = []
        for name in (lo_name, hi_name):
            if name in given:
                ends.append((given[name], name))
            else:
                ends.append(((stored or {}).get(name), f"the ad's {name}"))
        (lo, lo_what), (hi, hi_what) = ends
        if lo is None or hi is None:
            continue
        if lo > hi or (exclusive and lo == hi):
            relation = "not before" if exclusive else "above"
            raise ValueError(f"{lo_what} {lo} is {relation} {hi_what} {hi}")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_UNKNOWN = "null or left out: unknown (no input; targeting on it reaches only unrestricted ads)"


class EngagementIn(Strict):
    ad_id: Id
    ts: int = Field(ge=0, le=2**62, description="Unix seconds")
    surface: Surface | None = Field(None, description=_UNKNOWN)


class UserIn(Strict):
    """A user given inline instead of by id."""

    country: str | None = Field(None, max_length=64, description=_UNKNOWN)
    age: int | None = Field(None, ge=0, lt=150, description=_UNKNOWN)
    gender: Gender | None = Field(None, description=_UNKNOWN)
    cohort: Id | None = Field(
        None, description="default: the country's most common cohort (none without a country)"
    )
    history: list[EngagementIn] = Field(default_factory=list, max_length=MAX_LIST)
    organic_topics: list[I64] = Field(default_factory=list, max_length=MAX_LIST)


class FrequencyCap(Strict):
    """Leave out what the user engaged with `max` times or more in the last `window_s` seconds
    before the request: the ad itself, or every ad of its campaign or advertiser."""

    per: Literal["ad", "campaign", "advertiser"]
    max: int = Field(ge=1, le=1_000_000, description="engagements that reach the cap")
    window_s: int = Field(ge=1, le=2**40, description="seconds before the request's time")


class RetrieveRequest(Strict):
    """One ad request: a user (`user_id` of a stored user, or `user` inline) in a context."""

    user_id: Id | None = Field(None, description="a stored user; give this or `user`")
    user: UserIn | None = None
    ts: int | None = Field(
        None, ge=0, le=2**62, description="Unix seconds; default: now on the server"
    )
    surface: Surface | None = Field(None, description=_UNKNOWN)
    platform: Platform | None = Field(None, description=_UNKNOWN)
    hour: int | None = Field(None, ge=0, le=23, description="hour of day; default: from ts (UTC)")
    k: int = Field(100, ge=1, le=MAX_K)
    filter: dict[str, Any] | None = Field(
        None,
        min_length=1,
        max_length=1,
        description="filter tree over ad attributes, one operator per object, e.g. "
        '{"eq": ["format", "video"]}; null: no filter. At most 1,000 objects, 100,000 values '
        "in its in lists together, 32 levels and 64 distinct predicates (eq and in on one field "
        "under one any count once)",
    )
    exclude_ads: list[Id] = Field(default_factory=list, max_length=MAX_LIST)
    exclude_advertisers: list[Id] = Field(default_factory=list, max_length=MAX_LIST)
    frequency_cap: FrequencyCap | None = Field(
        None,
        description="counted over the engagements the user store holds (a stored user's last "
        "L) or the inline user's history",
    )
    max_per: (
        dict[Literal["advertiser", "campaign"], Annotated[int, Field(ge=1, le=MAX_K)]] | None
    ) = Field(
        None,
        min_length=1,
        max_length=1,
        description="at most this many results of one advertiser or campaign, e.g. "
        '{"advertiser": 2}: the eligible ads in score order, each skipped when its group '
        "already has that many; an ad without the field is never skipped",
    )
    rank: Literal["relevance", "value"] = Field(
        "relevance",
        description="relevance: the model's score; value: the score plus log(bid × pacing), "
        "the ad's expected value in log space, over the ads that have a bid",
    )
    explain: bool = Field(
        False,
        description="answer with an explanation: the ads left after each eligibility stage, "
        "the K-th score and each result's score split over the model's experts",
    )
    why_not: list[Id] = Field(
        default_factory=list,
        max_length=MAX_WHY_NOT,
        description="ad ids to say why they are not in the answer: the first eligibility "
        "stage each failed, the cap, or its rank among the eligible ads",
    )

    @field_validator("filter")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Here, on the bounds alone, so that a filter too large to serve is refused before any
        # work: the rest is checked against the index's fields by `compile_filter`.
        if value is not None:
            check_size(value)
        return value


class RetrieveBody(Strict):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"requests": [{"user_id": 7, "surface": "feed", "platform": "ios", "k": 10}]},
                {
                    "requests": [
                        {
                            "user_id": 3,
                            "surface": "reels",
                            "platform": "android",
                            "k": 5,
                            "filter": {"eq": ["format", "video"]},
                        },
                        {
                            "user": {"country": "US", "age": 31, "gender": "F"},
                            "surface": "feed",
                            "platform": "web",
                        },
                    ],
                    "timeout_ms": 5000,
                },
            ]
        }
    )

    requests: list[RetrieveRequest] = Field(min_length=1, max_length=MAX_REQUESTS)
    min_version: int | None = Field(
        None,
        ge=0,
        le=I64_MAX,
        description="answer from this index version or a newer one, else 409",
    )
    timeout_ms: int | None = Field(
        None, ge=1, le=60_000, description="deadline; default: the server's"
    )
    allow_partial: bool = Field(
        False,
        description="a sharded server (m31 serve --ray) may answer without shards that are "
        "down, saying so (partial, missing_shards); else it waits for them within the deadline "
        "and answers 503 if they do not come back",
    )

    @model_validator(mode="after")
    def _results_bounded(self):
        asked = sum(r.k for r in self.requests)
        if asked > MAX_RESULTS:
            raise ValueError(
                f"the call asks for {asked} results in all (the sum of its requests' k), more "
                f"than {MAX_RESULTS}: split it into several calls"
            )
        explained = sum(r.explain or bool(r.why_not) for r in self.requests)
        if explained > MAX_EXPLAINED:
            raise ValueError(
                f"{explained} requests of the call ask for an explanation (explain or why_not), "
                f"more than {MAX_EXPLAINED}: ask it of fewer"
            )
        return self


class AdExplained(BaseModel):
    ad_id: int
    score: float
    gate: list[float] = Field(description="the gate's weight of each expert for this ad")
    contributions: list[float] = Field(description="each expert's part of the score")
    bias: float
    value: float | None = Field(None, description="the value term, when ranked by value")


class WhyNotOut(BaseModel):
    ad_id: int
    stage: str = Field(
        description="unknown, the eligibility stage it failed, cap, rank or returned"
    )
    reason: str
    score: float | None = None
    rank: int | None = Field(None, description="among the eligible ads, from 1")


class ExplanationOut(BaseModel):
    eligible: dict[str, int] = Field(description="ads left after each stage, in order")
    kth_score: float | None
    experts: list[str]
    ads: list[AdExplained]
    why_not: list[WhyNotOut]


class Ranked(BaseModel):
    ad_ids: list[int]
    scores: list[float]
    explanation: ExplanationOut | None = Field(
        None, description="for a request that asked (explain, why_not)"
    )


class RetrieveResponse(BaseModel):
    results: list[Ranked]
    index_version: int
    batch_requests: int = Field(description="requests scored in the same device call")
    timings_ms: dict[str, float]
    partial: bool = Field(False, description="true: some shards did not answer (allow_partial)")
    missing_shards: list[int] = Field(
        default_factory=list, description="the shards whose ads the answer lacks"
    )


def _null_is_empty(value: list | None) -> list:
    return [] if value is None else value


_BOUND_DOC = {
    "schedule_start": "Unix seconds, eligible from; null: open",
    "schedule_end": "Unix seconds, eligible strictly before (after schedule_start); null: open",
    "target_age_min": "null: open",
    "target_age_max": "at least target_age_min; null: open",
}
_LIST_DOC = "empty or null: no restriction"
_VALUE_DOC = {
    "bid": "what a conversion (the ad's objective) is worth to its advertiser, > 0; null: no "
    "bid (value-ranked requests skip the ad)",
    "pacing": "the budget pacing multiplier in (0, 1]; null: 1",
}


class Attributes(Strict):
    """Eligibility attributes of an ad (null: see the module's note)."""

    status: Status = "active"
    schedule_start: I64 | None = Field(None, description=_BOUND_DOC["schedule_start"])
    schedule_end: I64 | None = Field(None, description=_BOUND_DOC["schedule_end"])
    target_countries: list[str] | None = Field(
        default_factory=list, max_length=MAX_LIST, description=_LIST_DOC
    )
    target_age_min: int | None = Field(None, ge=0, le=150, description=_BOUND_DOC["target_age_min"])
    target_age_max: int | None = Field(None, ge=0, le=150, description=_BOUND_DOC["target_age_max"])
    target_genders: list[Gender] | None = Field(default_factory=list, description=_LIST_DOC)
    target_platforms: list[Platform] | None = Field(default_factory=list, description=_LIST_DOC)
    target_surfaces: list[Surface] | None = Field(default_factory=list, description=_LIST_DOC)
    tags: list[str] | None = Field(
        default_factory=list, max_length=1000, description="null: no tags"
    )
    bid: float | None = Field(None, gt=0, allow_inf_nan=False, description=_VALUE_DOC["bid"])
    pacing: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description=_VALUE_DOC["pacing"]
    )

    _lists = field_validator(*LISTS)(_null_is_empty)

    @model_validator(mode="after")
    def _ranges(self):
        check_bounds({name: getattr(self, name) for name in self.model_fields_set})
        return self


class AdIn(Attributes):
    """A new or replaced ad: what the ad tower reads, and its attributes."""

    ad_id: Id
    advertiser_id: Id | None = Field(None, description="null: an ad without an advertiser")
    campaign_id: Id | None = None
    objective: Objective | None = Field(None, description="null: unknown")
    format: Format | None = Field(None, description="null: unknown")
    topic: int | None = Field(None, ge=0, le=2**31, description="null: unknown")
    category: int | None = Field(None, ge=0, le=2**31, description="null: unknown")
    quality: float | None = Field(
        0.0, ge=-100, le=100, allow_inf_nan=False, description="null: unknown (read as 0)"
    )
    text: str | None = Field(None, max_length=4000, description="null: no semantic input")


class UpsertBody(Strict):
    ads: list[AdIn] = Field(min_length=1, max_length=MAX_ADS)


class AttributesPatch(Strict):
    """The attributes to change; those left out keep their values. Null clears a bound or a
    list (open, no restriction); `status` cannot be null."""

    # Left out means unchanged; null is refused, as status has no "open" value and reading
    # null as "active" would resume a paused ad by accident.
    status: Status = Field(None, json_schema_extra=lambda s: s.pop("default"))  # type: ignore[assignment]
    schedule_start: I64 | None = Field(None, description=_BOUND_DOC["schedule_start"])
    schedule_end: I64 | None = Field(None, description=_BOUND_DOC["schedule_end"])
    target_countries: list[str] | None = Field(None, max_length=MAX_LIST, description=_LIST_DOC)
    target_age_min: int | None = Field(None, ge=0, le=150, description=_BOUND_DOC["target_age_min"])
    target_age_max: int | None = Field(None, ge=0, le=150, description=_BOUND_DOC["target_age_max"])
    target_genders: list[Gender] | None = Field(None, description=_LIST_DOC)
    target_platforms: list[Platform] | None = Field(None, description=_LIST_DOC)
    target_surfaces: list[Surface] | None = Field(None, description=_LIST_DOC)
    tags: list[str] | None = Field(None, max_length=1000, description="null: no tags")
    bid: float | None = Field(None, gt=0, allow_inf_nan=False, description=_VALUE_DOC["bid"])
    pacing: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description=_VALUE_DOC["pacing"]
    )

    _lists = field_validator(*LISTS)(_null_is_empty)

    @field_validator("status", mode="before")
    @classmethod
    def _status_not_null(cls, value: Any) -> Any:
        if value is None:
            raise ValueError(
                f"null is not a status: give one of {', '.join(STATUSES)}, or leave it out"
            )
        return value

    @model_validator(mode="after")
    def _ranges(self):
        check_bounds(self.model_dump(exclude_unset=True))
        return self


class EventIn(Strict):
    """One engagement of a user with an ad."""

    user_id: Id = Field(description="a user the store does not hold is created (no attributes)")
    ad_id: Id = Field(description="any ad id: one the model's catalogue lacks is kept too")
    ts: int = Field(ge=0, le=2**62, description="Unix seconds")
    surface: Surface | None = Field(None, description=_UNKNOWN)
    type: str | None = Field(None, min_length=1, max_length=64, description="logged, not read")
    weight: float | None = Field(
        None, gt=0, le=1e9, allow_inf_nan=False, description="logged, not read"
    )


class EventsBody(Strict):
    events: list[EventIn] = Field(min_length=1, max_length=MAX_EVENTS)
    idempotency_key: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="a retry with the key of a call already applied is not applied again: it "
        "answers that call's version; another call under a used key is a 422 (the last 100,000 "
        "keys are remembered)",
    )


class UserAttributesIn(Strict):
    """A user's attributes, replaced whole (history kept); left out or null: unknown."""

    user_id: Id
    country: str | None = Field(None, max_length=64, description=_UNKNOWN)
    age: int | None = Field(None, ge=0, lt=150, description=_UNKNOWN)
    gender: Gender | None = Field(None, description=_UNKNOWN)
    cohort: Id | None = Field(
        None, description="default: the country's most common cohort (none without a country)"
    )


class UsersBody(Strict):
    users: list[UserAttributesIn] = Field(min_length=1, max_length=MAX_ADS)


class EventsResponse(BaseModel):
    index_version: int = Field(description="the version that holds the events")
    users: int = Field(description="users the store holds")


class VersionResponse(BaseModel):
    index_version: int
    ads: int = Field(description="live ads in the index")


class AdOut(BaseModel):
    ad_id: int
    attributes: dict[str, Any]
    index_version: int


class Error(BaseModel):
    detail: str = Field(description="what is wrong; a 422 names the field, e.g. requests[0].k")


def _plain_decimal(value: Any) -> Any:
    if isinstance(value, str) and not re.fullmatch(r"0|[1-9][0-9]*", value):
        raise ValueError(
            "expected a plain decimal integer (digits only: no sign, point, separator, space "
            "or leading zero)"
        )
    return value


# An ad id in a path, as written: "1.0", " 1", "1_000" or "007" are not ids, though int() takes them.
AdIdPath = Annotated[
    int, PathParam(ge=0, le=I64_MAX, description="the ad's id"), BeforeValidator(_plain_decimal)
]


def vocab_schema(schema: dict, vocab: Mapping[str, Sequence[str]], closed: set[str]) -> None:
    """List the served model's values in an OpenAPI schema, in place: `enum` for a vocabulary
    in `closed` (other values are refused), a description otherwise (other values are taken as
    unknown: an ad's new format or objective)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            name = node.pop(VOCAB_KEY, None)
            if name in vocab:
                if name in closed:
                    node["enum"] = list(vocab[name])
                else:
                    known = ", ".join(vocab[name])
                    node["description"] = f"known {name}s: {known}; another is taken as unknown"
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
