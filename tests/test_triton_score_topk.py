"""The fused Triton score·filter·top-K against the reference (under TRITON_INTERPRET=1 on CPU).

Inputs are fp32 values that bf16 holds exactly, so the kernel (bf16 operands, fp32 accumulation)
and the fp32 reference score the same numbers and must return the same rows.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from test_score_topk import full_sort, make_mask

from m31.ops import NO_ROW, score
from m31.ops.quant import Int8Table, quantize_ad_table
from m31.ops.torch_score_topk import torch_score_topk
from m31.ops.triton_score_topk import (
    _exact_top,
    triton_score_topk,
    triton_score_topk_int8,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32 summation order and exp2 vs exp


def bf16_exact(t):
    return t.to(torch.bfloat16).float()


def problem(n_req, n_ads, n_exp, gdim, ddim, seed, levels=None):
    """(query, table) of bf16-exact fp32 values; `levels` makes few distinct values (ties)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        t = torch.randn(*shape, generator=gen)
        return bf16_exact(t) if levels is None else torch.round(t * levels) / levels

    query = (r(n_req, n_exp, gdim), r(n_req, n_exp, ddim), r(n_req, n_exp))
    table = (r(n_ads, gdim), r(n_ads, ddim), r(n_ads))
    return query, table


def assert_exact(got, want):
    (got_s, got_r), (want_s, want_r) = got, want
    assert got_s.dtype == torch.float32 and got_r.dtype == torch.int64
    assert torch.equal(got_r, want_r)
    torch.testing.assert_close(got_s, want_s, **TOL)


@pytest.mark.parametrize(
    ("n_req", "n_ads", "n_exp", "gdim", "ddim", "k", "mask_kind"),
    [
        (1, 1000, 8, 16, 16, 50, "none"),  # stacked tile, B = 1
        (3, 777, 3, 8, 5, 40, "shared"),  # stacked, E, G, D padded
        (17, 530, 3, 8, 5, 25, "per-request"),  # online softmax
        (70, 300, 2, 4, 6, 10, "per-request"),  # two request tiles
        (2, 1000, 4, 8, 8, 500, "none"),  # K larger than a tile of ads
        (1, 200, 8, 64, 64, 300, "shared"),  # K > N
        (3, 450, 1, 8, 12, 30, "shared"),  # E = 1: the gate folds away
        (17, 400, 1, 0, 8, 20, "none"),  # two-tower: E = 1, G = 0
        (3, 300, 3, 4, 4, 10, "nothing"),
        (3, 300, 3, 4, 4, 10, "everything"),
    ],
)
def test_matches_reference(n_req, n_ads, n_exp, gdim, ddim, k, mask_kind):
    query, table = problem(n_req, n_ads, n_exp, gdim, ddim, seed=n_ads)
    mask = make_mask(mask_kind, n_req, n_ads, seed=k)
    got = triton_score_topk(*query, *table, mask, k)
    assert_exact(got, torch_score_topk(*query, *table, mask, k))
    assert_exact(got, full_sort(query, table, mask, k))


def test_fewer_eligible_than_k_per_request():
    query, table = problem(3, 260, 3, 8, 8, seed=1)
    mask = torch.zeros(3, 260, dtype=torch.bool)
    mask[1, [5, 130, 259]] = True  # request 0: nothing, 1: three ads, 2: everything
    mask[2] = True
    scores, rows = triton_score_topk(*query, *table, mask, 8)
    assert (rows[0] == NO_ROW).all() and torch.isinf(scores[0]).all()
    assert sorted(rows[1, :3].tolist()) == [5, 130, 259] and (rows[1, 3:] == NO_ROW).all()
    assert_exact((scores, rows), full_sort(query, table, mask, 8))


def test_mask_all_true_equals_no_mask():
    query, table = problem(4, 500, 3, 8, 8, seed=2)
    everything = triton_score_topk(*query, *table, torch.ones(500, dtype=torch.bool), 20)
    assert_exact(everything, triton_score_topk(*query, *table, None, 20))


