"""Idempotency keys of event calls: each key is remembered with the version its call was applied
at and a digest of the call, so that a retry (the same call under the same key) answers that
version without applying anything, and a different call under a used key is refused, as payment
APIs and the IETF's Idempotency-Key draft do (422: the key does not name this call).

The digest is of the call's content, not of its JSON text: the same events in the same order
digest the same however the body was spaced or its keys ordered. Keys written before digests
were kept (older logs and snapshots) carry none and accept any retry, as they did.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

MAX_KEYS = 100_000  # keys remembered (the most recent)


class KeyReused(ValueError):
    """A used idempotency key given with a different call."""


def call_digest(user_ids, ad_ids, ts, surfaces, types=None, weights=None) -> str:
    """A digest of an events call: its events [n] in order, each (user, ad, time, surface,
    type, weight), None where not given."""
    n = len(user_ids)
    types = types if types is not None else [None] * n
    weights = weights if weights is not None else [None] * n
    rows = [
        [int(u), int(a), int(t), s, ty, None if w is None else float(w)]
        for u, a, t, s, ty, w in zip(user_ids, ad_ids, ts, surfaces, types, weights, strict=True)
    ]
    text = json.dumps(rows, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class IdempotencyKeys:
    """The last `MAX_KEYS` keys: key -> (version, digest or None). Not thread-safe: its owner
    serialises writes (the DurableIndex's mutex, the coordinator's)."""

    def __init__(self, items: Iterable[Sequence] = ()) -> None:
        """`items`: (key, version) or (key, version, digest) each, oldest first."""
        self._keys: OrderedDict[str, tuple[int, str | None]] = OrderedDict()
        for item in items:
            self.remember(item[0], item[1], item[2] if len(item) > 2 else None)

    def __len__(self) -> int:
        return len(self._keys)

    def applied(self, key: str, digest: str | None) -> int | None:
        """The version `key`'s call was applied at, if it was; KeyReused if that call was a
        different one (`digest` differs from the one remembered)."""
        if key not in self._keys:
            return None
        version, first = self._keys[key]
        if first is not None and digest is not None and first != digest:
            shown = key if len(key) <= 64 else key[:64] + "…"
            raise KeyReused(
                f"idempotency_key: {shown!r} was used at version {version} for a different call; "
                "a retry must repeat its call exactly, and a new call needs a new key"
            )
        return version

    def remember(self, key: str, version: int, digest: str | None) -> None:
        self._keys[key] = (int(version), digest)
        self._keys.move_to_end(key)
        while len(self._keys) > MAX_KEYS:
            self._keys.popitem(last=False)

    def items(self) -> list[tuple[str, int, str | None]]:
        """(key, version, digest) each, oldest first: what the constructor takes back."""
        return [(k, v, d) for k, (v, d) in self._keys.items()]
