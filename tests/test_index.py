import json
import os
import random
import re
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

from m31.engine.build import index_from_table
from m31.index import AdIndex, AdIndexError, FilterError, RequestContext, read_manifest
from m31.index.columns import BASE_FIELDS
from m31.index.testing import eligible, reference_mask
from m31.ops import score_topk
from m31.ops.quant import Int8Table, quantize_ad_table
from m31.world.config import preset
from m31.world.generate import generate

G, D = 3, 5
NOW = 1_700_000_000
REQ = RequestContext(country="US", age=30, gender="F", platform="ios", surface="feed", ts=NOW)


def embeddings(ids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = len(ids)
    return (
        torch.randn(n, G, generator=gen),
        torch.randn(n, D, generator=gen),
        torch.randn(n, generator=gen),
    )


def build(rows: dict, dtype=torch.float32, capacity=1024, seed=0) -> AdIndex:
    """An index over {ad_id: attributes}, inserted in one upsert."""
    index = AdIndex(G, D, dtype=dtype, capacity=capacity)
    ids = list(rows)
    index.upsert(ids, *embeddings(ids, seed), [rows[i] for i in ids])
    return index


def eligible_ids(index, request=REQ, filter_fn=None) -> list[int]:
    mask = index.eligible_mask(request, filter_fn)
    _, _, _, row_ids, _ = index.table()
    return row_ids[mask].tolist()


def state(index):
    """Everything observable about an index, to check that a failed call changed nothing."""
    with index.snapshot_view() as view:
        table = [view.g, view.x, view.b, view.row_ids, *(view.scales or ())]
        version = view.version
    ids = index.ids().tolist()
    return {
        "version": version,
        "len": len(index),
        "rows": index.num_rows,
        "capacity": index.capacity,
        "table": [t.clone() for t in table],
        "ids": ids,
        "ads": {i: index.get(i) for i in ids},
        "eligible": eligible_ids(index),
    }


def assert_same_state(a, b):
    ta, tb = a.pop("table"), b.pop("table")
    ads_a, ads_b = a.pop("ads"), b.pop("ads")
    assert a == b
    for u, v in zip(ta, tb, strict=True):
        assert torch.equal(u, v)
    assert ads_a.keys() == ads_b.keys()
    for i in ads_a:
        assert torch.equal(ads_a[i].g, ads_b[i].g) and torch.equal(ads_a[i].x, ads_b[i].x)
        assert ads_a[i].b == ads_b[i].b and ads_a[i].attributes == ads_b[i].attributes


# ---- eligibility ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "request_changes", "eligible"),
    [
        ({}, {}, True),
        ({"target_countries": ["US", "CA"]}, {}, True),
        ({"target_countries": ["DE"]}, {}, False),
        ({"target_countries": ["US"]}, {"country": None}, False),
        ({}, {"country": None, "age": None, "gender": None}, True),
        ({"target_age_min": 30, "target_age_max": 30}, {}, True),  # both bounds inclusive
        ({"target_age_min": 31}, {}, False),
        ({"target_age_min": 35, "target_age_max": 34}, {"age": 35}, False),  # targets nobody
        ({"target_age_max": 29}, {}, False),
        ({"target_age_min": 18}, {"age": None}, False),
        ({"target_genders": ["M"]}, {}, False),
        ({"target_genders": ["M", "F"]}, {}, True),
        ({"target_platforms": ["android", "web"]}, {}, False),
        ({"target_platforms": ["ios"]}, {}, True),
        ({"target_surfaces": ["reels"]}, {}, False),
        ({"target_surfaces": ["reels"]}, {"surface": "reels"}, True),
        ({"schedule_start": NOW}, {}, True),  # start inclusive
        ({"schedule_start": NOW + 1}, {}, False),
        ({"schedule_end": NOW}, {}, False),  # end exclusive
        ({"schedule_start": NOW - 5, "schedule_end": NOW + 1}, {}, True),
        ({"status": "paused"}, {}, False),
        ({"status": "budget_exhausted"}, {}, False),
        ({"status": "active"}, {}, True),
        ({}, {"exclude_ads": [7]}, False),
        ({}, {"exclude_ads": [8, 12345]}, True),
        ({}, {"exclude_advertisers": [99]}, False),
        ({}, {"exclude_advertisers": [98]}, True),
    ],
)
def test_targeting(attrs, request_changes, eligible):
    index = build({7: {"advertiser_id": 99, **attrs}, 8: {"advertiser_id": 1}})
    request = RequestContext(**{**REQ.__dict__, **request_changes})
    assert (7 in eligible_ids(index, request)) is eligible
    assert (8 in eligible_ids(index, request)) is (8 not in request.exclude_ads)


