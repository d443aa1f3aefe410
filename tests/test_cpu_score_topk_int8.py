"""cpu_score_topk_int8 (the cpu kernel reading an 8-bit table as stored) against the definition:
the reference and the full sort on the dequantized table. Odd sizes, masks, ties, one-part
queries (long rows), the error bounds with integer products, the cached table constants.
The end-to-end tests run each way steps 1 and 2 can run (`helpers`): compiled with AVX-512 where
the CPU has it, compiled as plain loops, and in torch ops (m31.ops.native)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_score_topk import assert_same, full_sort, random_problem
from test_score_topk import make_mask

from m31.ops import (
    Int8Table,
    PackedMask,
    native,
    quantize_ad_table,
    rounded_score,
    score,
    score_topk,
)
from m31.ops.cpu import cpu_score_topk_int8, int8
from m31.ops.cpu.bounds import affinity_offset, gate_bounds
from m31.ops.cpu.int8 import _split_query, int8_products_exact, int_products, plan_int8
from m31.ops.cpu.stats import table_stats
from m31.ops.cpu.worker import Threshold
from m31.ops.torch_score_topk import torch_score_topk

# Where the CPU's int8 products are not exact the kernel scores the dequantized table instead
# (still correct, and still tested below), but the integer filters themselves are then not run.
needs_exact_int8 = pytest.mark.skipif(
    not int8_products_exact(), reason="this CPU's int8 products saturate: the filters are not used"
)


@pytest.fixture(params=["on", "plain", "off"])
def helpers(request):
    """Steps 1 and 2 compiled (AVX-512 where the CPU has it), compiled as plain loops, in torch."""
    if request.param != "off" and native.library() is None:
        pytest.skip("no C compiler: the compiled helpers are not built")
    with native.use(request.param):
        yield request.param


def int8_problem(n_req, n_ads, n_exp, gdim, ddim, seed, scale=1.0):
    query, table = random_problem(n_req, n_ads, n_exp, gdim, ddim, seed, torch.float32, scale)
    quantized = quantize_ad_table(*table)
    return query, quantized, quantized.dequantize()


@pytest.mark.parametrize(
    ("n_req", "n_ads", "n_exp", "gdim", "ddim", "k", "block", "mask_kind"),
    [
        (1, 3001, 8, 16, 12, 50, 512, "shared"),  # N not a multiple of the block
        (3, 2500, 3, 8, 12, 700, 600, "per-request"),  # K > block
        (17, 1100, 8, 16, 12, 10, 256, "shared"),
        (3, 900, 1, 0, 12, 20, 300, "none"),  # two-tower: E = 1, G = 0
        (5, 700, 4, 0, 12, 30, 256, "per-request"),  # G = 0: gate = softmax(p)
        (2, 40, 3, 8, 12, 100, 16, "shared"),  # K > N
        (3, 500, 3, 8, 12, 5, 128, "nothing"),
        (4, 600, 8, 8, 12, 600, None, "everything"),  # K = N, all eligible
        (1, 20_011, 8, 64, 64, 100, None, "shared"),  # one request: logits of survivors only
        (64, 3001, 8, 64, 64, 100, None, "per-request"),
        (2, 700, 2, 600, 530, 25, 200, "shared"),  # G, D > 516: one-part queries
        (2, 600, 2, 0, 580, 25, 200, "per-request"),  # D past the compiled helpers' registers
        (3, 999, 5, 1, 1, 40, 100, "packed"),  # rows of one value (torch._int_mm got them wrong)
        (7, 1000, 3, 33, 65, 30, 200, "packed"),  # the last 32-value chunk of a row nearly empty
    ],
)
def test_matches_reference_and_definition(
    n_req, n_ads, n_exp, gdim, ddim, k, block, mask_kind, helpers
):
    query, quantized, dequantized = int8_problem(n_req, n_ads, n_exp, gdim, ddim, seed=n_ads)
    packed = mask_kind == "packed"
    mask = make_mask("per-request" if packed else mask_kind, n_req, n_ads, seed=n_req)
    got = cpu_score_topk_int8(
        *query, quantized, PackedMask.of(mask) if packed else mask, k, block=block, threads=2
    )
    assert_same(got, torch_score_topk(*query, *dequantized, mask, k))
    assert_same(got, full_sort(query, dequantized, mask, k))
    assert_same(score_topk(query, quantized, mask, k, kernel="cpu"), got)


def test_exact_ties_go_to_the_lower_row(helpers):
    # 6 distinct ads repeated over 1,000 rows: every score is tied with about 166 others
    query, quantized, _ = int8_problem(3, 6, 3, 8, 8, seed=3)
    order = torch.randint(0, 6, (1000,), generator=torch.Generator().manual_seed(4))
    quantized = Int8Table(*(t[order] for t in quantized))
    mask = make_mask("shared", 3, 1000, seed=5)
    for k in (7, 200, 450):
        got = cpu_score_topk_int8(*query, quantized, mask, k, block=128, threads=2)
        assert_same(got, full_sort(query, quantized.dequantize(), mask, k))


def test_threads_and_blocks_do_not_change_the_result(helpers):
    query, quantized, _ = int8_problem(6, 5000, 8, 16, 16, seed=11)
    mask = make_mask("per-request", 6, 5000, seed=12)
    want = cpu_score_topk_int8(*query, quantized, mask, 60, threads=1)
    for threads, block in ((2, 700), (3, 256), (1, 5000)):
        got = cpu_score_topk_int8(*query, quantized, mask, 60, block=block, threads=threads)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("cols", [1, 7, 64, 516, 517, 700])
def test_split_query_is_the_query_to_about_16_bits(cols):
    t = torch.randn(3, 4, cols, dtype=torch.float64) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None]
    ints, scale, err, norm = _split_query(t, (1, 2))
    parts = 2 if cols <= 516 else 1
    assert ints.dtype == torch.int8 and ints.shape == (parts, 3, 4, cols)
    assert ints.abs().max() <= 127 and scale.shape == (3, 1)  # one per request
    scale = scale[:, 0]
    w = ints[0].double() * 255 + ints[1].double() if parts == 2 else ints[0].double()
    exact = w * scale.double()[:, None, None]
    torch.testing.assert_close(err, (exact - t).norm(dim=2).amax(1), rtol=0, atol=0)
    torch.testing.assert_close(norm, exact.norm(dim=2).amax(1), rtol=0, atol=0)
    # the rounding is at most half a unit of the scale per element, relative to the largest
    units = 32_512 if parts == 2 else 127
    assert ((exact - t).abs() <= scale.double()[:, None, None] / 2 * (1 + 1e-12)).all()
    largest = t.abs().amax(dim=(1, 2)) / scale.double()  # the largest element uses every unit
    assert torch.allclose(largest, torch.full((3,), float(units), dtype=torch.float64))
    zero = torch.zeros(1, 2, cols, dtype=torch.float64)
    ints, scale, err, norm = _split_query(zero, (1, 2))
    assert (ints == 0).all() and scale.tolist() == [[1.0]] and err.item() == norm.item() == 0


@needs_exact_int8
@pytest.mark.parametrize("cols", [1, 5, 64, 600])
def test_int_products_are_exact(cols):
    gen = torch.Generator().manual_seed(cols)
    query = torch.randint(
        -127, 128, (2 if cols <= 516 else 1, 3, cols), dtype=torch.int8, generator=gen
    )
    ads = torch.randint(-127, 128, (37, cols), dtype=torch.int8, generator=gen)
    got = int_products(query.reshape(-1, cols), ads, 3, None)
    w = query[0].long() * 255 + query[1].long() if len(query) == 2 else query[0].long()
    assert torch.equal(got.long(), w @ ads.long().T)
    buf = torch.empty(len(query) * 3 * 40, dtype=torch.int32)
    assert torch.equal(int_products(query.reshape(-1, cols), ads, 3, buf), got)


@needs_exact_int8
def test_two_part_products_at_the_int32_limit():
    """The longest two-part rows (516) at the extremes, ads of -128 included: no overflow."""
    cols = 516
    query = torch.full((2, 2, cols), 127, dtype=torch.int8)
    query[:, 1] = -127
    ads = torch.full((3, cols), -128, dtype=torch.int8)
    ads[1] = 127
    got = int_products(query.reshape(-1, cols), ads, 2, None).long()
    want = (query[0].long() * 255 + query[1].long()) @ ads.long().T
    assert torch.equal(got, want) and want.abs().max() > 2**31 - 2**24  # near the limit


@needs_exact_int8
@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_the_gate_error_bound_holds(scale):
    """|s̃ - s| ≤ ε for every pair with integer products, against the fp32 definition and the
    exact (fp64) score on the dequantized table."""
    n_req, n_ads, n_exp, gdim = 4, 3000, 8, 32
    query, quantized, dequantized = int8_problem(n_req, n_ads, n_exp, gdim, 48, seed=7, scale=scale)
    q, v, p = query
    plan = plan_int8(q, v, p, 10)
    aff = int_products(plan.vh, quantized.x, n_req * n_exp, None).float()  # [B·E, N]
    aff = aff.view(n_req, n_exp, n_ads) * plan.v_scale[:, None, None] * quantized.x_scale
    logits = torch.stack([int_products(plan.qh[r], quantized.g, n_exp, None) for r in range(n_req)])
    logits = logits.float() * plan.q_scale[:, None, None] * quantized.g_scale  # [B, E, N]
    req = torch.arange(n_req).repeat_interleave(n_ads)  # every pair
    ad = torch.arange(n_ads).repeat(n_req)
    g, x, b = dequantized
    approx, eps = gate_bounds(
        plan,
        req,
        logits.permute(1, 0, 2).reshape(n_exp, -1),
        aff.permute(1, 0, 2).reshape(n_exp, -1),
        g.norm(dim=1)[ad],
        x.norm(dim=1)[ad],
        b[ad],
    )
    fp32 = score(*query, *dequantized).reshape(-1)
    exact = rounded_score(*query, *dequantized).reshape(-1)
    assert ((approx - fp32).abs() <= eps).all()
    assert ((approx.double() - exact).abs() <= eps.double()).all()
    assert eps.median() < 0.02 * fp32.std()  # tighter than bf16's products (test_cpu_score_topk)


@needs_exact_int8
@pytest.mark.parametrize(("n_exp", "gdim"), [(1, 0), (4, 8)])
def test_the_affinity_filter_keeps_every_ad_that_reaches_the_threshold(n_exp, gdim):
    """With τ set to each request's best fp32 score the best ad passes step 1; with E = 1, G = 0
    the bound is tight, so only its allowance for the rounding protects that ad."""
    n_req, n_ads = 64, 4000
    query, quantized, dequantized = int8_problem(
        n_req, n_ads, n_exp, gdim, 24, seed=n_exp, scale=3.0
    )
    q, v, p = query
    plan = plan_int8(q, v, p, 1)
    stats = table_stats(*quantized[:2], quantized.b, quantized.g_scale, quantized.x_scale)
    ints = int_products(plan.vh, quantized.x, n_req * n_exp, None)
    best = ints.view(n_req, n_exp, -1).amax(1).float() * plan.v_scale[:, None] * quantized.x_scale
    offset = affinity_offset(plan, stats.x_norm, stats.scan_bias)
    top_s, top_ad = score(*query, *dequantized).max(dim=1)  # [B]
    tau = Threshold(n_req, 1, plan.u_scan)
    tau.offer(torch.arange(n_req), top_s)
    keep = best + offset >= tau.for_scan[:, None]  # [B, N]
    assert keep[torch.arange(n_req), top_ad].all()
    assert keep.float().mean() < 0.5  # and it does filter


def test_the_table_constants_follow_in_place_changes(helpers):
    query, quantized, _ = int8_problem(3, 2000, 4, 8, 8, seed=5)
    mask = make_mask("shared", 3, 2000, seed=6)
    mask[:6] = True
    stats = table_stats(*quantized[:2], quantized.b, quantized.g_scale, quantized.x_scale)
    assert table_stats(*quantized[:2], quantized.b, quantized.g_scale, quantized.x_scale) is stats
    # ads 0, 2, 4 become every request's best: stale norms or biases would filter them out
    quantized.b[[0, 2, 4]] = 50.0
    quantized.x_scale[1::3].mul_(4)
    quantized.g[7:9] = 127
    got = cpu_score_topk_int8(*query, quantized, mask, 20)
    assert_same(got, full_sort(query, quantized.dequantize(), mask, 20))
    assert (got[1][:, :3].sort(dim=1).values == torch.tensor([0, 2, 4])).all()


def test_without_exact_int8_products_it_scores_the_dequantized_table(monkeypatch):
    query, quantized, dequantized = int8_problem(3, 900, 4, 8, 8, seed=2)
    mask = make_mask("per-request", 3, 900, seed=3)
    monkeypatch.setattr(int8, "int8_products_exact", lambda: False)
    got = cpu_score_topk_int8(*query, quantized, mask, 30)
    assert_same(got, full_sort(query, dequantized, mask, 30))


def test_out_of_range_queries_and_empty_inputs():
    query, quantized, dequantized = int8_problem(2, 300, 3, 4, 4, seed=1)
    q, v, p = query
    huge = (q * 1e30, v * 1e30, p)  # scores beyond fp32: the reference decides
    assert_same(
        cpu_score_topk_int8(*huge, quantized, None, 5),
        torch_score_topk(*huge, *dequantized, None, 5),
    )
    empty = quantize_ad_table(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0))
    scores, rows = cpu_score_topk_int8(*query, empty, None, 5)
    assert scores.shape == (2, 0) and rows.shape == (2, 0)
    scores, rows = cpu_score_topk_int8(*(t[:0] for t in query), quantized, None, 3)
    assert scores.shape == (0, 3) and rows.shape == (0, 3)
    assert math.isinf(
        cpu_score_topk_int8(*query, quantized, torch.zeros(300, dtype=torch.bool), 2)[0][0, 0]
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda t: t, TypeError, "must be an Int8Table"),
        (lambda t: t._replace(x=t.x.float()), ValueError, r"x must be torch\.int8"),
        (lambda t: t._replace(g_scale=t.g_scale.double()), ValueError, "g_scale must be"),
        (lambda t: t._replace(x_scale=t.x_scale[:5]), ValueError, "disagree on N"),
        (lambda t: t._replace(b=t.b[:5]), ValueError, "disagree on N"),
        (lambda t: t._replace(b=t.b[:, None]), ValueError, r"b must be torch\.float32 with 1 dims"),
    ],
)
def test_bad_arguments(change, error, message):
    query, quantized, dequantized = int8_problem(2, 9, 2, 4, 4, seed=0)
    table = dequantized if error is TypeError else change(quantized)
    with pytest.raises(error, match=message):
        cpu_score_topk_int8(*query, table, None, 3)
    if error is ValueError:  # the dispatcher refuses a malformed table for every kernel alike
        for kernel in ("torch", "cpu"):
            with pytest.raises(ValueError, match=message):
                score_topk(query, table, None, 3, kernel=kernel)
    with pytest.raises(ValueError, match="k must be positive"):
        cpu_score_topk_int8(*query, quantized, None, 0)


@settings(max_examples=30, deadline=None)
@given(
    n_req=st.integers(1, 5),
    n_ads=st.integers(1, 400),
    n_exp=st.integers(1, 4),
    gdim=st.sampled_from([0, 3, 8]),
    k=st.integers(1, 420),
    block=st.integers(1, 150),
    threads=st.integers(1, 3),
    mask_kind=st.sampled_from(["none", "shared", "per-request", "nothing", "packed"]),
    seed=st.integers(0, 10_000),
    way=st.sampled_from(["on", "plain", "off"]),
)
def test_property_matches_full_sort(
    n_req, n_ads, n_exp, gdim, k, block, threads, mask_kind, seed, way
):
    query, quantized, dequantized = int8_problem(n_req, n_ads, n_exp, gdim, 5, seed)
    packed = mask_kind == "packed"
    mask = make_mask("per-request" if packed else mask_kind, n_req, n_ads, seed + 1)
    with native.use(way):
        got = cpu_score_topk_int8(
            *query, quantized, PackedMask.of(mask) if packed else mask, k, block=block,
            threads=threads,
        )  # fmt: skip
    assert_same(got, full_sort(query, dequantized, mask, k))
