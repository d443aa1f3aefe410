"""Checks of a dataset folder: what everything downstream assumes of meta.json and the tables.

`validate(folder)` reads a folder written by any source (or by hand) and returns a `Report`:
each problem found is an `Issue` naming the file, the row (counted from 0, as pyarrow counts)
and the column, and the report holds the counts a summary prints. An error makes the folder
unusable or its results wrong; a warning is something the data model allows but a reader should
know (a MovieLens rating before its movie's release date). `m31 data validate DIR` prints the
report and exits 1 on any error.

Every check runs over whole columns (pyarrow compute, numpy) and reports one issue per file,
column and kind of problem: its first row, the value there, and how many rows share it. A column
that is missing, of another type or holding nulls where it may not is reported once (check
`types`) and left out of the other checks, which could only repeat it.

Nulls. A required column (`m31.data.schema.required`) holds no null; an optional column may
(null means absent, never a value: `m31.data.schema`), and the other checks skip its nulls (a
null is in every vocabulary, in range, and names no row). An optional column a table lacks
reads as nulls (a warning). The advertisers and organic tables may be empty, and meta's
`topics` may be an empty list (no topic vocabulary).

Checks, in the order they run (`CHECKS`):

    files         meta.json and the five tables present and readable
    meta          meta.json an object: source (text), repeat_engagement (true or false; absent in
                  folders written before it existed, a warning), topics, time_range and
                  item_attributes well formed (`m31.data.dataset.item_attributes`)
    types         every required column of `m31.data.schema` there with its arrow type and no
                  nulls, every optional one of its type (absent: a warning), no list holding a
                  null; each column meta's item_attributes declares in ads.parquet, of its kind
    empty         users, ads and events hold rows (advertisers and organic may be empty); some
                  event is an engagement (click)
    duplicates    users.user_id, ads.ad_id, advertisers.advertiser_id unique; with
                  repeat_engagement false, no user engaging with one ad twice (a warning)
    references    events.user_id in users, events.ad_id in ads, organic.user_id in users,
                  ads.advertiser_id in advertisers (unless that table is empty: a source without
                  advertisers, whose ads' advertiser ids stand alone)
    vocabularies  categorical values in their vocabulary (`m31.data.dataset.vocabularies`)
    numbers       ids, topics, users' and events' times >= 0, ages in 0..150, hour in 0..23,
                  floats finite, daily_budget >= 0; target_age_min above target_age_max (an
                  empty range: the ad reaches no one) is a warning, as the generator writes some
    time          event times within meta's time_range; an event before its ad's or its user's
                  created_at is a warning (the generator never writes one, but MovieLens-100K
                  holds 231 ratings from before their movie's release date)

The first three read the folder (`m31.data.validate_files`, where `Issue` and `Report` live too);
this module's checks read the values of the columns those found well typed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from m31.data.dataset import DatasetError, vocabularies
from m31.data.schema import TABLES
from m31.data.validate_files import CHECKS, ERROR, WARNING, FolderReader, Report

REQUIRED_ROWS = ("users", "ads", "events")
UNIQUE = {"users": "user_id", "ads": "ad_id", "advertisers": "advertiser_id"}
REFERENCES = (  # (table, column) -> (table, column) it must name a row of
    (("events", "user_id"), ("users", "user_id")),
    (("events", "ad_id"), ("ads", "ad_id")),
    (("ads", "advertiser_id"), ("advertisers", "advertiser_id")),
    (("organic", "user_id"), ("users", "user_id")),
)
CATEGORICAL = {  # (table, column) -> its vocabulary's name in `vocabularies`
    ("users", "gender"): "gender",
    ("users", "platform"): "platform",
    ("advertisers", "category"): "category",
    ("ads", "objective"): "objective",
    ("ads", "format"): "format",
    ("ads", "topic"): "topic",
    ("ads", "category"): "category",
    ("ads", "target_countries"): "country",
    ("ads", "target_genders"): "gender",
    ("ads", "target_platforms"): "platform",
    ("ads", "status"): "status",
    ("events", "surface"): "surface",
    ("events", "platform"): "platform",
    ("organic", "topic"): "topic",
    ("organic", "surface"): "organic_surface",
}
# The country vocabulary is where the users live, so an ad targeting another country is not a
# wrong value: it only reaches no user of this dataset there.
WARN_ONLY = {("ads", "target_countries")}
# Ids address rows and embedding tables; topics index embeddings too (their vocabulary check
# covers only the non-negative ones, so nothing is reported twice); users and events are of the
# Unix era. An ad may be older: MovieLens dates a movie by its release, back to 1922, and the
# index takes any second as the start of an ad's schedule.
NON_NEGATIVE = {
    "users": ("user_id", "created_at"),
    "advertisers": ("advertiser_id", "category"),
    "ads": ("ad_id", "advertiser_id", "campaign_id", "topic", "category"),
    "events": ("user_id", "ad_id", "ts"),
    "organic": ("user_id", "topic", "ts"),
}
RANGES = {  # (table, column) -> inclusive bounds
    ("users", "age"): (0, 150),
    ("ads", "target_age_min"): (0, 150),
    ("ads", "target_age_max"): (0, 150),
    ("events", "hour"): (0, 23),
}
FLOATS = (("ads", "daily_budget"), ("ads", "quality"))


def validate(folder: Path | str) -> Report:
    """Check dataset folder `folder` (see the module docstring); raises `DatasetError` only
    when it is not a folder at all."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"{folder}: no such dataset folder")
    start = time.perf_counter()
    v = _Validator(folder)
    v.run()
    v.report.seconds = time.perf_counter() - start
    return v.report