@pytest.mark.parametrize(("n_req", "n_exp", "gdim"), [(3, 3, 4), (20, 2, 4), (2, 1, 0)])
def test_ties_go_to_the_lower_row(n_req, n_exp, gdim):
    # 7 distinct ads repeated over 300 rows: every score has 40+ exact ties, across tiles
    query, table = problem(n_req, 7, n_exp, gdim, 3, seed=3, levels=1)
    table = tuple(t.repeat(43, *([1] * (t.dim() - 1)))[:300] for t in table)
    want = full_sort(query, table, None, 100)
    assert_exact(triton_score_topk(*query, *table, None, 100), want)
    assert_exact(triton_score_topk(*query, *table, None, 100, _capacity=5), want)


def test_candidates_in_any_order_sort_by_score_then_row():
    # On a GPU the atomic counter fills the buffer in any order; the interpreter runs programs
    # in row order, so shuffle a buffer by hand. Slots past the count hold garbage.
    gen = torch.Generator().manual_seed(11)
    rows = torch.randperm(500, generator=gen)[:40].int()
    scores = torch.randint(0, 4, (40,), generator=gen).float()  # 4 values: ties everywhere
    buffer_s = torch.cat([scores, torch.full((5,), 9.0)])[None]  # [1, 45]
    buffer_r = torch.cat([rows, torch.zeros(5, dtype=torch.int32)])[None]
    got_s, got_r = _exact_top(torch.tensor([40]), buffer_s, buffer_r, 50, 500)
    order = sorted(range(40), key=lambda i: (-scores[i].item(), rows[i].item()))
    assert got_r[0, :40].tolist() == [rows[i].item() for i in order]
    assert got_s[0, :40].tolist() == [scores[i].item() for i in order]
    assert (got_r[0, 40:] == NO_ROW).all() and torch.isinf(got_s[0, 40:]).all()


def test_all_scores_equal():
    query = (torch.zeros(2, 3, 4), torch.zeros(2, 3, 2), torch.zeros(2, 3))
    table = (torch.zeros(300, 4), torch.zeros(300, 2), torch.zeros(300))
    scores, rows = triton_score_topk(*query, *table, None, 150)
    assert rows.tolist() == [list(range(150))] * 2 and (scores == 0).all()


def test_gate_folded_into_the_query_when_g_is_0():
    # G = 0 with E > 1: Σ_e softmax(p)_e v_e is rounded to bf16 once, so scores agree to bf16
    query, table = problem(5, 800, 3, 0, 16, seed=4)
    scores, rows = triton_score_topk(*query, *table, None, 50)
    exact = score(*query, *table)  # [B, N]
    torch.testing.assert_close(scores, exact.gather(1, rows), atol=0.05, rtol=1e-2)
    want_rows = full_sort(query, table, None, 50)[1]
    recall = [
        len(set(a) & set(b)) / 50 for a, b in zip(rows.tolist(), want_rows.tolist(), strict=True)
    ]
    assert min(recall) >= 0.9


def test_threshold_too_high_is_retried():
    query, table = problem(3, 900, 3, 8, 8, seed=5)
    mask = make_mask("per-request", 3, 900, seed=5)
    want = full_sort(query, table, mask, 60)
    assert_exact(triton_score_topk(*query, *table, mask, 60, _tau=float("inf")), want)
    mixed = torch.tensor([float("inf"), 1e6, float("-inf")])  # -inf: everything survives
    assert_exact(triton_score_topk(*query, *table, mask, 60, _tau=mixed), want)


def test_buffer_overflow_is_retried():
    query, table = problem(3, 900, 8, 8, 8, seed=6)
    want = full_sort(query, table, None, 60)
    assert_exact(triton_score_topk(*query, *table, None, 60, _capacity=1), want)
    assert_exact(triton_score_topk(*query, *table, None, 60, _capacity=1, _tau=float("-inf")), want)


def test_thresholds_from_a_small_sample():
    # 64 sampled ads of 3000: τ sits at a sample rank estimate instead of an exact count
    query, table = problem(4, 3000, 3, 8, 8, seed=7)
    mask = make_mask("shared", 4, 3000, seed=7)
    for k in (5, 200):
        want = full_sort(query, table, mask, k)
        assert_exact(triton_score_topk(*query, *table, mask, k, _sample_rows=64), want)


