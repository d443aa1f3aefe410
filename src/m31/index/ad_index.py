"""The ad index of DESIGN §4: the ad table, eligibility attributes, versions and snapshots.

Shapes: N allocated rows (live and tombstoned ads), G gate-key dim, D value dim, n ads in one
call, cap the allocated capacity (N <= cap).

`AdIndex` holds the ad table g, x, b and the ads' attributes in an `AttributeTable`
(`m31.index.attributes`); eligibility is the built-in targeting rules of a `RequestContext`
and, optionally, a filter (`m31.index.filters`), and comes out as a bool mask [N] over rows.
It is computed from row bitmaps that every mutation keeps up to date (`m31.index.eligibility`,
whose `reference_mask` is the plain definition from the attribute columns). Beside it:
`checks` (what a mutation is given), `snapshot` (the format on disk), `tables` (an index of a
dataset's ads table), `durable` (an index behind a write-ahead log).

The table is stored in bfloat16 (the default), float16, float32 or int8. An int8 index holds the
8-bit table of DESIGN §4 (`m31.ops.quant`): each row is quantized on upsert with its own scales
(a row's codes depend on that row alone, so replaying an upsert gives the same bytes), b stays
float32, and a view's `ad_table` is an `Int8Table` that the kernels read as stored. What goes in
and what `get` and snapshots give back are the values themselves: for int8 the dequantized rows.

Rows of the ad table are write-once. An upsert appends fresh rows and tombstones the ids' old
rows; growth and compaction build new tensors. So the tensors `table()` hands out never change
afterwards, even while later mutations run, and a scorer may keep reading them after the lock is
released (asynchronous GPU work included). Attributes do change in place, so a mask is always
computed under the lock and returned as a fresh tensor; `snapshot_view()` holds the lock so that
table and masks come from one version. `frozen_view()` instead copies liveness and attributes
(once per version, under the lock), so masks are built from one version while mutations proceed.

Every mutation validates all of its input before touching anything, so a call that raises
leaves the index exactly as it was. The validation is public (`check_upsert`,
`check_vocabulary`, `check_update`, `check_delete`): it touches nothing and returns the
arguments as the mutation applies them, which is what a `DurableIndex` logs.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from m31.data.schema import BUILT_IN_VOCAB, STATUSES
from m31.index import checks, snapshot
from m31.index.attributes import BASE_FIELDS, AttributeTable, check_schema, value_term
from m31.index.eligibility import Eligibility
from m31.index.errors import AdIndexError
from m31.index.filters import CompiledFilter, compile_filter
from m31.index.limits import MAX_VOCABULARY
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table, quantize_ad_table

# Targeting lists hold values of closed vocabularies, the model's (`AdIndex(targeting=...)`):
# a typo would silently make an ad ineligible everywhere. Without one given, the built-in
# marketplace's, which snapshots written before the vocabularies were recorded hold.
TARGETING_VOCAB: dict[str, str] = {  # targeting list -> the vocabulary of its values
    "target_genders": "gender",
    "target_platforms": "platform",
    "target_surfaces": "surface",
}


@dataclass(frozen=True)
class RequestContext:
    """Who asks and where: what eligibility is evaluated against. None = unknown, which only
    ads without that restriction accept."""

    country: str | None
    age: int | None
    gender: str | None
    platform: str | None
    surface: str | None
    ts: int  # Unix seconds
    exclude_ads: Sequence[int] = ()  # e.g. already shown
    exclude_advertisers: Sequence[int] = ()  # e.g. blocked by the user


class AdRow(NamedTuple):
    g: torch.Tensor  # [G]
    x: torch.Tensor  # [D]
    b: float
    attributes: dict[str, Any]


@dataclass(frozen=True)
class CheckedUpsert:
    """An upsert's arguments as `AdIndex.check_upsert` validated them: what is applied (and
    what a `DurableIndex` logs)."""

    ids: np.ndarray  # [n] int64, distinct
    g: torch.Tensor  # [n, G] in the table dtype (int8: float32, quantized on apply), on its device
    x: torch.Tensor  # [n, D]
    b: torch.Tensor  # [n]
    columns: pa.Table  # n rows of the attribute schema, normalised


@dataclass(frozen=True)
class CheckedUpdate:
    """An attribute update as `AdIndex.check_update` validated it."""

    ad_id: int
    attrs: dict[str, Any]  # the attributes given, normalised as they are stored
    columns: pa.Table  # the ad's whole new row of attributes (1 row of the schema)


@dataclass(frozen=True)
class IndexView:
    """One version of the index, valid while its `snapshot_view()` block is open (for good,
    when it comes from `frozen_view()`)."""

    g: torch.Tensor  # [N, G] as stored (int8 codes for an 8-bit table)
    x: torch.Tensor  # [N, D]
    b: torch.Tensor  # [N]
    row_ids: torch.Tensor  # [N] int64 external ad id of each row
    version: int
    attributes: AttributeTable
    _index: AdIndex = field(repr=False)
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # int8: (g_scale [N], x_scale [N])
    # the version of the ads it shows: `version` may be newer when only the users changed since
    ads_version: int = -1
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # of these rows

    def value_term(self) -> torch.Tensor:
        """[N] fp32: the rows' value term (`attributes.value_term`), once per ads version."""
        if "value" not in self._memo:
            self._memo["value"] = value_term(self.attributes)
        return self._memo["value"]

    @property
    def ad_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | Int8Table:
        """What `m31.ops.score_topk` scores: (g, x, b), or an `Int8Table` for an 8-bit index."""
        if self.scales is None:
            return self.g, self.x, self.b
        return Int8Table(self.g, self.scales[0], self.x, self.scales[1], self.b)

    def eligible_mask(
        self, request: RequestContext, filter_fn: CompiledFilter | Mapping | None = None
    ) -> torch.Tensor:
        """[N] bool over this view's rows."""
        with self._current():
            return self._index._eligible(request, filter_fn)

    def eligible_masks(
        self,
        requests: Sequence[RequestContext],
        filters: Sequence[CompiledFilter | Mapping | None] | None = None,
    ) -> torch.Tensor:
        """bool [B, N]: `AdIndex.eligible_masks` over this view's rows."""
        return self.eligible_bits(requests, filters).unpack()

    def eligible_bits(
        self,
        requests: Sequence[RequestContext],
        filters: Sequence[CompiledFilter | Mapping | None] | None = None,
    ) -> PackedMask:
        """`AdIndex.eligible_bits` over this view's rows."""
        with self._current():
            return self._index._eligible_bits(requests, filters)

    @contextmanager
    def _current(self) -> Iterator[None]:
        """Hold the index's lock, and refuse a view of ads the index has changed since."""
        with self._index._lock:
            if self._index._table_version != self.ads_version:
                raise AdIndexError(
                    f"view of version {self.version} used after the index moved to "
                    f"{self._index._version} (use it inside its snapshot_view block)"
                )
            yield