def test_filters_combine_with_targeting():
    index = build(
        {
            1: {"advertiser_id": 1, "tags": ["shoes", "sale"]},
            2: {"advertiser_id": 2, "tags": ["shoes"], "status": "paused"},
            3: {"advertiser_id": 3, "tags": ["books"]},
        }
    )
    expr = {"any": [{"contains": ["tags", "shoes"]}, {"eq": ["advertiser_id", 3]}]}
    assert eligible_ids(index, REQ, expr) == [1, 3]
    assert eligible_ids(index, REQ, {"contains": ["tags", "unheard-of"]}) == []
    with pytest.raises(FilterError, match=re.escape("filter.eq: unknown field 'colour'")):
        index.eligible_mask(REQ, {"eq": ["colour", "red"]})


def test_mutations_return_increasing_versions_and_change_eligibility():
    index = AdIndex(G, D)
    assert index.version == 0
    versions = [index.upsert([1, 2], *embeddings([1, 2]), [{"advertiser_id": 1}] * 2)]
    versions.append(index.pause(1))
    assert eligible_ids(index) == [2]
    versions.append(index.resume(1))
    assert eligible_ids(index) == [1, 2]
    versions.append(index.update_attributes(2, target_countries=["DE"], tags=["x"]))
    assert eligible_ids(index) == [1]
    assert index.get(2).attributes["tags"] == ["x"]
    versions.append(index.delete([1]))
    assert eligible_ids(index) == [] and len(index) == 1 and 1 not in index
    versions.append(index.compact())
    versions.append(index.upsert([], torch.zeros(0, G), torch.zeros(0, D), [], []))
    assert versions == list(range(1, 8)) and index.version == 7


# ---- rejected calls leave the index unchanged ----------------------------------------------


def _good(n=2):
    ids = [10 + i for i in range(n)]
    return ids, *embeddings(ids, seed=5), [{"advertiser_id": 4}] * n


def _with(i, value):
    args = list(_good())
    args[i] = value
    return args


def _attrs(**kw):
    return _with(4, [{"advertiser_id": 4}, {"advertiser_id": 4, **kw}])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_with(0, [10, 10]), "upsert: ad id 10 appears more than once"),
        (_with(1, torch.zeros(2, G + 1)), f"g: expected shape [2, {G}], got [2, {G + 1}]"),
        (_with(2, torch.zeros(3, D)), f"x: expected shape [2, {D}], got [3, {D}]"),
        (_with(3, torch.zeros(2, 1)), "b: expected shape [2], got [2, 1]"),
        (_with(1, torch.tensor([[0.0] * G, [0.0, float("nan"), 0.0]])), "g: row 1 holds NaN"),
        (_with(3, torch.tensor([0.0, float("inf")])), "b: row 1 holds NaN or inf"),
        (_with(2, [[1.0] * D, [1.0]]), "x: not a numeric array"),
        (_with(0, [1.5, 2.5]), "ad_ids: expected a 1-d sequence of integers"),
        (_with(4, [{"advertiser_id": 4}]), "attributes: 1 rows for 2 ads"),
        (_with(4, "advertiser"), "attributes: expected a list of dicts or a pyarrow.Table"),
        (_attrs(colour="red"), "attributes: row 1: unknown attribute 'colour'"),
        (_attrs(status="on"), "attributes: status 'on' is not one of"),
        (_attrs(target_genders=["X"]), "attributes: target_genders 'X' is not one of"),
        (_attrs(target_surfaces=["tv"]), "attributes: target_surfaces 'tv' is not one of"),
        (_attrs(target_countries="US"), "row 1, attribute 'target_countries'"),
        (_attrs(target_age_min="18"), "row 1, attribute 'target_age_min'"),
        (
            _with(4, pa.table({"advertiser_id": pa.array([1.0, 2.0])})),
            "attribute column 'advertiser_id': type double does not fit kind int",
        ),
        (_with(4, pa.table({"advertiser_id": [1, 2], "colour": ["r", "g"]})), "column 'colour'"),
    ],
)
def test_rejected_upsert_leaves_index_unchanged(args, message):
    index = build({1: {"advertiser_id": 1}, 2: {"advertiser_id": 2, "tags": ["t"]}}, capacity=2)
    before = state(index)
    with pytest.raises(AdIndexError, match=re.escape(message)):
        index.upsert(*args)
    assert_same_state(before, state(index))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ix: ix.delete([1, 404]), "ad id 404 is not in the index"),
        (lambda ix: ix.delete([1, 1]), "delete: ad id 1 appears more than once"),
        (lambda ix: ix.pause(404), "ad id 404 is not in the index"),
        (lambda ix: ix.update_attributes(1, colour="red"), "unknown attribute 'colour'"),
        (lambda ix: ix.update_attributes(1, status="off"), "status 'off' is not one of"),
        (lambda ix: ix.update_attributes(3, status="active"), "ad id 3 is not in the index"),
    ],
)
def test_rejected_mutation_leaves_index_unchanged(call, message):
    index = build({1: {"advertiser_id": 1}, 2: {"advertiser_id": 2}, 3: {"advertiser_id": 3}})
    index.delete([3])  # a tombstoned id is unknown too
    before = state(index)
    with pytest.raises(AdIndexError, match=re.escape(message)):
        call(index)
    assert_same_state(before, state(index))


