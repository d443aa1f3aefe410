"""Group commit (DESIGN §7): concurrent events calls, and concurrent users calls, that reach the
coordinator while a transaction runs share the next one: one prepare per shard holding every
call's part for it, one decision, one commit, each fsync'd once (`m31.cluster.coordinator`).

A call is queued (`Call`), and the thread that next takes the coordinator's mutex commits every
call queued by then. Each call is still answered only after its own part is durable on every
shard it touches, and all or nothing: a group a shard refuses (an invalid call among them) is
run again call by call, so that each gets its own answer; a shard that is down fails only the
calls that touch it, and the others are committed without it.

A group's parts for one shard are one operation of the same kind, its calls' columns (events)
or users concatenated in queue order: applying it is applying the calls one after the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The operations whose concurrent calls are committed together.
GROUPED = ("events", "users")
_EVENT_COLUMNS = ("user_id", "ad_id", "ts", "surface")
_EVENT_OPTIONAL = ("type", "weight")

Ops = Mapping[int, tuple[str, dict[str, Any], Any]]


@dataclass(eq=False)  # calls are told apart by identity, never by their content
class Call:
    """One mutation call waiting for its answer (`result`, set under the coordinator's mutex)."""

    ops: Ops
    key: str | None = None
    digest: str | None = None
    result: tuple | None = None

    @property
    def kind(self) -> str | None:
        """The operation every part of the call is, if it is one of `GROUPED`; else None."""
        kinds = {op for op, _, _ in self.ops.values()}
        return kinds.pop() if len(kinds) == 1 and kinds <= set(GROUPED) else None


def keys_of(calls: Sequence[Call]) -> list[list]:
    """[key, digest] of each keyed call: what a commit record logs for them."""
    return [[c.key, c.digest] for c in calls if c.key is not None]


def merged(calls: Sequence[Call]) -> dict[int, tuple[str, dict[str, Any], None]]:
    """The calls' parts (all of one `GROUPED` kind) as one operation per shard, in call order."""
    kinds = {c.kind for c in calls}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"a group is calls of one of {GROUPED}, got {sorted(map(str, kinds))}")
    kind = kinds.pop()
    parts: dict[int, list[dict[str, Any]]] = {}
    for call in calls:
        for s, (_, args, _) in call.ops.items():
            parts.setdefault(s, []).append(args)
    join = _events if kind == "events" else _users
    return {s: (kind, join(args), None) for s, args in sorted(parts.items())}


def _events(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: [v for p in parts for v in p[name]] for name in _EVENT_COLUMNS}
    for name in _EVENT_OPTIONAL:  # None where no call gave the column, else None per event
        given = [p.get(name) for p in parts]
        out[name] = (
            None
            if all(g is None for g in given)
            else [
                v
                for p, g in zip(parts, given, strict=True)
                for v in (g if g is not None else [None] * len(p["user_id"]))
            ]
        )
    return out


def _users(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"users": [u for p in parts for u in p["users"]]}
