"""A dataset on disk: the five tables of `m31.data.schema` as parquet, plus `meta.json`.

Layout of a dataset folder::

    meta.json          source, repeat_engagement, seed, topic names, time range, and anything
                       the source adds
    users.parquet      advertisers.parquet  ads.parquet  events.parquet  organic.parquet
    truth.npz          (synthetic worlds only) the ground-truth response model's parameters

Writes are atomic: everything goes to a temporary sibling folder that is renamed into place
only when complete, so a folder that exists is always a whole dataset.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from m31.data.schema import BUILT_IN_VOCAB, STATUSES, TABLES

# The categorical vocabularies a dataset declares in meta.json's `vocab` (`vocabularies`).
VOCABULARIES = tuple(BUILT_IN_VOCAB)


class DatasetError(ValueError):
    """A dataset folder or file that cannot be used; the message names the file or field."""


@dataclass
class Dataset:
    users: pa.Table
    advertisers: pa.Table
    ads: pa.Table
    events: pa.Table
    organic: pa.Table
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, schema in TABLES.items():
            table = getattr(self, name)
            if not table.schema.equals(schema, check_metadata=False):
                raise DatasetError(
                    f"table {name!r} does not match its schema:\n"
                    f"expected {schema}\ngot {table.schema}"
                )

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
    built-in marketplace's (`schema.BUILT_IN_VOCAB`).
    `status` is the index's (`schema.STATUSES`); `country` is the countries its users live in
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


def write_atomic(out: Path, fill: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Create folder `out` by calling `fill(tmp)` on a temporary sibling and renaming it.

    An exception inside `fill` leaves `out` exactly as it was. With `overwrite`, an existing
    `out` is replaced only after the new folder is complete.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise DatasetError(f"{out}: already exists (pass overwrite to replace it)")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise DatasetError(f"{parent}: cannot write there ({e.strerror or e})") from e
    try:
        fill(tmp)
        _fsync_tree(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ds: Dataset, out: Path, overwrite: bool = False, extra: dict | None = None) -> Path:
    """Write `ds` (and optional extra numpy arrays, saved as `truth.npz`) atomically to `out`."""
    import numpy as np

    def fill(tmp: Path) -> None:
        for name in TABLES:
            pq.write_table(ds.table(name), tmp / f"{name}.parquet", compression="zstd")
        (tmp / "meta.json").write_text(json.dumps(ds.meta, indent=2, sort_keys=True) + "\n")
        if extra:
            np.savez(tmp / "truth.npz", **extra)

    return write_atomic(Path(out), fill, overwrite=overwrite)


def load(folder: Path) -> Dataset:
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
    tables = {}
    for name, schema in TABLES.items():
        path = folder / f"{name}.parquet"
        if not path.is_file():
            raise DatasetError(f"{path}: missing")
        try:
            tables[name] = pq.read_table(path, schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
            raise DatasetError(f"{path}: unreadable or wrong schema ({e})") from e
    return Dataset(**tables, meta=meta)


def load_truth(folder: Path) -> dict:
    """The ground-truth arrays of a synthetic world (`truth.npz`)."""
    import numpy as np

    path = Path(folder) / "truth.npz"
    if not path.is_file():
        raise DatasetError(f"{path}: missing (only synthetic worlds have a ground truth)")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}
