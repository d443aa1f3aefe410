"""The ad index (DESIGN §4): the ad table, eligibility attributes and filters, snapshots.

* `ad_index`: `AdIndex`, the ad table g, x, b with its attributes, versions and views;
* `snapshot`: the on-disk format of its snapshots (`AdIndex.save`, `AdIndex.load`);
* `attributes`: `AttributeTable`, the encoded attribute storage, and the arrow column checks;
* `filters`: the filter language, `compile_filter` -> `CompiledFilter`, and `evaluate_row`;
* `eligibility`: the row bitmaps (status, targeting, cached predicates) masks are built from;
* `durable`: `DurableIndex`, an `AdIndex` (and a user store) behind a write-ahead log;
* `users`: `UserStore`, each stored user's attributes and last engagements;
* `hierarchical`: k-means clusters of ads, scored coarse to fine;
* `limits`: the bounds on list attributes.
"""

from m31.index.ad_index import (
    AdIndex,
    AdIndexError,
    CheckedUpdate,
    CheckedUpsert,
    IndexView,
    RequestContext,
)
from m31.index.attributes import AttributeTable
from m31.index.durable import DurableIndex, DurableIndexError
from m31.index.filters import CompiledFilter, FilterError, compile_filter, evaluate_row
from m31.index.snapshot import read_manifest

__all__ = [
    "AdIndex",
    "AdIndexError",
    "AttributeTable",
    "CheckedUpdate",
    "CheckedUpsert",
    "CompiledFilter",
    "DurableIndex",
    "DurableIndexError",
    "FilterError",
    "IndexView",
    "RequestContext",
    "compile_filter",
    "evaluate_row",
    "read_manifest",
]
