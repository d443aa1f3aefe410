"""The ad index (DESIGN §4): the ad table and its eligibility, versions, snapshots and the
write-ahead log. It knows no dataset, engine, server or user store: it imports none of
`m31.data`, `m31.engine`, `m31.serve` and `m31.users` (`tests/test_index_layers.py`).

* `ad_index`: `AdIndex`, the writes (validation, mutations, snapshots) over the reads of
  `reads` (`AdIndexReads`: ids, rows, the table as stored, views, masks) and `IndexView`;
* `ad_table`: `AdTable`, the rows g, x, b (and 8-bit scales), their ad ids and liveness;
* `checks`: what a mutation is given, checked (`CheckedUpsert`, `CheckedUpdate`);
* `attributes`: `AttributeTable`, the encoded attribute storage; `columns`, its schema and the
  arrow column checks; `list_column`, one list field in CSR form;
* `filters`: the filter language, `compile_filter` -> `CompiledFilter`, and `evaluate_row`;
* `eligibility`: `RequestContext` and the row bitmaps (status, targeting, cached predicates)
  masks are built from; `testing`, the plain definition they are tested against;
* `snapshot`: the on-disk format of a snapshot (`AdIndex.save`, `AdIndex.load`);
* `durable`: `DurableIndex`, an `AdIndex` (and a `UserState`) behind a write-ahead log: `wal`,
  the log's records; `recovery`, opening a folder and replaying its log; `framing`, the record
  framing and fsync helpers it shares with the cluster's logs;
* `hierarchical`: k-means clusters of ads, scored coarse to fine;
* `limits`: the bounds on list attributes; `errors`: the index's errors.
"""

from m31.index.ad_index import AdIndex
from m31.index.attributes import AttributeTable
from m31.index.checks import CheckedUpdate, CheckedUpsert
from m31.index.durable import DurableIndex
from m31.index.eligibility import RequestContext
from m31.index.errors import AdIndexError, DurableIndexError
from m31.index.filters import CompiledFilter, FilterError, compile_filter, evaluate_row
from m31.index.reads import IndexView
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
