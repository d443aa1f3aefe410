"""The checks of a dataset folder that read it (files, meta, types), and what every check
reports into (`Issue`, `Report`). `m31.data.validate` runs them, then the checks of the values
on the columns they found well typed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from m31.data.dataset import DatasetError, item_attributes, repeat_engagement
from m31.data.schema import ITEM_ATTRIBUTE_TYPES, TABLES

ERROR, WARNING = "error", "warning"
CHECKS = (
    "files",
    "meta",
    "types",
    "empty",
    "duplicates",
    "references",
    "vocabularies",
    "numbers",
    "time",
)
META = "meta.json"


@dataclass(frozen=True)
class Issue:
    """One problem: in `file`, first at `row` (from 0; a line of meta.json, from 1) of `column`
    (a key of meta.json), shared by `count` rows. `row` and `column` are None where the problem
    is the whole file or table."""

    level: str
    check: str
    file: str
    row: int | None
    column: str | None
    message: str
    count: int = 1

    def __str__(self) -> str:
        json_file = self.file == META
        where = self.file
        if self.row is not None:
            where += f" {'line' if json_file else 'row'} {self.row}"
        if self.column is not None:
            where += f"{',' if self.row is not None else ''} {'key' if json_file else 'column'} "
            where += self.column
        more = f" (and {self.count - 1:,} more rows)" if self.count > 1 else ""
        return f"{where}: {self.message}{more}"


@dataclass
class Report:
    """What `validate` found, and the counts its summary prints."""

    folder: Path
    issues: list[Issue] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows, for readable tables
    engagements: int | None = None  # events with a click
    time_range: tuple[int, int] | None = None  # first and last event time
    meta: dict | None = None  # meta.json, when it is a JSON object
    seconds: float = 0.0

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.level == ERROR]

    @property
    def warnings(self) -> list[Issue]:
        return [i for i in self.issues if i.level == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    def found(self) -> dict[str, dict[str, int]]:
        """Per check, how many errors and warnings it reported."""
        out = {c: {ERROR: 0, WARNING: 0} for c in CHECKS}
        for i in self.issues:
            out[i.check][i.level] += 1
        return out

    def to_dict(self) -> dict:
        return {
            "folder": str(self.folder),
            "ok": self.ok,
            "rows": self.rows,
            "engagements": self.engagements,
            "time_range": list(self.time_range) if self.time_range else None,
            "checks": self.found(),
            "issues": [asdict(i) for i in self.issues],
            "seconds": round(self.seconds, 3),
        }


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


class FolderReader:
    """A dataset folder read (checks files, meta and types), with the helpers every check
    reports with (`add`, `flag`) and reads the columns with (`has`, `col`, `valid`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.report = Report(folder)
        # The columns of the right type, without nulls where they are required.
        self.tables: dict[str, pa.Table] = {}
        self.meta: dict | None = None
        self.item_attributes: dict[str, str] = {}  # meta's, when well formed
        self.time_range: tuple[int, int] | None = None  # meta's, when well formed
        self.topics_ok = False

    def add(self, level, check, file, row, column, message, count=1) -> None:
        self.report.issues.append(Issue(level, check, file, row, column, message, count))

    def flag(
        self,
        level: str,
        check: str,
        table: str,
        column: str,
        mask: np.ndarray,
        say: Callable[[int], str],
    ) -> None:
        """One issue for the rows where `mask` holds: the first row, `say(row)`, the count."""
        row = _first(mask)
        if row is not None:
            self.add(level, check, f"{table}.parquet", row, column, say(row), int(mask.sum()))

    def has(self, table: str, *columns: str) -> bool:
        t = self.tables.get(table)
        return t is not None and all(c in t.column_names for c in columns)

    def col(self, table: str, column: str) -> np.ndarray:
        """The column's values [n], a null read as 0 (see `valid`)."""
        c = self.tables[table][column]
        return (pc.fill_null(c, 0) if c.null_count else c).to_numpy()

    def valid(self, table: str, column: str) -> np.ndarray:
        """[n] bool: the rows where the column holds a value."""
        c = self.tables[table][column]
        if not c.null_count:
            return np.ones(len(c), bool)
        return c.is_valid().to_numpy(zero_copy_only=False)

    # files, meta, types

    def read_meta(self) -> None:
        path = self.folder / META
        if not path.is_file():
            self.add(ERROR, "files", META, None, None, "missing (not an m31 dataset folder?)")
            return
        try:
            meta = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            self.add(ERROR, "meta", META, None, None, f"not UTF-8 text (byte {e.start})")
            return
        except json.JSONDecodeError as e:
            self.add(
                ERROR, "meta", META, e.lineno, None, f"not valid JSON: {e.msg}, column {e.colno}"
            )
            return
        except OSError as e:
            self.add(ERROR, "files", META, None, None, f"cannot read ({e.strerror or e})")
            return
        if not isinstance(meta, dict):
            self.add(
                ERROR,
                "meta",
                META,
                None,
                None,
                f"expected a JSON object, got {type(meta).__name__}",
            )
            return
        self.meta = self.report.meta = meta
        source = meta.get("source")
        if not isinstance(source, str) or not source:
            self.add(
                ERROR, "meta", META, None, "source", f"expected the source's name, got {source!r}"
            )
        if "repeat_engagement" not in meta:
            derived = "true" if repeat_engagement(meta) else "false"
            self.add(
                WARNING,
                "meta",
                META,
                None,
                "repeat_engagement",
                f"absent (a folder written before it existed): derived from source {source!r} "
                f"as {derived}",
            )
        elif not isinstance(meta["repeat_engagement"], bool):
            self.add(
                ERROR,
                "meta",
                META,
                None,
                "repeat_engagement",
                f"expected true or false, got {meta['repeat_engagement']!r}",
            )
        self.read_topics(meta.get("topics"))
        self.read_time_range(meta.get("time_range"))
        try:
            self.item_attributes = item_attributes(meta)
        except DatasetError as e:
            message = str(e).removeprefix("meta.json: ")
            self.add(ERROR, "meta", META, None, "item_attributes", message)

    def read_topics(self, topics) -> None:
        if topics is None:
            return
        if not isinstance(topics, list):
            self.add(
                ERROR, "meta", META, None, "topics", f"expected a list, got {type(topics).__name__}"
            )
            return
        seen: set[int] = set()
        for i, t in enumerate(topics):
            problem = None
            if not isinstance(t, dict):
                problem = f"expected an object with id, name and category, got {t!r}"
            else:
                for key, kind in (("id", int), ("name", str), ("category", int)):
                    value = t.get(key)
                    if not isinstance(value, kind) or isinstance(value, bool):
                        wanted = "an integer" if kind is int else "text"
                        problem = f"{key}: expected {wanted}, got {value!r}"
                        break
                    if kind is int and value < 0:
                        problem = f"{key}: expected an integer >= 0, got {value}"
                        break
                if problem is None and t["id"] in seen:
                    problem = f"id {t['id']} is listed twice"
            if problem is not None:
                self.add(ERROR, "meta", META, None, f"topics[{i}]", problem)
                return
            seen.add(t["id"])
        self.topics_ok = True

    def read_time_range(self, value) -> None:
        if value is None:
            return
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
            or value[0] > value[1]
        ):
            self.add(
                ERROR,
                "meta",
                META,
                None,
                "time_range",
                f"expected [first, last] Unix seconds with first <= last, got {value!r}",
            )
            return
        self.time_range = (value[0], value[1])

    def read_table(self, name: str) -> None:
        file = f"{name}.parquet"
        path = self.folder / file
        if not path.is_file():
            self.add(ERROR, "files", file, None, None, "missing")
            return
        try:
            got = pq.ParquetFile(path).schema_arrow
        except (pa.ArrowException, OSError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.add(ERROR, "files", file, None, None, f"not a readable parquet file ({reason})")
            return
        extras = self.item_attributes if name == "ads" else {}
        fields = list(TABLES[name])
        fields += [pa.field(a, ITEM_ATTRIBUTE_TYPES[kind]) for a, kind in extras.items()]
        good = []
        for f in fields:
            declared = f.name in extras
            same_name = got.get_all_field_indices(f.name)
            i = same_name[0] if len(same_name) == 1 else -1
            if len(same_name) > 1:
                self.add(ERROR, "types", file, None, f.name, f"{len(same_name)} columns so named")
            elif i < 0 and declared:
                self.add(
                    ERROR,
                    "types",
                    file,
                    None,
                    f.name,
                    f"missing (meta.json's item_attributes declares it, {extras[f.name]})",
                )
            elif i < 0 and f.nullable:
                self.add(WARNING, "types", file, None, f.name, f"absent: read as null ({f.type})")
            elif i < 0:
                self.add(ERROR, "types", file, None, f.name, f"missing (expected {f.type})")
            elif not got.field(i).type.equals(f.type):
                kind = f" (item_attributes: {extras[f.name]})" if declared else ""
                self.add(
                    ERROR,
                    "types",
                    file,
                    None,
                    f.name,
                    f"{got.field(i).type}, expected {f.type}{kind}",
                )
            else:
                good.append(f)
        ignored = "not in the schema (ignored)"
        if name == "ads":
            ignored = "not in the schema nor meta.json's item_attributes (ignored)"
        for extra in sorted(set(got.names) - {f.name for f in fields}):
            self.add(WARNING, "types", file, None, extra, ignored)
        try:
            table = pq.read_table(path, columns=[f.name for f in good])
        except (pa.ArrowException, OSError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.add(ERROR, "files", file, None, None, f"unreadable ({reason})")
            return
        table = table.combine_chunks()
        keep = []
        for f in good:
            c = table[f.name]
            if pa.types.is_list(c.type) and pc.list_flatten(c).null_count:
                flat = pc.list_flatten(c)
                parents = pc.list_parent_indices(c).to_numpy()
                held = np.zeros(len(table), bool)
                held[parents[flat.is_null().to_numpy(zero_copy_only=False)]] = True
                self.flag(ERROR, "types", name, f.name, held, lambda _: "a list holds a null")
            elif not f.nullable and c.null_count:
                nulls = c.is_null().to_numpy(zero_copy_only=False)
                self.flag(ERROR, "types", name, f.name, nulls, lambda _: "null (a required column)")
            else:
                keep.append(f.name)
        self.tables[name] = table.select(keep)
