"""The ad index (DESIGN §4): the ad table, eligibility attributes and filters, snapshots.

* `ad_index`: `AdIndex`, the ad table g, x, b with its attributes, versions, views, snapshots;
* `attributes`: `AttributeTable`, the encoded attribute storage, and the arrow column checks;
* `filters`: the filter language, `compile_filter` -> `CompiledFilter`, and `evaluate_row`;
* `eligibility`: the row bitmaps (status, targeting, cached predicates) masks are built from;
* `durable`: `DurableIndex`, an `AdIndex` behind a write-ahead log and snapshots on disk;
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
    read_manifest,
)
from m31.index.attributes import AttributeTable
from m31.index.durable import DurableIndex, DurableIndexError
from m31.index.filters import CompiledFilter, FilterError, compile_filter, evaluate_row

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