def test_checks_change_nothing_and_return_what_a_mutation_applies():
    index = build({1: {"advertiser_id": 1}, 2: {"advertiser_id": 2}}, dtype=torch.bfloat16)
    before = state(index)
    ids, g, x, b, _ = _good()
    rows = [{"advertiser_id": 4, "tags": ["b", "a", "b"]}] * 2
    upsert = index.check_upsert(np.array(ids, dtype=np.uint32), g, x, b, rows)
    index.check_vocabulary(upsert.columns, upsert.ids)
    assert upsert.ids.dtype == np.int64 and upsert.ids.tolist() == ids
    for checked, given in ((upsert.g, g), (upsert.x, x), (upsert.b, b)):
        assert torch.equal(checked, given.bfloat16())
    assert upsert.columns.column("status").to_pylist() == ["active"] * 2
    assert upsert.columns.column("tags").to_pylist() == [["a", "b"]] * 2
    update = index.check_update(2, {"tags": ["z", "y", "z"], "status": None})
    assert update.ad_id == 2 and update.attrs == {"tags": ["y", "z"], "status": "active"}
    assert index.check_delete([2, 1]).tolist() == [2, 1]
    assert_same_state(before, state(index))
    index.update_attributes(2, tags=["z", "y", "z"], status=None)
    assert index.get(2).attributes == update.columns.to_pylist()[0]


def test_invalid_construction():
    with pytest.raises(AdIndexError, match="dtype"):
        AdIndex(G, D, dtype=torch.int32)
    with pytest.raises(AdIndexError, match="capacity"):
        AdIndex(G, D, capacity=0)
    with pytest.raises(AdIndexError, match="clashes"):
        AdIndex(G, D, extra_fields={"status": "int"})
    with pytest.raises(AdIndexError, match="unknown kind"):
        AdIndex(G, D, extra_fields={"score": "double"})


# ---- growth, table views, compaction -------------------------------------------------------


def test_growth_beyond_capacity_keeps_rows():
    index = AdIndex(G, D, capacity=2, dtype=torch.float32)
    added = {}
    for step in range(5):
        ids = list(range(step * 3, step * 3 + 3))
        g, x, b = embeddings(ids, seed=step)
        index.upsert(ids, g, x, b, [{"advertiser_id": step, "tags": [f"s{step}"]}] * 3)
        added.update({i: (g[k], x[k], b[k], step) for k, i in enumerate(ids)})
    assert index.capacity == 16 and len(index) == 15 and index.num_rows == 15
    for i, (g, x, b, step) in added.items():
        row = index.get(i)
        assert torch.equal(row.g, g) and torch.equal(row.x, x) and row.b == pytest.approx(float(b))
        assert row.attributes["advertiser_id"] == step and row.attributes["tags"] == [f"s{step}"]
    assert eligible_ids(index, REQ, {"contains": ["tags", "s4"]}) == [12, 13, 14]


def test_table_handed_out_never_changes():
    index = build({i: {"advertiser_id": i} for i in range(4)}, capacity=4)
    g, x, b, row_ids, version = index.table()
    kept = [t.clone() for t in (g, x, b, row_ids)]
    index.upsert(
        [1, 2],
        torch.full((2, G), 7.0),
        torch.full((2, D), 7.0),
        [9.0, 9.0],
        [{"advertiser_id": 9}] * 2,
    )
    index.upsert(list(range(10, 20)), *embeddings(range(10)), [{"advertiser_id": 1}] * 10)  # grows
    index.delete([0])
    index.compact()
    for before, now in zip(kept, (g, x, b, row_ids), strict=True):
        assert torch.equal(before, now)
    assert index.version == version + 4


