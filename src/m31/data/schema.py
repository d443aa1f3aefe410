"""The tables every dataset is turned into, whatever its source.

The synthetic marketplace and the MovieLens loader both write these five tables; everything
downstream (features, training, the index) reads only them. Timestamps are Unix seconds (int64).
List columns hold targeting sets; an empty list means "no restriction".
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

# The built-in marketplace's values of each categorical column. A dataset declares its own in
# meta.json (`vocab`: `m31.data.dataset.vocabularies`), and everything downstream reads them from
# there, from the features or from the checkpoint; these are what the synthetic world declares,
# and the values of dataset folders written before vocabularies were declared.
SURFACES = ("feed", "stories", "reels", "marketplace", "search")
PLATFORMS = ("ios", "android", "web")
FORMATS = ("image", "video", "carousel")
OBJECTIVES = ("clicks", "conversions", "app_installs")
GENDERS = ("F", "M")
ORGANIC_SURFACES = ("feed", "reels", "stories", "search", "other")
BUILT_IN_VOCAB = {
    "surface": SURFACES,
    "platform": PLATFORMS,
    "format": FORMATS,
    "objective": OBJECTIVES,
    "gender": GENDERS,
    "organic_surface": ORGANIC_SURFACES,
}
# An ad's status is the index's own vocabulary (what makes it eligible), not a dataset's.
STATUSES = ("active", "paused", "budget_exhausted")
AGE_EDGES = (18, 25, 35, 45, 55)  # lower edges of the buckets <18, 18-24, 25-34, 35-44, 45-54, 55+


def age_bucket(age):
    """Age (array) -> bucket 0..len(AGE_EDGES)."""
    return np.searchsorted(np.array(AGE_EDGES), age, side="right")


USERS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("age", pa.int16(), nullable=False),
        pa.field("gender", pa.string(), nullable=False),
        pa.field("country", pa.string(), nullable=False),
        pa.field("platform", pa.string(), nullable=False),  # the user's main device
        pa.field("cohort", pa.int32(), nullable=False),  # dense id of a demographic cohort
        pa.field("created_at", pa.int64(), nullable=False),
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
        pa.field("advertiser_id", pa.int64(), nullable=False),
        pa.field("campaign_id", pa.int64(), nullable=False),
        pa.field("objective", pa.string(), nullable=False),
        pa.field("format", pa.string(), nullable=False),
        pa.field("topic", pa.int32(), nullable=False),  # leaf topic id
        pa.field("category", pa.int32(), nullable=False),  # top-level topic id
        pa.field("text", pa.string(), nullable=False),  # creative text
        pa.field("target_countries", pa.list_(pa.string()), nullable=False),
        pa.field("target_age_min", pa.int16(), nullable=False),
        pa.field("target_age_max", pa.int16(), nullable=False),
        pa.field("target_genders", pa.list_(pa.string()), nullable=False),
        pa.field("target_platforms", pa.list_(pa.string()), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("daily_budget", pa.float32(), nullable=False),
        pa.field("quality", pa.float32(), nullable=False),  # estimated quality score, about N(0, 1)
        pa.field("created_at", pa.int64(), nullable=False),
    ]
)

# One row per impression (marketplace) or per rating (MovieLens, where every rating is an
# engagement: click = True, conversion = rating >= 4).
EVENTS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("ad_id", pa.int64(), nullable=False),
        pa.field("ts", pa.int64(), nullable=False),
        pa.field("surface", pa.string(), nullable=False),
        pa.field("hour", pa.int8(), nullable=False),
        pa.field("platform", pa.string(), nullable=False),
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
