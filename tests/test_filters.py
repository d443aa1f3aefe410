import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m31.index import AttributeTable, FilterError, compile_filter, evaluate_row
from m31.index.columns import columns_from_rows
from m31.index.filters import (
    MAX_NODES,
    MAX_PREDICATES,
    MAX_VALUES,
    HasValue,
    NoneOf,
    Predicate,
    with_clauses,
)

SCHEMA = {"n": "int", "m": "int", "f": "float", "s": "str", "u": "str", "t": "str_list"}
I64 = (-(2**63), 2**63 - 1)
WORDS = ["a", "b", "c", "", "é"]
TAGS = ["a", "b", "c", "d"]

CELLS = {
    "int": st.none() | st.integers(-3, 3) | st.sampled_from(I64),
    "float": st.none()
    | st.sampled_from([-1.5, 0.0, -0.0, 2.5, math.inf, -math.inf, math.nan])
    | st.integers(-2, 2),
    "str": st.none() | st.sampled_from(WORDS),
    "str_list": st.none() | st.lists(st.sampled_from(TAGS), max_size=4),
}
# Filter values include some no row holds ("zz", 7), which must match nothing.
VALUES = {
    "int": st.integers(-4, 4) | st.sampled_from([*I64, 7]),
    "float": st.sampled_from([-1.5, 0.0, 2.5, math.inf, -math.inf, 1, -2]),
    "str": st.sampled_from([*WORDS, "zz"]),
}


def row_strategy():
    return st.fixed_dictionaries({name: CELLS[kind] for name, kind in SCHEMA.items()})


@st.composite
def predicates(draw):
    name = draw(st.sampled_from(sorted(SCHEMA)))
    kind = SCHEMA[name]
    if kind == "str_list":
        return {"contains": [name, draw(st.sampled_from([*TAGS, "zz"]))]}
    value = VALUES[kind]
    ops = ["eq", "in"] + (["range"] if kind != "str" else [])
    op = draw(st.sampled_from(ops))
    if op == "eq":
        return {"eq": [name, draw(value)]}
    if op == "in":
        return {"in": [name, draw(st.lists(value, max_size=3))]}
    lo, hi = draw(st.none() | value), draw(st.none() | value)
    if lo is not None and hi is not None and lo > hi:  # an empty range is refused
        lo, hi = hi, lo
    return {"range": [name, lo, hi]}


filters = st.recursive(
    predicates(),
    lambda children: st.one_of(
        st.builds(lambda c: {"all": c}, st.lists(children, max_size=3)),
        st.builds(lambda c: {"any": c}, st.lists(children, max_size=3)),
        st.builds(lambda c: {"not": c}, children),
    ),
    max_leaves=8,
)


@st.composite
def tables(draw):
    """(final rows, table) where the table was first filled with other rows, then overwritten
    in two batches in random order: vocabulary growth and rewritten list rows are exercised."""
    final = draw(st.lists(row_strategy(), max_size=25))
    first = draw(st.lists(row_strategy(), min_size=len(final), max_size=len(final)))
    order = draw(st.permutations(range(len(final))))
    cut = draw(st.integers(0, len(final)))
    table = AttributeTable(SCHEMA, capacity=len(final) + draw(st.integers(0, 5)))
    table.write(torch.arange(len(first)), _columns(first))
    for part in (order[:cut], order[cut:]):
        table.write(torch.tensor(part, dtype=torch.int64), _columns([final[i] for i in part]))
    return final, table


def _columns(rows):
    return columns_from_rows(rows, SCHEMA)


@settings(max_examples=300, deadline=None)
@given(data=tables(), expr=filters)
def test_compiled_filter_equals_reference_on_every_row(data, expr):
    rows, table = data
    expr = json.loads(json.dumps(expr))  # filters arrive as JSON
    mask = compile_filter(expr, SCHEMA)(table)
    assert mask.dtype == torch.bool and mask.shape == (len(rows),)
    assert mask.tolist() == [evaluate_row(expr, row) for row in rows]


