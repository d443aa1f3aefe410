"""Read a MovieLens-100K folder into the five m31 tables (`m31.data.schema`).

Input files, all Latin-1 text, one record per line (u.genre is optional)::

    u.data   user_id <TAB> item_id <TAB> rating (1-5) <TAB> unix seconds
    u.user   user_id|age|gender (M/F)|occupation|zip
    u.item   movie_id|title|release date (01-Jan-1995, may be empty)|video date|imdb url|G flags
    u.genre  name|index              (the G genres; the standard 19 when the file is absent)

Output: users (one per u.user line, cohort = dense id of (occupation, age bucket), created at
their first rating), advertisers (one per genre, a "studio" stand-in), ads (one per movie,
owned by and topic = its first genre), events (one per rating: click always, conversion =
rating >= 4, sorted by ts, user, ad) and an empty organic table. A user rates a movie at most
once (meta `repeat_engagement` false).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from m31.data.dataset import Dataset, DatasetError
from m31.data.schema import ADS, ADVERTISERS, EVENTS, ORGANIC, USERS, age_bucket
from m31.vocabularies import GENDERS

STANDARD_GENRES = (
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
)

_DATA_FIELDS = ("user_id", "item_id", "rating", "timestamp")
_USER_FIELDS = "user_id|age|gender|occupation|zip"
_MONTHS = {
    m: i
    for i, m in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1
    )
}
# Python's int() also takes "1_000", "+5" and non-ASCII digits, which pyarrow rejects; keep the
# two parsers agreeing so the slow error scan finds whatever the fast path refused.
_INT = re.compile(r"-?[0-9]+")
_INT64 = (-(2**63), 2**63 - 1)


def load_movielens(folder: Path | str) -> Dataset:
    """Load a MovieLens-100K style folder; any unusable input raises `DatasetError`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"{folder}: no such MovieLens folder")
    for name in ("u.data", "u.user", "u.item"):
        if not (folder / name).is_file():
            raise DatasetError(f"{folder / name}: missing (not a MovieLens-100K folder?)")

    genres = _read_genres(folder / "u.genre")
    users = _read_users(folder / "u.user")
    items = _read_items(folder / "u.item", genres)
    r_user, r_item, rating, ts = _read_ratings(folder / "u.data", users["id"], items["id"])
    t0, t1 = int(ts.min()), int(ts.max())

    order = np.lexsort((r_item, r_user, ts))
    r_user, r_item, rating, ts = r_user[order], r_item[order], rating[order], ts[order]

    return Dataset(
        users=_users_table(users, r_user, ts, t0),
        advertisers=_advertisers_table(genres),
        ads=_ads_table(items, genres, t0),
        events=_events_table(r_user, r_item, rating, ts),
        organic=ORGANIC.empty_table(),
        meta={
            "source": "movielens",
            # A user rates a movie once (`_read_ratings` refuses a second rating), so what they
            # rated is never the next thing to find for them.
            "repeat_engagement": False,
            # The values its columns hold: ratings carry no surface, platform or format, so
            # each of those columns holds one value and tells the model nothing.
            "vocab": {
                "surface": ["feed"],
                "platform": ["web"],
                "format": ["video"],
                "objective": ["conversions"],
                "gender": list(GENDERS),
                "organic_surface": [],
            },
            "path": str(folder),
            "topics": [{"id": i, "name": g, "category": i} for i, g in enumerate(genres)],
            "n_ratings": len(ts),
            "time_range": [t0, t1],
        },
    )


# ---------------------------------------------------------------- parsing


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from e