def test_upsert_of_existing_id_replaces_it():
    index = build({1: {"advertiser_id": 1}, 2: {"advertiser_id": 2}})
    index.upsert(
        [1], torch.ones(1, G), torch.ones(1, D), [3.0], [{"advertiser_id": 5, "tags": ["new"]}]
    )
    assert len(index) == 2 and index.num_rows == 3 and index.ids().tolist() == [2, 1]
    row = index.get(1)
    assert torch.equal(row.g, torch.ones(G)) and row.b == 3.0 and row.attributes["tags"] == ["new"]
    assert eligible_ids(index) == [2, 1]


def _random_rows(rng, ids):
    countries = ["US", "CA", "DE", "FR"]
    return {
        i: {
            "advertiser_id": rng.randrange(4),
            "status": rng.choice(["active", "active", "paused"]),
            "target_countries": rng.sample(countries, rng.randrange(3)),
            "target_age_min": rng.choice([None, 18, 30]),
            "target_genders": rng.sample(["F", "M"], rng.randrange(2)),
            "tags": rng.sample(["a", "b", "c"], rng.randrange(3)),
        }
        for i in ids
    }


REQUESTS = [
    REQ,
    RequestContext(
        "DE", 25, "M", "android", "reels", NOW, exclude_ads=(3, 4), exclude_advertisers=(1,)
    ),
    RequestContext(None, None, None, None, None, NOW),
]


def test_delete_and_compact_equal_a_rebuild():
    rng = random.Random(3)
    rows = _random_rows(rng, range(40))
    index = build(rows, dtype=torch.bfloat16, capacity=8)
    changed = rng.sample(range(40), 10)
    new_rows = _random_rows(rng, changed)
    g, x, b = embeddings(changed, seed=9)
    index.upsert(changed, g, x, b, [new_rows[i] for i in changed])
    rows.update(new_rows)
    deleted = rng.sample(range(40), 15)
    index.delete(deleted)
    before = [eligible_ids(index, r, {"contains": ["tags", "a"]}) for r in REQUESTS]

    version = index.compact()
    assert version == index.version and index.num_rows == len(index) == 25
    after = [eligible_ids(index, r, {"contains": ["tags", "a"]}) for r in REQUESTS]
    assert after == before  # same ids in the same row order: no query result changes

    live = index.ids().tolist()
    rebuilt = AdIndex(G, D, dtype=torch.bfloat16)
    gs, xs, bs = zip(*[(index.get(i).g, index.get(i).x, index.get(i).b) for i in live], strict=True)
    rebuilt.upsert(live, torch.stack(gs), torch.stack(xs), list(bs), [rows[i] for i in live])
    for mine, theirs in zip(index.table()[:4], rebuilt.table()[:4], strict=True):
        assert torch.equal(mine, theirs)
    for r in REQUESTS:
        assert eligible_ids(index, r) == eligible_ids(rebuilt, r)
    assert sorted(live) == sorted(set(range(40)) - set(deleted))
    for i in live:
        mine, theirs = index.get(i), rebuilt.get(i)
        assert (
            torch.equal(mine.g, theirs.g)
            and mine.b == theirs.b
            and mine.attributes == theirs.attributes
        )


# ---- random interleaving against a plain model ---------------------------------------------


def _normalise(attrs):
    out = dict.fromkeys(BASE_FIELDS)
    out.update(status="active", **{k: [] for k, kind in BASE_FIELDS.items() if kind == "str_list"})
    out.update({k: sorted(set(v)) if isinstance(v, list) else v for k, v in attrs.items()})
    return out


def stored_values(dtype, g, x, b):
    """What an index of `dtype` stores for rows g [n, G], x [n, D], b [n] given in float32, as
    `get` returns them: an 8-bit index's rows quantized, each with its own scales."""
    if dtype == torch.int8:
        return quantize_ad_table(g, x, b).dequantize()
    return g.to(dtype), x.to(dtype), b.to(dtype)


