"""Request and response bodies of the HTTP API (pydantic; they make the OpenAPI schema).

Unknown keys are rejected (a misspelt field is an error, not a silently ignored option).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from m31.data.schema import FORMATS, GENDERS, OBJECTIVES, PLATFORMS, STATUSES, SURFACES

MAX_K = 4096  # results per request
MAX_REQUESTS = 1024  # requests per call
MAX_ADS = 10_000  # ads per upsert call
MAX_LIST = 10_000  # history, exclusions, targeting lists

Surface = Literal[SURFACES]  # type: ignore[valid-type]
Platform = Literal[PLATFORMS]  # type: ignore[valid-type]
Gender = Literal[GENDERS]  # type: ignore[valid-type]
Status = Literal[STATUSES]  # type: ignore[valid-type]
# Every integer that reaches an array or a column is an int64: larger ones are a 422, not an
# overflow deep inside.
I64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngagementIn(Strict):
    ad_id: I64
    ts: int = Field(ge=0, le=2**62, description="Unix seconds")
    surface: Surface


class UserIn(Strict):
    """A user given inline instead of by id."""

    country: str = Field(max_length=64)
    age: int = Field(ge=0, lt=150)
    gender: Gender
    cohort: I64 | None = Field(None, description="default: the country's most common cohort")
    history: list[EngagementIn] = Field(default_factory=list, max_length=MAX_LIST)
    organic_topics: list[I64] = Field(default_factory=list, max_length=MAX_LIST)


class RetrieveRequest(Strict):
    """One ad request: a user (`user_id` of a stored user, or `user` inline) in a context."""

    user_id: I64 | None = None
    user: UserIn | None = None
    ts: int | None = Field(
        None, ge=0, le=2**62, description="Unix seconds; default: now on the server"
    )
    surface: Surface
    platform: Platform
    hour: int | None = Field(None, ge=0, le=23, description="hour of day; default: from ts (UTC)")
    k: int = Field(100, ge=1, le=MAX_K)
    filter: dict[str, Any] | None = Field(
        None, description='filter tree over ad attributes, e.g. {"eq": ["format", "video"]}'
    )
    exclude_ads: list[I64] = Field(default_factory=list, max_length=MAX_LIST)
    exclude_advertisers: list[I64] = Field(default_factory=list, max_length=MAX_LIST)


class RetrieveBody(Strict):
    requests: list[RetrieveRequest] = Field(min_length=1, max_length=MAX_REQUESTS)
    min_version: int | None = Field(
        None, ge=0, description="answer from this index version or a newer one, else 409"
    )
    timeout_ms: int | None = Field(
        None, ge=1, le=60_000, description="deadline; default: the server's"
    )


class Ranked(BaseModel):
    ad_ids: list[int]
    scores: list[float]


class RetrieveResponse(BaseModel):
    results: list[Ranked]
    index_version: int
    batch_requests: int = Field(description="requests scored in the same device call")
    timings_ms: dict[str, float]


class Attributes(Strict):
    """Eligibility attributes of an ad; null = open (no restriction)."""

    status: Status = "active"
    schedule_start: I64 | None = Field(None, description="Unix seconds, eligible from")
    schedule_end: I64 | None = Field(None, description="Unix seconds, eligible strictly before")
    target_countries: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    target_age_min: int | None = Field(None, ge=0, le=150)
    target_age_max: int | None = Field(None, ge=0, le=150)
    target_genders: list[Gender] = Field(default_factory=list)
    target_platforms: list[Platform] = Field(default_factory=list)
    target_surfaces: list[Surface] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list, max_length=1000)


class AdIn(Attributes):
    """A new or replaced ad: what the ad tower reads, and its attributes."""

    ad_id: I64
    advertiser_id: I64
    campaign_id: I64 | None = None
    objective: Literal[OBJECTIVES]  # type: ignore[valid-type]
    format: Literal[FORMATS]  # type: ignore[valid-type]
    topic: int = Field(ge=0, le=2**31)
    category: int = Field(ge=0, le=2**31)
    quality: float = Field(0.0, ge=-100, le=100, allow_inf_nan=False)
    text: str = Field(max_length=4000)


class UpsertBody(Strict):
    ads: list[AdIn] = Field(min_length=1, max_length=MAX_ADS)


class AttributesPatch(Strict):
    """The attributes to change; those left out keep their values."""

    status: Status | None = None
    schedule_start: I64 | None = None
    schedule_end: I64 | None = None
    target_countries: list[str] | None = Field(None, max_length=MAX_LIST)
    target_age_min: int | None = Field(None, ge=0, le=150)
    target_age_max: int | None = Field(None, ge=0, le=150)
    target_genders: list[Gender] | None = None
    target_platforms: list[Platform] | None = None
    target_surfaces: list[Surface] | None = None
    tags: list[str] | None = Field(None, max_length=1000)


class VersionResponse(BaseModel):
    index_version: int
    ads: int = Field(description="live ads in the index")


class AdOut(BaseModel):
    ad_id: int
    attributes: dict[str, Any]
    index_version: int
