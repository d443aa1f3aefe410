"""List attributes under hostile input (issue 10, item 4): memory that grows with the data, not
with vocabulary x rows; bounded vocabularies, lists and country codes, refused before anything
is applied or logged; and masks that still equal `evaluate_row` through any mutation."""

import itertools
import re
import string
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m31.bench.attribute_memory import tensor_bytes  # what `m31 bench attribute-memory` counts
from m31.index import (
    AdIndex,
    AdIndexError,
    AttributeTable,
    DurableIndex,
    FilterError,
    RequestContext,
    compile_filter,
    evaluate_row,
)
from m31.index.columns import columns_from_arrow, columns_from_rows
from m31.index.limits import MAX_LIST_VALUES, MAX_VALUE_CHARS, MAX_VOCABULARY
from m31.index.testing import eligible_ads, reference_mask
from m31.index.wal import LOG
from m31.vocabularies import PLATFORMS
from m31.world.generate import COUNTRIES

G, D = 2, 3


def upsert(index, ids, attrs):
    n = len(ids)
    return index.upsert(ids, torch.zeros(n, G), torch.zeros(n, D), torch.zeros(n), attrs)


# ---- memory ------------------------------------------------------------------------------------


def test_list_memory_grows_with_the_values_held_not_with_vocabulary_times_rows():
    schema = {"t": "str_list"}
    cap, n = 50_000, 1_000
    few = [{"t": ["w0", "w1", "w2"]} for _ in range(n)]
    many = [{"t": [f"w{i}-{j}" for j in range(3)]} for i in range(n)]  # 3,000 distinct values
    sizes = []
    for rows in (few, many):
        table = AttributeTable(schema, capacity=cap)
        table.write(torch.arange(n), columns_from_rows(rows, schema))
        sizes.append(tensor_bytes(table))
    assert sizes[1] == sizes[0], "distinct values cost no tensor memory"
    # Per row: where its values start (int64) and how many (int32); per value: code and row.
    assert sizes[1] <= 12 * cap + 8 * 3 * n


def test_rewriting_rows_again_and_again_keeps_memory_flat():
    schema = {"t": "str_list"}
    table = AttributeTable(schema, capacity=64)
    sizes = []
    for k in range(300):
        rows = [{"t": [f"v{k}-{i}", "common"]} for i in range(10)]
        table.write(torch.arange(10), columns_from_rows(rows, schema))
        sizes.append(tensor_bytes(table))
    assert max(sizes) == sizes[0]
    assert table.to_arrow().column("t").to_pylist() == [sorted(r["t"]) for r in rows]
    assert table.contains("t", "v0-3").tolist() == [False] * 10
    assert table.contains("t", "v299-3").tolist() == [i == 3 for i in range(10)]


def test_an_index_grows_by_bytes_per_value_held():
    index = AdIndex(G, D, dtype=torch.float32, capacity=4096)
    upsert(index, list(range(100)), [{"advertiser_id": 1, "tags": ["a"]}] * 100)
    before = tensor_bytes(index._attrs)
    ids = list(range(100, 200))
    upsert(
        index, ids, [{"advertiser_id": 1, "tags": [f"new-{i}-{j}" for j in range(10)]} for i in ids]
    )
    # 1,000 new values on 100 ads: their entries, with the buffer's geometric slack.
    assert tensor_bytes(index._attrs) - before <= 2 * 8 * (1_000 + 100)


# ---- bounds ------------------------------------------------------------------------------------


def _index_with_full_vocabulary(capacity: int = 2048) -> AdIndex:
    """Ads 0.. whose tags take the whole vocabulary: MAX_VOCABULARY distinct values."""
    index = AdIndex(G, D, dtype=torch.float32, capacity=capacity)
    values = [f"v{k}" for k in range(MAX_VOCABULARY)]
    chunks = [values[lo : lo + MAX_LIST_VALUES] for lo in range(0, len(values), MAX_LIST_VALUES)]
    upsert(index, list(range(len(chunks))), [{"advertiser_id": 1, "tags": c} for c in chunks])
    return index


def _observable(index: AdIndex) -> tuple:
    return (
        index.version,
        len(index),
        index.num_rows,
        index.get(0).attributes,
        index._attrs.code("tags", "brand-new"),
        len(index._attrs._words["tags"]),
    )


