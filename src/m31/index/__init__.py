"""The ad index (DESIGN §4): the ad table, eligibility attributes and filters, snapshots."""

from m31.index.ad_index import AdIndex, AdIndexError, IndexView, RequestContext, read_manifest
from m31.index.durable import DurableIndex, DurableIndexError
from m31.index.filters import AttributeTable, FilterError, compile_filter, evaluate_row

__all__ = [
    "AdIndex",
    "AdIndexError",
    "AttributeTable",
    "DurableIndex",
    "DurableIndexError",
    "FilterError",
    "IndexView",
    "RequestContext",
    "compile_filter",
    "evaluate_row",
    "read_manifest",
]
