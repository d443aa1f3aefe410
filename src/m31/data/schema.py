"""The tables every dataset is turned into, whatever its source.

The synthetic marketplace, the MovieLens loader and the importer of a team's own data all write
these five tables; everything downstream (features, training, the index) reads only them.
Timestamps are Unix seconds (int64). List columns hold targeting sets; an empty list means "no
restriction".

Required and optional columns. A field marked `nullable=False` is required: every row holds a
value. Every other column is optional: null means the source does not have it, never a value,
and nothing downstream invents one in its place (`required`). What a null means where it is
read:

    users.age              no age: no age-bucket input (the unknown bucket); age targeting
                           treats the user as unknown (only ads with an open age range reach
                           them)
    users.gender, country, platform, cohort
                           the unknown value: no input from it (its embedding row is zero);
                           gender and country targeting treat the user as unknown (only ads
                           without that restriction reach them)
    users.created_at       unknown: no time check of the user's events
    ads.advertiser_id      an ad without an advertiser: no advertiser input to the ad tower,
                           and no advertiser filter or exclusion ever matches it
    ads.campaign_id        no campaign (a filter on it never matches)
    ads.objective, format, topic, category
                           the unknown value: no input from it
    ads.text               no semantic input: the text embedding is zeros, the text encoder
                           never sees a made-up sentence
    ads.target_age_min/max an open end of the age range
    ads.daily_budget       unknown (nothing reads it yet)
    ads.quality            0, the prior's mean: no information
    ads.created_at         an open schedule start: eligible from any time
    events.surface, platform
                           the unknown value: no input from it
    events.hour            the hour of `ts`, UTC

The advertisers and organic tables may be empty (a source without them), and meta.json's
`topics` may be empty (no topic vocabulary). ads.parquet may carry extra attribute columns
that meta.json lists under `item_attributes` (`ITEM_ATTRIBUTE_TYPES`); the index keeps them as
filter fields.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

# The categorical values of the built-in marketplace and an ad's statuses: `m31.vocabularies`.

AGE_EDGES = (18, 25, 35, 45, 55)  # lower edges of the buckets <18, 18-24, 25-34, 35-44, 45-54, 55+
N_AGE_BUCKETS = len(AGE_EDGES) + 1  # the code of an unknown age is N_AGE_BUCKETS


def age_bucket(age):
    """Age (array) -> bucket 0..len(AGE_EDGES)."""
    return np.searchsorted(np.array(AGE_EDGES), age, side="right")


# The kinds of the extra attribute columns of ads.parquet (meta.json `item_attributes`), the
# kinds of the index's attributes (`m31.index.columns.KINDS`), and the arrow type of each.
ITEM_ATTRIBUTE_TYPES: dict[str, pa.DataType] = {
    "str": pa.string(),
    "str_list": pa.list_(pa.string()),
    "int": pa.int64(),
    "float": pa.float64(),
}


USERS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("age", pa.int16()),
        pa.field("gender", pa.string()),
        pa.field("country", pa.string()),
        pa.field("platform", pa.string()),  # the user's main device
        pa.field("cohort", pa.int32()),  # dense id of a demographic cohort
        pa.field("created_at", pa.int64()),
    ]
)

ADVERTISERS = pa.schema(
    [
        pa.field("advertiser_id", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("category", pa.int32(), nullable=False),  # top-level topic it mostly sells in
    ]
)

ADS = pa.schema(
    [
        pa.field("ad_id", pa.int64(), nullable=False),
        pa.field("advertiser_id", pa.int64()),
        pa.field("campaign_id", pa.int64()),
        pa.field("objective", pa.string()),
        pa.field("format", pa.string()),
        pa.field("topic", pa.int32()),  # leaf topic id
        pa.field("category", pa.int32()),  # top-level topic id
        pa.field("text", pa.string()),  # creative text
        pa.field("target_countries", pa.list_(pa.string()), nullable=False),
        pa.field("target_age_min", pa.int16()),
        pa.field("target_age_max", pa.int16()),
        pa.field("target_genders", pa.list_(pa.string()), nullable=False),
        pa.field("target_platforms", pa.list_(pa.string()), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("daily_budget", pa.float32()),
        pa.field("quality", pa.float32()),  # estimated quality score, about N(0, 1)
        pa.field("created_at", pa.int64()),
    ]
)

# One row per impression (marketplace) or per rating (MovieLens, where every rating is an
# engagement: click = True, conversion = rating >= 4).
EVENTS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("ad_id", pa.int64(), nullable=False),
        pa.field("ts", pa.int64(), nullable=False),
        pa.field("surface", pa.string()),
        pa.field("hour", pa.int8()),
        pa.field("platform", pa.string()),
        pa.field("click", pa.bool_(), nullable=False),
        pa.field("conversion", pa.bool_(), nullable=False),
    ]
)

# Organic (non-ad) engagement on other surfaces: what the user watched, liked or followed.
ORGANIC = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("topic", pa.int32(), nullable=False),
        pa.field("ts", pa.int64(), nullable=False),
        pa.field("surface", pa.string(), nullable=False),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "users": USERS,
    "advertisers": ADVERTISERS,
    "ads": ADS,
    "events": EVENTS,
    "organic": ORGANIC,
}


def required(schema: pa.Schema) -> tuple[str, ...]:
    """The columns of `schema` that hold a value in every row."""
    return tuple(f.name for f in schema if not f.nullable)
