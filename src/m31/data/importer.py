"""`m31 data import`: files a team already has -> an m31 dataset folder (`m31.data.dataset`).

Sources, any combination with one source of events:

* **interactions** (`Interactions`): CSV, TSV, Parquet or JSON lines, a row per engagement, with
  a user id, an item id and a time (Unix seconds or milliseconds, a timestamp, or ISO 8601
  text), or no time at all (then the file's order is the order; see "Clock"); optional
  surface, platform, event type and weight columns;
* **sequences**: `user item item ...` per line, oldest first (the format of the sequential
  recommendation benchmarks, e.g. Amazon Beauty);
* **items** (`Items`): a catalogue (CSV, TSV, Parquet, JSON lines) with an id column and any
  attribute columns, or a JSON object item -> list of attribute ids (`*_item2attributes.json`);
* **users** (`Users`): a file with an id column and optional attribute columns.

Nothing a source lacks is invented: a missing column is null (absent) in the dataset, and
downstream a null is no input (an unknown value's zero embedding; a null text is no semantic
input). Users without a row, or a users file at all, have null attributes. What has a default
is documented here:

* every interaction is an engagement (`click` true); `conversion` is true for the event types
  `conversion_events` names, or for a weight of at least `conversion_min`, else false;
* an item is `active`, targets everyone (empty targeting lists) and has no advertiser unless
  its catalogue has an `advertiser_id` column;
* catalogue columns named like the ads table's (`advertiser_id`, `campaign_id`, `objective`,
  `format`, `status`, `quality`, `created_at`) fill them; every other column is an item
  attribute (`meta.json`'s `item_attributes`: str, str_list, int or float), kept for filters;
  the text column (`text`, `title` or `description`, or `Items.text`) is what the semantic
  expert embeds;
* vocabularies (`vocab`) are the values the files hold, sorted;
* `repeat_engagement` is whether a user engages with an item twice in the files, unless given.

**Clock.** With a time column, times are Unix seconds. Without one (sequence files, or
interactions with only an order), a user's i-th event is at i days (ts = 86,400 · i, from 0):
the model's time-since buckets then count events; `meta.json` says `"clock": "order"` and the
hour of day is null.

**Ids.** Integer ids (or text that is all decimal integers) are kept; otherwise every id of a
kind is replaced by its rank among the sorted distinct ids, and `user_ids.parquet` /
`item_ids.parquet` hold the originals (`id`, `external_id`).

**Errors.** Bad input raises `ImportFailed` naming the file, the row (from 1, as an editor counts
lines; a CSV's header is row 1) and the column, before anything is written: the folder appears
whole or not at all (`dataset.write_atomic`). Refused: a missing or empty file, bytes that are
not UTF-8, a missing column, a wrong type, a null or negative id, a duplicate item or user in
its catalogue, an event on an item the catalogue lacks, a time going backwards within a user
(unless `sort`), a negative time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from m31.data.dataset import VOCABULARIES, Dataset, DatasetError, write_atomic
from m31.data.schema import ADS, ADVERTISERS, EVENTS, ORGANIC, TABLES, USERS

DAY = 86_400
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
ATTRIBUTE_KINDS = {"str": pa.string(), "str_list": pa.list_(pa.string()),
                   "int": pa.int64(), "float": pa.float64()}  # fmt: skip


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


@dataclass
class ImportReport:
    out: Path
    users: int
    items: int
    events: int
    clock: str
    repeat_engagement: bool
    item_attributes: dict[str, str]
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"{self.out}: {self.users:,} users, {self.items:,} items, {self.events:,} events "
            f"(clock: {self.clock}, repeat_engagement: {str(self.repeat_engagement).lower()})",
        ]
        if self.item_attributes:
            attrs = ", ".join(f"{k} ({v})" for k, v in self.item_attributes.items())
            lines.append(f"item attributes: {attrs}")
        lines += self.notes
        lines.append("took " + ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)


# ---- reading files --------------------------------------------------------------------------


def _fail(path: Path, message: str, row: int | None = None, column: str | None = None) -> NoReturn:
    where = str(path)
    if row is not None:
        where += f": row {row}"
    if column is not None:
        where += f", column {column!r}" if row is not None else f": column {column!r}"
    raise ImportFailed(f"{where}: {message}")


def _text_bytes(path: Path) -> bytes:
    """The file's bytes, refused when missing, empty or not UTF-8 (naming the line)."""
    if not path.is_file():
        raise ImportFailed(f"{path}: no such file")
    data = path.read_bytes()
    if not data.strip():
        raise ImportFailed(f"{path}: empty file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(path, f"not UTF-8 (byte {e.start})", row=data[: e.start].count(b"\n") + 1)
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
            data = _text_bytes(path)
            delimiter = "\t" if suffix == ".tsv" else ","
            table = pcsv.read_csv(
                pa.BufferReader(data),
                parse_options=pcsv.ParseOptions(delimiter=delimiter),
                # An empty cell is absent (null), whatever the column's type.
                convert_options=pcsv.ConvertOptions(strings_can_be_null=True),
            )
        elif suffix in (".jsonl", ".ndjson", ".json"):
            table = pjson.read_json(pa.BufferReader(_text_bytes(path)))
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
            _fail(path, f"a list column must be text, got {col.type}", column=name)
        split = pc.split_pattern(pc.fill_null(col, ""), list_sep)
        # An empty cell is the empty list, not a list of one empty value.
        split = pc.if_else(pc.equal(pc.fill_null(col, ""), ""), pa.scalar([], split.type), split)
        table = table.set_column(table.schema.get_field_index(name), name, split)
    return table


def read_sequences(path: Path) -> tuple[pa.Array, pa.Array, np.ndarray, np.ndarray]:
    """(user ids, item ids as text, position within the user, line) of each event of a
    `user item item ...` file."""
    data = _text_bytes(Path(path))
    users, items, positions, lines = [], [], [], []
    for row, line in enumerate(data.decode().splitlines(), 1):
        tokens = line.split()
        if not tokens:
            continue
        if len(tokens) < 2:
            _fail(path, "a user without items (expected `user item item ...`)", row=row)
        users.extend([tokens[0]] * (len(tokens) - 1))
        items.extend(tokens[1:])
        positions.extend(range(len(tokens) - 1))
        lines.extend([row] * (len(tokens) - 1))
    if not items:
        raise ImportFailed(f"{path}: no sequences")
    return (
        pa.array(users, pa.string()),
        pa.array(items, pa.string()),
        np.asarray(positions, dtype=np.int64),
        np.asarray(lines, dtype=np.int64),
    )


def _named(table: pa.Table, path: Path, name: str, what: str) -> pa.ChunkedArray:
    if name not in table.column_names:
        _fail(path, f"no {what} column {name!r} (columns: {', '.join(table.column_names)})")
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
        _fail(path, "null id", row=_row(path, _first(col.is_null())), column=column)
    if pa.types.is_integer(col.type):
        negative = pc.less(col, 0)
        if pc.any(negative).as_py():
            _fail(path, "negative id", row=_row(path, _first(negative)), column=column)
        return pc.cast(col, pa.string())
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return pc.cast(col, pa.string())
    _fail(path, f"ids must be integers or text, got {col.type}", column=column)


def _first(mask: pa.Array | pa.ChunkedArray) -> int:
    return int(pc.index(mask, True).as_py())


def _row(path: Path, i: int) -> int:
    """The row of a file's i-th record as an editor counts lines (a CSV's header is row 1)."""
    return i + (2 if Path(path).suffix.lower() in (".csv", ".tsv", ".txt") else 1)


class IdSpace:
    """The ids of one kind (users or items) from every file, as int64 m31 ids."""

    def __init__(self) -> None:
        self.parts: list[pa.Array] = []

    def add(self, ids: pa.Array) -> None:
        self.parts.append(ids)

    def finish(self) -> None:
        distinct = (
            pc.unique(pa.concat_arrays(self.parts)) if self.parts else pa.array([], pa.string())
        )
        decimal = pc.all(pc.match_substring_regex(distinct, r"^[0-9]{1,18}$")).as_py()
        self.external = not (decimal or len(distinct) == 0)
        if self.external:
            self.dictionary = distinct.take(pc.sort_indices(distinct))
        else:
            self.dictionary = distinct

    def ids(self, text: pa.Array) -> np.ndarray:
        """int64 m31 ids of ids given as text."""
        if not self.external:
            return pc.cast(text, pa.int64()).to_numpy()
        return pc.index_in(text, value_set=self.dictionary).to_numpy().astype(np.int64)

    def all_ids(self) -> np.ndarray:
        return np.sort(self.ids(self.dictionary))

    def table(self) -> pa.Table:
        return pa.table({"id": self.ids(self.dictionary), "external_id": self.dictionary})


# ---- events ---------------------------------------------------------------------------------


@dataclass
class _Events:
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
        _fail(path, "null time", row=_row(path, _first(col.is_null())), column=name)
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
            _fail(path, "not a finite time", row=_row(path, int(np.argmax(bad))), column=name)
        ts = np.floor(values / (1000 if unit == "ms" else 1)).astype(np.int64)
    elif pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
        ts = pc.cast(pc.cast(col, pa.timestamp("s")), pa.int64()).to_numpy()
    elif pa.types.is_string(col.type):
        try:
            ts = pc.cast(pc.cast(col, pa.timestamp("s")), pa.int64()).to_numpy()
        except pa.ArrowInvalid as e:
            raise ImportFailed(f"{path}: column {name!r}: not a time ({e})") from e
    else:
        _fail(path, f"times must be numbers, timestamps or ISO 8601 text, got {col.type}",
              column=name)  # fmt: skip
    negative = ts < 0
    if negative.any():
        _fail(path, "a time before 1970", row=_row(path, int(np.argmax(negative))), column=name)
    return ts


def _positions(codes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Each row's position within its user (`codes`), in `order` (which groups each user's
    rows together)."""
    start = np.r_[0, np.flatnonzero(np.diff(codes[order])) + 1]
    pos = np.empty(len(codes), np.int64)
    pos[order] = np.arange(len(codes)) - np.repeat(start, np.diff(np.r_[start, len(codes)]))
    return pos


def read_interactions(spec: Interactions) -> _Events:
    path = Path(spec.path)
    table = read_table(path)
    user_col = _find(table, path, spec.user, USER_COLUMNS, "user")
    item_col = _find(table, path, spec.item, ITEM_COLUMNS, "item")
    for col, what, usual in ((user_col, "user", USER_COLUMNS), (item_col, "item", ITEM_COLUMNS)):
        if col is None:
            _fail(path, f"no {what} id column (looked for {', '.join(usual)}; name it)")
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
            _fail(path, "time goes backwards within the user (events are read in file order; "
                  "pass --sort to sort each user's events by time)", row=_row(path, row),
                  column=time_col)  # fmt: skip
        if spec.sort:
            order = np.lexsort((np.arange(len(ts)), ts, codes))
    pos = _positions(codes, order)
    events = _Events(user, item, ts, pos, _row(path, 0) + np.arange(len(pos)), path)
    for attr, given in (("surface", spec.surface), ("platform", spec.platform)):
        name = _find(table, path, given, (attr,), attr)
        if name is not None:
            col = table.column(name).combine_chunks()
            if not pa.types.is_string(col.type):
                _fail(path, f"{attr} must be text, got {col.type}", column=name)
            setattr(events, attr, col)
    conversion = np.zeros(len(pos), dtype=bool)
    if spec.conversion_events:
        name = _find(table, path, spec.event, ("event", "event_type", "type"), "event type")
        if name is None:
            _fail(path, "conversion events given, but no event type column (name it)")
        kinds = table.column(name).combine_chunks()
        conversion |= pc.fill_null(
            pc.is_in(kinds, pa.array(spec.conversion_events)), False
        ).to_numpy(zero_copy_only=False)
    if spec.conversion_min is not None:
        name = _find(table, path, spec.weight, ("weight", "rating", "value"), "weight")
        if name is None:
            _fail(path, "a conversion weight given, but no weight column (name it)")
        weight = table.column(name).combine_chunks()
        if not (pa.types.is_integer(weight.type) or pa.types.is_floating(weight.type)):
            _fail(path, f"weights must be numbers, got {weight.type}", column=name)
        conversion |= pc.fill_null(pc.greater_equal(weight, spec.conversion_min), False).to_numpy(
            zero_copy_only=False
        )
    events.conversion = conversion
    return events


def sequence_events(path: Path) -> _Events:
    user, item, pos, lines = read_sequences(path)
    _one_line_per_user(user, lines, Path(path))
    return _Events(user, item, None, pos, lines, Path(path))


def _one_line_per_user(user: pa.Array, lines: np.ndarray, path: Path) -> None:
    """A user on two lines would have two first events: refused, naming the second line."""
    codes = pc.dictionary_encode(user).indices.to_numpy()
    first_line = np.full(codes.max() + 1, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(first_line, codes, -lines)  # -(smallest line) per user
    again = lines != -first_line[codes]
    starts = np.r_[True, lines[1:] != lines[:-1]]
    clash = again & starts
    if clash.any():
        i = int(np.argmax(clash))
        _fail(path, f"user {user[i].as_py()!r} again (first on row {-first_line[codes[i]]})",
              row=int(lines[i]))  # fmt: skip


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
            _fail(path, "an infinite value", row=_row(path, _first(infinite)), column=name)
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
    _fail(path, f"an attribute must be text, a number or a list of them, got {t}", column=name)


@dataclass
class _Catalogue:
    ids: pa.Array  # text
    columns: dict[str, pa.Array]  # ads-table fields, aligned with ids
    attributes: dict[str, tuple[str, pa.Array]]
    text: pa.Array | None
    closed: bool  # a catalogue table: every event's item must be in it


def read_items(spec: Items) -> _Catalogue:
    path = Path(spec.path)
    if path.suffix.lower() == ".json":
        mapping = _json_object(path)
        if mapping is not None:
            return _item_map(path, mapping, spec.map_attribute)
    table = read_table(path, spec.list_columns, spec.list_sep)
    usual = (*ITEM_COLUMNS, "id")  # in a catalogue, "id" can only be the item's
    id_col = _find(table, path, spec.id, usual, "item id")
    if id_col is None:
        _fail(path, f"no item id column (looked for {', '.join(usual)}; name it)")
    ids = _id_text(table.column(id_col), path, id_col)
    _no_duplicates(ids, path, id_col)
    text_col = _find(table, path, spec.text, TEXT_COLUMNS, "text")
    text = None
    if text_col is not None:
        text = table.column(text_col).combine_chunks()
        if not pa.types.is_string(text.type):
            _fail(path, f"the text column must be text, got {text.type}", column=text_col)
    columns, attributes = {}, {}
    for name in table.column_names:
        if name in (id_col, text_col):
            continue
        col = table.column(name)
        if name in RESERVED:
            _fail(path, f"{name!r} names the ads table's topic ids, which an import leaves "
                  f"empty; rename the column (e.g. to {name + 's'!r})", column=name)  # fmt: skip
        if name in AD_FIELDS:
            try:
                columns[name] = pc.cast(col.combine_chunks(), AD_FIELDS[name])
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ImportFailed(f"{path}: column {name!r}: not {AD_FIELDS[name]} ({e})") from e
        else:
            attributes[name] = _attribute_kind(col, path, name)
    return _Catalogue(ids, columns, attributes, text, closed=True)


def _json_object(path: Path) -> dict | None:
    """The file as one JSON object, or None if it is JSON lines (one object per line)."""
    try:
        value = json.loads(_text_bytes(path))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            return None
        raise ImportFailed(f"{path}: row {e.lineno}: not JSON ({e.msg})") from e
    return value if isinstance(value, dict) else None


def _item_map(path: Path, mapping: dict, attribute: str) -> _Catalogue:
    """A JSON object item -> list of attribute ids: one str_list attribute; not a catalogue of
    all items (an item it lacks has no attributes)."""
    ids, values = [], []
    for item, attrs in mapping.items():
        if not isinstance(attrs, list) or not all(
            isinstance(a, str | int) and not isinstance(a, bool) for a in attrs
        ):
            raise ImportFailed(f"{path}: item {item!r}: expected a list of attribute ids")
        ids.append(str(item))
        values.append([str(a) for a in attrs])
    return _Catalogue(
        pa.array(ids, pa.string()),
        {},
        {attribute: ("str_list", pa.array(values, pa.list_(pa.string())))},
        None,
        closed=False,
    )


def _no_duplicates(ids: pa.Array, path: Path, column: str) -> None:
    codes = pc.dictionary_encode(ids).indices.to_numpy()
    order = np.argsort(codes, kind="stable")
    dup = np.flatnonzero(np.diff(codes[order]) == 0)
    if len(dup):
        first, again = int(order[dup[0]]), int(order[dup[0] + 1])
        _fail(path, f"duplicate id {ids[again].as_py()!r} (first at row {_row(path, first)})",
              row=_row(path, again), column=column)  # fmt: skip


def read_users(spec: Users) -> tuple[pa.Array, dict[str, pa.Array], list[str]]:
    """(user ids as text, users-table fields, ignored column names)."""
    path = Path(spec.path)
    table = read_table(path)
    usual = (*USER_COLUMNS, "id")
    id_col = _find(table, path, spec.id, usual, "user id")
    if id_col is None:
        _fail(path, f"no user id column (looked for {', '.join(usual)}; name it)")
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
            _fail(path, "an age outside 0..150", row=_row(path, _first(bad)), column="age")
    return ids, columns, ignored


# ---- the dataset ----------------------------------------------------------------------------


def _aligned(ids: np.ndarray, source_ids: np.ndarray, values: pa.Array, type_) -> pa.Array:
    """`values` (one per `source_ids`) at `ids`, null where a source lacks an id."""
    if values is None or not len(source_ids):
        return pa.nulls(len(ids), type_)
    order = np.argsort(source_ids, kind="stable")
    pos = np.searchsorted(source_ids[order], ids)
    pos = np.minimum(pos, len(order) - 1)
    hit = source_ids[order][pos] == ids
    taken = values.take(pa.array(order[pos]))
    return pc.if_else(pa.array(hit), taken, pa.nulls(len(ids), taken.type)).cast(type_)


def import_dataset(
    out: Path,
    interactions: Interactions | None = None,
    sequences: Path | None = None,
    items: Items | None = None,
    users: Users | None = None,
    repeat_engagement: bool | None = None,
    overwrite: bool = False,
) -> ImportReport:
    """Read the sources, check them, write the dataset folder `out` atomically."""
    if (interactions is None) == (sequences is None):
        raise ImportFailed("give one source of events: interactions or sequences")
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    ev = read_interactions(interactions) if interactions else sequence_events(Path(sequences))
    catalogue = read_items(items) if items else None
    user_file = read_users(users) if users else None
    seconds["read"] = time.perf_counter() - start

    start = time.perf_counter()
    user_space, item_space = IdSpace(), IdSpace()
    user_space.add(ev.user)
    item_space.add(ev.item)
    if catalogue is not None:
        if catalogue.closed:
            missing = pc.invert(pc.is_in(ev.item, value_set=catalogue.ids))
            if pc.any(missing).as_py():
                i = _first(missing)
                _fail(ev.path, f"item {ev.item[i].as_py()!r} is not in the catalogue "
                      f"{items.path}", row=int(ev.rows[i]))  # fmt: skip
        item_space.add(catalogue.ids)
    if user_file is not None:
        user_space.add(user_file[0])
    user_space.finish()
    item_space.finish()
    uid, iid = user_space.ids(ev.user), item_space.ids(ev.item)
    user_ids, item_ids = user_space.all_ids(), item_space.all_ids()

    # Events in each user's order.
    clock = "unix" if ev.ts is not None else "order"
    ts = ev.ts if ev.ts is not None else ev.order * DAY
    order = np.lexsort((ev.order, uid))
    n = len(order)
    hour = (
        pa.nulls(n, pa.int8())
        if ev.ts is None
        else pa.array(((ts[order] // 3600) % 24).astype(np.int8))
    )
    events = pa.table(
        {
            "user_id": pa.array(uid[order]),
            "ad_id": pa.array(iid[order]),
            "ts": pa.array(ts[order]),
            "surface": pa.nulls(n, pa.string())
            if ev.surface is None
            else ev.surface.take(pa.array(order)),
            "hour": hour,
            "platform": pa.nulls(n, pa.string())
            if ev.platform is None
            else ev.platform.take(pa.array(order)),
            "click": pa.array(np.ones(n, bool)),
            "conversion": pa.array(
                np.zeros(n, bool) if ev.conversion is None else ev.conversion[order]
            ),
        },
        schema=EVENTS,
    )

    # Items: every id the events or the catalogue name.
    cat_ids = item_space.ids(catalogue.ids) if catalogue is not None else np.zeros(0, np.int64)
    m = len(item_ids)
    ads_columns: dict[str, Any] = {"ad_id": pa.array(item_ids)}
    for f in ADS:
        if f.name == "ad_id":
            continue
        if f.name == "text":
            text = catalogue.text if catalogue is not None else None
            ads_columns["text"] = _aligned(item_ids, cat_ids, text, pa.string())
        elif f.name in ("target_countries", "target_genders", "target_platforms"):
            given = catalogue.columns.get(f.name) if catalogue is not None else None
            column = _aligned(item_ids, cat_ids, given, f.type)  # no list: no restriction
            ads_columns[f.name] = pc.if_else(pc.is_null(column), pa.scalar([], f.type), column)
        elif f.name == "status":
            given = catalogue.columns.get("status") if catalogue is not None else None
            status = _aligned(item_ids, cat_ids, given, pa.string())
            ads_columns["status"] = pc.fill_null(status, "active")
        else:
            given = catalogue.columns.get(f.name) if catalogue is not None else None
            ads_columns[f.name] = _aligned(item_ids, cat_ids, given, f.type)
    item_attributes = {}
    if catalogue is not None:
        for name, (kind, values) in catalogue.attributes.items():
            column = _aligned(item_ids, cat_ids, values, ATTRIBUTE_KINDS[kind])
            if kind == "str_list":
                column = pc.if_else(pc.is_null(column), pa.scalar([], column.type), column)
            ads_columns[name] = column
            item_attributes[name] = kind
    extra = [pa.field(name, ATTRIBUTE_KINDS[kind]) for name, kind in item_attributes.items()]
    ads = pa.table(ads_columns, schema=pa.schema([*ADS, *extra]))

    users_columns: dict[str, Any] = {"user_id": pa.array(user_ids)}
    notes = []
    file_ids = user_space.ids(user_file[0]) if user_file is not None else np.zeros(0, np.int64)
    for f in USERS:
        if f.name == "user_id":
            continue
        given = user_file[1].get(f.name) if user_file is not None else None
        users_columns[f.name] = _aligned(user_ids, file_ids, given, f.type)
    if user_file is not None and user_file[2]:
        notes.append(f"users: columns ignored (m31 reads none of them): {', '.join(user_file[2])}")
    users_t = pa.table(users_columns, schema=USERS)

    if repeat_engagement is None:
        pairs = uid.astype(np.int64) * (int(item_ids.max()) + 1 if m else 1) + iid
        repeat_engagement = bool(len(np.unique(pairs)) < len(pairs))
        shown = "some user engages" if repeat_engagement else "no user engages"
        notes.append(
            f"repeat_engagement: {str(repeat_engagement).lower()} ({shown} with an item twice in "
            "the files; say so with --repeat-engagement / --no-repeat-engagement)"
        )
    vocab = {name: [] for name in VOCABULARIES}
    for name, cols in (
        ("surface", [events["surface"]]),
        ("platform", [events["platform"], users_t["platform"]]),
        ("format", [ads["format"]]),
        ("objective", [ads["objective"]]),
        ("gender", [users_t["gender"]]),
    ):
        values = set()
        for col in cols:
            values |= {v for v in pc.unique(col).to_pylist() if v is not None}
        vocab[name] = sorted(values)
    sources = {
        "interactions": interactions and str(interactions.path),
        "sequences": sequences and str(sequences),
        "items": items and str(items.path),
        "users": users and str(users.path),
    }
    meta = {
        "source": "import",
        "imported_from": {k: v for k, v in sources.items() if v},
        "repeat_engagement": repeat_engagement,
        "vocab": vocab,
        "clock": clock,
        "topics": [],
        "item_attributes": item_attributes,
        "time_range": [int(ts.min()), int(ts.max())],
        "ids": {
            "users": "external (user_ids.parquet)" if user_space.external else "as given",
            "items": "external (item_ids.parquet)" if item_space.external else "as given",
        },
    }
    ds = Dataset(
        users=users_t,
        advertisers=ADVERTISERS.empty_table(),
        ads=ads,
        events=events,
        organic=ORGANIC.empty_table(),
        meta=meta,
    )
    seconds["convert"] = time.perf_counter() - start

    start = time.perf_counter()

    def fill(tmp: Path) -> None:
        for name in TABLES:
            pq.write_table(ds.table(name), tmp / f"{name}.parquet", compression="zstd")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for kind, space in (("user", user_space), ("item", item_space)):
            if space.external:
                pq.write_table(space.table(), tmp / f"{kind}_ids.parquet")

    write_atomic(Path(out), fill, overwrite=overwrite)
    seconds["write"] = time.perf_counter() - start
    return ImportReport(
        Path(out), len(user_ids), m, n, clock, repeat_engagement, item_attributes, seconds, notes
    )
