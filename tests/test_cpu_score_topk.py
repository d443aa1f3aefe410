"""cpu_score_topk's own parts: the product dtype, the error bounds themselves, the affinity
filter, threads and blocks, the cached table constants, its own arguments. Its answers are held
to the reference with every other kernel's in test_score_topk (the contract)."""

import pytest
import torch
from score_topk_helpers import assert_same, full_sort, make_mask, random_problem

from m31.ops import rounded_score, score
from m31.ops.cpu import bounds, cpu_score_topk
from m31.ops.cpu.bounds import _product_dtype, affinity_offset, gate_bounds, plan_float
from m31.ops.cpu.stats import _row_norms, table_stats
from m31.ops.cpu.worker import Threshold


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


def test_restores_the_callers_thread_count():
    before = torch.get_num_threads()
    query, table = random_problem(2, 300, 2, 4, 4, seed=1)
    cpu_score_topk(*query, *table, None, 5, block=64, threads=2)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [  # the arguments every kernel takes: test_score_topk.test_bad_arguments
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