@settings(max_examples=200, deadline=None)
@given(
    data=tables(),
    expr=st.one_of(st.none(), filters),
    present=st.sampled_from([None, "n", "f"]),
    none_of=st.one_of(st.none(), st.lists(st.integers(-3, 3), max_size=4)),
)
def test_the_engines_clauses_are_the_filter_they_stand_for(data, expr, present, none_of):
    """A request's filter with the engine's typed clauses (value ranking's `HasValue`, a cap's
    `NoneOf`) holds on the rows where the filter and each clause, written as the JSON it stands
    for, all hold."""
    rows, table = data
    expr = json.loads(json.dumps(expr))
    clauses, parts = [], [expr] if expr else []
    if present is not None:
        clauses.append(HasValue(present))
        parts.append({"range": [present, None, None]})
    if none_of is not None:
        clauses.append(NoneOf("m", tuple(none_of)))
        parts.append({"not": {"in": ["m", none_of]}})
    got = with_clauses(compile_filter(expr, SCHEMA) if expr else None, clauses, SCHEMA)
    if not parts:
        assert got is None
    else:
        assert got(table).tolist() == [evaluate_row({"all": parts}, row) for row in rows]


def test_a_clause_on_a_field_it_cannot_test_is_refused():
    with pytest.raises(FilterError, match="numeric field"):
        with_clauses(None, [HasValue("s")], SCHEMA)
    with pytest.raises(FilterError, match="unknown field"):
        with_clauses(None, [NoneOf("campaign_id", (1,))], SCHEMA)


def _same(kind, a, b):
    if kind == "str_list":
        return sorted(set(a or [])) == b  # lists are sets; null reads back empty
    if isinstance(a, float) and math.isnan(a):
        return b is not None and math.isnan(b)
    return a == b


@settings(max_examples=100, deadline=None)
@given(data=tables())
def test_table_decodes_what_was_written(data):
    rows, table = data
    decoded = table.to_arrow().to_pylist()
    assert len(decoded) == len(rows)
    for row, back in zip(rows, decoded, strict=True):
        assert [k for k, kind in SCHEMA.items() if not _same(kind, row[k], back[k])] == [], (
            row,
            back,
        )


@settings(max_examples=50, deadline=None)
@given(data=tables(), expr=filters)
def test_take_keeps_filter_results(data, expr):
    rows, table = data
    keep = torch.arange(len(rows) - 1, -1, -2)  # every other row, reversed
    taken = table.take(keep, capacity=len(rows) + 1)
    fn = compile_filter(expr, SCHEMA)
    assert fn(taken).tolist() == fn(table)[keep].tolist()


