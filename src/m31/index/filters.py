"""The filter language over per-ad attributes: validation, compilation to tensor ops, reference.

Shapes: N rows of the attribute table a filter runs on.

A filter is a JSON boolean tree::

    {"all": [f, ...]}   {"any": [f, ...]}   {"not": f}
    {"eq": [field, value]}   {"in": [field, [value, ...]]}
    {"range": [field, lo, hi]}      inclusive; lo or hi null = open on that side; lo <= hi
    {"contains": [field, value]}    list fields only

A filter's size is bounded, so that no request can make compiling it or building its mask
expensive (each bound is refused with a `FilterError` naming it): `MAX_NODES` objects in the
tree, `MAX_VALUES` values in its `in` lists together, `MAX_DEPTH` levels of nesting, and
`MAX_PREDICATES` distinct leaves once the `eq` and `in` leaves of one field under one `any` are
merged into a single `in` (each distinct leaf is one pass over an attribute column the first
time it is asked; so `{"any": [{"eq": ["advertiser_id", 1]}, {"eq": ["advertiser_id", 2]}]}`
costs what `{"in": ["advertiser_id", [1, 2]]}` costs).

`compile_filter` validates a tree once against a schema (field name -> kind) and returns a
`CompiledFilter`: a function from an `AttributeTable` (`m31.index.attributes`, where the
attributes are stored and encoded) to a bool mask [N], computed with a handful of tensor ops on
the table's device. It keeps the validated tree (`node`): all / any / not over `Predicate`
leaves, each named by a key of plain values, so that `m31.index.eligibility` can evaluate the
same filter over per-predicate row bitmaps and share them between requests. `evaluate_row` is
the plain-Python definition of the same semantics:
a null value never equals, lies in or contains anything (so `not` of such a predicate holds),
and a value the table has never seen simply matches nothing.

What the engine adds to a request's filter is typed, not JSON: `with_clauses` compiles a
request's filter with clauses (`HasValue`, `NoneOf`) into one `CompiledFilter`, the clauses
outside the request's own limits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from m31.index.attributes import AttributeTable
from m31.index.columns import cell_ok, check_schema
from m31.index.limits import COUNTRY_CODE, COUNTRY_FIELDS

_ARGS = {
    "eq": "[field, value]",
    "in": "[field, [values]]",
    "range": "[field, lo, hi]",
    "contains": "[field, value]",
}
_ARITY = {"eq": 2, "in": 2, "range": 3, "contains": 2}


class FilterError(ValueError):
    """An invalid filter expression; the message names the path of the bad node in the tree."""


MAX_DEPTH = 32  # nesting of all/any/not: deeper trees are refused, not recursed into
MAX_NODES = 1_000  # objects in one filter tree (operators and leaves)
MAX_VALUES = 100_000  # values of one filter's `in` lists together
# Distinct leaves of one compiled filter: half the eligibility cache (`MAX_CACHED_BITMAPS`), so
# that one request cannot evict every bitmap the others share.
MAX_PREDICATES = 64


@dataclass(frozen=True, eq=False)
class Predicate:
    """A leaf of a compiled filter: `run` maps a table (or `AttributeRows`) of n rows to a bool
    mask [n]. Predicates with equal keys hold on the same rows of every table."""

    key: tuple[Hashable, ...]  # (op, field, *normalised arguments)
    run: Callable[[AttributeTable], torch.Tensor]


# ("all", (node, ...)) | ("any", (node, ...)) | ("not", node) | Predicate
Node = tuple | Predicate


class CompiledFilter:
    """A validated filter: call it on a table for its bool mask [N]. `node` is the tree and
    `key` a hashable name of it: filters with equal keys hold on the same rows."""

    def __init__(self, node: Node):
        self.node = node
        self.key = _key(node)

    def __call__(self, table: AttributeTable) -> torch.Tensor:
        return _run(self.node, table)


def _key(node: Node) -> tuple:
    if isinstance(node, Predicate):
        return node.key
    op, arg = node
    return (op, _key(arg)) if op == "not" else (op, tuple(_key(c) for c in arg))


def _run(node: Node, table: AttributeTable) -> torch.Tensor:
    if isinstance(node, Predicate):
        return node.run(table)
    op, arg = node
    if op == "not":
        return ~_run(arg, table)
    if op == "all":
        mask = torch.ones(table.n_rows, dtype=torch.bool, device=table.device)  # [N]
        for child in arg:
            mask &= _run(child, table)
        return mask
    mask = torch.zeros(table.n_rows, dtype=torch.bool, device=table.device)  # [N]
    for child in arg:
        mask |= _run(child, table)
    return mask


def compile_filter(expr: Any, schema: Mapping[str, str]) -> CompiledFilter:
    """Validate `expr` once against `schema`; return table -> bool mask [N] on its device."""
    check_size(expr)
    node = _compile(expr, check_schema(schema), "filter", 0)
    leaves = _leaves(node)
    if len(leaves) > MAX_PREDICATES:
        raise FilterError(
            f"filter: {len(leaves)} distinct predicates, more than {MAX_PREDICATES} (eq and in "
            "on one field under one any count once: give the values as one in list)"
        )
    return CompiledFilter(node)


@dataclass(frozen=True)
class HasValue:
    """A clause the engine adds to a request's filter: rows whose `field` holds a value (not
    null). Ranking by value asks it of the bid (`m31.engine.requests.RANKS`)."""

    field: str


@dataclass(frozen=True)
class NoneOf:
    """A clause the engine adds to a request's filter: rows whose `field` is none of `values`
    (a null is none of them). A frequency cap per campaign leaves out the capped campaigns."""

    field: str
    values: tuple[int | float | str, ...]


# A typed clause: built by the engine from a request's options, never parsed from JSON
Clause = HasValue | NoneOf


def with_clauses(
    base: CompiledFilter | None, clauses: Sequence[Clause], schema: Mapping[str, str]
) -> CompiledFilter | None:
    """`base` (a request's own filter, or None) and every clause, as one compiled filter (None
    when there is neither). The request's own filter keeps its limits (`compile_filter`); the
    clauses are the engine's, outside them."""
    schema = check_schema(schema)
    nodes: list[Node] = [] if base is None else [base.node]
    for clause in clauses:
        where = f"clause {clause!r}"
        if isinstance(clause, HasValue):
            nodes.append(_predicate("range", [clause.field, None, None], schema, where))
        elif isinstance(clause, NoneOf):
            nodes.append(
                ("not", _predicate("in", [clause.field, list(clause.values)], schema, where))
            )
        else:
            raise TypeError(f"not a filter clause: {clause!r}")
    if not nodes:
        return None
    return CompiledFilter(nodes[0] if len(nodes) == 1 else ("all", tuple(nodes)))


