"""The table importer of `m31 data import` (`m31.data.importer`): interactions, items and users
files (CSV, TSV, Parquet, JSON lines) read and checked column by column, every refusal naming
the file, the row and the column (`ImportFailed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from m31.data.dataset import DatasetError

USER_COLUMNS = ("user_id", "user", "userId", "uid")
ITEM_COLUMNS = ("item_id", "item", "itemId", "ad_id", "movieId", "product_id", "asin")
TIME_COLUMNS = ("ts", "timestamp", "time", "datetime")
TEXT_COLUMNS = ("text", "title", "description")
# Catalogue columns that fill the ads table's own (name -> arrow type); users' likewise.
AD_FIELDS = {
    "advertiser_id": pa.int64(),
    "campaign_id": pa.int64(),
    "objective": pa.string(),
    "format": pa.string(),
    "status": pa.string(),
    "target_countries": pa.list_(pa.string()),
    "target_age_min": pa.int16(),
    "target_age_max": pa.int16(),
    "target_genders": pa.list_(pa.string()),
    "target_platforms": pa.list_(pa.string()),
    "daily_budget": pa.float32(),
    "quality": pa.float32(),
    "created_at": pa.int64(),
}
# The ads table's topic ids, which index the built-in marketplace's topic vocabulary: an import
# has none, and a catalogue column of these names would read as them.
RESERVED = ("topic", "category")
USER_FIELDS = {
    "age": pa.int16(),
    "gender": pa.string(),
    "country": pa.string(),
    "platform": pa.string(),
    "cohort": pa.int32(),
    "created_at": pa.int64(),
}


class ImportFailed(DatasetError):
    """Input that cannot be imported; the message names the file, row and column."""


@dataclass(frozen=True)
class Interactions:
    """A file of engagements; a column left None is looked for under its usual names."""

    path: Path
    user: str | None = None
    item: str | None = None
    time: str | None = None  # None: the usual names (none of them: the file's order)
    time_unit: str = "s"  # of integer times: "s" or "ms"
    surface: str | None = None
    platform: str | None = None
    event: str | None = None
    weight: str | None = None
    conversion_events: tuple[str, ...] = ()  # event types that are conversions
    conversion_min: float | None = None  # a weight at least this is a conversion
    sort: bool = False  # sort each user's events by time instead of refusing disorder
    no_time: bool = False  # the file has no time column: its order is the events' order


@dataclass(frozen=True)
class Items:
    path: Path
    id: str | None = None
    text: str | None = None
    list_columns: tuple[str, ...] = ()  # CSV columns holding lists, split at `list_sep`
    list_sep: str = "|"
    map_attribute: str = "attributes"  # the attribute a JSON item -> ids map becomes


@dataclass(frozen=True)
class Users:
    path: Path
    id: str | None = None


# ---- reading files --------------------------------------------------------------------------


def fail(path: Path, message: str, row: int | None = None, column: str | None = None) -> NoReturn:
    where = str(path)
    if row is not None:
        where += f": row {row}"
    if column is not None:
        where += f", column {column!r}" if row is not None else f": column {column!r}"
    raise ImportFailed(f"{where}: {message}")


def text_bytes(path: Path) -> bytes:
    """The file's bytes, refused when missing, empty or not UTF-8 (naming the line)."""
    if not path.is_file():
        raise ImportFailed(f"{path}: no such file")
    data = path.read_bytes()
    if not data.strip():
        raise ImportFailed(f"{path}: empty file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(path, f"not UTF-8 (byte {e.start})", row=data[: e.start].count(b"\n") + 1)
    return data


def read_table(path: Path, list_columns: Sequence[str] = (), list_sep: str = "|") -> pa.Table:
    """A CSV, TSV, Parquet or JSON-lines file as a table; rows as the file holds them."""
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson

    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            if not path.is_file():
                raise ImportFailed(f"{path}: no such file")
            table = pq.read_table(path)
        elif suffix in (".csv", ".tsv", ".txt"):
            data = text_bytes(path)
            delimiter = "\t" if suffix == ".tsv" else ","
            table = pcsv.read_csv(
                pa.BufferReader(data),
                parse_options=pcsv.ParseOptions(delimiter=delimiter),
                # An empty cell is absent (null), whatever the column's type.
                convert_options=pcsv.ConvertOptions(strings_can_be_null=True),
            )
        elif suffix in (".jsonl", ".ndjson", ".json"):
            table = pjson.read_json(pa.BufferReader(text_bytes(path)))
        else:
            raise ImportFailed(
                f"{path}: unknown file type {suffix!r} (.csv, .tsv, .parquet, .jsonl)"
            )
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise ImportFailed(f"{path}: unreadable ({e})") from e
    if table.num_rows == 0:
        raise ImportFailed(f"{path}: no rows")
    for name in list_columns:
        col = _named(table, path, name, "list column")
        if not pa.types.is_string(col.type) and not pa.types.is_large_string(col.type):
            fail(path, f"a list column must be text, got {col.type}", column=name)
        split = pc.split_pattern(pc.fill_null(col, ""), list_sep)
        # An empty cell is the empty list, not a list of one empty value.
        split = pc.if_else(pc.equal(pc.fill_null(col, ""), ""), pa.scalar([], split.type), split)
        table = table.set_column(table.schema.get_field_index(name), name, split)
    return table


def _named(table: pa.Table, path: Path, name: str, what: str) -> pa.ChunkedArray:
    if name not in table.column_names:
        fail(path, f"no {what} column {name!r} (columns: {', '.join(table.column_names)})")
    return table.column(name)


def _find(
    table: pa.Table, path: Path, given: str | None, usual: Sequence[str], what: str
) -> str | None:
    if given is not None:
        _named(table, path, given, what)
        return given
    return next((c for c in usual if c in table.column_names), None)


# ---- ids ------------------------------------------------------------------------------------


def _id_text(col: pa.ChunkedArray | pa.Array, path: Path, column: str) -> pa.Array:
    """Ids as text, refusing nulls, negative numbers and non-integer numbers."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if col.null_count:
        fail(path, "null id", row=_row(path, first_true(col.is_null())), column=column)
    if pa.types.is_integer(col.type):
        negative = pc.less(col, 0)
        if pc.any(negative).as_py():
            fail(path, "negative id", row=_row(path, first_true(negative)), column=column)
        return pc.cast(col, pa.string())
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return pc.cast(col, pa.string())
    fail(path, f"ids must be integers or text, got {col.type}", column=column)


def first_true(mask: pa.Array | pa.ChunkedArray) -> int:
    return int(pc.index(mask, True).as_py())


def _row(path: Path, i: int) -> int:
    """The row of a file's i-th record as an editor counts lines (a CSV's header is row 1)."""
    return i + (2 if Path(path).suffix.lower() in (".csv", ".tsv", ".txt") else 1)


# ---- events ---------------------------------------------------------------------------------


@dataclass
class Events:
    user: pa.Array  # text ids
    item: pa.Array
    ts: np.ndarray | None  # Unix seconds, or None: the file's order
    order: np.ndarray  # each event's position within its user (file order)
    rows: np.ndarray  # file row of each event (for messages)
    path: Path
    surface: pa.Array | None = None
    platform: pa.Array | None = None
    conversion: np.ndarray | None = None


def _times(col: pa.ChunkedArray, path: Path, name: str, unit: str) -> np.ndarray:
    col = col.combine_chunks()
    if col.null_count:
        fail(path, "null time", row=_row(path, first_true(col.is_null())), column=name)
    if pa.types.is_integer(col.type):
        ts = col.to_numpy().astype(np.int64)
        if unit == "ms":
            ts = ts // 1000
        elif unit != "s":
            raise ImportFailed(f"time unit must be s or ms, got {unit!r}")
    elif pa.types.is_floating(col.type):
        values = col.to_numpy()
        bad = ~np.isfinite(values)
        if bad.any():
            fail(path, "not a finite time", row=_row(path, int(np.argmax(bad))), column=name)
        ts = np.floor(values / (1000 if unit == "ms" else 1)).astype(np.int64)
    elif pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
        ts = pc.cast(pc.cast(col, pa.timestamp("s")), pa.int64()).to_numpy()
    elif pa.types.is_string(col.type):
        try:
            ts = pc.cast(pc.cast(col, pa.timestamp("s")), pa.int64()).to_numpy()
        except pa.ArrowInvalid as e:
            raise ImportFailed(f"{path}: column {name!r}: not a time ({e})") from e
    else:
        fail(
            path, f"times must be numbers, timestamps or ISO 8601 text, got {col.type}", column=name
        )
    negative = ts < 0
    if negative.any():
        fail(path, "a time before 1970", row=_row(path, int(np.argmax(negative))), column=name)
    return ts


def _positions(codes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Each row's position within its user (`codes`), in `order` (which groups each user's
    rows together)."""
    start = np.r_[0, np.flatnonzero(np.diff(codes[order])) + 1]
    pos = np.empty(len(codes), np.int64)
    pos[order] = np.arange(len(codes)) - np.repeat(start, np.diff(np.r_[start, len(codes)]))
    return pos