def _lookup(values: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([n] bool: each value is one of `ids`, [n] the row of `ids` holding it where it is)."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    pos = np.minimum(np.searchsorted(ordered, values), max(len(ids) - 1, 0))
    found = ordered[pos] == values if len(ids) else np.zeros(len(values), bool)
    return found, order[pos] if len(ids) else pos


def _shown(values: list) -> str:
    shown = ", ".join(repr(v) for v in values[:5])
    return shown + (f" and {len(values) - 5} more" if len(values) > 5 else "")


class _Validator(FolderReader):
    """The folder read, then the checks of its values (empty to time, `CHECKS`)."""

    def run(self) -> None:
        self.read_meta()
        for name in TABLES:
            self.read_table(name)
        self.check_empty()
        self.check_duplicates()
        found = self.check_references()
        self.check_vocabularies()
        self.check_numbers()
        self.check_time(found)
        r = self.report
        r.rows = {name: t.num_rows for name, t in self.tables.items()}
        if self.has("events", "click"):
            r.engagements = int(self.col("events", "click").sum())
        if self.has("events", "ts") and self.tables["events"].num_rows:
            lo, hi = pc.min_max(self.tables["events"]["ts"]).values()
            r.time_range = (lo.as_py(), hi.as_py())

    # empty, duplicates, references

    def check_empty(self) -> None:
        for name in REQUIRED_ROWS:
            if name in self.tables and self.tables[name].num_rows == 0:
                self.add(ERROR, "empty", f"{name}.parquet", None, None, "no rows")
        if self.has("events", "click") and self.tables["events"].num_rows:
            if not self.col("events", "click").any():
                self.add(
                    WARNING,
                    "empty",
                    "events.parquet",
                    None,
                    "click",
                    "no event is an engagement (click): nothing to train or evaluate on",
                )

    def check_duplicates(self) -> None:
        for table, column in UNIQUE.items():
            if not self.has(table, column):
                continue
            ids = self.col(table, column)
            order = np.argsort(ids, kind="stable")
            ordered = ids[order]
            repeat = np.zeros(len(ids), bool)
            repeat[order[1:][ordered[1:] == ordered[:-1]]] = True

            def say(row, ids=ids, ordered=ordered, order=order, column=column):
                first = int(order[np.searchsorted(ordered, ids[row])])
                return f"{column} {ids[row]} repeats row {first}"

            self.flag(ERROR, "duplicates", table, column, repeat, say)
        if (
            self.meta is not None
            and isinstance(self.meta.get("repeat_engagement"), bool)
            and not self.meta["repeat_engagement"]
            and self.has("events", "user_id", "ad_id", "click")
        ):
            user, ad = self.col("events", "user_id"), self.col("events", "ad_id")
            rows = np.flatnonzero(self.col("events", "click"))
            order = rows[np.lexsort((rows, ad[rows], user[rows]))]  # by user, ad, then row
            u, a = user[order], ad[order]
            same = np.r_[False, (u[1:] == u[:-1]) & (a[1:] == a[:-1])]
            starts = np.maximum.accumulate(np.where(same, 0, np.arange(len(order))))
            first_of = np.zeros(len(user), np.int64)
            first_of[order] = order[starts]
            again = np.zeros(len(user), bool)
            again[order[same]] = True

            def say(row):
                return (
                    f"user {user[row]} engages with ad {ad[row]} again (first at row "
                    f"{first_of[row]}), but meta.json says repeat_engagement false"
                )

            self.flag(WARNING, "duplicates", "events", "ad_id", again, say)

    def check_references(self) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
        """Report ids naming no row; return, per (table, column), which rows' ids were found
        and the row of the other table each names (the time check reads them)."""
        found = {}
        for (table, column), (other, key) in REFERENCES:
            if not (self.has(table, column) and self.has(other, key)):
                continue
            if other == "advertisers" and not self.tables[other].num_rows:
                continue  # a source without advertisers: its ads' advertiser ids stand alone
            values, valid = self.col(table, column), self.valid(table, column)
            hit, row_of = _lookup(values, self.col(other, key))
            hit &= valid  # a null names no row, and needs none
            found[(table, column)] = (hit, row_of)
            self.flag(
                ERROR,
                "references",
                table,
                column,
                ~hit & valid,
                lambda row, values=values, other=other, key=key: (
                    f"{key} {values[row]} is not in {other}.parquet"
                ),
            )
        return found

    # vocabularies, numbers, time

    def check_vocabularies(self) -> None:
        countries = ()
        if self.has("users", "country"):
            country = self.tables["users"]["country"]
            self.flag(
                ERROR,
                "vocabularies",
                "users",
                "country",
                pc.fill_null(pc.equal(country, ""), False).to_numpy(zero_copy_only=False),
                lambda _: "empty country",
            )
            countries = [c for c in pc.unique(pc.drop_null(country)).to_pylist() if c]
        meta = self.meta if self.meta is not None and self.topics_ok else {}
        vocab = vocabularies(meta, countries)
        for (table, column), name in CATEGORICAL.items():
            # Without the users' countries (a type error reported already) there is no country
            # vocabulary to compare with, rather than an empty one.
            if name not in vocab or not self.has(table, column):
                continue
            if name == "country" and not self.has("users", "country"):
                continue
            allowed = vocab[name]
            c = self.tables[table][column]
            level = WARNING if (table, column) in WARN_ONLY else ERROR
            if pa.types.is_list(c.type):
                flat = pc.list_flatten(c)
                bad_entry = pc.invert(pc.is_in(flat, pa.array(allowed, flat.type)))
                bad_entry = bad_entry.to_numpy(zero_copy_only=False)
                bad = np.zeros(len(c), bool)
                bad[pc.list_parent_indices(c).to_numpy()[bad_entry]] = True
                unknown = pc.unique(pc.filter(flat, bad_entry)).to_pylist()
            elif pa.types.is_integer(c.type):
                values = self.col(table, column)
                bad = ~np.isin(values, np.asarray(allowed, dtype=values.dtype)) & (values >= 0)
                bad &= self.valid(table, column)
                unknown = np.unique(values[bad]).tolist()
            else:
                bad = pc.invert(pc.is_in(c, pa.array(allowed, c.type))).to_numpy(
                    zero_copy_only=False
                )
                bad &= self.valid(table, column)
                unknown = pc.unique(pc.filter(c, bad)).to_pylist()
            if name in ("topic", "category"):
                expected = f"the {name}s meta.json's topics list"
            else:
                expected = "one of " + ", ".join(map(str, allowed))
            self.flag(
                level,
                "vocabularies",
                table,
                column,
                bad,
                lambda _, unknown=unknown, name=name, expected=expected: (
                    f"unknown {name} {_shown(unknown)} (expected {expected})"
                ),
            )

    def check_numbers(self) -> None:
        bounds = [((t, c), (0, None)) for t, cs in NON_NEGATIVE.items() for c in cs]
        for (table, column), (lo, hi) in [*bounds, *RANGES.items()]:
            if not self.has(table, column):
                continue
            values = self.col(table, column)
            outside = (values < lo) if hi is None else (values < lo) | (values > hi)
            self.flag(
                ERROR,
                "numbers",
                table,
                column,
                outside & self.valid(table, column),
                lambda row, values=values, lo=lo, hi=hi: (
                    f"{values[row]} is negative"
                    if hi is None
                    else f"{values[row]} is outside {lo}..{hi}"
                ),
            )
        if self.has("ads", "target_age_min", "target_age_max"):
            # A warning, not an error: the synthetic generator draws the two ends apart (35 and
            # 34 happen), so 2-3% of its ads have an empty range and are never shown. They are
            # harmless offline, but the serving API refuses such a range in an upsert.
            lo, hi = self.col("ads", "target_age_min"), self.col("ads", "target_age_max")
            both = self.valid("ads", "target_age_min") & self.valid("ads", "target_age_max")
            self.flag(
                WARNING,
                "numbers",
                "ads",
                "target_age_min",
                (lo > hi) & both,
                lambda row: (
                    f"{lo[row]} is above target_age_max {hi[row]}: an empty age range, the ad "
                    "reaches no one"
                ),
            )
        for table, column in FLOATS:
            if self.has(table, column):
                values = self.col(table, column)
                self.flag(
                    ERROR,
                    "numbers",
                    table,
                    column,
                    ~np.isfinite(values) & self.valid(table, column),
                    lambda row, values=values: f"{values[row]} is not a finite number",
                )
        if self.has("ads", "daily_budget"):
            budget = self.col("ads", "daily_budget")
            self.flag(
                ERROR,
                "numbers",
                "ads",
                "daily_budget",
                (budget < 0) & self.valid("ads", "daily_budget"),
                lambda row: f"{budget[row]} is negative",
            )

    def check_time(self, found: dict) -> None:
        if not self.has("events", "ts"):
            return
        ts = self.col("events", "ts")
        if self.time_range is not None:
            lo, hi = self.time_range
            self.flag(
                ERROR,
                "time",
                "events",
                "ts",
                (ts < lo) | (ts > hi),
                lambda row: f"{ts[row]} is outside meta.json's time_range [{lo}, {hi}]",
            )
        for column, other in (("ad_id", "ads"), ("user_id", "users")):
            if ("events", column) not in found or not self.has(other, "created_at"):
                continue
            hit, row_of = found[("events", column)]
            created = self.col(other, "created_at")[row_of]
            hit = hit & self.valid(other, "created_at")[row_of]
            self.flag(
                WARNING,
                "time",
                "events",
                "ts",
                hit & (ts < created),
                lambda row, created=created, column=column, other=other: (
                    f"{ts[row]} is before the created_at {created[row]} of its {other[:-1]} "
                    f"({column} {self.col('events', column)[row]})"
                ),
            )


def summary(report: Report, show: int = 10) -> str:
    """The report as text: what the folder holds, what each check found, and the first `show`
    errors and warnings."""
    r, lines = report, []
    rows = r.rows
    tables = ", ".join(f"{name} {rows[name]:,}" for name in TABLES if name in rows)
    lines.append(f"{r.folder}: {len(rows)} of {len(TABLES)} tables readable ({tables or 'none'})")
    if rows:
        what = [
            f"{rows[k]:,} {label}"
            for k, label in (("users", "users"), ("ads", "items"))
            if k in rows
        ]
        if "events" in rows:
            engaged = f" ({r.engagements:,} engagements)" if r.engagements is not None else ""
            what.append(f"{rows['events']:,} events{engaged}")
        lines.append(", ".join(what))
    if r.time_range is not None:
        lo, hi = r.time_range
        lines.append(f"events from {_format_time(lo)} to {_format_time(hi)} UTC")
    if r.meta is not None:
        source = r.meta.get("source")
        repeat = r.meta.get("repeat_engagement", "absent")
        lines.append(f"source {source!r}, repeat_engagement {json.dumps(repeat)}")
    found = r.found()
    lines.append(f"{'check':<14}{'errors':>8}{'warnings':>10}")
    for check in CHECKS:
        lines.append(f"{check:<14}{found[check][ERROR]:>8,}{found[check][WARNING]:>10,}")
    for title, issues in (("errors", r.errors), ("warnings", r.warnings)):
        if issues and show > 0:
            first = f"first {show} of " if len(issues) > show else ""
            lines.append(f"{title} ({first}{len(issues):,}):")
            lines.extend(f"  {i}" for i in issues[:show])
    n_err, n_warn = len(r.errors), len(r.warnings)
    verdict = "invalid" if n_err else "valid"
    lines.append(
        f"{verdict}: {n_err:,} error{'s' * (n_err != 1)}, {n_warn:,} warning{'s' * (n_warn != 1)}"
        f" ({r.seconds:.2f} s)"
    )
    return "\n".join(lines)


def _format_time(seconds: int) -> str:
    from datetime import UTC, datetime

    try:
        return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return str(seconds)
