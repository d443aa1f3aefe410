"""A dataset on disk: the five tables of `m31.data.schema` as parquet, plus `meta.json`.

Layout of a dataset folder::

    meta.json          source, repeat_engagement, vocab, seed, topic names, time range,
                       item_attributes, and anything the source adds
    users.parquet      advertisers.parquet  ads.parquet  events.parquet  organic.parquet
    truth.npz          (synthetic worlds only) the ground-truth response model's parameters

A table holds the columns of its schema (`m31.data.schema`), each of exactly its arrow type. A
required column (`schema.required`) holds no null; an optional one may (null means absent, see
`m31.data.schema`), and a table without an optional column reads as if it held one of nulls.
ads.parquet may carry extra attribute columns, which meta.json names under `item_attributes`
(`item_attributes`: name -> "str", "str_list", "int" or "float"); they come after the schema's
columns, and other extra columns are not read. `Dataset` and `load` refuse anything else
(`DatasetError` naming the file or table and the column): nothing is cast or filled in.

Writes are atomic: everything goes to a temporary sibling folder that is renamed into place
only when complete, so a folder that exists is always a whole dataset.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from m31.data.schema import ADS, ITEM_ATTRIBUTE_TYPES, TABLES
from m31.files import write_folder_atomic
from m31.vocabularies import BUILT_IN_VOCAB, STATUSES

# The categorical vocabularies a dataset declares in meta.json's `vocab` (`vocabularies`).
VOCABULARIES = tuple(BUILT_IN_VOCAB)


# Names the index gives attributes of its own (`m31.index.columns.BASE_FIELDS`) that are not
# columns of the ads table: an item attribute may not take them, but it may feed the index's
# `tags` and `target_surfaces`, which are sets of strings.
INDEX_FIELDS = {"schedule_start": None, "schedule_end": None, "tags": "str_list",
                "target_surfaces": "str_list", "bid": None, "pacing": None}  # fmt: skip


class DatasetError(ValueError):
    """A dataset folder or file that cannot be used; the message names the file or field."""


def item_attributes(meta: Mapping) -> dict[str, str]:
    """The extra attribute columns of the ads table that meta.json declares (`item_attributes`:
    column name -> kind, one of `schema.ITEM_ATTRIBUTE_TYPES`); none when it declares none.
    Raises `DatasetError` for a malformed declaration, or a name that is a column of the ads
    table or an attribute the index gives itself."""
    declared = meta.get("item_attributes", {})
    if not isinstance(declared, Mapping):
        raise DatasetError(
            f"meta.json: item_attributes must be an object of column name -> kind, got {declared!r}"
        )
    kinds = ", ".join(ITEM_ATTRIBUTE_TYPES)
    for name, kind in declared.items():
        if not isinstance(name, str) or not name:
            raise DatasetError(f"meta.json: item_attributes: {name!r} is not a column name")
        if kind not in ITEM_ATTRIBUTE_TYPES:
            raise DatasetError(
                f"meta.json: item_attributes.{name}: kind {kind!r} is not one of {kinds}"
            )
        if name in ADS.names:
            raise DatasetError(
                f"meta.json: item_attributes.{name}: a column of the ads schema, not an extra one"
            )
        if name in INDEX_FIELDS and INDEX_FIELDS[name] != kind:
            allowed = f"only as {INDEX_FIELDS[name]}" if INDEX_FIELDS[name] else "not"
            raise DatasetError(
                f"meta.json: item_attributes.{name}: the index's own attribute, which an item "
                f"attribute may feed {allowed}"
            )
    return dict(declared)


def conform(name: str, table: pa.Table, attributes: Mapping[str, str] | None = None) -> pa.Table:
    """`table` as table `name` of the schema: the schema's columns in its order (an optional
    one the table lacks as nulls), then, for the ads, the extra columns `attributes` declares
    (`item_attributes`); other columns are dropped. Raises `DatasetError` naming the column for
    a required column missing or holding a null, a column of another type (nothing is cast),
    a list holding a null, or a declared extra column missing or of another kind."""
    schema = TABLES[name]
    wanted = [(f, True) for f in schema]
    wanted += [
        (pa.field(a, ITEM_ATTRIBUTE_TYPES[kind]), False) for a, kind in (attributes or {}).items()
    ]
    fields, columns = [], []
    for f, in_schema in wanted:
        what = f"column {f.name!r}" if in_schema else f"item attribute {f.name!r}"
        found = table.schema.get_all_field_indices(f.name)
        if len(found) > 1:
            raise DatasetError(f"{what}: {len(found)} columns so named")
        if not found:
            if in_schema and f.nullable:
                fields.append(f)
                columns.append(pa.chunked_array([pa.nulls(table.num_rows, f.type)]))
                continue
            expected = "required" if in_schema else "declared in meta.json's item_attributes"
            raise DatasetError(f"{what}: missing ({expected}, {f.type})")
        col = table.column(found[0])
        if not col.type.equals(f.type):
            raise DatasetError(f"{what}: {col.type}, expected {f.type}")
        if not f.nullable and col.null_count:
            row = pc.index(col.is_null(), True).as_py()
            raise DatasetError(f"{what}: null in row {row} (a required column)")
        if pa.types.is_list(f.type) and pc.list_flatten(col).null_count:
            raise DatasetError(f"{what}: a list holds a null")
        fields.append(f)
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


@dataclass
class Dataset:
    users: pa.Table
    advertisers: pa.Table
    ads: pa.Table
    events: pa.Table
    organic: pa.Table
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Conform each table to its schema (`conform`): the ads with the item attributes meta
        declares."""
        attributes = item_attributes(self.meta)
        for name in TABLES:
            try:
                table = conform(name, getattr(self, name), attributes if name == "ads" else None)
            except DatasetError as e:
                raise DatasetError(f"table {name!r}: {e}") from None
            setattr(self, name, table)

    def table(self, name: str) -> pa.Table:
        return getattr(self, name)

    def counts(self) -> dict[str, int]:
        return {name: self.table(name).num_rows for name in TABLES}


