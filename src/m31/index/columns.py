"""The attribute schema of an index and the arrow columns attributes arrive in.

A schema maps field names to kinds (`KINDS`): int (int64), float (float64), str, and str_list
(a set of strings); every index has the built-in fields (`BASE_FIELDS`). Attributes arrive as
rows of plain values (`columns_from_rows`) or as an arrow table (`columns_from_arrow`); both
check every value and give one arrow table of `arrow_schema(schema)`, which
`m31.index.attributes.AttributeTable.write` encodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Attributes every index has. Schedule and age bounds are nullable (null = open) and may be
# empty (min > max targets nobody, as the synthetic world draws some); a targeting list that is
# empty means "no restriction". A null advertiser_id is an ad without an advertiser: no
# advertiser filter or exclusion ever matches it.
BASE_FIELDS: dict[str, str] = {
    "advertiser_id": "int",
    "status": "str",
    "schedule_start": "int",  # Unix seconds, eligible from this second on
    "schedule_end": "int",  # Unix seconds, eligible strictly before it
    "target_countries": "str_list",
    "target_age_min": "int",
    "target_age_max": "int",
    "target_genders": "str_list",
    "target_platforms": "str_list",
    "target_surfaces": "str_list",
    "tags": "str_list",
    # The auction's live value (DESIGN §2, "The value term"): the ad's bid, in the value units of
    # its objective (> 0; null: no bid, which value-aware requests never return), and its pacing
    # multiplier (0 < pacing <= 1; null: 1). Changing them re-encodes nothing.
    "bid": "float",
    "pacing": "float",
}
# Base fields that snapshots written before they existed lack: read as null.
LATER_FIELDS = ("bid", "pacing")

KINDS: tuple[str, ...] = ("int", "float", "str", "str_list")
ARROW_TYPES: dict[str, pa.DataType] = {
    "int": pa.int64(),
    "float": pa.float64(),
    "str": pa.string(),
    "str_list": pa.list_(pa.string()),
}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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
