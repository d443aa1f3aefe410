"""cpu_score_topk against the reference and the full-sort definition: odd sizes, ties, masks,
scores closer than bf16 can tell apart, the error bound itself, threads and blocks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_score_topk import make_mask

from m31.ops import NO_ROW, rounded_score, score
from m31.ops.cpu import bounds, cpu_score_topk
from m31.ops.cpu.bounds import _product_dtype, affinity_offset, gate_bounds, plan_float
from m31.ops.cpu.stats import _row_norms, table_stats
from m31.ops.cpu.worker import Threshold
from m31.ops.torch_score_topk import torch_score_topk


def random_problem(n_req, n_ads, n_exp, gdim, ddim, seed, dtype=torch.bfloat16, scale=1.0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    query = (r(n_req, n_exp, gdim) * scale, r(n_req, n_exp, ddim), r(n_req, n_exp) * scale)
    table = tuple(t.to(dtype) for t in (r(n_ads, gdim), r(n_ads, ddim), r(n_ads)))
    return query, table


def full_sort(query, table, mask, k):
    """The definition: every score (`rounded_score`), ineligible ones dropped, stable sort (lower
    row first)."""
    s = rounded_score(*query, *table)  # [B, N]
    k_out = min(k, s.shape[1])
    out_s, out_r = [], []
    for i in range(s.shape[0]):
        m = torch.ones(s.shape[1], dtype=torch.bool) if mask is None else mask.expand_as(s)[i]
        rows = torch.nonzero(m)[:, 0]
        vals, order = torch.sort(s[i, rows], descending=True, stable=True)
        vals, rows = vals[:k_out], rows[order[:k_out]]
        pad = k_out - len(rows)
        out_s.append(torch.cat([vals, torch.full((pad,), -math.inf)]))
        out_r.append(torch.cat([rows, torch.full((pad,), NO_ROW, dtype=torch.long)]))
    return torch.stack(out_s), torch.stack(out_r)


def assert_same(got, want):
    """Same rows; scores agree to fp32 evaluation noise (both evaluate §2 in fp32, in another order)."""
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.long
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def assert_same_up_to_near_ties(got, want, exact, tol):
    """Rows equal except swaps of ads whose exact scores ([B, N] fp64) are within tol."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    differ = got[1] != want[1]
    near = (exact.gather(1, got[1]) - exact.gather(1, want[1])).abs() <= tol
    assert (~differ | near).all()


@pytest.mark.parametrize(
    ("n_req", "n_ads", "n_exp", "gdim", "k", "block", "mask_kind", "dtype"),
    [
        (1, 3001, 8, 16, 50, 512, "shared", torch.bfloat16),  # N not a multiple of the block
        (3, 2500, 3, 8, 700, 600, "per-request", torch.bfloat16),  # K > block
        (17, 1100, 8, 16, 10, 256, "shared", torch.bfloat16),
        (3, 900, 1, 0, 20, 300, "none", torch.bfloat16),  # two-tower: E = 1, G = 0
        (5, 700, 4, 0, 30, 256, "per-request", torch.bfloat16),  # G = 0: gate = softmax(p)
        (2, 40, 3, 8, 100, 16, "shared", torch.bfloat16),  # K > N
        (3, 500, 3, 8, 5, 128, "nothing", torch.bfloat16),
        (4, 600, 8, 8, 600, None, "everything", torch.bfloat16),  # K = N, all eligible
        (3, 1300, 3, 8, 25, 400, "shared", torch.float32),
        (2, 800, 8, 16, 40, None, "per-request", torch.float16),
    ],
)
def test_matches_reference_and_definition(
    n_req, n_ads, n_exp, gdim, k, block, mask_kind, dtype, native_bf16
):
    query, table = random_problem(n_req, n_ads, n_exp, gdim, 12, seed=n_ads, dtype=dtype)
    mask = make_mask(mask_kind, n_req, n_ads, seed=n_req)
    got = cpu_score_topk(*query, *table, mask, k, block=block, threads=2)
    assert_same(got, torch_score_topk(*query, *table, mask, k))
    assert_same(got, full_sort(query, table, mask, k))


def test_exact_ties_go_to_the_lower_row():
    # 6 distinct ads repeated over 1,000 rows: every score is tied with about 166 others
    query, table = random_problem(3, 6, 3, 8, 8, seed=3)
    order = torch.randint(0, 6, (1000,), generator=torch.Generator().manual_seed(4))
    table = tuple(t[order] for t in table)
    mask = make_mask("shared", 3, 1000, seed=5)
    for k in (7, 200, 450):
        got = cpu_score_topk(*query, *table, mask, k, block=128, threads=2)
        assert_same(got, full_sort(query, table, mask, k))
    every_score_zero = (torch.zeros(1, 1, 0), torch.zeros(1, 1, 2), torch.zeros(1, 1))
    zeros = (torch.zeros(10, 0), torch.zeros(10, 2), torch.zeros(10))
    scores, rows = cpu_score_topk(*every_score_zero, *zeros, None, 4, block=3)
    assert rows.tolist() == [[0, 1, 2, 3]] and scores.tolist() == [[0.0] * 4]