def _lines(data: bytes) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every non-empty line."""
    for n, line in enumerate(data.decode("latin-1").split("\n"), 1):
        line = line.removesuffix("\r")
        if line:
            yield n, line


def _int(path: Path, n: int, name: str, text: str) -> int:
    s = text.strip()
    if not _INT.fullmatch(s):
        raise DatasetError(f"{path}: line {n}: {name} {text!r} is not an integer")
    value = int(s)
    if not _INT64[0] <= value <= _INT64[1]:
        raise DatasetError(f"{path}: line {n}: {name} {value} is out of range")
    return value


def _read_genres(path: Path) -> list[str]:
    if not path.exists():
        return list(STANDARD_GENRES)
    by_index: dict[int, str] = {}
    for n, line in _lines(_read(path)):
        fields = line.split("|")
        if len(fields) != 2:
            raise DatasetError(
                f"{path}: line {n}: expected 2 '|'-separated fields (name|index), got {len(fields)}"
            )
        name, index = fields[0], _int(path, n, "genre index", fields[1])
        if not name:
            raise DatasetError(f"{path}: line {n}: empty genre name")
        if index in by_index:
            raise DatasetError(f"{path}: line {n}: duplicate genre index {index}")
        by_index[index] = name
    # Flags in u.item are positional, so the indices must be exactly 0..G-1.
    if sorted(by_index) != list(range(len(by_index))) or not by_index:
        raise DatasetError(
            f"{path}: genre indices must be 0..N-1 without gaps, got {sorted(by_index)}"
        )
    return [by_index[i] for i in range(len(by_index))]


def _read_users(path: Path) -> dict:
    ids: list[int] = []
    ages: list[int] = []
    genders: list[str] = []
    occupations: list[str] = []
    seen: set[int] = set()
    for n, line in _lines(_read(path)):
        fields = line.split("|")
        if len(fields) != 5:
            raise DatasetError(
                f"{path}: line {n}: expected 5 '|'-separated fields ({_USER_FIELDS}), "
                f"got {len(fields)}"
            )
        uid = _int(path, n, "user_id", fields[0])
        if uid in seen:
            raise DatasetError(f"{path}: line {n}: duplicate user_id {uid}")
        seen.add(uid)
        age = _int(path, n, "age", fields[1])
        if not 0 <= age <= 150:
            raise DatasetError(f"{path}: line {n}: age {age} outside 0-150")
        if fields[2] not in GENDERS:
            raise DatasetError(f"{path}: line {n}: gender {fields[2]!r} is not one of {GENDERS}")
        ids.append(uid)
        ages.append(age)
        genders.append(fields[2])
        occupations.append(fields[3])
    if not ids:
        raise DatasetError(f"{path}: no users")
    order = np.argsort(np.array(ids, dtype=np.int64), kind="stable")
    return {
        "id": np.array(ids, dtype=np.int64)[order],
        "age": np.array(ages, dtype=np.int16)[order],
        "gender": [genders[i] for i in order],
        "occupation": [occupations[i] for i in order],
    }


def _read_items(path: Path, genres: list[str]) -> dict:
    n_fields = 5 + len(genres)
    ids: list[int] = []
    titles: list[str] = []
    released: list[int | None] = []
    item_genres: list[list[int]] = []
    seen: set[int] = set()
    for n, line in _lines(_read(path)):
        fields = line.split("|")
        if len(fields) != n_fields:
            raise DatasetError(
                f"{path}: line {n}: expected {n_fields} '|'-separated fields "
                f"(5 + {len(genres)} genre flags), got {len(fields)}"
            )
        mid = _int(path, n, "movie_id", fields[0])
        if mid in seen:
            raise DatasetError(f"{path}: line {n}: duplicate movie_id {mid}")
        seen.add(mid)
        flags = fields[5:]
        for g, flag in enumerate(flags):
            if flag not in ("0", "1"):
                raise DatasetError(
                    f"{path}: line {n}: genre flag {g} ({genres[g]}) is {flag!r}, expected 0 or 1"
                )
        ids.append(mid)
        titles.append(fields[1])
        released.append(_parse_date(fields[2]))
        item_genres.append([g for g, flag in enumerate(flags) if flag == "1"])
    if not ids:
        raise DatasetError(f"{path}: no movies")
    order = np.argsort(np.array(ids, dtype=np.int64), kind="stable")
    return {
        "id": np.array(ids, dtype=np.int64)[order],
        "title": [titles[i] for i in order],
        "released": [released[i] for i in order],
        "genres": [item_genres[i] for i in order],
    }


def _parse_date(text: str) -> int | None:
    """`01-Jan-1995` as Unix seconds at UTC midnight; None when empty or not a real date."""
    parts = text.strip().split("-")
    if len(parts) != 3 or parts[1].lower() not in _MONTHS:
        return None
    try:
        day = datetime(int(parts[2]), _MONTHS[parts[1].lower()], int(parts[0]), tzinfo=UTC)
    except ValueError:
        return None
    return int(day.timestamp())


def _read_ratings(
    path: Path, user_ids: np.ndarray, item_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    data = _read(path)
    if not data.strip():
        raise DatasetError(f"{path}: no ratings")
    # Fast path: pyarrow parses and numpy checks. On any failure, a line-by-line scan finds the
    # first bad line so the message can point at it.
    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(column_names=list(_DATA_FIELDS)),
            parse_options=pacsv.ParseOptions(
                delimiter="\t", quote_char=False, ignore_empty_lines=True
            ),
            convert_options=pacsv.ConvertOptions(
                column_types=dict.fromkeys(_DATA_FIELDS, pa.int64()), null_values=[]
            ),
        )
    except pa.ArrowException as e:
        _scan_ratings(path, data, user_ids, item_ids)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatasetError(f"{path}: unreadable ({reason})") from e
    user, item, rating, ts = (table.column(c).to_numpy() for c in _DATA_FIELDS)
    if (
        ((rating < 1) | (rating > 5)).any()
        or not np.isin(user, user_ids).all()
        or not np.isin(item, item_ids).all()
        or len(np.unique(np.stack([user, item]), axis=1)[0]) < len(user)
    ):
        _scan_ratings(path, data, user_ids, item_ids)
        raise DatasetError(f"{path}: invalid ratings")
    return user, item, rating, ts


def _scan_ratings(path: Path, data: bytes, user_ids: np.ndarray, item_ids: np.ndarray) -> None:
    """Raise a `DatasetError` for the first bad line of u.data, if there is one."""
    users, items = set(user_ids.tolist()), set(item_ids.tolist())
    rated: dict[tuple[int, int], int] = {}
    for n, line in _lines(data):
        fields = line.split("\t")
        if len(fields) != 4:
            raise DatasetError(
                f"{path}: line {n}: expected 4 tab-separated fields "
                f"({' '.join(_DATA_FIELDS)}), got {len(fields)}"
            )
        user, item, rating, _ = (
            _int(path, n, name, text) for name, text in zip(_DATA_FIELDS, fields, strict=True)
        )
        if not 1 <= rating <= 5:
            raise DatasetError(f"{path}: line {n}: rating {rating} outside 1-5")
        if user not in users:
            raise DatasetError(f"{path}: line {n}: user_id {user} is not in u.user")
        if item not in items:
            raise DatasetError(f"{path}: line {n}: item_id {item} is not in u.item")
        first = rated.setdefault((user, item), n)
        if first != n:
            raise DatasetError(
                f"{path}: line {n}: user {user} rated item {item} already on line {first}"
            )


# ---------------------------------------------------------------- tables


def _const(value, type_: pa.DataType, n: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, type_), n)


def _users_table(users: dict, r_user: np.ndarray, ts: np.ndarray, t0: int) -> pa.Table:
    n = len(users["id"])
    buckets = age_bucket(users["age"]).tolist()
    keys = list(zip(users["occupation"], buckets, strict=True))
    cohort_of = {key: i for i, key in enumerate(sorted(set(keys)))}
    cohort = np.array([cohort_of[k] for k in keys], dtype=np.int32)

    # ts is sorted, so a user's first event is their earliest; users who never rated get the
    # dataset's first timestamp so created_at is never after any event.
    created = np.full(n, t0, dtype=np.int64)
    pos = np.searchsorted(users["id"], r_user)
    first_pos, first_idx = np.unique(pos, return_index=True)
    created[first_pos] = ts[first_idx]

    return pa.Table.from_arrays(
        [
            pa.array(users["id"], pa.int64()),
            pa.array(users["age"], pa.int16()),
            pa.array(users["gender"], pa.string()),
            _const("US", pa.string(), n),
            _const("web", pa.string(), n),
            pa.array(cohort, pa.int32()),
            pa.array(created, pa.int64()),
        ],
        schema=USERS,
    )


def _advertisers_table(genres: list[str]) -> pa.Table:
    index = np.arange(len(genres))
    return pa.Table.from_arrays(
        [
            pa.array(index, pa.int64()),
            pa.array(genres, pa.string()),
            pa.array(index, pa.int32()),
        ],
        schema=ADVERTISERS,
    )


def _ads_table(items: dict, genres: list[str], t0: int) -> pa.Table:
    n = len(items["id"])
    # A movie with no genre flag at all belongs to genre 0 ("unknown"), as the data itself does.
    first = [gs[0] if gs else 0 for gs in items["genres"]]
    text = [
        f"{title}. {', '.join(genres[g] for g in (gs or [0]))} film."
        for title, gs in zip(items["title"], items["genres"], strict=True)
    ]
    created = [t0 if r is None else r for r in items["released"]]
    no_targets = pa.array([[]] * n, pa.list_(pa.string()))
    return pa.Table.from_arrays(
        [
            pa.array(items["id"], pa.int64()),
            pa.array(first, pa.int64()),
            pa.array(items["id"], pa.int64()),
            _const("conversions", pa.string(), n),
            _const("video", pa.string(), n),
            pa.array(first, pa.int32()),
            pa.array(first, pa.int32()),
            pa.array(text, pa.string()),
            no_targets,
            _const(0, pa.int16(), n),
            _const(120, pa.int16(), n),
            no_targets,
            no_targets,
            _const("active", pa.string(), n),
            _const(0.0, pa.float32(), n),
            _const(0.0, pa.float32(), n),
            pa.array(created, pa.int64()),
        ],
        schema=ADS,
    )


def _events_table(
    user: np.ndarray, item: np.ndarray, rating: np.ndarray, ts: np.ndarray
) -> pa.Table:
    n = len(ts)
    return pa.Table.from_arrays(
        [
            pa.array(user, pa.int64()),
            pa.array(item, pa.int64()),
            pa.array(ts, pa.int64()),
            _const("feed", pa.string(), n),
            pa.array((ts // 3600 % 24).astype(np.int8), pa.int8()),
            _const("web", pa.string(), n),
            _const(True, pa.bool_(), n),
            pa.array(rating >= 4, pa.bool_()),
        ],
        schema=EVENTS,
    )
