"""The row-bitmap eligibility index (`m31.index.eligibility`) against the column builder it
replaced and a plain-Python evaluation (`m31.index.testing`: `reference_mask`, `eligible_ads`),
through random worlds, filters and mutation sequences."""

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m31.index import AdIndex, RequestContext, compile_filter
from m31.index import eligibility as elig
from m31.index.columns import BASE_FIELDS
from m31.index.eligibility import _assign
from m31.index.stages import STAGES, stage_masks
from m31.index.testing import eligible, eligible_ads, reference_mask, refusing_stage
from m31.ops.masks import _pack_torch, _unpack_torch, pack, unpack
from m31.vocabularies import GENDERS, PLATFORMS, STATUSES, SURFACES

G, D = 2, 3
NOW = 1_000
EXTRA = {"format": "str", "labels": "str_list", "score": "float"}
SCHEMA = {**BASE_FIELDS, **EXTRA}
COUNTRIES = ("US", "DE", "JP")
TAGS = ("a", "b", "c", "d", "e", "f")
FORMATS = ("image", "video", "carousel")

# ---- packing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 431, 1000])
def test_pack_and_unpack_round_trip_in_numpys_little_bit_order(n):
    mask = torch.rand(3, n, generator=torch.Generator().manual_seed(n)) < 0.5
    bits = pack(mask)
    assert bits.dtype == torch.uint8 and bits.shape == (3, -(-n // 8))
    assert np.array_equal(bits.numpy(), np.packbits(mask.numpy(), axis=-1, bitorder="little"))
    assert torch.equal(unpack(bits, n), mask)
    wider = torch.cat([bits, torch.full((3, 2), 0xFF, dtype=torch.uint8)], 1)
    assert torch.equal(unpack(wider, n), mask)  # bytes past ceil(n / 8) are never read
    # What other devices run, checked here on the CPU against numpy.
    assert torch.equal(_pack_torch(mask), bits) and torch.equal(_unpack_torch(wider, n), mask)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_assign_sets_exactly_the_rows_given(data):
    """Runs of rows (an upsert's) and scattered rows (updates, deletes) in bitmaps of odd widths."""
    n = data.draw(st.integers(1, 300))
    v = data.draw(st.integers(1, 3))
    before = torch.tensor(data.draw(st.lists(st.booleans(), min_size=v * n, max_size=v * n)))
    before = before.view(v, n)
    if data.draw(st.booleans()):
        lo = data.draw(st.integers(0, n - 1))
        rows = torch.arange(lo, data.draw(st.integers(lo + 1, n)))
    else:
        rows = torch.tensor(
            data.draw(st.lists(st.integers(0, n - 1), unique=True)), dtype=torch.long
        )
    match = torch.rand(v, len(rows), generator=torch.Generator().manual_seed(n)) < 0.5
    bits = pack(before)
    _assign(bits, rows, match)
    expected = before.clone()
    expected[:, rows] = match
    assert torch.equal(unpack(bits, n), expected)


# ---- random worlds -----------------------------------------------------------------------------

TS = st.sampled_from([NOW - 50, NOW, NOW + 1, NOW + 50])
AGE_BOUND = st.none() | st.sampled_from([18, 25, 35, 65])

AD = st.fixed_dictionaries(
    {
        "advertiser_id": st.integers(1, 4),
        "status": st.none() | st.sampled_from(STATUSES),
        "schedule_start": st.none() | TS,
        "schedule_end": st.none() | TS,
        "target_countries": st.lists(st.sampled_from(COUNTRIES), max_size=2),
        "target_age_min": AGE_BOUND,
        "target_age_max": AGE_BOUND,
        "target_genders": st.lists(st.sampled_from(GENDERS), max_size=1),
        "target_platforms": st.lists(st.sampled_from(PLATFORMS), max_size=2),
        "target_surfaces": st.lists(st.sampled_from(SURFACES), max_size=2),
        "tags": st.none() | st.lists(st.sampled_from(TAGS), max_size=3),
        "format": st.none() | st.sampled_from(FORMATS),
        "labels": st.lists(st.sampled_from(TAGS[:3]), max_size=2),
        "score": st.none() | st.sampled_from([0.0, 0.5, 1.0]),
    }
)


@st.composite
def predicates(draw):
    pick = draw(st.integers(0, 8))
    if pick == 0:
        return {"contains": ["tags", draw(st.sampled_from([*TAGS, "zz"]))]}
    if pick == 1:
        return {"contains": ["labels", draw(st.sampled_from(TAGS))]}
    if pick == 2:
        return {"contains": ["target_countries", draw(st.sampled_from([*COUNTRIES, "ZZ"]))]}
    if pick == 3:
        return {"eq": ["format", draw(st.sampled_from([*FORMATS, "gif"]))]}
    if pick == 4:
        return {"in": ["format", draw(st.lists(st.sampled_from(FORMATS), max_size=2))]}
    if pick == 5:
        return {"eq": ["advertiser_id", draw(st.integers(0, 4))]}
    if pick == 6:
        return {"range": ["score", draw(st.none() | st.just(0.5)), draw(st.none() | st.just(0.5))]}
    if pick == 7:
        return {"eq": ["status", draw(st.sampled_from(STATUSES))]}
    return {"range": ["target_age_min", draw(st.none() | st.just(20)), None]}


FILTERS = st.none() | st.recursive(
    predicates(),
    lambda children: st.one_of(
        st.builds(lambda c: {"all": c}, st.lists(children, max_size=3)),
        st.builds(lambda c: {"any": c}, st.lists(children, max_size=3)),
        st.builds(lambda c: {"not": c}, children),
    ),
    max_leaves=5,
)

REQUEST = st.builds(
    RequestContext,
    country=st.none() | st.sampled_from([*COUNTRIES, "FR"]),
    age=st.none() | st.sampled_from([17, 18, 30, 65, 70]),
    gender=st.none() | st.sampled_from(GENDERS),
    platform=st.none() | st.sampled_from(PLATFORMS),
    surface=st.none() | st.sampled_from(SURFACES),
    ts=TS,
    exclude_ads=st.lists(st.integers(0, 12), max_size=2),
    exclude_advertisers=st.lists(st.integers(1, 5), max_size=2),
)


def stored(attrs: dict) -> dict:
    """Attributes as the index reads them back: status defaults to active, lists are sets."""
    out = dict(attrs, status=attrs["status"] or "active")
    for name, kind in SCHEMA.items():
        if kind == "str_list":
            out[name] = sorted(set(out[name] or []))
    return out


def check(index: AdIndex, model: dict[int, dict], batch, filters) -> None:
    """Every way to get the batch's masks agrees with the reference builder and plain Python."""
    masks = index.eligible_masks(batch, filters)
    row_ids = index.table()[3]
    assert masks.shape == (len(batch), index.num_rows)
    view = index.frozen_view()
    for mask, r, expr in zip(masks, batch, filters, strict=True):
        assert torch.equal(mask, reference_mask(index, r, expr))
        assert set(row_ids[mask].tolist()) == eligible_ads(model, r, expr)
        check_stages(view, model, r, expr, mask)
    assert torch.equal(view.eligible_masks(batch, filters), masks)


def check_stages(view, model: dict[int, dict], r, expr, mask) -> None:
    """The stages of `m31.index.stages`: each narrows the one before, the last is the mask,
    and the stage a live ad first fails is the plain definition's (`refusing_stage`)."""
    masks = stage_masks(view, r, expr)
    assert list(masks) == list(STAGES)
    assert torch.equal(masks["live"], view.live_mask())
    assert torch.equal(masks["filter"], mask)
    before = masks["live"]
    for stage in STAGES[1:]:
        assert not (masks[stage] & ~before).any(), stage
        before = masks[stage]
    live = [(row, ad_id) for row, ad_id in enumerate(view.row_ids.tolist()) if masks["live"][row]]
    assert sorted(ad_id for _, ad_id in live) == sorted(model)  # one live row per ad
    unknown = [13, -1, 2**40]  # ids no world holds (theirs are 0..12)
    asked = [ad_id for _, ad_id in live][::-1] + unknown
    assert view.rows_of(asked).tolist() == [row for row, _ in live][::-1] + [-1] * 3
    for row, ad_id in live:
        failed = next((s for s in STAGES if not masks[s][row]), None)
        want = refusing_stage(ad_id, model[ad_id], r, expr)
        assert failed == want, (ad_id, failed, want)
        assert eligible(ad_id, model[ad_id], r, expr) == (want is None)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), cached=st.sampled_from([2, 128]))
