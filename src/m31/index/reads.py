"""The reading side of the ad index of DESIGN §4, "AdIndex": `AdIndexReads`, the base of
`AdIndex` (`m31.index.ad_index`), holds an index's state and answers every read of it; `AdIndex`
adds the writes (validation, mutations, snapshots).

Shapes: N allocated rows (live and tombstoned ads), G gate-key dim, D value dim, B requests.

The state: the ad table g, x, b with each row's ad id and liveness (`m31.index.ad_table`), the
live map (ad id -> its row), the ads' attributes (`m31.index.attributes`), the row bitmaps masks
are built from (`m31.index.eligibility`) and the version. Reads: ids, one ad's row, the table as
stored, eligibility masks for `RequestContext`s and filters, and views. An `IndexView` is one
version of the index: `snapshot_view()` holds the lock for a block, so table and masks come from
one version; `frozen_view()` copies liveness, attributes and bitmaps once per version, under the
lock, and returns a view that stays valid without it.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from m31.index.ad_table import TABLE_DTYPES, AdTable
from m31.index.attributes import AttributeTable, value_term
from m31.index.columns import BASE_FIELDS, check_schema
from m31.index.eligibility import Eligibility, RequestContext
from m31.index.errors import AdIndexError
from m31.index.filters import CompiledFilter, compile_filter
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table
from m31.vocabularies import BUILT_IN_VOCAB, STATUSES

# Targeting lists hold values of closed vocabularies, the model's (`AdIndex(targeting=...)`):
# a typo would silently make an ad ineligible everywhere. Without one given, the built-in
# marketplace's, which snapshots written before the vocabularies were recorded hold.
TARGETING_VOCAB: dict[str, str] = {  # targeting list -> the vocabulary of its values
    "target_genders": "gender",
    "target_platforms": "platform",
    "target_surfaces": "surface",
}


class AdRow(NamedTuple):
    g: torch.Tensor  # [G]
    x: torch.Tensor  # [D]
    b: float
    attributes: dict[str, Any]


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
    _index: AdIndexReads = field(repr=False)
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

    @property
    def schema(self) -> dict[str, str]:
        """Attribute name -> kind, the schema to compile filters against."""
        return self._index.schema

    def live_mask(self) -> torch.Tensor:
        """[N] bool: the rows of this view that hold a live ad; a copy."""
        with self._current():
            return self._index.live_mask()

    def rows_of(self, ad_ids: Sequence[int]) -> np.ndarray:
        """[n] int64: the live row of each ad id in this view, -1 for one it does not hold.
        The first call sorts the live rows' ids (kept for the view's life); each call is then
        a binary search per id."""
        if "ids" not in self._memo:
            live = torch.nonzero(self.live_mask()).flatten().cpu().numpy()
            ids = self.row_ids.cpu().numpy()[live]
            order = np.argsort(ids, kind="stable")
            self._memo["ids"] = (ids[order], live[order])
        ids, rows = self._memo["ids"]
        want = np.asarray(ad_ids, dtype=np.int64).reshape(-1)
        if not len(ids):
            return np.full(len(want), -1, np.int64)
        at = np.searchsorted(ids, want).clip(max=len(ids) - 1)
        return np.where(ids[at] == want, rows[at], -1).astype(np.int64)

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


class AdIndexReads:
    """An ad index's state and its reads: the base of `AdIndex`, which adds the writes; see the
    module docstring."""

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
        if dtype not in TABLE_DTYPES.values():
            raise AdIndexError(f"dtype {dtype} not supported (one of {list(TABLE_DTYPES)})")
        for name, dim in (("dim_g", dim_g), ("dim_x", dim_x), ("capacity", capacity - 1)):
            if not isinstance(dim, int) or dim < 0:
                raise AdIndexError(f"{name} must be a non-negative int (capacity >= 1)")
        self._schema = _schema(extra_fields)
        self.targeting = _targeting(targeting)
        self._allowed = {"status": STATUSES, **self.targeting}
        self.dim_g, self.dim_x, self.dtype = dim_g, dim_x, dtype
        self.quantized = dtype == torch.int8
        self.device = torch.device(device)
        self.model_hash: str | None = None  # of the checkpoint whose ad tower made g, x, b
        self._lock = threading.RLock()
        self._version = 0
        self._table_version = 0  # the last version that changed the ads (not only the users)
        self._rows: dict[int, int] = {}  # external id -> its live row
        self._ads = AdTable(dim_g, dim_x, dtype, self.device, capacity)
        self._attrs = AttributeTable(self._schema, self.device, capacity)
        self._bitmaps = Eligibility(self.device, capacity)  # follows the table's liveness, _attrs
        # the view `frozen_view` returned for the last version it saw (over a frozen copy)
        self._frozen: IndexView | None = None

    # ---- reading -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def capacity(self) -> int:
        return self._ads.capacity

    @property
    def num_rows(self) -> int:
        """Allocated rows N, tombstones included (what masks and `table()` range over)."""
        return self._ads.n

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
            n = self._ads.n
            return self._ads.row_ids[:n][self._ads.live[:n]].clone()

    def live_mask(self) -> torch.Tensor:
        """[N] bool: the rows that hold a live ad (the others are tombstones); a copy."""
        with self._lock:
            return self._ads.live[: self._ads.n].clone()

    def get(self, ad_id: int) -> AdRow:
        """The stored row of one live ad (copies)."""
        with self._lock:
            row = self._row_of(ad_id)
            rows = torch.tensor([row], device=self.device)
            attributes = self._attrs.to_arrow(rows).to_pylist()[0]
            g, x, b = self._ads.values(slice(row, row + 1))
            return AdRow(g[0], x[0], float(b[0]), attributes)

    def table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(g [N, G], x [N, D], b [N], row_ids [N], version) as stored, never modified
        afterwards. For an 8-bit index g and x are the codes: score a view's `ad_table`."""
        with self._lock:
            return (*self._ads.stored(), self._version)

    @contextmanager
    def snapshot_view(self) -> Iterator[IndexView]:
        """Hold the lock: mutations wait until the block ends, so table and masks agree."""
        with self._lock:
            yield self._view()

    def _view(self) -> IndexView:
        """A view of this index (or of a frozen copy) as it is."""
        g, x, b, row_ids, version = self.table()
        scales = self._ads.scales()
        return IndexView(
            g, x, b, row_ids, version, self._attrs, self, scales, ads_version=self._table_version
        )

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
                and view.ads_version == self._table_version
            ):  # only the users moved on (`advance_version`): the same ads, a newer version
                view = self._frozen = dataclasses.replace(view, version=self._version)
            if view is None or view.version != self._version:
                view = self._frozen = self._frozen_copy()._view()
            return view

    def _frozen_copy(self) -> AdIndexReads:
        """A copy of this index at its version for a frozen view: it shares the write-once
        table and copies liveness, attributes and bitmaps (under the lock)."""
        n = self._ads.n
        frozen = copy.copy(self)
        frozen._lock = threading.RLock()
        frozen._ads = self._ads.frozen()
        frozen._attrs = self._attrs.snapshot()  # plain copies: no gathers
        self._bitmaps.adopt(self._attrs, n)
        frozen._bitmaps = self._bitmaps.copy(n)
        frozen._rows = None  # the live map moves on; masks read the row ids instead
        frozen._frozen = None
        return frozen

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
        ads = self._ads
        return self._bitmaps.masks(requests, compiled, self._attrs, ads.row_ids, ads.n)

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


def _schema(extra_fields: Mapping[str, str] | None) -> dict[str, str]:
    """The attribute schema of an index: the built-in fields and `extra_fields`."""
    extra = dict(extra_fields or {})
    clash = sorted(set(extra) & set(BASE_FIELDS))
    if clash:
        raise AdIndexError(f"extra field {clash[0]!r} clashes with a built-in attribute")
    try:
        return check_schema({**BASE_FIELDS, **extra})
    except ValueError as e:
        raise AdIndexError(str(e)) from e


def _targeting(given: Mapping[str, Sequence[str]] | None) -> dict[str, tuple[str, ...]]:
    """The values each targeting list may hold: those `given`, else the built-in ones."""
    given = dict(given or {})
    if set(given) - set(TARGETING_VOCAB):
        raise AdIndexError(
            f"targeting: {sorted(set(given) - set(TARGETING_VOCAB))} are not targeting lists "
            f"(those are {', '.join(TARGETING_VOCAB)})"
        )
    return {
        name: tuple(given.get(name, BUILT_IN_VOCAB[vocab]))
        for name, vocab in TARGETING_VOCAB.items()
    }
