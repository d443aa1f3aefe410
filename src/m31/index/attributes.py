"""The encoded attribute table: per-ad attributes on one device, so that filters are tensor ops.

Shapes: N rows (cap allocated), M entries of one list field: a (row, word) pair each (Mcap
allocated), V values in the vocabulary of one field, k rows in one call, m entries in one call.

The table holds the fields of a schema (`m31.index.columns`: kinds, the built-in fields, and the
checks that give attributes as one arrow table of `arrow_schema(schema)`, which
`AttributeTable.write` encodes and `AttributeTable.to_arrow` decodes); each list field is a
`ListColumn` (`m31.index.list_column`). The filter language that runs on the table is
`m31.index.filters`; the ad index that owns one is `m31.index.ad_index`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from m31.index.columns import ARROW_TYPES, arrow_schema, check_schema, columns_from_rows
from m31.index.limits import MAX_VOCABULARY
from m31.index.list_column import ListColumn


class AttributeTable:
    """Per-row attributes of N rows, encoded on one device so that filters are tensor ops.

    * int / float fields: values [cap] (int64 / float64) and a validity mask [cap];
    * str fields: int64 codes [cap] into the field's vocabulary (-1 = null), so eq / in compare
      integers;
    * str_list fields: the codes of each row's words in CSR form (`ListColumn`), so memory grows
      with the words rows hold, not with vocabulary x rows; `contains` compares the flat codes
      with one code and scatters the hits to their rows. Lists are sets: order and repeats are
      not kept, a list reads back sorted, and null reads back as the empty list.

    Vocabularies only grow while the table lives (a code never changes meaning), a list
    field's up to `MAX_VOCABULARY` values: a write beyond that is refused. `take` builds a new
    table whose list vocabularies keep only the values its rows hold.
    """

    def __init__(self, schema: Mapping[str, str], device="cpu", capacity: int = 0):
        self.schema = check_schema(schema)
        self.device = torch.device(device)
        self._cap = int(capacity)
        self._n = 0
        self._values: dict[str, torch.Tensor] = {}  # [cap] of int, float and str fields
        self._valid: dict[str, torch.Tensor] = {}  # [cap] validity of int and float fields
        self._lists: dict[str, ListColumn] = {}
        self._vocab: dict[str, dict[str, int]] = {}
        self._words: dict[str, list[str]] = {}
        # A snapshot's vocabulary sizes: it shares the vocabularies of the table it was taken
        # from (which only grow) and reads the words that were there. None: a table of its own.
        self._sizes: dict[str, int] | None = None
        for name, kind in self.schema.items():
            if kind == "str_list":
                self._lists[name] = ListColumn(self._cap, self.device)
            else:
                self._values[name], self._valid[name] = self._alloc(kind, self._cap)
            if kind in ("str", "str_list"):
                self._vocab[name], self._words[name] = {}, []

    @classmethod
    def from_rows(
        cls, rows: Sequence[Mapping[str, Any]], schema: Mapping[str, str], device="cpu"
    ) -> AttributeTable:
        table = cls(schema, device, capacity=len(rows))
        table.write(torch.arange(len(rows), device=table.device), columns_from_rows(rows, schema))
        return table

    def _alloc(self, kind: str, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        valid = torch.zeros(cap, dtype=torch.bool, device=dev)  # [cap]
        if kind == "int":
            return torch.zeros(cap, dtype=torch.int64, device=dev), valid
        if kind == "float":
            return torch.zeros(cap, dtype=torch.float64, device=dev), valid
        return torch.full((cap,), -1, dtype=torch.int64, device=dev), valid

    @property
    def n_rows(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._cap

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` rows, keeping the rows written so far."""
        if capacity <= self._cap:
            return
        n = self._n
        for name, kind in self.schema.items():
            if kind == "str_list":
                self._lists[name].reserve_rows(capacity, n)
                continue
            new, valid = self._alloc(kind, capacity)
            new[:n] = self._values[name][:n]
            valid[:n] = self._valid[name][:n]
            self._values[name], self._valid[name] = new, valid
        self._cap = capacity

    def vocabulary_overflow(self, columns: pa.Table) -> tuple[str, int] | None:
        """(field, row of `columns`) where writing `columns` would first take a list field past
        `MAX_VOCABULARY` distinct values; None when everything fits. Changes nothing."""
        for name in self._lists:
            vocab = self._vocab[name]
            col = columns.column(name).combine_chunks()
            enc = pc.dictionary_encode(pc.list_flatten(col))
            room = MAX_VOCABULARY - len(vocab)
            new = [i for i, w in enumerate(enc.dictionary.to_pylist()) if w not in vocab]
            if len(new) > room:
                # The dictionary lists words in order of first appearance, so the new word that
                # does not fit is new[room], and its first appearance is where the limit is hit.
                entry = pc.index(enc.indices, new[room]).as_py()
                return name, pc.list_parent_indices(col)[entry].as_py()
        return None

    def _encode(self, name: str, words: pa.Array) -> np.ndarray:
        """Strings -> codes, adding unseen words to the vocabulary; null -> -1."""
        enc = pc.dictionary_encode(words)
        vocab, known = self._vocab[name], self._words[name]
        lut = []
        for w in enc.dictionary.to_pylist():
            if w not in vocab:
                vocab[w] = len(known)
                known.append(w)
            lut.append(vocab[w])
        lut.append(-1)  # the slot nulls are pointed at below
        idx = pc.fill_null(enc.indices, len(lut) - 1).to_numpy(zero_copy_only=False)
        return np.asarray(lut, dtype=np.int64)[idx]

    def write(self, rows: torch.Tensor, columns: pa.Table, fields=None) -> None:
        """Set distinct rows [k] (< capacity) from a table of `arrow_schema(self.schema)`;
        `fields`: only these columns (the others hold the rows' values already).

        Raises ValueError, changing nothing, if a list field would exceed `MAX_VOCABULARY`.
        """
        if self._sizes is not None:
            raise RuntimeError("a snapshot of a table is read-only")
        if len(rows) == 0:
            return
        overflow = self.vocabulary_overflow(columns)
        if overflow is not None:
            name, row = overflow
            raise ValueError(
                f"row {row}, attribute {name!r}: more than {MAX_VOCABULARY} distinct values"
            )
        for name, kind in self.schema.items():
            if fields is not None and name not in fields:
                continue
            col = columns.column(name).combine_chunks()
            if kind in ("int", "float"):
                valid = col.is_valid().to_numpy(zero_copy_only=False)  # [k]
                values = pc.fill_null(col, 0).to_numpy(zero_copy_only=False)  # [k]
                self._values[name][rows] = torch.tensor(values, device=self.device)
                self._valid[name][rows] = torch.tensor(valid, device=self.device)
            elif kind == "str":
                self._values[name][rows] = torch.tensor(self._encode(name, col), device=self.device)
            else:
                codes = self._encode(name, pc.list_flatten(col))  # [m]
                where = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)  # [m]
                # One key per (row, code) pair: np.unique drops repeats and groups by row.
                key = np.unique(where.astype(np.int64) * (len(self._words[name]) + 1) + codes)
                where, codes = np.divmod(key, len(self._words[name]) + 1)
                self._lists[name].write(
                    rows,
                    torch.tensor(codes, device=self.device),
                    torch.tensor(where, device=self.device),
                )
        self._n = max(self._n, int(rows.max()) + 1)

    def snapshot(self) -> AttributeTable:
        """A copy of the table as it is (its N rows, no room for more), made of plain copies of
        the arrays: no gathers, and list fields keep their entries and vocabularies as they are
        (dead entries included), where `take` would rebuild and compact them. What a frozen
        view keeps, read-only. It shares only the vocabularies, which only grow, and reads the
        words they held when it was made: a distinct value costs its memory once, not once per
        version a reader holds."""
        n = self._n
        out = AttributeTable({}, self.device, n)
        out.schema, out._n = self.schema, n
        out._sizes = {}
        for name, kind in self.schema.items():
            if kind == "str_list":
                src, lists = self._lists[name], ListColumn(0, self.device)
                lists.codes = src.codes[: src.used].clone()
                lists.owner = src.owner[: src.used].clone()
                lists.start, lists.count = src.start[:n].clone(), src.count[:n].clone()
                lists.used, lists.dead = src.used, src.dead
                out._lists[name] = lists
            else:
                out._values[name] = self._values[name][:n].clone()
                out._valid[name] = self._valid[name][:n].clone()
            if name in self._vocab:
                out._vocab[name], out._words[name] = self._vocab[name], self._words[name]
                out._sizes[name] = len(self.vocabulary(name))
        return out

    def take(self, rows: torch.Tensor, capacity: int) -> AttributeTable:
        """A new table whose row i is row rows[i] of this one. str vocabularies are kept as
        they are; a list field's keeps only the values the taken rows hold, so compaction
        frees the values no row holds any more."""
        out = AttributeTable(self.schema, self.device, capacity)
        out._n, k = len(rows), len(rows)
        for name, kind in self.schema.items():
            if kind != "str_list":
                out._values[name][:k] = self._values[name][rows]
                out._valid[name][:k] = self._valid[name][rows]
                if name in self._vocab:
                    out._words[name] = list(self.vocabulary(name))
                    out._vocab[name] = {w: c for c, w in enumerate(out._words[name])}
                continue
            codes, count = self._lists[name].gather(rows)  # [m], [k]
            held = torch.unique(codes)  # [V'] ascending, so words keep their relative order
            known = self.vocabulary(name)
            renumber = torch.full(
                (len(known),), -1, dtype=torch.int32, device=self.device
            )  # [V] old code -> new code, -1 where no taken row holds the value
            renumber[held] = torch.arange(len(held), dtype=torch.int32, device=self.device)
            words = [known[c] for c in held.tolist()]
            out._words[name], out._vocab[name] = words, {w: c for c, w in enumerate(words)}
            lists = ListColumn(capacity, self.device)
            lists.codes = renumber[codes]  # [m]
            lists.owner = torch.repeat_interleave(
                torch.arange(k, dtype=torch.int32, device=self.device),
                count,
                output_size=len(codes),
            )  # [m]
            lists.start[:k] = torch.cumsum(count, 0) - count
            lists.count[:k] = count
            lists.used = len(codes)
            out._lists[name] = lists
        return out

    def numeric(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [N], valid [N]) of an int or float field."""
        return self._values[name][: self._n], self._valid[name][: self._n]

    def codes(self, name: str) -> torch.Tensor:
        """Codes [N] of a str field, -1 for null."""
        return self._values[name][: self._n]

    def code(self, name: str, word: str | None) -> int | None:
        """The code of `word` in a str or str_list field, None if no row ever held it."""
        code = None if word is None else self._vocab[name].get(word)
        if code is not None and self._sizes is not None and code >= self._sizes[name]:
            return None  # a value that came after this snapshot
        return code

    def contains(self, name: str, word: str | None) -> torch.Tensor:
        """[N] bool: rows whose list field `name` holds `word`."""
        code = self.code(name, word)
        if code is None:
            return torch.zeros(self._n, dtype=torch.bool, device=self.device)
        return self._lists[name].contains(code, self._n)

    def nonempty(self, name: str) -> torch.Tensor:
        """[N] bool: rows whose list field `name` is not empty."""
        return self._lists[name].count[: self._n] > 0

    def vocabulary(self, name: str) -> list[str]:
        """The values of a str or str_list field in code order (read it, do not change it).
        Codes only grow while the table lives; `take` renumbers."""
        words = self._words[name]
        return words if self._sizes is None else words[: self._sizes[name]]

    def rows(self, rows: torch.Tensor) -> AttributeRows:
        """The rows [k] of this table, read like a table of k rows (no copy of the columns)."""
        return AttributeRows(self, rows)

    def to_arrow(self, rows: torch.Tensor | None = None) -> pa.Table:
        """The decoded attributes of `rows` (default all N rows) as `arrow_schema(self.schema)`."""
        if rows is None:
            rows = torch.arange(self._n, device=self.device)
        arrays = []
        for name, kind in self.schema.items():
            if kind in ("int", "float"):
                values = self._values[name][rows].cpu().numpy()  # [k]
                valid = self._valid[name][rows].cpu().numpy()  # [k]
                arrays.append(pa.array(values, type=ARROW_TYPES[kind], mask=~valid))
                continue
            if kind == "str":
                arrays.append(self._decode(name, self._values[name][rows].cpu().numpy()))
                continue
            codes, count = self._lists[name].gather(rows)  # [m], [k]
            count = count.cpu().numpy()
            held = self._decode(name, codes.cpu().numpy())  # [m]
            # Each list comes out sorted, whatever order its words entered the vocabulary in.
            order = pc.sort_indices(
                pa.table({"row": np.repeat(np.arange(len(count)), count), "word": held}),
                [("row", "ascending"), ("word", "ascending")],
            )
            offsets = np.concatenate([[0], np.cumsum(count)])  # [k+1]
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), held.take(order)))
        return pa.Table.from_arrays(arrays, schema=arrow_schema(self.schema))

    def _decode(self, name: str, codes: np.ndarray) -> pa.Array:
        """The words of `codes` [k] of str field `name`, null where a code is negative."""
        vocab = self.vocabulary(name)
        if 4 * len(codes) < len(vocab):  # a few rows (one ad's GET): look up just their words
            return pa.array([vocab[c] if c >= 0 else None for c in codes.tolist()], pa.string())
        return pa.array(vocab, pa.string()).take(pa.array(codes, mask=codes < 0))


class AttributeRows:
    """Rows [k] of an `AttributeTable`, with the table's reading methods over just those rows,
    so that what a filter or an eligibility rule computes for a whole table (a compiled filter
    runs on either) can be recomputed for the few rows a write changed. Valid until the table's
    next write."""

    def __init__(self, table: AttributeTable, rows: torch.Tensor):
        self.schema, self.device = table.schema, table.device
        self._table, self._rows = table, rows

    @property
    def n_rows(self) -> int:
        return len(self._rows)

    def numeric(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [k], valid [k]) of an int or float field."""
        t = self._table
        return t._values[name][self._rows], t._valid[name][self._rows]

    def codes(self, name: str) -> torch.Tensor:
        """Codes [k] of a str field, -1 for null."""
        return self._table._values[name][self._rows]

    def code(self, name: str, word: str | None) -> int | None:
        return self._table.code(name, word)

    def lists(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [m], counts [k]) of a list field: the rows' entries, row after row."""
        return self._table._lists[name].gather(self._rows)

    def contains(self, name: str, word: str | None) -> torch.Tensor:
        """[k] bool: rows whose list field `name` holds `word`."""
        hit = torch.zeros(len(self._rows), dtype=torch.bool, device=self.device)  # [k]
        code = self.code(name, word)
        if code is None:
            return hit
        codes, count = self.lists(name)  # [m], [k]
        owner = torch.repeat_interleave(
            torch.arange(len(self._rows), device=self.device), count, output_size=len(codes)
        )  # [m]
        hit[owner[codes == code]] = True
        return hit


def value_term(table: AttributeTable) -> torch.Tensor:
    """[N] fp32: each row's value term log(bid · pacing) (DESIGN §2, "The value term"), pacing
    null read as 1, and 0 for a row without a bid (which value-ranked requests filter out,
    `m31.engine.prepare.HAS_BID`). Computed in fp64 and rounded once."""
    bid, has_bid = table.numeric("bid")
    pacing, has_pacing = table.numeric("pacing")
    term = torch.log(torch.where(has_bid, bid.double(), 1.0))
    term += torch.log(torch.where(has_pacing & has_bid, pacing.double(), 1.0))
    return term.float()