def read_interactions(spec: Interactions) -> Events:
    path = Path(spec.path)
    table = read_table(path)
    user_col = _find(table, path, spec.user, USER_COLUMNS, "user")
    item_col = _find(table, path, spec.item, ITEM_COLUMNS, "item")
    for col, what, usual in ((user_col, "user", USER_COLUMNS), (item_col, "item", ITEM_COLUMNS)):
        if col is None:
            fail(path, f"no {what} id column (looked for {', '.join(usual)}; name it)")
    user = _id_text(table.column(user_col), path, user_col)
    item = _id_text(table.column(item_col), path, item_col)
    time_col = None if spec.no_time else _find(table, path, spec.time, TIME_COLUMNS, "time")
    ts = (
        None if time_col is None else _times(table.column(time_col), path, time_col, spec.time_unit)
    )
    codes = pc.dictionary_encode(user).indices.to_numpy()
    order = np.argsort(codes, kind="stable")  # each user's rows, in file order
    if ts is not None:
        back = (np.diff(codes[order]) == 0) & (np.diff(ts[order]) < 0)
        if back.any() and not spec.sort:
            row = int(order[np.argmax(back) + 1])
            fail(
                path,
                "time goes backwards within the user (events are read in file order; "
                "pass --sort to sort each user's events by time)",
                row=_row(path, row),
                column=time_col,
            )
        if spec.sort:
            order = np.lexsort((np.arange(len(ts)), ts, codes))
    pos = _positions(codes, order)
    events = Events(user, item, ts, pos, _row(path, 0) + np.arange(len(pos)), path)
    for attr, given in (("surface", spec.surface), ("platform", spec.platform)):
        name = _find(table, path, given, (attr,), attr)
        if name is not None:
            col = table.column(name).combine_chunks()
            if not pa.types.is_string(col.type):
                fail(path, f"{attr} must be text, got {col.type}", column=name)
            setattr(events, attr, col)
    conversion = np.zeros(len(pos), dtype=bool)
    if spec.conversion_events:
        name = _find(table, path, spec.event, ("event", "event_type", "type"), "event type")
        if name is None:
            fail(path, "conversion events given, but no event type column (name it)")
        kinds = table.column(name).combine_chunks()
        conversion |= pc.fill_null(
            pc.is_in(kinds, pa.array(spec.conversion_events)), False
        ).to_numpy(zero_copy_only=False)
    if spec.conversion_min is not None:
        name = _find(table, path, spec.weight, ("weight", "rating", "value"), "weight")
        if name is None:
            fail(path, "a conversion weight given, but no weight column (name it)")
        weight = table.column(name).combine_chunks()
        if not (pa.types.is_integer(weight.type) or pa.types.is_floating(weight.type)):
            fail(path, f"weights must be numbers, got {weight.type}", column=name)
        conversion |= pc.fill_null(pc.greater_equal(weight, spec.conversion_min), False).to_numpy(
            zero_copy_only=False
        )
    events.conversion = conversion
    return events