def check_size(expr: Any) -> None:
    """FilterError if `expr` has more than `MAX_NODES` objects or `MAX_VALUES` values in its
    `in` lists; what is malformed (or too deep) is left to `compile_filter` to name. Stops at
    the first bound exceeded, so a huge tree costs no more than a small one to refuse."""
    nodes = values = 0
    stack = [expr]
    while stack:
        node = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise FilterError(f"filter: more than {MAX_NODES} objects (operators and leaves)")
        if not isinstance(node, Mapping) or len(node) != 1:
            continue
        ((op, arg),) = node.items()
        if op in ("all", "any") and isinstance(arg, list | tuple):
            stack.extend(arg)
        elif op == "not":
            stack.append(arg)
        elif op == "in" and isinstance(arg, list | tuple) and len(arg) == 2:
            if isinstance(arg[1], list | tuple):
                values += len(arg[1])
                if values > MAX_VALUES:
                    raise FilterError(
                        f"filter: more than {MAX_VALUES} values in its in lists together"
                    )


def _leaves(node: Node) -> set:
    if isinstance(node, Predicate):
        return {node.key}
    op, arg = node
    if op == "not":
        return _leaves(arg)
    return set().union(*(_leaves(child) for child in arg))


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _compile(node: Any, schema: dict[str, str], path: str, depth: int) -> Node:
    if depth > MAX_DEPTH:
        raise FilterError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if not isinstance(node, Mapping) or len(node) != 1:
        raise FilterError(
            f"{path}: expected an object with exactly one operator, got {_short(node)}"
        )
    ((op, arg),) = node.items()
    where = f"{path}.{op}"
    if op in ("all", "any"):
        if not isinstance(arg, list | tuple):
            raise FilterError(f"{where}: expected a list of filters, got {_short(arg)}")
        parts = [_compile(child, schema, f"{where}[{i}]", depth + 1) for i, child in enumerate(arg)]
        return (op, tuple(_merge_in(parts, schema) if op == "any" else parts))
    if op == "not":
        return ("not", _compile(arg, schema, where, depth + 1))
    if op in _ARITY:
        return _predicate(op, arg, schema, where)
    raise FilterError(
        f"{path}: unknown operator {op!r} (one of all, any, not, {', '.join(_ARITY)})"
    )


def _merge_in(parts: list[Node], schema: dict[str, str]) -> list[Node]:
    """The children of an `any` with its `in` leaves (`eq` is one) merged into one per field,
    in the place of the field's first: a row is in one of the sets iff it is in their union."""
    values: dict[str, list] = {}
    for part in parts:
        if isinstance(part, Predicate) and part.key[0] == "in":
            values.setdefault(part.key[1], []).extend(part.key[2])
    merged: list[Node] = []
    for part in parts:
        if not (isinstance(part, Predicate) and part.key[0] == "in"):
            merged.append(part)
        elif (field := part.key[1]) in values:
            merged.append(_in(field, schema[field], values.pop(field)))
    return merged


