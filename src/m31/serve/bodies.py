"""The API's bodies as the engine and the index take them, for every backend: a retrieve
request as an `AdRequest`, new ads through the ad tower, events as columns, users' attributes
as the store's codes."""

from __future__ import annotations

from m31.engine import AdRequest, Engagement, InlineUser, Retriever
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.engine.requests import FrequencyCap
from m31.serve.schemas import AdIn, EventIn, RetrieveRequest, UserAttributesIn


def to_engine(r: RetrieveRequest, now: int) -> AdRequest:
    """An API request as the engine takes it (`ts` defaults to the server's clock)."""
    user = None
    if r.user is not None:
        u = r.user
        user = InlineUser(
            country=u.country,
            age=u.age,
            gender=u.gender,
            cohort=u.cohort,
            history=tuple(Engagement(e.ad_id, e.ts, e.surface) for e in u.history),
            organic_topics=tuple(u.organic_topics),
        )
    return AdRequest(
        user_id=r.user_id,
        ts=now if r.ts is None else r.ts,
        surface=r.surface,
        platform=r.platform,
        hour=r.hour,
        exclude_ads=tuple(r.exclude_ads),
        exclude_advertisers=tuple(r.exclude_advertisers),
        filter=r.filter,
        user=user,
        frequency_cap=None
        if r.frequency_cap is None
        else FrequencyCap(r.frequency_cap.per, r.frequency_cap.max, r.frequency_cap.window_s),
        max_per=r.max_per,
        rank=r.rank,
        explain=r.explain,
        why_not=tuple(r.why_not),
    )


def encode_ads(encoder: AdEncoder, ads: list[AdIn]):
    """(g [n, G], x [n, D], b [n]): the new ads through the model's ad tower; a ValueError
    naming ads[i].field before any work."""
    new = [
        NewAd(
            a.ad_id,
            a.advertiser_id,
            a.objective,
            a.format,
            a.topic,
            a.category,
            a.text,
            a.quality,
        )  # no item attributes: the ad routes take the index's base fields only
        for a in ads
    ]
    encoder.check(new)
    return encoder.encode(new)


def ad_attributes(retriever: Retriever, ads: list[AdIn]) -> list[dict]:
    """The index attributes of each ad (the fields of the served index's schema)."""
    schema = retriever.index.schema
    return [{name: a.model_dump().get(name) for name in schema} for a in ads]


def event_columns(events: list[EventIn]) -> tuple[list, ...]:
    """(user ids, ad ids, times, surfaces, types, weights) of the events, [n] each."""
    return tuple(
        [getattr(e, name) for e in events]
        for name in ("user_id", "ad_id", "ts", "surface", "type", "weight")
    )


def user_codes(
    retriever: Retriever, users: list[UserAttributesIn]
) -> list[tuple[int, dict[str, int]]]:
    """(user id, the store's codes of its attributes) of each user; RequestError naming the
    field before anything is logged."""
    return [
        (
            u.user_id,
            retriever.user_codes(f"users[{i}]", InlineUser(u.country, u.age, u.gender, u.cohort)),
        )
        for i, u in enumerate(users)
    ]