def test_a_full_vocabulary_refuses_new_values_and_applies_nothing():
    index = _index_with_full_vocabulary()
    before = _observable(index)
    known = {"advertiser_id": 1, "tags": ["v1", "v2"]}
    message = f"ad 9001: tags would hold more than {MAX_VOCABULARY} distinct values"
    with pytest.raises(AdIndexError, match=re.escape(message)):
        upsert(index, [9000, 9001], [known, {"advertiser_id": 1, "tags": ["v3", "brand-new"]}])
    with pytest.raises(AdIndexError, match=re.escape("ad 0: tags would hold more than")):
        index.update_attributes(0, tags=["brand-new"])
    assert _observable(index) == before and 9000 not in index
    upsert(index, [9000], [known])  # values already held are still welcome
    assert index.get(9000).attributes["tags"] == ["v1", "v2"]

    # Compaction drops the values only deleted ads held, which makes room again.
    index.delete([1, 2])
    index.compact()
    upsert(index, [9001], [{"advertiser_id": 1, "tags": ["brand-new"]}])
    assert index.get(9001).attributes["tags"] == ["brand-new"]
    assert index._attrs.code("tags", f"v{MAX_LIST_VALUES}") is None  # ad 1's first value


def test_a_refused_mutation_of_a_durable_index_is_not_logged(tmp_path):
    with DurableIndex.create(tmp_path / "d", _index_with_full_vocabulary()) as d:
        log = tmp_path / "d" / LOG
        size, version = log.stat().st_size, d.version
        with pytest.raises(AdIndexError, match="ad 9001: tags would hold more than"):
            upsert(d, [9001], [{"advertiser_id": 1, "tags": ["brand-new"]}])
        with pytest.raises(AdIndexError, match="ad 0: tags would hold more than"):
            d.update_attributes(0, tags=["brand-new"])
        with pytest.raises(AdIndexError, match="ad 9002: target_countries value 'usa'"):
            upsert(d, [9002], [{"advertiser_id": 1, "target_countries": ["usa"]}])
        assert log.stat().st_size == size and d.version == version
        upsert(d, [9003], [{"advertiser_id": 1, "tags": ["v7"]}])  # still takes mutations
        assert log.stat().st_size > size
    with DurableIndex.open(tmp_path / "d") as d:
        assert d.version == version + 1 and 9001 not in d.index and 9003 in d.index


@pytest.mark.parametrize("country", ["usa", "us", "U1", "ÜS", "", "US ", "U", "US\n"])
def test_country_codes_must_be_iso_shaped(country):
    index = AdIndex(G, D, dtype=torch.float32)
    message = f"ad 5: target_countries value {country!r} is not an ISO 3166-1 alpha-2"
    with pytest.raises(AdIndexError, match=re.escape(message)):
        upsert(
            index,
            [4, 5],
            [
                {"advertiser_id": 1, "target_countries": ["US"]},
                {"advertiser_id": 1, "target_countries": ["DE", country]},
            ],
        )
    assert len(index) == 0 and index.version == 0
    upsert(index, [4], [{"advertiser_id": 1, "target_countries": ["US"]}])
    with pytest.raises(AdIndexError, match=re.escape("ad 4: target_countries value")):
        index.update_attributes(4, target_countries=[country])
    assert index.get(4).attributes["target_countries"] == ["US"]
    with pytest.raises(
        FilterError, match=re.escape("filter.not.contains: 'target_countries' holds ISO")
    ):
        compile_filter({"not": {"contains": ["target_countries", country]}}, index.schema)


def test_every_code_shaped_country_is_accepted_in_one_list():
    index = AdIndex(G, D, dtype=torch.float32)
    codes = ["".join(p) for p in itertools.product(string.ascii_uppercase, repeat=2)]
    assert set(COUNTRIES) <= set(codes)  # the synthetic world's countries stay valid
    upsert(index, [1], [{"advertiser_id": 1, "target_countries": codes}])
    assert index.get(1).attributes["target_countries"] == codes
    assert compile_filter({"contains": ["target_countries", "ZZ"]}, index.schema)(
        index._attrs
    ).tolist() == [True]


@pytest.mark.parametrize("field", ["tags", "labels"])
def test_free_form_lists_are_bounded_per_ad(field):
    index = AdIndex(G, D, dtype=torch.float32, extra_fields={"labels": "str_list"})
    longest = ["x" * MAX_VALUE_CHARS, "é" * MAX_VALUE_CHARS]  # characters, not bytes
    most = [f"t{i}" for i in range(MAX_LIST_VALUES - 2)] + longest
    upsert(index, [1], [{"advertiser_id": 1, field: most}])
    too_many = [f"t{i}" for i in range(MAX_LIST_VALUES + 1)]
    too_long = ["ok", "y" * (MAX_VALUE_CHARS + 1)]
    for value, message in [
        (too_many, f"{field} holds {MAX_LIST_VALUES + 1} values (at most {MAX_LIST_VALUES})"),
        (
            too_long,
            f"{field} value '{'y' * MAX_VALUE_CHARS}'… is longer than {MAX_VALUE_CHARS} characters",
        ),
    ]:
        with pytest.raises(AdIndexError, match=re.escape(f"ad 2: {message}")):
            upsert(index, [2], [{"advertiser_id": 1, field: value}])
        with pytest.raises(AdIndexError, match=re.escape(f"ad 1: {message}")):
            index.update_attributes(1, **{field: value})
    assert index.version == 1 and index.get(1).attributes[field] == sorted(most)