@pytest.mark.parametrize(
    ("seed", "dtype"), [(0, torch.float32), (1, torch.float32), (2, torch.int8)]
)
def test_random_operations_match_a_plain_model(seed, dtype):
    rng = random.Random(seed)
    index = AdIndex(G, D, dtype=dtype, capacity=2)
    model: dict[int, tuple] = {}  # id -> (g, x, b, attributes)
    version = 0
    for step in range(70):
        op = rng.choice(["upsert", "upsert", "update", "pause", "delete", "compact", "bad"])
        if op == "upsert":
            ids = rng.sample(range(30), rng.randrange(1, 5))
            rows = _random_rows(rng, ids)
            for i in ids:
                if rng.random() < 0.3:
                    rows[i]["schedule_end"] = NOW + rng.choice([-1, 0, 1])
            g, x, b = embeddings(ids, seed=step)
            version = index.upsert(ids, g, x, b, [rows[i] for i in ids])
            g, x, b = stored_values(dtype, g, x, b)
            model.update(
                {i: (g[k], x[k], float(b[k]), _normalise(rows[i])) for k, i in enumerate(ids)}
            )
        elif op in ("update", "pause") and model:
            i = rng.choice(sorted(model))
            change = (
                {"status": "paused"}
                if op == "pause"
                else {"target_countries": ["US"], "tags": ["z"]}
            )
            version = index.pause(i) if op == "pause" else index.update_attributes(i, **change)
            model[i][3].update(change)
        elif op == "delete" and model:
            ids = rng.sample(sorted(model), rng.randrange(1, min(3, len(model)) + 1))
            version = index.delete(ids)
            for i in ids:
                del model[i]
        elif op == "compact":
            version = index.compact()
        elif op == "bad":
            before = state(index)
            with pytest.raises(AdIndexError):
                index.upsert([1, 1], *embeddings([1, 1]), [{"advertiser_id": 1}] * 2)
            assert_same_state(before, state(index))
        assert index.version == version
        assert sorted(index.ids().tolist()) == sorted(model) and len(index) == len(model)
        for i, (g, x, b, attrs) in model.items():
            row = index.get(i)
            assert torch.equal(row.g, g) and torch.equal(row.x, x) and row.b == pytest.approx(b)
            assert row.attributes == attrs
        for r in REQUESTS:
            expected = {i for i, m in model.items() if eligible(i, m[3], r, None)}
            got = eligible_ids(index, r)
            assert len(got) == len(set(got)) and set(got) == expected
            assert torch.equal(index.eligible_mask(r), reference_mask(index, r, None))
        with index.snapshot_view() as view:  # what is scored: the values `get` gives back
            table = view.ad_table
            if dtype == torch.int8:
                table = table.dequantize()
            for i in model:
                row = index._row_of(i)
                assert torch.equal(table[0][row], model[i][0])
                assert torch.equal(table[1][row], model[i][1])


# ---- snapshots -----------------------------------------------------------------------------


def _index_with_history(dtype=torch.bfloat16):
    rng = random.Random(7)
    index = build(_random_rows(rng, range(20)), dtype=dtype, capacity=4)
    index.delete([3, 4, 5])
    index.pause(6)
    index.upsert(
        [2], torch.ones(1, G), torch.ones(1, D), [0.5], [{"advertiser_id": 2, "tags": ["é", "b"]}]
    )
    return index


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_snapshot_round_trip(tmp_path, dtype):
    index = _index_with_history(dtype)
    index.save(tmp_path / "snap", model_hash="abc123")
    loaded = AdIndex.load(tmp_path / "snap")
    assert (
        loaded.version == index.version and loaded.dtype == dtype and loaded.model_hash == "abc123"
    )
    assert loaded.schema == index.schema and len(loaded) == len(index)
    live = index.ids()
    assert torch.equal(loaded.ids(), live)
    for r in REQUESTS:
        for expr in (None, {"contains": ["tags", "b"]}, {"not": {"in": ["advertiser_id", [0, 1]]}}):
            assert eligible_ids(loaded, r, expr) == eligible_ids(index, r, expr)
    for i in live.tolist():
        assert loaded.get(i).attributes == index.get(i).attributes
    index.compact()  # a snapshot holds the live rows in order: the compacted table
    for mine, theirs in zip(state(index)["table"], state(loaded)["table"], strict=True):
        assert torch.equal(mine, theirs)  # an 8-bit table: the same codes and scales

    # Anything can read it: numpy for the table, parquet for the attributes.
    manifest = read_manifest(tmp_path / "snap")
    assert manifest["count"] == len(index) and manifest["dtype"] == str(dtype).removeprefix(
        "torch."
    )
    g = np.load(tmp_path / "snap" / "g.npy")
    assert g.shape == (len(index), G) and g.dtype == (
        np.int8 if dtype == torch.int8 else np.float32
    )
    assert np.load(tmp_path / "snap" / "ids.npy").tolist() == live.tolist()


