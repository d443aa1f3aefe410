"""cpu_score_topk_int8's own parts (the cpu kernel reading an 8-bit table as stored): the query
in integers, exact integer products, the error bounds with them, the affinity filter, threads
and blocks, the cached table constants, CPUs without exact int8 products, inputs past the
bounds' range. Each that runs the kernel end to end runs each way steps 1 and 2 can run
(`helpers`): compiled with AVX-512 where the CPU has it, compiled as plain loops, and in torch ops
(m31.ops.cpu.native). Its answers are held to the reference with every other kernel's in
test_score_topk (the contract)."""

import pytest
import torch
from score_topk_helpers import (
    assert_same,
    full_sort,
    int8_problem,
    make_mask,
    needs_exact_int8,
)

from m31.ops import rounded_score, score
from m31.ops.cpu import cpu_score_topk_int8, int8, native
from m31.ops.cpu.bounds import affinity_offset, gate_bounds
from m31.ops.cpu.int8 import _split_query, int_products, plan_int8
from m31.ops.cpu.stats import table_stats
from m31.ops.cpu.worker import Threshold
from m31.ops.reference import torch_score_topk


@pytest.fixture(params=["on", "plain", "off"])
def helpers(request):
    """Steps 1 and 2 compiled (AVX-512 where the CPU has it), compiled as plain loops, in torch."""
    if request.param != "off" and native.library() is None:
        pytest.skip("no C compiler: the compiled helpers are not built")
    with native.use(request.param):
        yield request.param


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


def test_out_of_range_queries_go_to_the_reference():
    query, quantized, dequantized = int8_problem(2, 300, 3, 4, 4, seed=1)
    q, v, p = query
    huge = (q * 1e30, v * 1e30, p)  # scores beyond fp32: the reference decides
    assert_same(
        cpu_score_topk_int8(*huge, quantized, None, 5),
        torch_score_topk(*huge, *dequantized, None, 5),
    )
