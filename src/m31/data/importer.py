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
whole or not at all (`m31.files.write_folder_atomic`). Refused: a missing or empty file, bytes that are
not UTF-8, a missing column, a wrong type, a null or negative id, a duplicate item or user in
its catalogue, an event on an item the catalogue lacks, a time going backwards within a user
(unless `sort`), a negative time.

The files are read by `m31.data.import_tables` (tables of interactions, items and users) and
`m31.data.import_sequences` (sequence files); this module turns what they read into the five
tables, `meta.json` and the id maps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from m31.data.dataset import VOCABULARIES, Dataset
from m31.data.import_sequences import read_item_map, sequence_events
from m31.data.import_tables import (
    ImportFailed,
    Interactions,
    Items,
    Users,
    fail,
    first_true,
    read_interactions,
    read_items,
    read_users,
)
from m31.data.schema import ADS, ADVERTISERS, EVENTS, ITEM_ATTRIBUTE_TYPES, ORGANIC, TABLES, USERS
from m31.files import write_folder_atomic

DAY = 86_400


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
    catalogue = (read_item_map(items) or read_items(items)) if items else None
    user_file = read_users(users) if users else None
    seconds["read"] = time.perf_counter() - start

    start = time.perf_counter()
    user_space, item_space = _id_spaces(ev, catalogue, user_file, items)
    uid, iid = user_space.ids(ev.user), item_space.ids(ev.item)
    user_ids, item_ids = user_space.all_ids(), item_space.all_ids()
    events, clock, ts = _events(ev, uid, iid)
    cat_ids = item_space.ids(catalogue.ids) if catalogue is not None else np.zeros(0, np.int64)
    ads, item_attributes = _ads(item_ids, cat_ids, catalogue)
    notes = []
    file_ids = user_space.ids(user_file[0]) if user_file is not None else np.zeros(0, np.int64)
    users_t = _users(user_ids, file_ids, user_file)
    if user_file is not None and user_file[2]:
        notes.append(f"users: columns ignored (m31 reads none of them): {', '.join(user_file[2])}")
    if repeat_engagement is None:
        repeat_engagement = _repeats(uid, iid, item_ids)
        shown = "some user engages" if repeat_engagement else "no user engages"
        notes.append(
            f"repeat_engagement: {str(repeat_engagement).lower()} ({shown} with an item twice in "
            "the files; say so with --repeat-engagement / --no-repeat-engagement)"
        )
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
        "vocab": _vocabularies(events, users_t, ads),
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
    _write(Path(out), ds, (("user", user_space), ("item", item_space)), overwrite)
    seconds["write"] = time.perf_counter() - start
    n_users, n_items, n_events = len(user_ids), len(item_ids), len(events)
    return ImportReport(
        Path(out),
        n_users,
        n_items,
        n_events,
        clock,
        repeat_engagement,
        item_attributes,
        seconds,
        notes,
    )


def _write(out: Path, ds: Dataset, spaces, overwrite: bool) -> None:
    """The dataset folder `out`, atomically: its tables, meta.json and, for an id space that
    maps external ids, that map."""

    def fill(tmp: Path) -> None:
        for name in TABLES:
            pq.write_table(ds.table(name), tmp / f"{name}.parquet", compression="zstd")
        (tmp / "meta.json").write_text(json.dumps(ds.meta, indent=2, sort_keys=True) + "\n")
        for kind, space in spaces:
            if space.external:
                pq.write_table(space.table(), tmp / f"{kind}_ids.parquet")

    write_folder_atomic(out, fill, overwrite=overwrite)


def _id_spaces(ev, catalogue, user_file, items) -> tuple[IdSpace, IdSpace]:
    """The users' and the items' id spaces: every id the events, the catalogue and the users
    file name. An item of the events outside a closed catalogue is refused."""
    user_space, item_space = IdSpace(), IdSpace()
    user_space.add(ev.user)
    item_space.add(ev.item)
    if catalogue is not None:
        if catalogue.closed:
            missing = pc.invert(pc.is_in(ev.item, value_set=catalogue.ids))
            if pc.any(missing).as_py():
                i = first_true(missing)
                fail(
                    ev.path,
                    f"item {ev.item[i].as_py()!r} is not in the catalogue {items.path}",
                    row=int(ev.rows[i]),
                )
        item_space.add(catalogue.ids)
    if user_file is not None:
        user_space.add(user_file[0])
    user_space.finish()
    item_space.finish()
    return user_space, item_space


