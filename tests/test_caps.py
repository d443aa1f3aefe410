"""Caps per group in the top-K (`m31.engine.caps`, issue 30 item 1): the vectorised walk
against the plain one; the engine's capped search against the walk over its own full ranking
on every kernel (Triton under TRITON_INTERPRET=1), bf16 and 8-bit tables, filters and ties;
S = 3 shards merged against one index; the checks and the HTTP route."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import ThreadServer, World, fresh_state

from m31.cluster.layout import init_cluster, shard_dir
from m31.cluster.shard import Shard
from m31.engine import (
    AdRequest,
    RequestError,
    Retrieved,
    eligible_masks,
    merge,
    request_context,
    search,
)
from m31.engine.caps import capped, reference
from m31.index import AdIndex, compile_filter
from m31.ops import available_kernels
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend

G, D, E = 4, 4, 2
POOL = np.random.default_rng(2).normal(size=(4, G + D + 1)).astype(np.float32)  # ties
FILTERS = [None, {"eq": ["format", "video"]}, {"not": {"in": ["advertiser_id", [0]]}}]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.booleans()), max_size=40),
    st.integers(1, 4),
    st.integers(1, 15),
)
def test_the_walk_keeps_the_first_of_each_group(cands, cap, k):
    """Scores with many ties, groups and ads without a group, any cap and k."""
    ids = np.arange(len(cands), dtype=np.int64)[::-1].copy()  # ids against the input order
    scores = np.array([c[0] for c in cands], np.float32)
    groups = np.array([c[1] for c in cands], np.int64)
    valid = np.array([c[2] for c in cands], bool)
    got = capped(ids, scores, groups, valid, cap, k)
    assert got.tolist() == reference(ids, scores, groups, valid, cap, k).tolist()


def make_index(n: int, rng, dtype, share_tied: float = 0.5) -> AdIndex:
    """n ads, `share_tied` of them with vectors from a pool of four (equal scores)."""
    index = AdIndex(G, D, dtype=dtype, extra_fields={"format": "str"})
    t = rng.normal(size=(n, G + D + 1)).astype(np.float32)
    tied = rng.random(n) < share_tied
    t[tied] = POOL[rng.integers(0, len(POOL), int(tied.sum()))]
    attrs = [{"advertiser_id": None if rng.random() < 0.1 else int(rng.integers(0, 6)),
              "format": ["video", "image"][int(rng.integers(2))]} for _ in range(n)]  # fmt: skip
    index.upsert(rng.permutation(5 * n)[:n] + 1, t[:, :G], t[:, G:-1], t[:, -1], attrs)
    return index


def inputs(index: AdIndex, b: int, rng):
    view = index.frozen_view()
    requests = [AdRequest(user_id=0, filter=FILTERS[i % len(FILTERS)]) for i in range(b)]
    ctx = [(request_context(r, {}), compile_filter(r.filter, index.schema) if r.filter else None)
           for r in requests]  # fmt: skip
    query = tuple(torch.as_tensor(rng.normal(size=s).astype(np.float32))
                  for s in ((b, E, G), (b, E, D), (b, E)))  # fmt: skip
    return view, eligible_masks(view, ctx), query


def walked(view, full, cap, k: int) -> tuple[list[int], list[float]]:
    """The plain walk over an uncapped full ranking."""
    values, valid = (t.numpy() for t in view.attributes.numeric("advertiser_id"))
    at = {int(i): r for r, i in enumerate(view.row_ids.tolist())}
    rows = np.array([at[int(i)] for i in full.ad_ids], np.int64)
    pick = reference(full.ad_ids, full.scores, values[rows], valid[rows], cap, k)
    return full.ad_ids[pick].tolist(), full.scores[pick].tolist()


@pytest.mark.parametrize("kernel", available_kernels("cpu"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_capped_search_is_the_walk_on_every_kernel(kernel, dtype):
    rng = np.random.default_rng(3)
    # The last: every score among a few values, so that the kernel's first rows of a tie (by
    # row) are not the walk's (by ad id) at the fetched prefix's end.
    for n, tied in ((1, 0.5), (37, 0.5), (300, 0.5), (300, 1.0)):
        index = make_index(n, rng, dtype, tied)
        view, mask, query = inputs(index, 3, rng)
        for cap, k in ((1, 5), (2, 17), (3, n + 2)):
            caps = [("advertiser_id", cap)] * 3
            got = search(query, view, mask, [k] * 3, kernel, caps)
            full = search(query, view, mask, [n] * 3, kernel)
            for r, f in zip(got, full, strict=True):
                ids, scores = walked(view, f, cap, k)
                assert r.ad_ids.tolist() == ids
                np.testing.assert_array_equal(r.scores, np.array(scores, np.float32))


def test_three_shards_merge_to_the_one_index(tmp_path):
    """Each shard's capped top-K, merged by the same walk, is the one index's capped top-K."""
    rng = np.random.default_rng(5)
    index = make_index(400, rng, torch.float32)
    state = init_cluster(index.save(tmp_path / "snapshot"), tmp_path / "state", 3)
    shards = [Shard(shard_dir(state, s), s) for s in range(3)]
    view, mask, query = inputs(index, 3, rng)
    for cap, k in ((1, 4), (2, 30), (5, 500)):
        requests = [(AdRequest(user_id=0, filter=FILTERS[i], max_per={"advertiser": cap}), {})
                    for i in range(3)]  # fmt: skip
        payload = (tuple(t.numpy() for t in query), requests, [k] * 3)
        answers = [s.search(payload) for s in shards]
        want = search(query, view, mask, [k] * 3, caps=[("advertiser_id", cap)] * 3)
        for r in range(3):
            got = merge([Retrieved(*a.results[r]) for a in answers], k, ("advertiser_id", cap))
            assert got.ad_ids.tolist() == want[r].ad_ids.tolist(), (cap, k, r)
    for s in shards:
        s.close()


@pytest.fixture(scope="module")
def world(served_world) -> World:
    return served_world


def test_requests_are_checked_and_served_over_http(world):
    config = ServeConfig(index=fresh_state(world, "caps"), model=world.model, timeout_ms=60_000)
    app = create_app(config, LocalBackend.load)
    with ThreadServer(app) as s:
        retriever = app.state.backend.retriever
        for bad, message in (({"brand": 1}, "not one of advertiser, campaign"),
                             ({"advertiser": 0}, "positive integer"),
                             ({"advertiser": 1, "campaign": 1}, "one grouping")):  # fmt: skip
            with pytest.raises(RequestError, match=message):
                retriever.prepare([AdRequest(user_id=1, max_per=bad)], 5)
        body = {"user_id": 1, "surface": "feed", "k": 30}
        plain = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [body]}).json()
        r = httpx.post(f"{s.url}/v1/retrieve",
                       json={"requests": [{**body, "max_per": {"advertiser": 1}}]})  # fmt: skip
        assert r.status_code == 200, r.text
        got = r.json()["results"][0]["ad_ids"]
        held = retriever.index.numeric_values(got, "advertiser_id")
        assert 1 < len(got) <= 30 and len(set(held)) == len(got)  # one ad per advertiser
        assert got[0] == plain["results"][0]["ad_ids"][0]
        for bad in ({"advertiser": 0}, {"brand": 2}, {}, {"advertiser": 1, "campaign": 1}):
            r = httpx.post(f"{s.url}/v1/retrieve",
                           json={"requests": [{**body, "max_per": bad}]})  # fmt: skip
            assert r.status_code == 422 and "max_per" in r.text, r.text
