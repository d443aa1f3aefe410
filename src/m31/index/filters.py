"""Filter expressions over per-ad attributes, and the encoded attribute table they run on.

Shapes: N rows, V words in one list field's vocabulary (Vcap: its allocated rows).

A filter is a JSON boolean tree::

    {"all": [f, ...]}   {"any": [f, ...]}   {"not": f}
    {"eq": [field, value]}   {"in": [field, [value, ...]]}
    {"range": [field, lo, hi]}      inclusive; lo or hi null = open on that side
    {"contains": [field, value]}    list fields only

`compile_filter` validates a tree once against a schema (field name -> kind) and returns a
function from an `AttributeTable` to a bool mask [N], computed with a handful of tensor ops on
the table's device. `evaluate_row` is the plain-Python definition of the same semantics:
a null value never equals, lies in or contains anything (so `not` of such a predicate holds),
and a value the table has never seen simply matches nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

FieldKind = Literal["int", "float", "str", "str_list"]
KINDS: tuple[str, ...] = ("int", "float", "str", "str_list")
ARROW_TYPES: dict[str, pa.DataType] = {
    "int": pa.int64(),
    "float": pa.float64(),
    "str": pa.string(),
    "str_list": pa.list_(pa.string()),
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_ARGS = {
    "eq": "[field, value]",
    "in": "[field, [values]]",
    "range": "[field, lo, hi]",
    "contains": "[field, value]",
}
_ARITY = {"eq": 2, "in": 2, "range": 3, "contains": 2}

Mask = Callable[["AttributeTable"], torch.Tensor]


class FilterError(ValueError):
    """An invalid filter expression; the message names the path of the bad node in the tree."""


def _is_int(v: Any) -> bool:
    return (
        isinstance(v, int | np.integer)
        and not isinstance(v, bool | np.bool_)
        and _INT64_MIN <= v <= _INT64_MAX
    )


def _is_float(v: Any) -> bool:
    if not isinstance(v, int | float | np.integer | np.floating) or isinstance(v, bool | np.bool_):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def cell_ok(kind: str, v: Any) -> bool:
    """Whether `v` is a valid non-null attribute value for a field of `kind`."""
    if kind == "int":
        return _is_int(v)
    if kind == "float":
        return _is_float(v)
    if kind == "str":
        return isinstance(v, str)
    return isinstance(v, list | tuple | set | frozenset) and all(isinstance(w, str) for w in v)


def check_schema(schema: Mapping[str, str]) -> dict[str, str]:
    for name, kind in schema.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"schema: field names must be non-empty strings, got {name!r}")
        if kind not in KINDS:
            raise ValueError(f"schema: field {name!r} has unknown kind {kind!r} (one of {KINDS})")
    return dict(schema)


def arrow_schema(schema: Mapping[str, str]) -> pa.Schema:
    return pa.schema([pa.field(name, ARROW_TYPES[kind]) for name, kind in schema.items()])


def columns_from_rows(rows: Sequence[Mapping[str, Any]], schema: Mapping[str, str]) -> pa.Table:
    """Rows of plain values -> a table of `arrow_schema(schema)`; absent keys are null.

    Each value is type-checked here because pyarrow would silently truncate 1.5 to an int64
    or split the string "ab" into the list ["a", "b"].
    """
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"row {i}: expected a dict of attributes, got {type(row).__name__}")
        unknown = sorted(set(row) - set(schema))
        if unknown:
            raise ValueError(f"row {i}: unknown attribute {unknown[0]!r} (known: {sorted(schema)})")
    arrays = []
    for name, kind in schema.items():
        values = [row.get(name) for row in rows]
        for i, v in enumerate(values):
            if v is not None and not cell_ok(kind, v):
                raise ValueError(f"row {i}, attribute {name!r}: {v!r} is not a valid {kind} value")
        if kind == "str_list":
            values = [None if v is None else sorted(set(v)) for v in values]
        arrays.append(pa.array(values, type=ARROW_TYPES[kind]))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(schema))


def _arrow_type_ok(kind: str, t: pa.DataType) -> bool:
    if kind == "int":
        return pa.types.is_integer(t)
    if kind == "float":
        return pa.types.is_integer(t) or pa.types.is_floating(t)
    if kind == "str":
        return pa.types.is_string(t) or pa.types.is_large_string(t)
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and _arrow_type_ok(
        "str", t.value_type
    )


def columns_from_arrow(table: pa.Table, schema: Mapping[str, str]) -> pa.Table:
    """An arrow table with a subset of the schema's columns -> `arrow_schema(schema)`."""
    unknown = sorted(set(table.column_names) - set(schema))
    if unknown:
        raise ValueError(f"unknown attribute column {unknown[0]!r} (known: {sorted(schema)})")
    arrays = []
    for name, kind in schema.items():
        if name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, ARROW_TYPES[kind]))
            continue
        col = table.column(name)
        if not _arrow_type_ok(kind, col.type):
            raise ValueError(f"attribute column {name!r}: type {col.type} does not fit kind {kind}")
        try:
            col = col.cast(ARROW_TYPES[kind])
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(f"attribute column {name!r}: {e}") from e
        if kind == "str_list" and pc.list_flatten(col).null_count:
            raise ValueError(f"attribute column {name!r}: lists must not hold nulls")
        arrays.append(col.combine_chunks())
    return pa.Table.from_arrays(arrays, schema=arrow_schema(schema))