def test_an_8_bit_index_quantizes_each_row_on_its_own_and_scores_as_stored():
    rows = {i: {"advertiser_id": i % 3} for i in range(9)}
    index = build(rows, dtype=torch.int8, capacity=4)
    g, x, b = embeddings(list(rows))
    g[4] = 0.0  # an all-zero row stays exactly zero
    index.upsert([4], g[4:5], x[4:5], b[4:5], [rows[4]])
    one_by_one = AdIndex(G, D, dtype=torch.int8)
    for i in rows:  # each ad alone: the same codes and scales as in a batch
        one_by_one.upsert([i], g[i : i + 1], x[i : i + 1], b[i : i + 1], [rows[i]])
    with index.snapshot_view() as view, one_by_one.snapshot_view() as alone:
        table = view.ad_table
        assert isinstance(table, Int8Table) and table.g.dtype == torch.int8
        live = torch.tensor([index._row_of(i) for i in rows])
        want = quantize_ad_table(g, x, b)
        for mine, theirs, single in zip(table, want, alone.ad_table, strict=True):
            assert torch.equal(mine[live], theirs) and torch.equal(single, theirs)
        assert not table.g[index._row_of(4)].any() and table.g_scale[index._row_of(4)] == 1
        # scored as stored: the kernel on the codes equals the reference on the dequantized rows
        gen = torch.Generator().manual_seed(1)
        query = (torch.randn(3, 2, G, generator=gen), torch.randn(3, 2, D, generator=gen),
                 torch.randn(3, 2, generator=gen))  # fmt: skip
        mask = view.eligible_bits([REQ] * 3)
        got = score_topk(query, table, mask, 5, kernel="cpu")
        ref = score_topk(query, table.dequantize(), mask.unpack(), 5, kernel="torch")
        torch.testing.assert_close(got[0], ref[0])
        assert torch.equal(got[1], ref[1])
    got = index.get(2)
    g2, x2, b2 = quantize_ad_table(g[2:3], x[2:3], b[2:3]).dequantize()
    assert torch.equal(got.g, g2[0]) and torch.equal(got.x, x2[0]) and got.b == float(b2[0])
    with pytest.raises(AdIndexError, match="NaN or inf"):
        index.upsert([1], torch.full((1, G), float("nan")), x[:1], b[:1], [rows[1]])
    with pytest.raises(AdIndexError, match=re.escape("overflows torch.float32")):
        index.upsert([1], g[:1], torch.full((1, D), 1e300, dtype=torch.float64), b[:1], [rows[1]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_frozen_view_is_one_object_per_version(dtype, monkeypatch):
    """Every call of one version returns the same view, tensors and all: what a kernel keeps
    per table object (the cpu kernel's row norms) is found again by the next request."""
    from m31.ops.cpu import stats

    norms = []
    row_norms = stats._row_norms
    monkeypatch.setattr(
        stats, "_row_norms", lambda *a, **kw: norms.append(1) or row_norms(*a, **kw)
    )
    index = build({i: {"advertiser_id": i} for i in range(6)}, dtype=dtype)
    view = index.frozen_view()
    assert index.frozen_view() is view
    g, x, _ = embeddings([0, 1])
    query = (g[None], x[None], torch.zeros(1, 2))  # q [1, 2, G], v [1, 2, D], p [1, 2]
    score_topk(query, index.frozen_view().ad_table, None, 3, kernel="cpu")
    first = len(norms)
    for _ in range(2):
        score_topk(query, index.frozen_view().ad_table, None, 3, kernel="cpu")
    assert first > 0 and len(norms) == first  # the table's norms: computed once
    index.pause(2)
    again = index.frozen_view()
    assert again is not view and again.version == view.version + 1
    assert index.frozen_view() is again


def test_load_rejects_damaged_8_bit_snapshots(tmp_path):
    index = _index_with_history(torch.int8)
    index.save(tmp_path / "good")
    n = len(index)

    def damage(folder, name, edit):
        arr = np.load(folder / f"{name}.npy")
        edit(arr)
        np.save(folder / f"{name}.npy", arr)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"][f"{name}.npy"]["bytes"] = (folder / f"{name}.npy").stat().st_size
        (folder / "manifest.json").write_text(json.dumps(manifest))

    for k, (name, edit, message) in enumerate([
        ("g_scale", lambda a: a.__setitem__(1, 0.0), "g_scale: row 1 holds 0.0, not a positive"),
        ("x_scale", lambda a: a.__setitem__(2, np.nan), "x_scale: row 2 holds nan"),
        ("b", lambda a: a.__setitem__(0, np.inf), "b: row 0 holds inf, not a finite number"),
        ("x", lambda a: a.__setitem__((0, 0), -128), "int8 code of -128"),
    ]):  # fmt: skip
        folder = tmp_path / f"bad{k}"
        folder.mkdir()
        for f in (tmp_path / "good").iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        damage(folder, name, edit)
        with pytest.raises(AdIndexError, match=re.escape(message)):
            AdIndex.load(folder)
    (tmp_path / "bad0" / "g_scale.npy").unlink()
    with pytest.raises(AdIndexError, match=re.escape("g_scale.npy: missing")):
        AdIndex.load(tmp_path / "bad0")
    assert len(AdIndex.load(tmp_path / "good")) == n


def test_interrupted_save_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    index = _index_with_history()
    index.save(tmp_path / "snap")
    saved_version = index.version
    index.upsert([100], torch.ones(1, G), torch.ones(1, D), [1.0], [{"advertiser_id": 1}])

    real_save, calls = np.save, []

    def failing_save(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        index.save(tmp_path / "snap", overwrite=True)
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        index.save(tmp_path / "fresh")
    monkeypatch.undo()

    assert sorted(os.listdir(tmp_path)) == ["snap"]  # no half-written folder left anywhere
    loaded = AdIndex.load(tmp_path / "snap")
    assert loaded.version == saved_version and 100 not in loaded
    with pytest.raises(AdIndexError, match="already exists"):
        index.save(tmp_path / "snap")
    index.save(tmp_path / "snap", overwrite=True)
    assert 100 in AdIndex.load(tmp_path / "snap")


def _edit_manifest(folder, **changes):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def test_load_rejects_damaged_snapshots(tmp_path):
    index = _index_with_history()
    snap = index.save(tmp_path / "snap")

    def damaged(name, damage):
        folder = tmp_path / name
        folder.mkdir()
        for f in snap.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        damage(folder)
        return folder

    def reshape_g(folder):
        np.save(folder / "g.npy", np.zeros((len(index), G + 1), np.float32))
        files = json.loads((folder / "manifest.json").read_text())["files"]
        files["g.npy"]["bytes"] = (folder / "g.npy").stat().st_size
        _edit_manifest(folder, files=files)

    cases = [
        (lambda f: (f / "manifest.json").unlink(), "manifest.json: missing"),
        (lambda f: (f / "manifest.json").write_text("{"), "not valid JSON"),
        (lambda f: _edit_manifest(f, format="other"), "not an m31.ad_index manifest"),
        (lambda f: _edit_manifest(f, format_version=99), "format_version 99"),
        (lambda f: _edit_manifest(f, dtype="int4"), "dtype 'int4'"),
        (lambda f: _edit_manifest(f, count="many"), "'count' missing or not a int"),
        (lambda f: (f / "x.npy").unlink(), "x.npy: missing"),
        (lambda f: (f / "b.npy").write_bytes(b"\x93NUMPY"), "b.npy: size 6 differs"),
        (reshape_g, f"g.npy: float32 [{len(index)}, {G + 1}] does not match the manifest"),
        (lambda f: _edit_manifest(f, count=len(index) + 1), "does not match the manifest"),
    ]
    for k, (damage, message) in enumerate(cases):
        with pytest.raises(AdIndexError, match=re.escape(message)):
            AdIndex.load(damaged(f"bad{k}", damage))


# ---- consistency under concurrency ---------------------------------------------------------


def test_readers_never_see_half_a_batch():
    index = AdIndex(G, D, capacity=4)
    batch = [0, 1, 2, 3, 4]

    def write(k):
        # One batch sets embeddings and attributes together; they must be seen together.
        n = len(batch)
        attrs = [{"advertiser_id": k, "tags": [f"v{k}"]}] * n
        return index.upsert(
            batch, torch.full((n, G), float(k)), torch.full((n, D), float(k)), [float(k)] * n, attrs
        )

    write(0)
    stop, first_read = threading.Event(), threading.Event()
    errors, seen = [], []

    def writer():
        try:
            first_read.wait(timeout=30)  # so that reads overlap the writes
            for k in range(1, 60):
                write(k)
                if k % 10 == 0:
                    index.compact()
        finally:
            stop.set()

    def read_view():
        with index.snapshot_view() as view:
            mask = view.eligible_mask(REQ)
            rows = mask.nonzero().squeeze(1)
            adv = view.attributes.numeric("advertiser_id")[0][rows]
            k = int(adv[0])
            assert sorted(view.row_ids[rows].tolist()) == batch
            assert (adv == k).all()
            for t in (view.g[rows], view.x[rows], view.b[rows]):
                assert (t.float() == k).all()
            tagged = view.eligible_mask(REQ, {"contains": ["tags", f"v{k}"]})
            assert torch.equal(tagged, mask)
            return k, view.version

    def read_table():
        # Without the lock held: rows are write-once, so each row still agrees with itself.
        g, x, b, _, _ = index.table()
        assert torch.equal(g[:, 0], b) and torch.equal(x[:, 0], b)

    def reader():
        try:
            last = -1
            while True:
                done = stop.is_set()
                k, version = read_view()
                read_table()
                assert version >= last
                last = version
                seen.append(k)
                first_read.set()
                if done:
                    break
        except Exception as e:  # surfaced in the main thread below
            errors.append(e)
            first_read.set()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    assert index.version == 1 + 59 + 5
    assert 0 in seen and 59 in seen  # reads happened before, during and after the writes


def test_a_view_is_only_valid_inside_its_block():
    index = build({1: {"advertiser_id": 1}})
    with index.snapshot_view() as view:
        assert view.eligible_mask(REQ).tolist() == [True]
    assert view.eligible_mask(REQ).tolist() == [True]  # nothing changed since
    index.pause(1)
    with pytest.raises(AdIndexError, match="used after the index moved"):
        view.eligible_mask(REQ)


# ---- building from the dataset's ads table -------------------------------------------------


@pytest.fixture(scope="module")
def world_ads():
    ds, _ = generate(preset("tiny").with_overrides(n_impressions=2_000, n_users=100), seed=0)
    return ds.ads


def test_index_from_table_matches_the_ads_table(world_ads, tmp_path):
    ads = world_ads.slice(0, 300)
    n = ads.num_rows
    g, x, b = torch.randn(n, G), torch.randn(n, D), torch.randn(n)
    index = index_from_table(ads, g, x, b, capacity=64)
    assert len(index) == n and index.capacity >= n and index.version == 1
    assert torch.equal(index.ids(), torch.tensor(ads.column("ad_id").to_numpy()))
    rows = ads.to_pylist()
    ts = int(np.median(ads.column("created_at").to_numpy()))
    requests = [
        RequestContext("US", 30, "F", "ios", "feed", ts),
        RequestContext(
            "DE", 19, "M", "android", "reels", ts, exclude_advertisers=(rows[0]["advertiser_id"],)
        ),
    ]
    for r in requests:
        attrs = [
            {
                **{k: row.get(k) for k in BASE_FIELDS},
                "schedule_start": row["created_at"],
                "target_surfaces": [],
            }
            for row in rows
        ]
        expected = [
            row["ad_id"]
            for row, a in zip(rows, attrs, strict=True)
            if eligible(row["ad_id"], a, r, None)
        ]
        assert eligible_ids(index, r) == expected
        assert 0 < len(expected) < n
        assert torch.equal(index.eligible_mask(r), reference_mask(index, r, None))
    video = eligible_ids(index, requests[0], {"eq": ["format", "video"]})
    assert video == [
        row["ad_id"]
        for row in rows
        if row["ad_id"] in set(eligible_ids(index, requests[0])) and row["format"] == "video"
    ]
    loaded = AdIndex.load(index.save(tmp_path / "snap"))
    assert eligible_ids(loaded, requests[0], {"eq": ["format", "video"]}) == video
    assert loaded.get(rows[5]["ad_id"]).attributes["objective"] == rows[5]["objective"]


def test_index_from_table_accepts_tags_and_rejects_missing_columns(world_ads):
    ads = world_ads.slice(0, 4)
    tags = pa.array([["x"], [], ["x", "y"], None], pa.list_(pa.large_string()))
    index = index_from_table(
        ads.append_column("tags", tags), torch.zeros(4, G), torch.zeros(4, D), torch.zeros(4)
    )
    ids = ads.column("ad_id").to_pylist()
    assert [index.get(i).attributes["tags"] for i in ids] == [["x"], [], ["x", "y"], []]
    with pytest.raises(AdIndexError, match="missing column 'status'"):
        index_from_table(
            ads.drop_columns(["status"]), torch.zeros(4, G), torch.zeros(4, D), torch.zeros(4)
        )