def test_empty_inputs():
    query, table = problem(3, 0, 2, 4, 4, seed=0)
    scores, rows = triton_score_topk(*query, *table, None, 5)
    assert scores.shape == (3, 0) and rows.shape == (3, 0)
    query, table = problem(0, 50, 2, 4, 4, seed=0)
    assert triton_score_topk(*query, *table, None, 5)[1].shape == (0, 5)


def test_bf16_table_is_read_as_is():
    query, table = problem(3, 400, 3, 8, 8, seed=8)
    bf16 = (table[0].bfloat16(), table[1].bfloat16(), table[2])
    assert_exact(triton_score_topk(*query, *bf16, None, 30), full_sort(query, table, None, 30))


def test_quantize_ad_table():
    gen = torch.Generator().manual_seed(0)
    g, x, b = torch.randn(50, 6, generator=gen), torch.randn(50, 9, generator=gen), torch.randn(50)
    x[3] = 0.0  # a zero row keeps scale 1 and stays zero
    table = quantize_ad_table(g, x, b)
    assert table.g.dtype == table.x.dtype == torch.int8
    assert (table.x.abs().amax(1) == torch.where(torch.arange(50) == 3, 0, 127)).all()
    assert table.x_scale[3] == 1 and (table.x[3] == 0).all()
    g_deq, x_deq, b_deq = table.dequantize()
    assert ((g_deq - g).abs() <= table.g_scale[:, None] / 2 + 1e-7).all()
    assert ((x_deq - x).abs() <= table.x_scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(b_deq, b)
    assert (table.num_ads, table.gate_dim, table.value_dim) == (50, 6, 9)
    assert table.to("cpu").device.type == "cpu"
    two_tower = quantize_ad_table(torch.zeros(50, 0), x, b)
    assert two_tower.g.shape == (50, 0) and (two_tower.g_scale == 1).all()


@pytest.mark.parametrize(
    ("n_req", "n_exp", "gdim", "ddim", "mask_kind"),
    [(1, 8, 16, 16, "none"), (17, 3, 8, 5, "per-request"), (3, 1, 0, 12, "shared")],
)
def test_int8_matches_reference_on_the_dequantized_table(n_req, n_exp, gdim, ddim, mask_kind):
    query, table = problem(n_req, 700, n_exp, gdim, ddim, seed=9)
    int8 = quantize_ad_table(*table)
    mask = make_mask(mask_kind, n_req, 700, seed=9)
    got = triton_score_topk_int8(*query, int8, mask, 40)
    assert_exact(got, torch_score_topk(*query, *int8.dequantize(), mask, 40))
    assert_exact(got, triton_score_topk_int8(*query, int8, mask, 40, _tau=float("inf")))


def test_int8_recall_against_bf16():
    query, table = problem(4, 4000, 8, 32, 32, seed=10)
    k = 100
    bf16_rows = triton_score_topk(*query, *table, None, k)[1]
    int8_rows = triton_score_topk_int8(*query, quantize_ad_table(*table), None, k)[1]
    recall = sum(
        len(set(a) & set(b)) for a, b in zip(bf16_rows.tolist(), int8_rows.tolist(), strict=True)
    ) / (k * 4)
    print(f"int8 recall@{k} vs bf16 (B=4, N=4000, E=8, G=D=32, random normal): {recall:.3f}")
    assert recall >= 0.9


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": 0}, "k must be positive"),
        ({"mask": torch.ones(3, dtype=torch.bool)}, "mask must be bool"),
        ({"mask": torch.ones(2, 9)}, "mask must be bool"),
        ({"g": torch.zeros(9, 5)}, "ad table must be"),
        ({"b": torch.zeros(8)}, "ad table must be"),
        ({"g": torch.zeros(9, 4, dtype=torch.int8)}, "floating point"),
        ({"p": torch.zeros(2, 3)}, "disagree on B or E"),
        ({"q": torch.zeros(2, 2, 300), "g": torch.zeros(9, 300)}, "G <= 256"),
    ],
)
def test_bad_arguments(change, message):
    (q, v, p), (g, x, b) = problem(2, 9, 2, 4, 4, seed=0)
    kw = {"q": q, "v": v, "p": p, "g": g, "x": x, "b": b, "mask": None, "k": 3} | change
    with pytest.raises(ValueError, match=message):
        triton_score_topk(**kw)