def _check_value(kind: str, v: Any, where: str, what: str = "value") -> Any:
    """A filter value for a scalar of `kind`, normalised to the Python type compared against."""
    if kind == "int":
        if not cell_ok("int", v):
            raise FilterError(f"{where}: {what} {v!r} is not an int64 integer")
        return int(v)
    if kind == "float":
        if not cell_ok("float", v):
            raise FilterError(f"{where}: {what} {v!r} is not a number")
        if math.isnan(v):
            raise FilterError(f"{where}: {what} is NaN, which never matches anything")
        # A float column compares in float64; an int that does not survive the round trip
        # would compare differently in Python and in torch.
        if float(v) != v:
            raise FilterError(f"{where}: {what} {v!r} is not exactly representable as float64")
        return float(v)
    if not isinstance(v, str):
        raise FilterError(f"{where}: {what} {v!r} is not a string")
    return v


def _predicate(op: str, arg: Any, schema: dict[str, str], where: str) -> Predicate:
    if not isinstance(arg, list | tuple) or len(arg) != _ARITY[op]:
        raise FilterError(f"{where}: expected {_ARGS[op]}, got {arg!r}")
    field = arg[0]
    if not isinstance(field, str):
        raise FilterError(f"{where}: field name must be a string, got {field!r}")
    if field not in schema:
        raise FilterError(f"{where}: unknown field {field!r}")
    kind = schema[field]
    if op == "contains":
        if kind != "str_list":
            raise FilterError(f"{where}: 'contains' needs a list field, {field!r} is {kind}")
        word = _check_value("str", arg[1], where)
        if field in COUNTRY_FIELDS and not re.fullmatch(COUNTRY_CODE, word):
            raise FilterError(
                f"{where}: {field!r} holds ISO 3166-1 alpha-2 codes (two uppercase letters), "
                f"got {word!r}"
            )
        return Predicate(("contains", field, word), lambda table: table.contains(field, word))
    if kind == "str_list":
        raise FilterError(f"{where}: {op!r} does not apply to list field {field!r}; use 'contains'")
    if op == "range":
        if kind == "str":
            raise FilterError(f"{where}: 'range' needs a numeric field, {field!r} is {kind}")
        lo = None if arg[1] is None else _check_value(kind, arg[1], where, "lo")
        hi = None if arg[2] is None else _check_value(kind, arg[2], where, "hi")
        if lo is not None and hi is not None and lo > hi:
            raise FilterError(f"{where}: lo {lo!r} is above hi {hi!r}, so nothing would match")
        return _range(field, lo, hi)
    if op == "eq":
        return _in(field, kind, [_check_value(kind, arg[1], where)])
    if not isinstance(arg[1], list | tuple):
        raise FilterError(f"{where}: expected a list of values, got {arg[1]!r}")
    return _in(field, kind, [_check_value(kind, v, where) for v in arg[1]])


def _range(field: str, lo: Any, hi: Any) -> Predicate:
    def run(table: AttributeTable) -> torch.Tensor:
        values, mask = table.numeric(field)  # [N], [N]
        if lo is not None:
            mask = mask & (values >= lo)
        if hi is not None:
            mask = mask & (values <= hi)
        return mask

    return Predicate(("range", field, lo, hi), run)


def _in(field: str, kind: str, wanted: list) -> Predicate:
    def run(table: AttributeTable) -> torch.Tensor:
        if kind == "str":
            values = table.codes(field)  # [N]; null = -1 is never a wanted code
            codes = [c for w in wanted if (c := table.code(field, w)) is not None]
            if not codes:
                return torch.zeros(table.n_rows, dtype=torch.bool, device=table.device)
            test = torch.tensor(codes, dtype=torch.int64, device=table.device)
            return values == test[0] if len(codes) == 1 else torch.isin(values, test)
        values, valid = table.numeric(field)  # [N], [N]
        if not wanted:
            return torch.zeros(table.n_rows, dtype=torch.bool, device=table.device)
        test = torch.tensor(wanted, dtype=values.dtype, device=table.device)
        hit = values == test[0] if len(wanted) == 1 else torch.isin(values, test)
        return valid & hit

    # Sorted and deduplicated, so that equal sets share a key (a float field holds no NaN).
    return Predicate(("in", field, tuple(sorted(set(wanted)))), run)


def evaluate_row(expr: Mapping[str, Any], row: Mapping[str, Any]) -> bool:
    """The reference semantics of a (valid) filter on one row of plain values; absent = null."""
    ((op, arg),) = expr.items()
    if op == "all":
        return all(evaluate_row(child, row) for child in arg)
    if op == "any":
        return any(evaluate_row(child, row) for child in arg)
    if op == "not":
        return not evaluate_row(arg, row)
    value = row.get(arg[0])
    if value is None:
        return False
    if op == "eq":
        return value == arg[1]
    if op == "in":
        return any(value == w for w in arg[1])  # not `in`: it matches NaN by identity
    if op == "range":
        lo, hi = arg[1], arg[2]
        return (lo is None or lo <= value) and (hi is None or value <= hi)
    return arg[1] in value
