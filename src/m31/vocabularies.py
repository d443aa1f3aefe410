"""The closed vocabularies every layer shares, so that the dataset schema (`m31.data.schema`) and
the index (`m31.index`) read them from one place without either importing the other.

The built-in marketplace's values of each categorical column. A dataset declares its own in
meta.json (`vocab`: `m31.data.dataset.vocabularies`), and everything downstream reads them from
there, from the features or from the checkpoint; these are what the synthetic world declares,
the values of dataset folders written before vocabularies were declared, and the targeting
values of an index given no model's (`m31.index.ad_index.AdIndex`: snapshots written before the
vocabularies were recorded hold them).
"""

from __future__ import annotations

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
