"""The sequence-file importer of `m31 data import` (`m31.data.importer`), for the formats of the
sequential recommendation benchmarks (e.g. S3-Rec's Amazon Beauty): `user item item ...` per
line, oldest first, and `*_item2attributes.json`, one JSON object item -> attribute ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from m31.data.import_tables import Catalogue, Events, ImportFailed, Items, fail, text_bytes


def read_sequences(path: Path) -> tuple[pa.Array, pa.Array, np.ndarray, np.ndarray]:
    """(user ids, item ids as text, position within the user, line) of each event of a
    `user item item ...` file."""
    data = text_bytes(Path(path))
    users, items, positions, lines = [], [], [], []
    for row, line in enumerate(data.decode().splitlines(), 1):
        tokens = line.split()
        if not tokens:
            continue
        if len(tokens) < 2:
            fail(path, "a user without items (expected `user item item ...`)", row=row)
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


def sequence_events(path: Path) -> Events:
    user, item, pos, lines = read_sequences(path)
    _one_line_per_user(user, lines, Path(path))
    return Events(user, item, None, pos, lines, Path(path))


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
        fail(
            path,
            f"user {user[i].as_py()!r} again (first on row {-first_line[codes[i]]})",
            row=int(lines[i]),
        )


def _json_object(path: Path) -> dict | None:
    """The file as one JSON object, or None if it is JSON lines (one object per line)."""
    try:
        value = json.loads(text_bytes(path))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            return None
        raise ImportFailed(f"{path}: row {e.lineno}: not JSON ({e.msg})") from e
    return value if isinstance(value, dict) else None


def read_item_map(spec: Items) -> Catalogue | None:
    """The items of a `.json` file holding one JSON object (`_item_map`); None for any other
    file, which is a catalogue table (`import_tables.read_items`)."""
    path = Path(spec.path)
    if path.suffix.lower() != ".json":
        return None
    mapping = _json_object(path)
    return None if mapping is None else _item_map(path, mapping, spec.map_attribute)


def _item_map(path: Path, mapping: dict, attribute: str) -> Catalogue:
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
    return Catalogue(
        pa.array(ids, pa.string()),
        {},
        {attribute: ("str_list", pa.array(values, pa.list_(pa.string())))},
        None,
        closed=False,
    )