def test_empty_combinators_and_empty_table():
    table = AttributeTable.from_rows([{"n": 1}, {}], SCHEMA)
    assert compile_filter({"all": []}, SCHEMA)(table).tolist() == [True, True]
    assert compile_filter({"any": []}, SCHEMA)(table).tolist() == [False, False]
    assert compile_filter({"in": ["n", []]}, SCHEMA)(table).tolist() == [False, False]
    assert compile_filter({"not": {"eq": ["n", 1]}}, SCHEMA)(table).tolist() == [False, True]
    empty = AttributeTable(SCHEMA, capacity=4)
    assert compile_filter({"eq": ["s", "a"]}, SCHEMA)(empty).shape == (0,)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        (
            {"all": [{"eq": ["n", 1]}, {"eq": ["colour", 1]}]},
            "filter.all[1].eq: unknown field 'colour'",
        ),
        ({"xor": []}, "filter: unknown operator 'xor'"),
        ({"any": [{"not": {"near": ["n", 1]}}]}, "filter.any[0].not: unknown operator 'near'"),
        (
            {"eq": ["n", 1], "in": ["n", [1]]},
            "filter: expected an object with exactly one operator",
        ),
        ([{"eq": ["n", 1]}], "filter: expected an object with exactly one operator"),
        ({"all": {"eq": ["n", 1]}}, "filter.all: expected a list of filters"),
        ({"eq": ["n", 1, 2]}, "filter.eq: expected [field, value]"),
        ({"range": ["n", 1]}, "filter.range: expected [field, lo, hi]"),
        ({"in": ["n", 1]}, "filter.in: expected a list of values"),
        ({"eq": [3, 1]}, "filter.eq: field name must be a string"),
        ({"eq": ["n", "1"]}, "filter.eq: value '1' is not an int64 integer"),
        ({"eq": ["n", True]}, "filter.eq: value True is not an int64 integer"),
        ({"eq": ["n", 1.5]}, "filter.eq: value 1.5 is not an int64 integer"),
        ({"eq": ["n", 2**63]}, "is not an int64 integer"),
        ({"in": ["s", ["a", 1]]}, "filter.in: value 1 is not a string"),
        ({"range": ["f", "a", None]}, "filter.range: lo 'a' is not a number"),
        ({"range": ["f", None, math.nan]}, "filter.range: hi is NaN"),
        ({"range": ["n", 2, 1]}, "filter.range: lo 2 is above hi 1, so nothing would match"),
        ({"eq": ["f", 2**60 + 1]}, "not exactly representable as float64"),
        ({"contains": ["n", 1]}, "filter.contains: 'contains' needs a list field, 'n' is int"),
        ({"contains": ["t", 1]}, "filter.contains: value 1 is not a string"),
        ({"eq": ["t", "a"]}, "filter.eq: 'eq' does not apply to list field 't'; use 'contains'"),
        ({"range": ["s", "a", "b"]}, "filter.range: 'range' needs a numeric field, 's' is str"),
        ({"not": {"all": [{"any": [{}]}]}}, "filter.not.all[0].any[0]: expected an object"),
    ],
)
def test_invalid_filters_name_the_path(expr, message):
    with pytest.raises(FilterError, match=re.escape(message)):
        compile_filter(expr, SCHEMA)


def test_a_filter_beyond_its_bounds_is_refused_naming_the_bound():
    at_bound = {"any": [{"eq": ["n", i]} for i in range(MAX_NODES - 1)]}  # MAX_NODES objects
    assert isinstance(compile_filter(at_bound, SCHEMA).node[1][0], Predicate)
    cases = [
        ({"any": [*at_bound["any"], {"eq": ["n", -1]}]}, f"more than {MAX_NODES} objects"),
        (
            {"all": [{"in": ["n", list(range(MAX_VALUES))]}, {"in": ["f", [0.5]]}]},
            f"more than {MAX_VALUES} values",
        ),
        (
            {"all": [{"range": ["n", i, None]} for i in range(MAX_PREDICATES + 1)]},
            f"{MAX_PREDICATES + 1} distinct predicates, more than {MAX_PREDICATES}",
        ),
    ]
    for expr, message in cases:
        with pytest.raises(FilterError, match=re.escape(message)):
            compile_filter(expr, SCHEMA)
    # Distinct leaves, not objects: the same range twice is one predicate.
    same = {"all": [{"range": ["n", 1, None]}] * (MAX_PREDICATES + 1)}
    compile_filter(same, SCHEMA)


def test_eq_and_in_of_one_field_under_any_are_one_predicate():
    expr = {
        "any": [
            {"eq": ["n", 3]},
            {"range": ["f", 0, 1]},
            {"in": ["n", [2, 1]]},
            {"eq": ["s", "a"]},
            {"all": [{"eq": ["n", 7]}]},
        ]
    }
    op, parts = compile_filter(expr, SCHEMA).node
    assert op == "any"
    assert [p.key if isinstance(p, Predicate) else p[0] for p in parts] == [
        compile_filter({"in": ["n", [1, 2, 3]]}, SCHEMA).key,
        ("range", "f", 0.0, 1.0),
        ("in", "s", ("a",)),
        "all",  # under another operator: not merged
    ]


def test_filter_error_is_a_value_error():
    assert issubclass(FilterError, ValueError)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"n": 1.5}, "row 0, attribute 'n': 1.5 is not a valid int value"),
        ({"t": "ab"}, "row 0, attribute 't': 'ab' is not a valid str_list value"),
        ({"s": 3}, "row 0, attribute 's'"),
        ({"colour": 3}, "row 0: unknown attribute 'colour'"),
    ],
)
def test_rows_are_type_checked(row, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AttributeTable.from_rows([row], SCHEMA)
