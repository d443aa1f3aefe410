"""The ad index of DESIGN §4: the ad table, eligibility attributes, versions and views.

Shapes: N allocated rows (live and tombstoned ads), G gate-key dim, D value dim, n ads in one
call.

`AdIndex` holds the ad table g, x, b (`m31.index.ad_table`) and the ads' attributes in an
`AttributeTable` (`m31.index.attributes`); eligibility is the built-in targeting rules of a
`RequestContext` and, optionally, a filter (`m31.index.filters`), and comes out as a bool mask
[N] over rows. It is computed from row bitmaps that every mutation keeps up to date
(`m31.index.eligibility`; `m31.index.testing.reference_mask` is the plain definition from the
attribute columns). Its reads and views are those of its base, `AdIndexReads`
(`m31.index.reads`); this module adds the writes. Beside it: `checks` (what a mutation is
given), `snapshot` (the format on disk), `durable` (an index behind a write-ahead log).

The table is stored in bfloat16 (the default), float16, float32 or int8 (`TABLE_DTYPES`). An int8 index holds the
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

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from m31.index import checks, snapshot
from m31.index.ad_table import TABLE_DTYPES
from m31.index.checks import CheckedUpdate, CheckedUpsert
from m31.index.columns import BASE_FIELDS
from m31.index.eligibility import Eligibility
from m31.index.errors import AdIndexError
from m31.index.limits import MAX_VOCABULARY
from m31.index.reads import AdIndexReads
from m31.ops.quant import Int8Table, quantize_ad_table


class AdIndex(AdIndexReads):
    """The ad index: its reads (`AdIndexReads`) and its writes; see the module docstring."""

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
        return checks.matrix(a, n, dim, what, self.device, self._ads.value_dtype)

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
        with self._lock:
            self.check_vocabulary(columns, ids)
            self._reserve(self._ads.n + len(ids))
            rows = self._ads.append(ids, table)  # [n]
            self._attrs.write(rows, columns)
            self._bitmaps.write(rows, self._attrs)
            self._bitmaps.set_live(rows, True)
            # A changed ad moves to its new row, so rows already handed out stay as they were.
            old = [self._rows[i] for i in ids.tolist() if i in self._rows]
            if old:
                self._retire(old)
            self._rows.update(zip(ids.tolist(), rows.tolist(), strict=True))
            return self._bump()

    def _retire(self, rows: list[int]) -> None:
        """Tombstone rows: in the table and in the bitmaps."""
        at = torch.tensor(rows, device=self.device)
        self._ads.retire(at)
        self._bitmaps.set_live(at, False)

    def _bump(self) -> int:
        """A mutation of the ads: the next version."""
        self._version += 1
        self._table_version = self._version
        return self._version

    def advance_version(self) -> int:
        """The next version, the ads unchanged: a change of the serving state beside them (the
        user store's events, `m31.users`), so that one version orders every write. Views of
        the ads are kept (`frozen_view` relabels its view rather than copying it)."""
        with self._lock:
            self._version += 1
            return self._version

    def _reserve(self, need: int) -> None:
        """Room for `need` rows in the table, the attributes and the bitmaps."""
        if need <= self._ads.capacity:
            return
        self._ads.reserve(need)
        self._attrs.reserve(self._ads.capacity)
        self._bitmaps.reserve(self._ads.capacity)

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
                self._retire(rows)
            for i in ids.tolist():
                del self._rows[i]
            return self._bump()

    def compact(self) -> int:
        """Reclaim tombstoned rows; live rows keep their order, so no query result changes."""
        with self._lock:
            # New tensors rather than moving rows in place: views already handed out stay valid.
            live = self._ads.compact()  # [k]: where the live rows were
            k = len(live)
            self._attrs = self._attrs.take(live, self._ads.capacity)
            self._bitmaps = Eligibility(self.device, self._ads.capacity)
            kept = torch.arange(k, device=self.device)  # [k]
            self._bitmaps.write(kept, self._attrs)
            self._bitmaps.set_live(kept, True)
            self._rows = dict(zip(self._ads.row_ids[:k].tolist(), range(k), strict=True))
            return self._bump()

    # ---- snapshots ------------------------------------------------------------------------

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
            live = self._ads.live_rows()  # [n_live]
            arrays = self._ads.saved(live)
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
            TABLE_DTYPES[manifest["dtype"]],
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
        table = checks.int8_rows(arrays, self.device)
        self._append(ids, table, self._columns(attributes, ids))