# ---- items and users ------------------------------------------------------------------------


def _attribute_kind(col: pa.ChunkedArray, path: Path, name: str) -> tuple[str, pa.Array]:
    col = col.combine_chunks()
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str", pc.cast(col, pa.string())
    if pa.types.is_boolean(t):
        return "str", pc.cast(col, pa.string())
    if pa.types.is_integer(t):
        return "int", pc.cast(col, pa.int64())
    if pa.types.is_floating(t):
        col = pc.cast(col, pa.float64())
        infinite = pc.fill_null(pc.is_inf(col), False)
        if pc.any(infinite).as_py():
            fail(path, "an infinite value", row=_row(path, first_true(infinite)), column=name)
        # NaN is how CSV and pandas spell a missing number: null, like an empty cell.
        return "float", pc.if_else(pc.is_nan(col), pa.scalar(None, pa.float64()), col)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = t.value_type
        if (
            pa.types.is_string(inner)
            or pa.types.is_integer(inner)
            or pa.types.is_large_string(inner)
        ):
            return "str_list", pc.cast(col, pa.list_(pa.string()))
    fail(path, f"an attribute must be text, a number or a list of them, got {t}", column=name)


@dataclass
class Catalogue:
    ids: pa.Array  # text
    columns: dict[str, pa.Array]  # ads-table fields, aligned with ids
    attributes: dict[str, tuple[str, pa.Array]]
    text: pa.Array | None
    closed: bool  # a catalogue table: every event's item must be in it