def test_scores_closer_than_bf16_resolution_are_ranked_exactly():
    # Affinities ≈ 100 that differ by ~0.01: bf16 (spacing 0.5 there) maps hundreds of them to
    # one value, so only the exact rescoring of everything within the error bound can rank them.
    n_ads, ddim = 2000, 16
    gen = torch.Generator().manual_seed(0)
    x = 1 + torch.randint(0, 4, (n_ads, ddim), generator=gen) * 2.0**-7  # exact in bf16
    v = 100 / ddim + 1e-2 * torch.randn(2, 1, ddim, generator=gen)
    query = (torch.zeros(2, 1, 0), v, torch.zeros(2, 1))
    table = (torch.zeros(n_ads, 0, dtype=torch.bfloat16), x.to(torch.bfloat16), torch.zeros(n_ads))
    got = cpu_score_topk(*query, *table, None, 50, block=256)
    assert len(set(got[0][0].tolist())) > 40  # distinct fp32 scores...
    approx = (v[0].to(torch.bfloat16) @ x.to(torch.bfloat16).T).float()
    assert len(set(approx[0].tolist())) < 10  # ...that bf16 products cannot tell apart
    # fp32 evaluations in a different order may swap ads closer than fp32 can resolve (~1e-5)
    exact = score(*(t.double() for t in (*query, *table)))
    assert_same_up_to_near_ties(got, full_sort(query, table, None, 50), exact, tol=1e-4)


@pytest.fixture(params=[True, False], ids=["native-bf16", "emulated-bf16"])
def native_bf16(request, monkeypatch):
    """Both product choices for bf16 tables, whatever this CPU has (`_product_dtype`): bf16
    products, or fp32 ones where bf16 arithmetic is emulated (for B·E ≥ 32, or any B·E
    without AVX-512)."""
    monkeypatch.setattr(bounds, "_native_bf16", lambda: request.param)
    return request.param


@pytest.mark.parametrize("avx512", [True, False])
def test_the_product_dtype(native_bf16, avx512, monkeypatch):
    monkeypatch.setattr(bounds, "_avx512", lambda: avx512)
    bf16, fp16 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float16)
    assert _product_dtype(fp16, 1) == torch.float32
    few = torch.bfloat16 if native_bf16 or avx512 else torch.float32  # AVX2: bf16 is slow
    assert _product_dtype(bf16, 31) == few
    assert _product_dtype(bf16, 32) == (torch.bfloat16 if native_bf16 else torch.float32)


@pytest.mark.parametrize(
    ("dtype", "scale", "useful"),
    [(torch.bfloat16, 1.0, 0.1), (torch.bfloat16, 6.0, 0.3), (torch.float32, 3.0, 1e-3)],
)
def test_the_gate_error_bound_holds(dtype, scale, useful, native_bf16):
    """|s̃ - s| ≤ ε for every pair, against the fp32 definition and the exact (fp64) score."""
    query, table = random_problem(4, 3000, 8, 32, 48, seed=7, dtype=dtype, scale=scale)
    q, v, p = query
    g, x, b = table
    plan = plan_float(q, v, p, g, x, 10)
    n_req, n_exp, n_ads = 4, 8, 3000
    logits = (plan.qh @ g.to(plan.qh.dtype).T).view(n_req, n_exp, n_ads)  # product dtype
    aff = (plan.vh @ x.to(plan.vh.dtype).T).view(n_req, n_exp, n_ads)
    req = torch.arange(n_req).repeat_interleave(n_ads)  # every pair
    ad = torch.arange(n_ads).repeat(n_req)
    approx, eps = gate_bounds(
        plan,
        req,
        logits.permute(1, 0, 2).reshape(n_exp, -1),
        aff.permute(1, 0, 2).reshape(n_exp, -1),
        g.float().norm(dim=1)[ad],
        x.float().norm(dim=1)[ad],
        b.float()[ad],
    )
    fp32 = score(*query, *table).reshape(-1)
    exact = rounded_score(*query, *table).reshape(-1)
    assert ((approx - fp32).abs() <= eps).all()
    assert ((approx.double() - exact).abs() <= eps.double()).all()
    assert eps.median() < useful * fp32.std()  # a bound, but not a useless one