def repeat_engagement(meta: Mapping) -> bool:
    """Whether a user may engage with the same item again, from a dataset's or feature folder's
    meta (`repeat_engagement`, set by the source at import).

    It alone decides whether evaluation drops what a user engaged with before from the ranked
    list (`exclude_seen = not repeat_engagement(meta)`), in training's validation and in
    `m31 eval` alike: where nothing repeats, a seen item cannot be the next one and would only
    crowd the list.

    A folder written before the key existed has none. For it the rule of that time holds: only
    MovieLens (one rating per user and movie) does not repeat.
    """
    if "repeat_engagement" not in meta:
        return meta.get("source") != "movielens"
    value = meta["repeat_engagement"]
    if not isinstance(value, bool):
        raise DatasetError(f"meta repeat_engagement: expected true or false, got {value!r}")
    return value


def vocabularies(meta: Mapping, countries: Iterable[str] = ()) -> dict[str, tuple]:
    """The allowed values of a dataset's categorical columns, by vocabulary name.

    Each of `VOCABULARIES` is what meta.json declares under `vocab` (a dataset's values are its
    own data: a `watch` surface or a `story_ad` format needs no code; a name it leaves out has
    no values), or, in a folder written before vocabularies were declared (no `vocab`), the
    built-in marketplace's (`m31.vocabularies.BUILT_IN_VOCAB`). `status` is the index's
    (`m31.vocabularies.STATUSES`); `country` is the countries its users live in
    (`countries`, sorted); `topic` and `category` are the ids and categories that meta's
    `topics` lists, and absent when it lists none. Every lookup of a dataset's vocabularies goes
    through here. Raises `DatasetError` for a declared vocabulary that is not a list of distinct
    non-empty strings.
    """
    declared = meta.get("vocab", BUILT_IN_VOCAB)
    if not isinstance(declared, Mapping):
        raise DatasetError(f"meta.json: vocab must be an object of lists, got {declared!r}")
    vocab: dict[str, tuple] = {}
    for name in VOCABULARIES:
        values = declared.get(name, ())
        if (
            not isinstance(values, list | tuple)
            or not all(isinstance(v, str) and v for v in values)
            or len(set(values)) != len(values)
        ):
            raise DatasetError(
                f"meta.json: vocab.{name} must be a list of distinct non-empty strings, "
                f"got {values!r}"
            )
        vocab[name] = tuple(values)
    vocab["status"] = STATUSES
    vocab["country"] = tuple(sorted(set(countries)))
    topics = meta.get("topics") or []
    if topics:
        vocab["topic"] = tuple(sorted({int(t["id"]) for t in topics}))
        vocab["category"] = tuple(sorted({int(t["category"]) for t in topics}))
    return vocab


def save(ds: Dataset, out: Path, overwrite: bool = False, extra: dict | None = None) -> Path:
    """Write `ds` (and optional extra numpy arrays, saved as `truth.npz`) atomically to `out`."""
    import numpy as np

    def fill(tmp: Path) -> None:
        for name in TABLES:
            pq.write_table(ds.table(name), tmp / f"{name}.parquet", compression="zstd")
        (tmp / "meta.json").write_text(json.dumps(ds.meta, indent=2, sort_keys=True) + "\n")
        if extra:
            np.savez(tmp / "truth.npz", **extra)

    return write_folder_atomic(Path(out), fill, overwrite=overwrite)


def load(folder: Path) -> Dataset:
    """The dataset in `folder`; each table checked as `conform` does (`DatasetError` naming the
    file and column)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"{folder}: no such dataset folder")
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise DatasetError(f"{meta_path}: missing (not an m31 dataset folder?)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{meta_path}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise DatasetError(f"{meta_path}: expected a JSON object")
    attributes = item_attributes(meta)
    tables = {}
    for name, schema in TABLES.items():
        path = folder / f"{name}.parquet"
        if not path.is_file():
            raise DatasetError(f"{path}: missing")
        wanted = [*schema.names, *(attributes if name == "ads" else ())]
        try:
            names = pq.ParquetFile(path).schema_arrow.names
            table = pq.read_table(path, columns=[c for c in names if c in wanted])
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"{path}: unreadable ({e})") from e
        try:
            tables[name] = conform(name, table, attributes if name == "ads" else None)
        except DatasetError as e:
            raise DatasetError(f"{path}: {e}") from None
    return Dataset(**tables, meta=meta)


def load_truth(folder: Path) -> dict:
    """The ground-truth arrays of a synthetic world (`truth.npz`)."""
    import numpy as np

    path = Path(folder) / "truth.npz"
    if not path.is_file():
        raise DatasetError(f"{path}: missing (only synthetic worlds have a ground truth)")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}