def test_bad_int8_tables():
    query, table = problem(2, 9, 2, 4, 4, seed=0)
    good = quantize_ad_table(*table)
    with pytest.raises(TypeError, match="must be an Int8Table"):
        triton_score_topk_int8(*query, table, None, 3)
    with pytest.raises(ValueError, match=r"x must be torch\.int8"):
        triton_score_topk_int8(*query, good._replace(x=good.x.float()), None, 3)
    with pytest.raises(ValueError, match="disagree on N"):
        triton_score_topk_int8(*query, good._replace(g_scale=torch.ones(8)), None, 3)
    with pytest.raises(ValueError, match=r"x_scale must be torch\.float32"):
        triton_score_topk_int8(*query, good._replace(x_scale=good.x_scale.double()), None, 3)
    with pytest.raises(ValueError, match="disagree on N"):
        quantize_ad_table(torch.zeros(9, 4), torch.zeros(8, 4), torch.zeros(9))
    assert isinstance(good, Int8Table)


COMPILE_FOR_HOPPER = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from m31.ops import triton_score_topk as T

def compile_variant(n_req, n_exp, gdim, ddim, quant, mask_mode, table="*bf16", value=False):
    has_gate = gdim > 0 and n_exp > 1
    ep, gp, dp = (triton.next_power_of_2(n) for n in (n_exp, gdim, ddim))
    gp, dp = max(16, gp), max(16, dp)
    table = "*i8" if quant else table
    parts = {"*i8": 1, "*bf16": 1, "*fp16": 2, "*fp32": 3}[table]
    tiles = T._pick_tiles(n_req, ep, max(gp, dp), has_gate, parts - 1 + quant)
    ptr = dict(q_ptr="*bf16", v_ptr="*bf16", p_ptr="*fp32", g_ptr=table, x_ptr=table,
               b_ptr="*fp32", g_scale_ptr="*fp32", x_scale_ptr="*fp32", value_ptr="*fp32",
               bits_ptr="*i32",
               tau_ptr="*fp32", count_ptr="*i32", cand_score_ptr="*fp32", cand_row_ptr="*i32")
    ints = dict(n_req="i32", n_ads="i32", gate_dim="i32", value_dim="i32", stride_g="i64",
                stride_x="i64", stride_bits="i32", capacity="i32", gate_scale="fp32")
    const = dict(BB=tiles.bb, BN=tiles.bn, E=n_exp, EP=ep, GP=gp, DP=dp, HAS_GATE=has_gate,
                 STACKED=tiles.stacked, QUANT=quant, HAS_VALUE=value, MASK_MODE=mask_mode,
                 TP=parts, DOT=tl.bfloat16)
    signature = ptr | ints | {name: "constexpr" for name in const}
    src = ASTSource(T._score_topk_kernel, signature, constexprs=const)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": T._NUM_WARPS})
    assert "mma" in kernel.asm["ptx"], "no tensor-core instruction"

compile_variant(1, 8, 64, 64, False, 2)  # stacked
compile_variant(1, 8, 64, 64, False, 2, value=True)  # stacked, with a value column
compile_variant(64, 8, 64, 64, True, 1)  # online, int8
compile_variant(64, 8, 64, 64, True, 1, value=True)  # online, int8, with a value column
compile_variant(17, 3, 8, 5, False, 0)  # online, padded dims
compile_variant(5, 1, 0, 64, True, 2)  # gate folded away
compile_variant(1, 8, 64, 64, False, 0, "*fp16")  # stacked, an fp16 table in two bf16 parts
compile_variant(64, 8, 64, 64, False, 2, "*fp32")  # online, an fp32 table in three parts
compile_variant(5, 1, 0, 64, False, 1, "*fp16")  # gate folded away, an fp16 table
print("compiled")
"""


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter accepts more than the compiler: build the real sm_90 binary (ptxas)."""
    env = os.environ | {"TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COMPILE_FOR_HOPPER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