# ---- masks equal the definition through mutations ------------------------------------------

SCHEMA = {"n": "int", "s": "str", "t": "str_list", "u": "str_list"}
WORDS = ["a", "b", "c", "d", "", "é", "a b"]
LISTS = st.none() | st.lists(st.sampled_from(WORDS), max_size=5)  # repeats allowed
ROWS = st.fixed_dictionaries(
    {
        "n": st.none() | st.integers(-2, 2),
        "s": st.none() | st.sampled_from(["x", "y", "w", "v", "é"]),
        "t": LISTS,
        "u": LISTS,
    }
)


def _filters(contains):
    return st.recursive(
        contains,
        lambda children: st.one_of(
            st.builds(lambda c: {"all": c}, st.lists(children, max_size=3)),
            st.builds(lambda c: {"any": c}, st.lists(children, max_size=3)),
            st.builds(lambda c: {"not": c}, children),
        ),
        max_leaves=6,
    )


TABLE_FILTERS = _filters(
    st.builds(
        lambda f, w: {"contains": [f, w]},
        st.sampled_from(["t", "u"]),
        st.sampled_from([*WORDS, "zz"]),
    )
    | st.builds(lambda v: {"eq": ["n", v]}, st.integers(-2, 2))
    | st.builds(lambda v: {"in": ["s", v]}, st.lists(st.sampled_from(["x", "y", "q"]), max_size=2))
)


def _write(table, rows, model, data):
    """Write `model` rows `rows`, as Python rows or as an arrow table with lists unnormalised."""
    if data.draw(st.booleans()):
        columns = columns_from_rows([model[i] for i in rows], SCHEMA)
    else:
        raw = {name: [model[i][name] for i in rows] for name in SCHEMA}
        columns = columns_from_arrow(pa.table(raw, schema=pa.schema(_arrow_fields())), SCHEMA)
    table.write(torch.tensor(rows, dtype=torch.int64), columns)


def _arrow_fields():
    types = {"n": pa.int64(), "s": pa.string(), "t": pa.list_(pa.string())}
    return [pa.field(name, types.get(name, pa.list_(pa.string()))) for name in SCHEMA]


def _check_table(table, model, expr):
    assert table.n_rows == len(model)
    for field in ("t", "u"):
        for word in [*WORDS, "zz"]:
            expected = [word in (row[field] or []) for row in model]
            assert table.contains(field, word).tolist() == expected, (field, word)
        assert table.nonempty(field).tolist() == [bool(row[field]) for row in model]
    decoded = table.to_arrow().to_pylist()
    for row, back in zip(model, decoded, strict=True):
        assert back == {**row, "t": sorted(set(row["t"] or [])), "u": sorted(set(row["u"] or []))}
    for i in range(len(model)):  # one row decodes only its own words: the same as the table's
        assert table.to_arrow(torch.tensor([i])).to_pylist() == [decoded[i]]
    assert compile_filter(expr, SCHEMA)(table).tolist() == [evaluate_row(expr, r) for r in model]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), cap=st.integers(1, 37))
def test_table_masks_equal_the_reference_through_mutations(data, cap):
    table = AttributeTable(SCHEMA, capacity=cap)
    model: list[dict] = []  # row i of the table, as written
    for _ in range(data.draw(st.integers(1, 9))):
        op = data.draw(
            st.sampled_from(["append", "rewrite", "rewrite", "take", "round trip", "snapshot"])
        )
        if op == "append":
            new = data.draw(st.lists(ROWS, max_size=7))
            rows = list(range(len(model), len(model) + len(new)))
            model += new
            table.reserve(max(table.capacity, len(model)))
            _write(table, rows, model, data)
        elif op == "rewrite" and model:
            rows = data.draw(st.lists(st.sampled_from(range(len(model))), unique=True))
            for i in rows:
                model[i] = data.draw(ROWS)
            _write(table, rows, model, data)
        elif op == "take":
            keep = (
                data.draw(st.lists(st.sampled_from(range(len(model))), unique=True))
                if model
                else []
            )
            table = table.take(
                torch.tensor(keep, dtype=torch.int64), len(keep) + data.draw(st.integers(0, 3))
            )
            model = [model[i] for i in keep]
        elif op == "snapshot":  # a frozen view's copy, which later writes must not reach
            before, then = table.to_arrow(), list(model)
            snap = table.snapshot()
            if model:  # new words too, which the snapshot's shared vocabularies then hold
                model[0] = data.draw(ROWS)
                _write(table, [0], model, data)
            assert snap.to_arrow().equals(before)
            _check_table(snap, then, data.draw(TABLE_FILTERS))
            with pytest.raises(RuntimeError, match="read-only"):
                snap.write(torch.tensor([0]), columns_from_rows(then[:1], SCHEMA))
        elif op == "round trip":
            copy = AttributeTable(SCHEMA, capacity=len(model))
            copy.write(torch.arange(len(model)), columns_from_arrow(table.to_arrow(), SCHEMA))
            table = copy
        _check_table(table, model, data.draw(TABLE_FILTERS))