def test_bitmap_masks_equal_the_column_masks_through_mutations(data, cached):
    """Upserts (new ads and rewrites), attribute updates, pauses, deletes, compactions and
    save/load, with batches of requests that repeat keys; `cached` = 2 evicts all the time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(elig, "MAX_CACHED_BITMAPS", cached)
        index = AdIndex(G, D, dtype=torch.float32, capacity=data.draw(st.integers(1, 9)),
                        extra_fields=EXTRA)  # fmt: skip
        model: dict[int, dict] = {}
        # Drawn once, so that later steps ask what earlier ones cached, across writes.
        pool = data.draw(st.lists(REQUEST, min_size=1, max_size=3))
        exprs = data.draw(st.lists(FILTERS, min_size=1, max_size=2))
        old_views = []  # (view, batch, filters, masks) of earlier versions
        for _ in range(data.draw(st.integers(1, 8))):
            op = data.draw(
                st.sampled_from(
                    ["upsert", "upsert", "update", "pause", "delete", "compact", "reload"]
                )
            )
            if op == "upsert":
                ids = data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True))
                attrs = [data.draw(AD) for _ in ids]
                n = len(ids)
                index.upsert(ids, torch.zeros(n, G), torch.zeros(n, D), torch.zeros(n), attrs)
                model.update({i: stored(a) for i, a in zip(ids, attrs, strict=True)})
            elif op in ("update", "pause") and model:
                i = data.draw(st.sampled_from(sorted(model)))
                if op == "pause":
                    index.pause(i)
                    model[i]["status"] = "paused"
                else:
                    new = data.draw(AD)
                    fields = data.draw(
                        st.lists(st.sampled_from(sorted(new)), min_size=1, unique=True)
                    )
                    change = {f: new[f] for f in fields}
                    index.update_attributes(i, **change)
                    model[i] = stored({**model[i], **change})
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
            size = data.draw(st.integers(1, 5))
            batch = [data.draw(st.sampled_from(pool)) for _ in range(size)]
            filters = [data.draw(st.sampled_from(exprs)) for _ in range(size)]
            check(index, model, batch, filters)
            view = index.frozen_view()
            old_views.append((view, batch, filters, view.eligible_masks(batch, filters).clone()))
        for view, batch, filters, masks in old_views:  # each still answers for its version
            assert torch.equal(view.eligible_masks(batch, filters), masks)


# ---- grouping, exclusions and the cache ------------------------------------------------------


def _index(n: int = 40, seed: int = 0) -> tuple[AdIndex, dict[int, dict]]:
    rng = random.Random(seed)
    model = {}
    for i in range(n):
        model[i] = {
            "advertiser_id": rng.randrange(1, 5),
            "target_countries": rng.sample(COUNTRIES, rng.randrange(0, 3)),
            "target_age_min": rng.choice([None, 18, 30]),
            "tags": rng.sample(TAGS, rng.randrange(0, 3)),
            "format": rng.choice(FORMATS),
            "schedule_start": rng.choice([None, NOW - 10, NOW + 10]),
        }
    index = AdIndex(G, D, dtype=torch.float32, extra_fields=EXTRA)
    ids = list(model)
    index.upsert(ids, torch.zeros(n, G), torch.zeros(n, D), torch.zeros(n), list(model.values()))
    return index, model


def _bitmaps(view):
    return view._index._bitmaps


def test_requests_with_one_key_share_one_computation_and_keep_their_exclusions():
    index, model = _index()
    view = index.frozen_view()
    base = RequestContext("US", 30, "F", "ios", "feed", NOW)
    other = RequestContext("DE", 30, "F", "ios", "feed", NOW)
    excluding = RequestContext("US", 30, "F", "ios", "feed", NOW, exclude_ads=(0, 1, 2, 3))
    blocking = RequestContext("US", 30, "F", "ios", "feed", NOW, exclude_advertisers=(1,))
    tags = {"contains": ["tags", "a"]}
    batch = [base, other, excluding, base, blocking, base, base]
    filters = [None, None, None, None, None, tags, compile_filter(tags, index.schema)]
    masks = view.eligible_masks(batch, filters)
    # Keys: (US, no filter) for requests 0, 2, 3, 4; (DE, none); (US, tags) for 5 and 6.
    assert _bitmaps(view).key_masks == 3
    row_ids = index.table()[3]
    for mask, r, f in zip(masks, batch, filters, strict=True):
        assert torch.equal(mask, reference_mask(index, r, f))
        assert set(row_ids[mask].tolist()) == eligible_ads(model, r, tags if f else None)
    assert torch.equal(masks[0], masks[3]) and torch.equal(masks[5], masks[6])
    assert not masks[2, :4].any() and torch.equal(masks[2, 4:], masks[0, 4:])
    assert masks[0, :4].any(), "the excluded ads are eligible for the others"
    blocked = index.table()[3][masks[0] & ~masks[4]]
    assert blocked.numel() and all(
        index.get(int(i)).attributes["advertiser_id"] == 1 for i in blocked
    )


def test_a_batch_sharing_one_mask_gets_it_expanded():
    index, _ = _index()
    r = RequestContext("US", 30, "F", "ios", "feed", NOW)
    masks = index.eligible_masks([r] * 5)
    assert masks.shape == (5, index.num_rows) and masks.stride(0) == 0
    assert torch.equal(masks[4], reference_mask(index, r, None))
    assert index.eligible_masks([]).shape == (0, index.num_rows)


def test_predicates_a_frozen_copy_computes_are_cached_by_the_index_for_the_next_version():
    index, model = _index()
    r = RequestContext("US", 30, "F", "ios", "feed", NOW)
    tags = compile_filter({"contains": ["tags", "b"]}, index.schema)
    view = index.frozen_view()
    view.eligible_masks([r], [tags])
    key = tags.node.key
    assert key in _bitmaps(view)._slots and key not in index._bitmaps._slots
    index.update_attributes(0, tags=["b"])  # a new version: the next view is a new copy
    model[0]["tags"] = ["b"]
    view = index.frozen_view()
    assert key in index._bitmaps._slots and key in _bitmaps(view)._slots
    slot = _bitmaps(view)._slots[key]
    assert unpack(_bitmaps(view)._cache[slot], index.num_rows)[0]  # ad 0's row, kept up to date
    mask = view.eligible_masks([r], [tags])[0]
    assert torch.equal(mask, reference_mask(index, r, tags))


def test_the_predicate_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(elig, "MAX_CACHED_BITMAPS", 5)
    index, _ = _index()
    r = RequestContext("US", 30, "F", "ios", "feed", NOW)
    for k in range(20):
        expr = {"contains": ["tags", f"x{k}"]}
        assert torch.equal(index.eligible_mask(r, expr), reference_mask(index, r, expr))
    bitmaps = index._bitmaps
    assert len(bitmaps._slots) == len(bitmaps._fns) == 5 and len(bitmaps._cache) <= 5


def test_bitmap_memory_is_a_byte_per_eight_rows_per_value():
    """The families hold one bitmap per value in use; tags of a thousand distinct values cost
    no bitmap until asked about."""
    n = 4096
    index = AdIndex(G, D, dtype=torch.float32, capacity=n)
    attrs = [{"advertiser_id": 1, "tags": [f"t{i}"], "target_countries": ["US"]} for i in range(n)]
    index.upsert(range(n), torch.zeros(n, G), torch.zeros(n, D), torch.zeros(n), attrs)
    bitmaps = index._bitmaps
    rows = sum(1 + len(f.rows) for f in bitmaps._families.values()) + 1 + len(bitmaps._cache)
    # status: null + active; countries: empty + US; genders, platforms, surfaces: empty only.
    assert rows == 2 + 2 + 3 + 1
    total = bitmaps.live.numel() + sum(f.bits.numel() for f in bitmaps._families.values())
    assert total <= 16 * n // 8