class AdIndex:
    """The ad table `g, x, b` plus per-ad attributes on one device; see the module docstring."""

    def __init__(
        self,
        dim_g: int,
        dim_x: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        capacity: int = 1024,
        extra_fields: Mapping[str, str] | None = None,
        targeting: Mapping[str, Sequence[str]] | None = None,
    ):
        """`targeting`: the values each targeting list may hold (`TARGETING_VOCAB`'s keys)."""
        if dtype not in snapshot.DTYPES.values():
            raise AdIndexError(f"dtype {dtype} not supported (one of {list(snapshot.DTYPES)})")
        for name, dim in (("dim_g", dim_g), ("dim_x", dim_x), ("capacity", capacity - 1)):
            if not isinstance(dim, int) or dim < 0:
                raise AdIndexError(f"{name} must be a non-negative int (capacity >= 1)")
        extra = dict(extra_fields or {})
        clash = sorted(set(extra) & set(BASE_FIELDS))
        if clash:
            raise AdIndexError(f"extra field {clash[0]!r} clashes with a built-in attribute")
        try:
            self._schema = check_schema({**BASE_FIELDS, **extra})
        except ValueError as e:
            raise AdIndexError(str(e)) from e
        given = dict(targeting or {})
        if set(given) - set(TARGETING_VOCAB):
            raise AdIndexError(
                f"targeting: {sorted(set(given) - set(TARGETING_VOCAB))} are not targeting lists "
                f"(those are {', '.join(TARGETING_VOCAB)})"
            )
        self.targeting = {
            name: tuple(given.get(name, BUILT_IN_VOCAB[vocab]))
            for name, vocab in TARGETING_VOCAB.items()
        }
        self._allowed = {"status": STATUSES, **self.targeting}
        self.dim_g, self.dim_x, self.dtype = dim_g, dim_x, dtype
        self.quantized = dtype == torch.int8
        # what upserts are validated in, and b's dtype: an 8-bit table keeps b in float32
        self._value_dtype = torch.float32 if self.quantized else dtype
        self.device = torch.device(device)
        self.model_hash: str | None = None  # of the checkpoint whose ad tower made g, x, b
        self._lock = threading.RLock()
        self._cap = capacity
        self._n = 0  # rows allocated so far, live or tombstoned
        self._version = 0
        self._table_version = 0  # the last version that changed the ads (not only the users)
        self._rows: dict[int, int] = {}  # external id -> its live row
        self._g = torch.zeros(capacity, dim_g, dtype=dtype, device=self.device)  # [cap, G]
        self._x = torch.zeros(capacity, dim_x, dtype=dtype, device=self.device)  # [cap, D]
        self._b = torch.zeros(capacity, dtype=self._value_dtype, device=self.device)  # [cap]
        # int8: each row's scales ([cap] float32 each), else None
        self._g_scale = self._x_scale = None
        if self.quantized:
            self._g_scale = torch.ones(capacity, device=self.device)
            self._x_scale = torch.ones(capacity, device=self.device)
        self._row_ids = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._live = torch.zeros(capacity, dtype=torch.bool, device=self.device)  # [cap]
        self._attrs = AttributeTable(self._schema, self.device, capacity)
        self._bitmaps = Eligibility(self.device, capacity)  # follows _live and _attrs
        # the view `frozen_view` returned for the last version it saw (over a frozen copy)
        self._frozen: IndexView | None = None

    # ---- reading -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def num_rows(self) -> int:
        """Allocated rows N, tombstones included (what masks and `table()` range over)."""
        return self._n

    @property
    def schema(self) -> dict[str, str]:
        """Attribute name -> kind, the schema to compile filters against."""
        return dict(self._schema)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, ad_id: int) -> bool:
        return int(ad_id) in self._rows

    def ids(self) -> torch.Tensor:
        """[n_live] int64 ids of the live ads, in row order."""
        with self._lock:
            return self._row_ids[: self._n][self._live[: self._n]].clone()

    def get(self, ad_id: int) -> AdRow:
        """The stored row of one live ad (copies)."""
        with self._lock:
            row = self._row_of(ad_id)
            rows = torch.tensor([row], device=self.device)
            attributes = self._attrs.to_arrow(rows).to_pylist()[0]
            g, x, b = self._values(slice(row, row + 1))
            return AdRow(g[0], x[0], float(b[0]), attributes)

    def _values(
        self, rows: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the rows' (g, x, b) values: an 8-bit table's dequantized, in float32."""
        if self.quantized:
            scales = self._g_scale[rows], self._x_scale[rows]
            return Int8Table(
                self._g[rows], scales[0], self._x[rows], scales[1], self._b[rows]
            ).dequantize()
        return self._g[rows].clone(), self._x[rows].clone(), self._b[rows].clone()

    def table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(g [N, G], x [N, D], b [N], row_ids [N], version) as stored, never modified
        afterwards. For an 8-bit index g and x are the codes: score a view's `ad_table`."""
        with self._lock:
            n = self._n
            return self._g[:n], self._x[:n], self._b[:n], self._row_ids[:n], self._version

    def _scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(g_scale [N], x_scale [N]) of an 8-bit index (write-once like the table), else None."""
        return None if not self.quantized else (self._g_scale[: self._n], self._x_scale[: self._n])

    @contextmanager
    def snapshot_view(self) -> Iterator[IndexView]:
        """Hold the lock: mutations wait until the block ends, so table and masks agree."""
        with self._lock:
            g, x, b, row_ids, version = self.table()
            yield IndexView(g, x, b, row_ids, version, self._attrs, self, self._scales(),
                            ads_version=self._table_version)  # fmt: skip

    def frozen_view(self) -> IndexView:
        """A view that stays valid without the lock: its masks are built from a copy of the
        liveness and attributes of its version, so mutations never wait for them.

        The copy is made under the lock once per version (a mutation costs the next view one
        copy of the attributes, not the build of every mask after it), and every call of one
        version returns the same view: its tensors are the same objects, so what a kernel keeps
        per table (the cpu kernel's row norms) is found again rather than recomputed per call.
        """
        with self._lock:
            view = self._frozen
            if (
                view is not None
                and view.version != self._version
                and view.ads_version == (self._table_version)
            ):  # only the users moved on (`advance_version`): the same ads, a newer version
                view = self._frozen = dataclasses.replace(view, version=self._version)
            if view is None or view.version != self._version:
                n = self._n
                frozen = copy.copy(self)  # shares the write-once table
                frozen._lock = threading.RLock()
                frozen._live = self._live[:n].clone()
                frozen._attrs = self._attrs.snapshot()  # plain copies: no gathers
                self._bitmaps.adopt(self._attrs, n)
                frozen._bitmaps = self._bitmaps.copy(n)
                frozen._rows = None  # the live map moves on; masks read `_row_ids` instead
                frozen._frozen = None
                g, x, b, row_ids, version = frozen.table()
                view = IndexView(g, x, b, row_ids, version, frozen._attrs, frozen, frozen._scales(),
                                 ads_version=self._table_version)  # fmt: skip
                self._frozen = view
            return view

    def eligible_mask(
        self, request: RequestContext, filter_fn: CompiledFilter | Mapping | None = None
    ) -> torch.Tensor:
        """[N] bool over rows; `filter_fn`: a compiled filter or its JSON tree.

        For the version the mask belongs to, ask a view: `with index.snapshot_view() as view:`
        then `view.eligible_mask(...)` and `view.version`.
        """
        with self._lock:
            return self._eligible(request, filter_fn)

    def eligible_masks(
        self,
        requests: Sequence[RequestContext],
        filters: Sequence[CompiledFilter | Mapping | None] | None = None,
    ) -> torch.Tensor:
        """bool [B, N]: row b is `eligible_mask(requests[b], filters[b])` (`filters`: one per
        request, or None for none). Requests with the same targeting context, second and filter
        share one computation; when all B share one mask and exclude nothing, the result is
        that mask expanded to [B, N]: read it, do not write into it."""
        return self.eligible_bits(requests, filters).unpack()

    def eligible_bits(
        self,
        requests: Sequence[RequestContext],
        filters: Sequence[CompiledFilter | Mapping | None] | None = None,
    ) -> PackedMask:
        """The masks of `eligible_masks` as the kernels take them: one bitmap per distinct
        targeting context, second and filter, plus one per request that excludes advertisers
        or ads (`m31.ops.masks.PackedMask`: N / 8 bytes a bitmap)."""
        with self._lock:
            return self._eligible_bits(requests, filters)

    def _eligible_bits(
        self,
        requests: Sequence[RequestContext],
        filters: Sequence[CompiledFilter | Mapping | None] | None,
    ) -> PackedMask:
        if filters is None:
            filters = [None] * len(requests)
        compiled = [
            compile_filter(f, self._schema) if isinstance(f, Mapping) else f for f in filters
        ]
        return self._bitmaps.masks(requests, compiled, self._attrs, self._row_ids, self._n)

    def _eligible(
        self, request: RequestContext, filter_fn: CompiledFilter | Mapping | None
    ) -> torch.Tensor:
        return self._eligible_bits([request], [filter_fn]).unpack()[0]  # a fresh tensor

    def numeric_values(self, ad_ids: Sequence[int] | np.ndarray, name: str) -> list[int | None]:
        """The value of the int field `name` of each live ad (None: null, or no such ad)."""
        with self._lock:
            rows = [self._rows.get(int(a), -1) for a in ad_ids]
            held = [r for r in rows if r >= 0]
            if not held:
                return [None] * len(rows)
            values, valid = self._attrs.numeric(name)
            at = torch.tensor(held, device=self.device)
            got = iter(zip(values[at].tolist(), valid[at].tolist(), strict=True))
        out = []
        for r in rows:
            v, ok = next(got) if r >= 0 else (None, False)
            out.append(int(v) if ok else None)
        return out

    def _row_of(self, ad_id: int) -> int:
        row = self._rows.get(int(ad_id))
        if row is None:
            raise AdIndexError(f"ad id {int(ad_id)} is not in the index")
        return row

    # ---- validation (touches nothing) -----------------------------------------------------
    # Each mutation runs the check_* of its arguments and applies what it returns, so a
    # DurableIndex that logs what the checks return logs what is applied. check_upsert reads
    # only its arguments and the index's fixed dims, dtype and schema. check_vocabulary,
    # check_update and check_delete read the index's current state, so they hold only while no
    # mutation runs: the mutations call them under the lock, and a DurableIndex, the only
    # mutator of its index, under its own mutex.

    def check_upsert(self, ad_ids: Any, g: Any, x: Any, b: Any, attributes: Any) -> CheckedUpsert:
        """Validate the ads of an upsert on their own: ids [n], g [n, G], x [n, D], b [n] (cast
        to the table dtype; float32 for an 8-bit table, which quantizes them on apply) and
        attributes (dicts or an arrow table). `check_vocabulary` then checks the attributes
        against the index."""
        ids = checks.ids_of(ad_ids)
        n = len(ids)
        checks.no_duplicates(ids, "upsert")
        return CheckedUpsert(
            ids,
            self._matrix(g, n, self.dim_g, "g"),  # [n, G]
            self._matrix(x, n, self.dim_x, "x"),  # [n, D]
            self._matrix(b, n, None, "b"),  # [n]
            self._columns(attributes, ids),
        )

    def check_vocabulary(self, columns: pa.Table, ids: np.ndarray) -> None:
        """Refuse attributes of the ads `ids` [n] (`columns`, as `check_upsert` returns them)
        that would take a list field of this index past `MAX_VOCABULARY` values."""
        overflow = self._attrs.vocabulary_overflow(columns)
        if overflow is not None:
            name, row = overflow
            raise AdIndexError(
                f"attributes: ad {int(ids[row])}: {name} would hold more than {MAX_VOCABULARY} "
                "distinct values in the index (compact() drops the values no ad holds any more)"
            )

    def check_update(self, ad_id: int, attrs: Mapping[str, Any]) -> CheckedUpdate:
        """Validate a change of some attributes of the live ad `ad_id`, vocabularies included."""
        row = self._row_of(ad_id)
        unknown = sorted(set(attrs) - set(self._schema))
        if unknown:
            raise AdIndexError(f"update_attributes: unknown attribute {unknown[0]!r}")
        rows = torch.tensor([row], device=self.device)
        merged = {**self._attrs.to_arrow(rows).to_pylist()[0], **attrs}
        ids = np.array([int(ad_id)])
        columns = self._columns([merged], ids)
        self.check_vocabulary(columns, ids)
        normalised = {name: columns.column(name)[0].as_py() for name in attrs}
        return CheckedUpdate(int(ad_id), normalised, columns)

    def check_delete(self, ad_ids: Any) -> np.ndarray:
        """Validate a delete; the ids [n] int64 of live ads, distinct."""
        ids = checks.ids_of(ad_ids)
        checks.no_duplicates(ids, "delete")
        for i in ids.tolist():
            self._row_of(i)
        return ids

    def _matrix(self, a: Any, n: int, dim: int | None, what: str) -> torch.Tensor:
        return checks.matrix(a, n, dim, what, self.device, self._value_dtype)

    def _columns(self, attributes: Any, ids: np.ndarray) -> pa.Table:
        return checks.columns(attributes, ids, self._schema, self._allowed)

    # ---- mutations (each returns the new version) -----------------------------------------

    def upsert(self, ad_ids: Any, g: Any, x: Any, b: Any, attributes: Any) -> int:
        """Add new ads or replace existing ones: ids [n], g [n, G], x [n, D], b [n]."""
        checked = self.check_upsert(ad_ids, g, x, b, attributes)
        table = (checked.g, checked.x, checked.b)
        if self.quantized:  # row by row: an ad's codes do not depend on the rest of its batch
            table = quantize_ad_table(*table)
        return self._append(checked.ids, table, checked.columns)

    def _append(
        self,
        ids: np.ndarray,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | Int8Table,
        columns: pa.Table,
    ) -> int:
        """Write validated ads (ids [n], their table rows as stored, their attributes) to fresh
        rows and retire the ids' old rows."""
        n = len(ids)
        with self._lock:
            self.check_vocabulary(columns, ids)
            start = self._n
            self._reserve(start + n)
            new = slice(start, start + n)
            if self.quantized:
                self._g[new], self._x[new], self._b[new] = table.g, table.x, table.b
                self._g_scale[new], self._x_scale[new] = table.g_scale, table.x_scale
            else:
                self._g[new], self._x[new], self._b[new] = table
            self._row_ids[new] = torch.from_numpy(ids).to(self.device)  # [n]
            self._live[new] = True
            rows = torch.arange(start, start + n, device=self.device)  # [n]
            self._attrs.write(rows, columns)
            self._bitmaps.write(rows, self._attrs)
            self._bitmaps.set_live(rows, True)
            # A changed ad moves to its new row, so rows already handed out stay as they were.
            old = [self._rows[i] for i in ids.tolist() if i in self._rows]
            if old:
                self._live[torch.tensor(old, device=self.device)] = False
                self._bitmaps.set_live(torch.tensor(old, device=self.device), False)
            self._rows.update(zip(ids.tolist(), range(start, start + n), strict=True))
            self._n = start + n
            return self._bump()

    def _bump(self) -> int:
        """A mutation of the ads: the next version."""
        self._version += 1
        self._table_version = self._version
        return self._version

    def advance_version(self) -> int:
        """The next version, the ads unchanged: a change of the serving state beside them (the
        user store's events, `m31.index.users`), so that one version orders every write. Views
        of the ads are kept (`frozen_view` relabels its view rather than copying it)."""
        with self._lock:
            self._version += 1
            return self._version

    def _reserve(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = self._cap
        while cap < need:
            cap *= 2  # geometric growth: amortised O(1) copies per appended row
        n = self._n
        for name, fill in self._row_arrays():
            old = getattr(self, name)
            grown = torch.full((cap, *old.shape[1:]), fill, dtype=old.dtype, device=self.device)
            grown[:n] = old[:n]
            setattr(self, name, grown)
        self._attrs.reserve(cap)
        self._bitmaps.reserve(cap)
        self._cap = cap

    def _row_arrays(self) -> list[tuple[str, Any]]:
        """The per-row tensors (attribute name, fill of an unused row)."""
        arrays = [("_g", 0), ("_x", 0), ("_b", 0), ("_row_ids", -1), ("_live", False)]
        return arrays + ([("_g_scale", 1.0), ("_x_scale", 1.0)] if self.quantized else [])

    def update_attributes(self, ad_id: int, **attrs: Any) -> int:
        """Change some attributes of one live ad; its embeddings are kept as they are."""
        with self._lock:
            checked = self.check_update(ad_id, attrs)
            rows = torch.tensor([self._rows[checked.ad_id]], device=self.device)  # [1]
            self._attrs.write(rows, checked.columns, checked.attrs)  # the changed fields only
            self._bitmaps.write(rows, self._attrs, checked.attrs)
            return self._bump()

    def pause(self, ad_id: int) -> int:
        return self.update_attributes(ad_id, status="paused")

    def resume(self, ad_id: int) -> int:
        return self.update_attributes(ad_id, status="active")

    def delete(self, ad_ids: Any) -> int:
        """Tombstone ads: their rows stay allocated (never eligible) until `compact()`."""
        with self._lock:
            ids = self.check_delete(ad_ids)
            rows = [self._rows[i] for i in ids.tolist()]
            if rows:
                self._live[torch.tensor(rows, device=self.device)] = False
                self._bitmaps.set_live(torch.tensor(rows, device=self.device), False)
            for i in ids.tolist():
                del self._rows[i]
            return self._bump()

    def compact(self) -> int:
        """Reclaim tombstoned rows; live rows keep their order, so no query result changes."""
        with self._lock:
            live = self._live[: self._n].nonzero().squeeze(1)  # [n_live], ascending
            k = len(live)
            fresh = {}  # name -> [cap, ...]: the live rows first, in order, then unused rows
            for name, fill in self._row_arrays():
                old = getattr(self, name)
                fresh[name] = torch.full_like(old, fill)
                fresh[name][:k] = old[live]
            attrs = self._attrs.take(live, self._cap)
            bitmaps = Eligibility(self.device, self._cap)
            kept = torch.arange(k, device=self.device)  # [k]
            bitmaps.write(kept, attrs)
            bitmaps.set_live(kept, True)
            # New tensors rather than moving rows in place: views already handed out stay valid.
            for name, t in fresh.items():
                setattr(self, name, t)
            self._attrs, self._bitmaps = attrs, bitmaps
            self._rows = dict(zip(self._row_ids[:k].tolist(), range(k), strict=True))
            self._n = k
            return self._bump()

    # ---- building and snapshots -----------------------------------------------------------

    @classmethod
    def from_table(cls, ads: pa.Table, g: Any, x: Any, b: Any, **options: Any) -> AdIndex:
        """An index over a dataset's ads table, rows aligned with g, x, b
        (`m31.index.tables.from_ads_table`, where `options` are described)."""
        from m31.index.tables import from_ads_table

        return from_ads_table(cls, ads, g, x, b, **options)

    def save(
        self,
        path: str | Path,
        model_hash: str | None = None,
        overwrite: bool = False,
        beside: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write a snapshot folder of the live ads atomically (`m31.index.snapshot.write`).

        Only live rows are written, in row order, so the snapshot is the compacted index; the
        index itself is not changed. `model_hash` records the checkpoint that made g, x, b;
        `beside(folder)` may add a subfolder of its own (the engine's online features).
        """
        with self._lock:
            live = self._live[: self._n].nonzero().squeeze(1)  # [n_live]
            arrays = {"g": self._g[live], "x": self._x[live], "b": self._b[live]}  # [n_live, ·]
            arrays["ids"] = self._row_ids[live]  # [n_live]
            if self.quantized:
                arrays |= {"g_scale": self._g_scale[live], "x_scale": self._x_scale[live]}
            # bf16 and fp16 widened to float32 (exactly); int8 codes, scales and ids as they are
            arrays = {
                name: (a.float() if a.is_floating_point() else a).cpu().numpy()
                for name, a in arrays.items()
            }
            attributes = self._attrs.to_arrow(live)
            manifest = {
                "index_version": self._version,
                "dim_g": self.dim_g,
                "dim_x": self.dim_x,
                "dtype": str(self.dtype).removeprefix("torch."),
                "count": len(live),
                "model_hash": model_hash,
                "fields": dict(self._schema),
                "targeting": {name: list(values) for name, values in self.targeting.items()},
            }
        return snapshot.write(Path(path), arrays, attributes, manifest, overwrite, beside)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> AdIndex:
        """Read a snapshot written by `save`, checking the manifest against every file."""
        manifest, arrays, attributes = snapshot.read(Path(path))
        count = manifest["count"]
        extra = {k: v for k, v in manifest["fields"].items() if k not in BASE_FIELDS}
        index = cls(
            manifest["dim_g"],
            manifest["dim_x"],
            device,
            snapshot.DTYPES[manifest["dtype"]],
            max(count, 1),
            extra_fields=extra,
            targeting=manifest.get("targeting"),
        )
        try:
            if index.quantized:
                index._load_int8(arrays, attributes)
            else:
                index.upsert(arrays["ids"], arrays["g"], arrays["x"], arrays["b"], attributes)
        except AdIndexError as e:
            raise AdIndexError(f"{path}: snapshot content is invalid: {e}") from e
        index._version = index._table_version = manifest["index_version"]
        index.model_hash = manifest["model_hash"]
        return index

    def _load_int8(self, arrays: dict[str, np.ndarray], attributes: pa.Table) -> None:
        """Append a snapshot's 8-bit rows as stored (codes and scales, shapes checked by
        `load`): requantizing their dequantized values could move a scale by an ulp."""
        ids = checks.ids_of(arrays["ids"])
        checks.no_duplicates(ids, "snapshot")
        t = Int8Table(*(torch.from_numpy(arrays[k]).to(self.device) for k in Int8Table._fields))
        ok = {"g_scale": t.g_scale > 0, "x_scale": t.x_scale > 0, "b": torch.isfinite(t.b)}
        for name, good in ok.items():
            bad = ~(good & torch.isfinite(getattr(t, name)))
            if bad.any():
                row = int(bad.nonzero()[0])
                want = "a finite number" if name == "b" else "a positive finite scale"
                raise AdIndexError(
                    f"{name}: row {row} holds {float(getattr(t, name)[row])}, not {want}"
                )
        if (t.g == -128).any() or (t.x == -128).any():
            raise AdIndexError("g, x: an int8 code of -128 (the symmetric range is ±127)")
        self._append(ids, t, self._columns(attributes, ids))
