"""Item attributes as the ad tower reads them: hashed tokens per ad (DESIGN §3, "Ad tower").

Shapes: A ads, T tokens per ad.

A dataset's declared item attributes of kind str and str_list (meta.json `item_attributes`: the
categories and brand of the Amazon files, any categorical or list column of an imported
catalogue) become tokens: each (column, value) pair hashed to a 63-bit id, so that an ad gets
the same tokens in training, in the online features and when it is upserted later with the same
attributes, and a value first seen online still has a token (the model hashes it into its
table). Each ad keeps at most `MAX_TOKENS`, its columns in declared order and each column's
values sorted; -1 pads. int and float attributes stay filter fields only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MAX_TOKENS = 32
TOKEN_KINDS = ("str", "str_list")


def token(column: str, value: str) -> int:
    """The id of `value` in `column`: a 63-bit hash, stable across processes and machines."""
    digest = hashlib.blake2b(f"{column}\x1f{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def token_columns(kinds: Mapping[str, str]) -> list[str]:
    """The declared attribute columns that become tokens, in declared order."""
    return [name for name, kind in kinds.items() if kind in TOKEN_KINDS]


def attribute_tokens(
    columns: Mapping[str, Sequence[Any]], kinds: Mapping[str, str], n: int
) -> np.ndarray:
    """[n, T] int64 tokens of n ads, T the most any ad has (at most `MAX_TOKENS`), -1 padding.

    `columns`: column -> its n values (a str or None for kind str; a list of str, or None, for
    kind str_list), for every column of `kinds` (column -> kind) that `token_columns` keeps."""
    rows: list[list[int]] = [[] for _ in range(n)]
    known: dict[tuple[str, str], int] = {}
    for name in token_columns(kinds):
        values = columns[name]
        if len(values) != n:
            raise ValueError(f"{name}: {len(values)} values for {n} ads")
        for i, value in enumerate(values):
            if value is None:
                continue
            words = [value] if kinds[name] == "str" else sorted({w for w in value if w is not None})
            for w in words:
                t = known.get((name, w))
                if t is None:
                    t = known[(name, w)] = token(name, w)
                rows[i].append(t)
    width = min(MAX_TOKENS, max((len(r) for r in rows), default=0))
    out = np.full((n, width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        kept = r[:width]
        out[i, : len(kept)] = kept
    return out