def read_items(spec: Items) -> Catalogue:
    """A catalogue table: ids, the ads-table fields it fills, item attributes, text."""
    path = Path(spec.path)
    table = read_table(path, spec.list_columns, spec.list_sep)
    usual = (*ITEM_COLUMNS, "id")  # in a catalogue, "id" can only be the item's
    id_col = _find(table, path, spec.id, usual, "item id")
    if id_col is None:
        fail(path, f"no item id column (looked for {', '.join(usual)}; name it)")
    ids = _id_text(table.column(id_col), path, id_col)
    _no_duplicates(ids, path, id_col)
    text_col = _find(table, path, spec.text, TEXT_COLUMNS, "text")
    text = None
    if text_col is not None:
        text = table.column(text_col).combine_chunks()
        if not pa.types.is_string(text.type):
            fail(path, f"the text column must be text, got {text.type}", column=text_col)
    columns, attributes = {}, {}
    for name in table.column_names:
        if name in (id_col, text_col):
            continue
        col = table.column(name)
        if name in RESERVED:
            fail(
                path,
                f"{name!r} names the ads table's topic ids, which an import leaves "
                f"empty; rename the column (e.g. to {name + 's'!r})",
                column=name,
            )
        if name in AD_FIELDS:
            try:
                columns[name] = pc.cast(col.combine_chunks(), AD_FIELDS[name])
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ImportFailed(f"{path}: column {name!r}: not {AD_FIELDS[name]} ({e})") from e
        else:
            attributes[name] = _attribute_kind(col, path, name)
    return Catalogue(ids, columns, attributes, text, closed=True)


def _no_duplicates(ids: pa.Array, path: Path, column: str) -> None:
    codes = pc.dictionary_encode(ids).indices.to_numpy()
    order = np.argsort(codes, kind="stable")
    dup = np.flatnonzero(np.diff(codes[order]) == 0)
    if len(dup):
        first, again = int(order[dup[0]]), int(order[dup[0] + 1])
        fail(
            path,
            f"duplicate id {ids[again].as_py()!r} (first at row {_row(path, first)})",
            row=_row(path, again),
            column=column,
        )


def read_users(spec: Users) -> tuple[pa.Array, dict[str, pa.Array], list[str]]:
    """(user ids as text, users-table fields, ignored column names)."""
    path = Path(spec.path)
    table = read_table(path)
    usual = (*USER_COLUMNS, "id")
    id_col = _find(table, path, spec.id, usual, "user id")
    if id_col is None:
        fail(path, f"no user id column (looked for {', '.join(usual)}; name it)")
    ids = _id_text(table.column(id_col), path, id_col)
    _no_duplicates(ids, path, id_col)
    columns, ignored = {}, []
    for name in table.column_names:
        if name == id_col:
            continue
        if name not in USER_FIELDS:
            ignored.append(name)
            continue
        try:
            columns[name] = pc.cast(table.column(name).combine_chunks(), USER_FIELDS[name])
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ImportFailed(f"{path}: column {name!r}: not {USER_FIELDS[name]} ({e})") from e
    if "age" in columns:
        age = columns["age"]
        bad = pc.fill_null(pc.or_(pc.less(age, 0), pc.greater(age, 150)), False)
        if pc.any(bad).as_py():
            fail(path, "an age outside 0..150", row=_row(path, first_true(bad)), column="age")
    return ids, columns, ignored