INDEX_FILTERS = _filters(
    st.builds(lambda w: {"contains": ["tags", w]}, st.sampled_from([*WORDS, "zz"]))
    | st.builds(lambda c: {"contains": ["target_countries", c]}, st.sampled_from(COUNTRIES[:4]))
)
AD = st.fixed_dictionaries(
    {
        "advertiser_id": st.integers(0, 2),
        "target_countries": st.lists(st.sampled_from(COUNTRIES[:4]), max_size=3),
        "target_platforms": st.lists(st.sampled_from(PLATFORMS), max_size=2),
        "tags": st.none() | st.lists(st.sampled_from(WORDS), max_size=4),
    }
)


def _eligible(index, request, expr):
    mask = index.eligible_mask(request, expr)
    return set(index.table()[3][mask].tolist())


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_index_masks_equal_the_reference_through_mutations(data):
    index = AdIndex(G, D, dtype=torch.float32, capacity=data.draw(st.integers(1, 9)))
    model: dict[int, dict] = {}
    for _ in range(data.draw(st.integers(1, 10))):
        op = data.draw(
            st.sampled_from(["upsert", "upsert", "update", "delete", "compact", "reload"])
        )
        if op == "upsert":
            ids = data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True))
            attrs = [data.draw(AD) for _ in ids]
            upsert(index, ids, attrs)
            model.update(zip(ids, attrs, strict=True))
        elif op == "update" and model:
            i = data.draw(st.sampled_from(sorted(model)))
            change = {
                "tags": data.draw(AD)["tags"],
                "target_countries": data.draw(AD)["target_countries"],
            }
            index.update_attributes(i, **change)
            model[i] = {**model[i], **change}
        elif op == "delete" and model:
            ids = data.draw(st.lists(st.sampled_from(sorted(model)), min_size=1, unique=True))
            index.delete(ids)
            for i in ids:
                del model[i]
        elif op == "compact":
            index.compact()
        elif op == "reload":
            with tempfile.TemporaryDirectory() as tmp:
                index = AdIndex.load(index.save(Path(tmp) / "snapshot"))
        country = data.draw(st.sampled_from([*COUNTRIES[:4], None]))
        request = RequestContext(
            country, None, None, data.draw(st.sampled_from([*PLATFORMS, None])), None, 0
        )
        expr = data.draw(INDEX_FILTERS)
        assert _eligible(index, request, expr) == eligible_ads(model, request, expr)
        assert torch.equal(index.eligible_mask(request, expr), reference_mask(index, request, expr))
        assert {i: index.get(i).attributes["tags"] for i in model} == {
            i: sorted(set(a["tags"] or [])) for i, a in model.items()
        }


def test_duplicate_values_in_an_arrow_list_read_back_once():
    table = AttributeTable({"t": "str_list"}, capacity=3)
    lists = pa.table({"t": pa.array([["b", "a", "b"], [], ["c", "c"]], pa.list_(pa.string()))})
    table.write(torch.arange(3), columns_from_arrow(lists, {"t": "str_list"}))
    assert table.to_arrow().column("t").to_pylist() == [["a", "b"], [], ["c"]]
    assert table.contains("t", "c").tolist() == [False, False, True]
    assert np.array_equal(table.nonempty("t").numpy(), [True, False, True])


def test_contains_masks_are_reused_until_a_write_and_never_shared():
    """Requests ask `contains` about the same few values: the row mask is kept per value, must
    follow every write, and no caller can change another's copy."""
    schema = {"tags": "str_list"}
    table = AttributeTable.from_rows(
        [{"tags": ["a"]}, {"tags": ["b"]}, {"tags": ["a", "b"]}], schema
    )
    first = table.contains("tags", "a")
    assert first.tolist() == [True, False, True]
    first[:] = False
    assert table.contains("tags", "a").tolist() == [True, False, True]
    table.write(torch.tensor([1]), columns_from_rows([{"tags": ["a"]}], schema))
    assert table.contains("tags", "a").tolist() == [True, True, True]
    table.reserve(8)
    table.write(torch.tensor([3]), columns_from_rows([{"tags": ["a"]}], schema))
    assert table.contains("tags", "a").tolist() == [True, True, True, True]
