"""The index's checks of what it is given (ids, vectors, attribute columns, a snapshot's 8-bit
rows), each a pure function of its arguments: `AdIndex.check_upsert` and the other `check_*`
methods run them, and what they return is what a mutation applies (and a `DurableIndex` logs):
a `CheckedUpsert` or a `CheckedUpdate`.

Shapes: n ads in one call, G gate-key dim, D value dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from m31.index.columns import columns_from_arrow, columns_from_rows
from m31.index.errors import AdIndexError
from m31.index.limits import COUNTRY_CODE, COUNTRY_FIELDS, MAX_LIST_VALUES, MAX_VALUE_CHARS
from m31.ops.quant import Int8Table


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


def ids_of(ad_ids: Any, what: str = "ad_ids") -> np.ndarray:
    """Any sequence of integer ids (or one id) -> int64 [n]."""
    if isinstance(ad_ids, pa.Array | pa.ChunkedArray):
        ad_ids = ad_ids.to_numpy()
    elif isinstance(ad_ids, torch.Tensor):
        ad_ids = ad_ids.cpu().numpy()
    arr = np.atleast_1d(np.asarray(ad_ids))
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise AdIndexError(
            f"{what}: expected a 1-d sequence of integers, got {arr.dtype} {arr.shape}"
        )
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        raise AdIndexError(f"{what}: ids must fit in int64")
    return arr.astype(np.int64)


def shape_of(a: Any) -> tuple[int, ...]:
    return tuple(a.shape) if hasattr(a, "shape") else np.shape(a)


def check_list(col: pa.ListArray, name: str, ids: np.ndarray) -> None:
    """Refuse a country that is not shaped like a code, or a free-form list beyond its limits."""
    values = pc.list_flatten(col)
    if name in COUNTRY_FIELDS:
        bad = pc.invert(pc.match_substring_regex(values, f"^{COUNTRY_CODE}$"))
        problem = "is not an ISO 3166-1 alpha-2 country code (two uppercase letters)"
    else:
        lengths = pc.list_value_length(col)
        over = pc.greater(lengths, MAX_LIST_VALUES)
        if pc.any(over).as_py():
            row = pc.index(over, True).as_py()
            raise AdIndexError(
                f"attributes: ad {int(ids[row])}: {name} holds {lengths[row].as_py()} values "
                f"(at most {MAX_LIST_VALUES})"
            )
        bad = pc.greater(pc.utf8_length(values), MAX_VALUE_CHARS)
        problem = f"is longer than {MAX_VALUE_CHARS} characters"
    if pc.any(bad).as_py():
        entry = pc.index(bad, True).as_py()
        row = pc.list_parent_indices(col)[entry].as_py()
        word = values[entry].as_py()
        shown = repr(word) if len(word) <= MAX_VALUE_CHARS else repr(word[:MAX_VALUE_CHARS]) + "…"
        raise AdIndexError(f"attributes: ad {int(ids[row])}: {name} value {shown} {problem}")


def no_duplicates(ids: np.ndarray, what: str) -> None:
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise AdIndexError(f"{what}: ad id {int(uniq[counts > 1][0])} appears more than once")


def matrix(
    a: Any, n: int, dim: int | None, what: str, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """`a` as a finite tensor [n, dim] (or [n]) of `dtype` on `device`; AdIndexError naming
    `what` otherwise."""
    try:
        t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
    except (ValueError, TypeError) as e:
        raise AdIndexError(f"{what}: not a numeric array ({e})") from e
    shape = (n,) if dim is None else (n, dim)
    if tuple(t.shape) != shape:
        raise AdIndexError(f"{what}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype == torch.bool or t.is_complex():
        raise AdIndexError(f"{what}: expected real numbers, got {t.dtype}")
    t = t.to(device=device, dtype=dtype)
    bad = ~torch.isfinite(t) if dim is None else ~torch.isfinite(t).all(1)
    if bad.any():
        raise AdIndexError(
            f"{what}: row {int(bad.nonzero()[0])} holds NaN or inf (or overflows {dtype})"
        )
    return t


def columns(
    attributes: Any, ids: np.ndarray, schema: Mapping[str, str], allowed: Mapping[str, Sequence]
) -> pa.Table:
    """Attributes of the ads `ids` [n] (dicts or an arrow table) -> validated arrow table of
    `schema`, each closed list within its `allowed` values. Checks each ad on its own;
    `AdIndex.check_vocabulary` checks them against the index."""
    n = len(ids)
    try:
        if isinstance(attributes, pa.Table):
            table = columns_from_arrow(attributes, schema)
        elif isinstance(attributes, Sequence) and not isinstance(attributes, str):
            table = columns_from_rows(attributes, schema)
        else:
            raise ValueError(
                f"expected a list of dicts or a pyarrow.Table, got {type(attributes).__name__}"
            )
    except ValueError as e:
        raise AdIndexError(f"attributes: {e}") from e
    if table.num_rows != n:
        raise AdIndexError(f"attributes: {table.num_rows} rows for {n} ads")
    table = table.set_column(
        table.schema.get_field_index("status"),
        "status",
        pc.fill_null(table.column("status"), "active"),
    )
    _check_value_fields(table, ids)
    for name, values_of in allowed.items():
        col = table.column(name)
        values = pc.list_flatten(col) if schema[name] == "str_list" else col
        bad = pc.invert(pc.is_in(values, value_set=pa.array(values_of, pa.string())))
        if pc.any(bad).as_py():
            word = values.filter(bad)[0].as_py()
            raise AdIndexError(f"attributes: {name} {word!r} is not one of {values_of}")
    for name, kind in schema.items():
        if kind == "str_list" and name not in allowed:
            check_list(table.column(name).combine_chunks(), name, ids)
    return table


# The value fields' ranges (`m31.index.columns.BASE_FIELDS`): lo < value <= hi.
VALUE_RANGES = {"bid": (0.0, math.inf), "pacing": (0.0, 1.0)}


def _check_value_fields(table: pa.Table, ids: np.ndarray) -> None:
    """Refuse a bid that is not a positive finite number, or a pacing outside (0, 1]."""
    for name, (lo, hi) in VALUE_RANGES.items():
        col = table.column(name)
        values = col.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls: NaN
        given = np.asarray(col.is_valid())
        bad = given & ~(np.isfinite(values) & (values > lo) & (values <= hi))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            want = "a positive finite number" if name == "bid" else "a number in (0, 1]"
            raise AdIndexError(
                f"attributes: ad {int(ids[i])}: {name} {float(values[i])} is not {want}"
            )


def int8_rows(arrays: Mapping[str, np.ndarray], device: torch.device) -> Int8Table:
    """A snapshot's 8-bit rows (codes and scales as stored, shapes checked by
    `m31.index.snapshot.read`) on `device`, if every scale is positive and finite, every b
    finite and no code -128; AdIndexError naming the array and row otherwise."""
    t = Int8Table(*(torch.from_numpy(arrays[k]).to(device) for k in Int8Table._fields))
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
    return t