@pytest.mark.parametrize(("n_exp", "gdim"), [(1, 0), (4, 8)])
def test_the_affinity_filter_keeps_every_ad_that_reaches_the_threshold(n_exp, gdim, native_bf16):
    """With τ set to each request's best fp32 score, the best ad must pass step 1. With E = 1
    and G = 0 the bound U is tight (s = A + b), and with v exact in bf16 only the allowance for
    the rounding of the bf16 product protects an ad whose product was rounded down."""
    query, table = random_problem(64, 4000, n_exp, gdim, 24, seed=n_exp, scale=3.0)
    q, v, p = query
    v = v.to(torch.bfloat16).float()
    query = (q, v, p)
    g, x, b = table
    plan = plan_float(q, v, p, g, x, 1)
    best = (plan.vh @ x.to(plan.vh.dtype).T).view(64, n_exp, -1).amax(1)  # [B, N] M̂
    offset = affinity_offset(plan, _row_norms(x), table_stats(g, x, b).scan_bias)
    top_s, top_ad = score(*query, *table).max(dim=1)  # [B]
    tau = Threshold(64, 1, plan.u_scan)
    tau.offer(torch.arange(64), top_s)
    keep = best + offset >= tau.for_scan[:, None]  # [B, N]
    assert keep[torch.arange(64), top_ad].all()
    assert keep.float().mean() < 0.5  # and it does filter


def test_threads_and_blocks_do_not_change_the_result():
    query, table = random_problem(6, 5000, 8, 16, 16, seed=11)
    mask = make_mask("per-request", 6, 5000, seed=12)
    want = cpu_score_topk(*query, *table, mask, 60, threads=1)
    for threads, block in ((2, 700), (3, 256), (1, 5000)):
        got = cpu_score_topk(*query, *table, mask, 60, block=block, threads=threads)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_the_table_constants_follow_in_place_changes():
    """The per-table constants are reused across calls, but not after the table changed in place."""
    query, table = random_problem(3, 2000, 4, 8, 8, seed=5)
    g, x, b = table
    mask = make_mask("shared", 3, 2000, seed=6)
    mask[:6] = True
    assert_same(cpu_score_topk(*query, *table, mask, 20), full_sort(query, table, mask, 20))
    before = table_stats(g, x, b)
    assert table_stats(g, x, b) is before  # cached
    # through a view: ads 0, 2, 4 become every request's best, which stale biases would filter out
    b[::2][:3] = 50.0
    x[1::3].mul_(4)
    assert table_stats(g, x, b) is not before
    got = cpu_score_topk(*query, *table, mask, 20)
    assert_same(got, full_sort(query, table, mask, 20))
    assert (got[1][:, :3].sort(dim=1).values == torch.tensor([0, 2, 4])).all()
    with torch.inference_mode():  # no version counter: never cached
        frozen = tuple(t.clone() for t in table)
    assert table_stats(*frozen) is not table_stats(*frozen)
    assert_same(cpu_score_topk(*query, *frozen, mask, 20), full_sort(query, frozen, mask, 20))


def test_empty_inputs():
    query, table = random_problem(3, 5, 2, 4, 4, seed=0)
    empty = (torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0))
    scores, rows = cpu_score_topk(*query, *empty, None, 5)
    assert scores.shape == (3, 0) and rows.shape == (3, 0)
    no_requests = tuple(t[:0] for t in query)
    scores, rows = cpu_score_topk(*no_requests, *table, None, 3)
    assert scores.shape == (0, 3) and rows.shape == (0, 3)


def test_restores_the_callers_thread_count():
    before = torch.get_num_threads()
    query, table = random_problem(2, 300, 2, 4, 4, seed=1)
    cpu_score_topk(*query, *table, None, 5, block=64, threads=2)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"k": 0}, "k must be positive"),
        ({"mask": torch.ones(3, dtype=torch.bool)}, "mask must be bool"),
        ({"mask": torch.ones(9)}, "mask must be bool"),
        ({"table": (torch.zeros(9, 5), torch.zeros(9, 4), torch.zeros(9))}, "ad table must be"),
        (
            {"table": (torch.zeros(9, 4), torch.zeros(9, 4, dtype=torch.long), torch.zeros(9))},
            "x must be",
        ),
        ({"block": 0}, "block must be positive"),
        ({"threads": -1}, "threads must be positive"),
    ],
)
def test_bad_arguments(args, message):
    query, table = random_problem(2, 9, 2, 4, 4, seed=0, dtype=torch.float32)
    kw = {"mask": None, "k": 3, "table": table, "block": None, "threads": None} | args
    with pytest.raises(ValueError, match=message):
        cpu_score_topk(
            *query, *kw["table"], kw["mask"], kw["k"], block=kw["block"], threads=kw["threads"]
        )


@settings(max_examples=30, deadline=None)
@given(
    n_req=st.integers(1, 5),
    n_ads=st.integers(1, 400),
    n_exp=st.integers(1, 4),
    gdim=st.sampled_from([0, 3, 8]),
    k=st.integers(1, 420),
    block=st.integers(1, 150),
    threads=st.integers(1, 3),
    mask_kind=st.sampled_from(["none", "shared", "per-request", "nothing"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 10_000),
)
def test_property_matches_full_sort(
    n_req, n_ads, n_exp, gdim, k, block, threads, mask_kind, dtype, seed
):
    query, table = random_problem(n_req, n_ads, n_exp, gdim, 5, seed, dtype=dtype)
    mask = make_mask(mask_kind, n_req, n_ads, seed + 1)
    got = cpu_score_topk(*query, *table, mask, k, block=block, threads=threads)
    assert_same(got, full_sort(query, table, mask, k))