def _events(ev, uid: np.ndarray, iid: np.ndarray) -> tuple[pa.Table, str, np.ndarray]:
    """(the events table in each user's order, the clock, the times [n] in the files' order):
    a source without times gets its order as the clock, a day per step."""
    clock = "unix" if ev.ts is not None else "order"
    ts = ev.ts if ev.ts is not None else ev.order * DAY
    order = np.lexsort((ev.order, uid))
    n = len(order)
    take = pa.array(order)
    hour = (
        pa.nulls(n, pa.int8())
        if ev.ts is None
        else pa.array(((ts[order] // 3600) % 24).astype(np.int8))
    )
    surface = pa.nulls(n, pa.string()) if ev.surface is None else ev.surface.take(take)
    platform = pa.nulls(n, pa.string()) if ev.platform is None else ev.platform.take(take)
    conversion = np.zeros(n, bool) if ev.conversion is None else ev.conversion[order]
    columns = {
        "user_id": pa.array(uid[order]),
        "ad_id": pa.array(iid[order]),
        "ts": pa.array(ts[order]),
        "surface": surface,
        "hour": hour,
        "platform": platform,
        "click": pa.array(np.ones(n, bool)),
        "conversion": pa.array(conversion),
    }
    return pa.table(columns, schema=EVENTS), clock, ts


def _ads(item_ids: np.ndarray, cat_ids: np.ndarray, catalogue) -> tuple[pa.Table, dict]:
    """(the ads table: every id the events or the catalogue name, the catalogue's columns
    aligned to them; the item attributes by kind)."""
    ads_columns: dict[str, Any] = {"ad_id": pa.array(item_ids)}
    for f in ADS:
        if f.name == "ad_id":
            continue
        if f.name == "text":
            given = catalogue.text if catalogue is not None else None
        else:
            given = catalogue.columns.get(f.name) if catalogue is not None else None
        column = _aligned(item_ids, cat_ids, given, pa.string() if f.name == "text" else f.type)
        if f.name in ("target_countries", "target_genders", "target_platforms"):
            column = pc.if_else(pc.is_null(column), pa.scalar([], f.type), column)  # none: all
        elif f.name == "status":
            column = pc.fill_null(column, "active")
        ads_columns[f.name] = column
    item_attributes = {}
    if catalogue is not None:
        for name, (kind, values) in catalogue.attributes.items():
            column = _aligned(item_ids, cat_ids, values, ITEM_ATTRIBUTE_TYPES[kind])
            if kind == "str_list":
                column = pc.if_else(pc.is_null(column), pa.scalar([], column.type), column)
            ads_columns[name] = column
            item_attributes[name] = kind
    extra = [pa.field(name, ITEM_ATTRIBUTE_TYPES[kind]) for name, kind in item_attributes.items()]
    return pa.table(ads_columns, schema=pa.schema([*ADS, *extra])), item_attributes


def _users(user_ids: np.ndarray, file_ids: np.ndarray, user_file) -> pa.Table:
    """The users table: every user id, the users file's columns aligned to them."""
    users_columns: dict[str, Any] = {"user_id": pa.array(user_ids)}
    for f in USERS:
        if f.name == "user_id":
            continue
        given = user_file[1].get(f.name) if user_file is not None else None
        users_columns[f.name] = _aligned(user_ids, file_ids, given, f.type)
    return pa.table(users_columns, schema=USERS)


def _repeats(uid: np.ndarray, iid: np.ndarray, item_ids: np.ndarray) -> bool:
    """Whether some user engages with an item twice in the events."""
    pairs = uid.astype(np.int64) * (int(item_ids.max()) + 1 if len(item_ids) else 1) + iid
    return bool(len(np.unique(pairs)) < len(pairs))


def _vocabularies(events: pa.Table, users: pa.Table, ads: pa.Table) -> dict[str, list[str]]:
    """Each categorical field's values, as the tables hold them, sorted."""
    vocab = {name: [] for name in VOCABULARIES}
    for name, cols in (
        ("surface", [events["surface"]]),
        ("platform", [events["platform"], users["platform"]]),
        ("format", [ads["format"]]),
        ("objective", [ads["objective"]]),
        ("gender", [users["gender"]]),
    ):
        values = set()
        for col in cols:
            values |= {v for v in pc.unique(col).to_pylist() if v is not None}
        vocab[name] = sorted(values)
    return vocab