class AttributeTable:
    """Per-row attributes of N rows, encoded on one device so that filters are tensor ops.

    * int / float fields: values [cap] (int64 / float64) and a validity mask [cap];
    * str fields: int64 codes [cap] into the field's vocabulary (-1 = null), so eq / in compare
      integers;
    * str_list fields: a membership matrix [Vcap, cap], word-major so that `contains` reads one
      contiguous row of N bytes, and a non-empty flag [cap]. Lists are sets: order and repeats
      are not kept, a list reads back sorted, and null reads back as the empty list.

    Vocabularies only grow (a code never changes meaning while the table lives). Dense
    membership suits the small vocabularies of targeting (countries, platforms) and modest tag
    sets.
    """

    def __init__(self, schema: Mapping[str, str], device="cpu", capacity: int = 0):
        self.schema = check_schema(schema)
        self.device = torch.device(device)
        self._cap = int(capacity)
        self._n = 0
        self._values: dict[str, torch.Tensor] = {}  # [cap] or [Vcap, cap] for lists
        self._valid: dict[str, torch.Tensor] = {}  # [cap] numeric validity / list non-empty
        self._vocab: dict[str, dict[str, int]] = {}
        self._words: dict[str, list[str]] = {}
        for name, kind in self.schema.items():
            self._values[name], self._valid[name] = self._alloc(kind, self._cap, 0)
            if kind in ("str", "str_list"):
                self._vocab[name], self._words[name] = {}, []

    @classmethod
    def from_rows(
        cls, rows: Sequence[Mapping[str, Any]], schema: Mapping[str, str], device="cpu"
    ) -> AttributeTable:
        table = cls(schema, device, capacity=len(rows))
        table.write(torch.arange(len(rows), device=table.device), columns_from_rows(rows, schema))
        return table

    def _alloc(self, kind: str, cap: int, vcap: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        valid = torch.zeros(cap, dtype=torch.bool, device=dev)  # [cap]
        if kind == "int":
            return torch.zeros(cap, dtype=torch.int64, device=dev), valid
        if kind == "float":
            return torch.zeros(cap, dtype=torch.float64, device=dev), valid
        if kind == "str":
            return torch.full((cap,), -1, dtype=torch.int64, device=dev), valid
        return torch.zeros(vcap, cap, dtype=torch.bool, device=dev), valid  # [Vcap, cap]

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
            old, old_valid = self._values[name], self._valid[name]
            vcap = old.shape[0] if kind == "str_list" else 0
            new, valid = self._alloc(kind, capacity, vcap)
            new[..., :n] = old[..., :n]
            valid[:n] = old_valid[:n]
            self._values[name], self._valid[name] = new, valid
        self._cap = capacity

    def _reserve_vocab(self, name: str) -> None:
        member = self._values[name]  # [Vcap, cap]
        need = len(self._words[name])
        if need <= member.shape[0]:
            return
        vcap = max(8, member.shape[0])
        while vcap < need:
            vcap *= 2  # geometric, so a stream of new tags costs amortised O(1) copies
        grown = torch.zeros(vcap, self._cap, dtype=torch.bool, device=self.device)
        grown[: member.shape[0]] = member
        self._values[name] = grown

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

    def write(self, rows: torch.Tensor, columns: pa.Table) -> None:
        """Set distinct rows [n] (< capacity) from a table of `arrow_schema(self.schema)`."""
        if len(rows) == 0:
            return
        for name, kind in self.schema.items():
            col = columns.column(name).combine_chunks()
            if kind in ("int", "float"):
                valid = col.is_valid().to_numpy(zero_copy_only=False)
                values = pc.fill_null(col, 0).to_numpy(zero_copy_only=False)
                self._values[name][rows] = torch.tensor(values, device=self.device)
                self._valid[name][rows] = torch.tensor(valid, device=self.device)
            elif kind == "str":
                self._values[name][rows] = torch.tensor(self._encode(name, col), device=self.device)
            else:
                codes = torch.tensor(self._encode(name, pc.list_flatten(col)), device=self.device)
                parent = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
                self._reserve_vocab(name)
                member = self._values[name]  # [Vcap, cap]
                member[:, rows] = False  # a rewritten row loses its old words
                member[codes, rows[torch.tensor(parent, device=self.device)]] = True
                counts = np.bincount(parent, minlength=len(col))
                self._valid[name][rows] = torch.tensor(counts > 0, device=self.device)
        self._n = max(self._n, int(rows.max()) + 1)

    def take(self, rows: torch.Tensor, capacity: int) -> AttributeTable:
        """A new table whose row i is row rows[i] of this one (same vocabularies)."""
        out = AttributeTable(self.schema, self.device, 0)
        out._cap, out._n, k = capacity, len(rows), len(rows)
        for name, kind in self.schema.items():
            vcap = self._values[name].shape[0] if kind == "str_list" else 0
            values, valid = self._alloc(kind, capacity, vcap)
            values[..., :k] = self._values[name][..., rows]
            valid[:k] = self._valid[name][rows]
            out._values[name], out._valid[name] = values, valid
            if name in self._vocab:
                out._vocab[name], out._words[name] = (
                    dict(self._vocab[name]),
                    list(self._words[name]),
                )
        return out

    def numeric(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [N], valid [N]) of an int or float field."""
        return self._values[name][: self._n], self._valid[name][: self._n]

    def codes(self, name: str) -> torch.Tensor:
        """Codes [N] of a str field, -1 for null."""
        return self._values[name][: self._n]

    def code(self, name: str, word: str | None) -> int | None:
        """The code of `word` in a str or str_list field, None if no row ever held it."""
        return None if word is None else self._vocab[name].get(word)

    def contains(self, name: str, word: str | None) -> torch.Tensor:
        """[N] bool: rows whose list field `name` holds `word`."""
        code = self.code(name, word)
        if code is None:
            return torch.zeros(self._n, dtype=torch.bool, device=self.device)
        return self._values[name][code, : self._n]

    def nonempty(self, name: str) -> torch.Tensor:
        """[N] bool: rows whose list field `name` is not empty."""
        return self._valid[name][: self._n]

    def to_arrow(self, rows: torch.Tensor | None = None) -> pa.Table:
        """The decoded attributes of `rows` (default all N rows) as `arrow_schema(self.schema)`."""
        if rows is None:
            rows = torch.arange(self._n, device=self.device)
        k = len(rows)
        arrays = []
        for name, kind in self.schema.items():
            if kind in ("int", "float"):
                values = self._values[name][rows].cpu().numpy()
                valid = self._valid[name][rows].cpu().numpy()
                arrays.append(pa.array(values, type=ARROW_TYPES[kind], mask=~valid))
                continue
            words = pa.array(self._words[name], type=pa.string())
            if kind == "str":
                codes = self._values[name][rows].cpu().numpy()
                arrays.append(words.take(pa.array(codes, mask=codes < 0)))
                continue
            member = self._values[name][: len(self._words[name])][:, rows]  # [V, k]
            row, code = member.T.nonzero().cpu().numpy().T
            # Each list comes out sorted, whatever order its words entered the vocabulary in.
            rank = np.argsort(np.argsort(np.array(self._words[name], dtype=object)))
            order = np.lexsort((rank[code], row))
            row, code = row[order], code[order]
            offsets = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=k))])
            arrays.append(
                pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), words.take(pa.array(code)))
            )
        return pa.Table.from_arrays(arrays, schema=arrow_schema(self.schema))


MAX_DEPTH = 32  # nesting of all/any/not: deeper trees are refused, not recursed into


def compile_filter(expr: Any, schema: Mapping[str, str]) -> Mask:
    """Validate `expr` once against `schema`; return table -> bool mask [N] on its device."""
    return _compile(expr, check_schema(schema), "filter", 0)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _compile(node: Any, schema: dict[str, str], path: str, depth: int) -> Mask:
    if depth > MAX_DEPTH:
        raise FilterError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if not isinstance(node, Mapping) or len(node) != 1:
        raise FilterError(
            f"{path}: expected an object with exactly one operator, got {_short(node)}"
        )
    ((op, arg),) = node.items()
    where = f"{path}.{op}"
    if op in ("all", "any"):
        if not isinstance(arg, list | tuple):
            raise FilterError(f"{where}: expected a list of filters, got {_short(arg)}")
        parts = [_compile(child, schema, f"{where}[{i}]", depth + 1) for i, child in enumerate(arg)]
        return _all(parts) if op == "all" else _any(parts)
    if op == "not":
        inner = _compile(arg, schema, where, depth + 1)
        return lambda table: ~inner(table)
    if op in _ARITY:
        return _predicate(op, arg, schema, where)
    raise FilterError(
        f"{path}: unknown operator {op!r} (one of all, any, not, {', '.join(_ARITY)})"
    )


def _all(parts: list[Mask]) -> Mask:
    def run(table: AttributeTable) -> torch.Tensor:
        mask = torch.ones(table.n_rows, dtype=torch.bool, device=table.device)  # [N]
        for part in parts:
            mask &= part(table)
        return mask

    return run


def _any(parts: list[Mask]) -> Mask:
    def run(table: AttributeTable) -> torch.Tensor:
        mask = torch.zeros(table.n_rows, dtype=torch.bool, device=table.device)  # [N]
        for part in parts:
            mask |= part(table)
        return mask

    return run


def _check_value(kind: str, v: Any, where: str, what: str = "value") -> Any:
    """A filter value for a scalar of `kind`, normalised to the Python type compared against."""
    if kind == "int":
        if not _is_int(v):
            raise FilterError(f"{where}: {what} {v!r} is not an int64 integer")
        return int(v)
    if kind == "float":
        if not _is_float(v):
            raise FilterError(f"{where}: {what} {v!r} is not a number")
        if math.isnan(v):
            raise FilterError(f"{where}: {what} is NaN, which never matches anything")
        # A float column compares in float64; an int that does not survive the round trip
        # would compare differently in Python and in torch.
        if float(v) != v:
            raise FilterError(f"{where}: {what} {v!r} is not exactly representable as float64")
        return float(v)
    if not isinstance(v, str):
        raise FilterError(f"{where}: {what} {v!r} is not a string")
    return v


def _predicate(op: str, arg: Any, schema: dict[str, str], where: str) -> Mask:
    if not isinstance(arg, list | tuple) or len(arg) != _ARITY[op]:
        raise FilterError(f"{where}: expected {_ARGS[op]}, got {arg!r}")
    field = arg[0]
    if not isinstance(field, str):
        raise FilterError(f"{where}: field name must be a string, got {field!r}")
    if field not in schema:
        raise FilterError(f"{where}: unknown field {field!r}")
    kind = schema[field]
    if op == "contains":
        if kind != "str_list":
            raise FilterError(f"{where}: 'contains' needs a list field, {field!r} is {kind}")
        word = _check_value("str", arg[1], where)
        return lambda table: table.contains(field, word)
    if kind == "str_list":
        raise FilterError(f"{where}: {op!r} does not apply to list field {field!r}; use 'contains'")
    if op == "range":
        if kind == "str":
            raise FilterError(f"{where}: 'range' needs a numeric field, {field!r} is {kind}")
        lo = None if arg[1] is None else _check_value(kind, arg[1], where, "lo")
        hi = None if arg[2] is None else _check_value(kind, arg[2], where, "hi")
        return _range(field, lo, hi)
    if op == "eq":
        return _in(field, kind, [_check_value(kind, arg[1], where)])
    if not isinstance(arg[1], list | tuple):
        raise FilterError(f"{where}: expected a list of values, got {arg[1]!r}")
    return _in(field, kind, [_check_value(kind, v, where) for v in arg[1]])


def _range(field: str, lo: Any, hi: Any) -> Mask:
    def run(table: AttributeTable) -> torch.Tensor:
        values, mask = table.numeric(field)  # [N], [N]
        if lo is not None:
            mask = mask & (values >= lo)
        if hi is not None:
            mask = mask & (values <= hi)
        return mask

    return run


def _in(field: str, kind: str, wanted: list) -> Mask:
    def run(table: AttributeTable) -> torch.Tensor:
        if kind == "str":
            values = table.codes(field)  # [N]; null = -1 is never a wanted code
            codes = [c for w in wanted if (c := table.code(field, w)) is not None]
            if not codes:
                return torch.zeros(table.n_rows, dtype=torch.bool, device=table.device)
            test = torch.tensor(codes, dtype=torch.int64, device=table.device)
            return values == test[0] if len(codes) == 1 else torch.isin(values, test)
        values, valid = table.numeric(field)  # [N], [N]
        if not wanted:
            return torch.zeros(table.n_rows, dtype=torch.bool, device=table.device)
        test = torch.tensor(wanted, dtype=values.dtype, device=table.device)
        hit = values == test[0] if len(wanted) == 1 else torch.isin(values, test)
        return valid & hit

    return run


def evaluate_row(expr: Mapping[str, Any], row: Mapping[str, Any]) -> bool:
    """The reference semantics of a (valid) filter on one row of plain values; absent = null."""
    ((op, arg),) = expr.items()
    if op == "all":
        return all(evaluate_row(child, row) for child in arg)
    if op == "any":
        return any(evaluate_row(child, row) for child in arg)
    if op == "not":
        return not evaluate_row(arg, row)
    value = row.get(arg[0])
    if value is None:
        return False
    if op == "eq":
        return value == arg[1]
    if op == "in":
        return any(value == w for w in arg[1])  # not `in`: it matches NaN by identity
    if op == "range":
        lo, hi = arg[1], arg[2]
        return (lo is None or lo <= value) and (hi is None or value <= hi)
    return arg[1] in value
